"""One of 2 processes of a real data-parallel jls run (jax.distributed, CPU).

Usage: multiprocess.py PROCESS_ID PORT OUT_JSON. Each process has 2 local CPU
devices (XLA_FLAGS set by the test); the global mesh has 4. Step 2 has a nan
in process 1's data only. Writes what this process saw.
"""

import json
import sys

import jax

pid, port, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=pid,
    initialization_timeout=30,
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jls  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 4, jax.devices()
mesh = Mesh(np.array(jax.devices()), ("dp",))
replicated = NamedSharding(mesh, P())
data = NamedSharding(mesh, P("dp"))

params = jax.device_put(
    {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.full((4,), 0.1)},
    replicated,
)
tx = jls.loss_scaling(optax.adam(1e-2), jls.dynamic_scale(2.0**8))
opt_state = jax.device_put(tx.init(params), replicated)


def loss_fn(p, x):
    return jnp.mean((x @ p["w"] + p["b"][None, :]) ** 2)


@jax.jit
def train_step(params, opt_state, x):
    grads = jax.grad(lambda p: jls.scale_loss(loss_fn(p, x), opt_state))(params)
    params, opt_state = jls.apply_gradients(tx, grads, opt_state, params)
    return params, opt_state, jls.metrics(opt_state)


seen = []
for step in range(4):
    local = np.linspace(0.0, 1.0, 4 * 3, dtype=np.float32).reshape(4, 3) + pid + step
    if step == 2 and pid == 1:
        local[3, 2] = np.nan
    x = jax.make_array_from_process_local_data(data, local)
    params, opt_state, m = train_step(params, opt_state, x)
    local_params = jax.tree.map(
        lambda a: np.asarray(a.addressable_data(0)).astype(np.float64).tolist(), params
    )
    seen.append(
        {
            "scale": float(m["loss_scale"].addressable_data(0)),
            "skipped": bool(m["skipped"].addressable_data(0)),
            "params": local_params,
        }
    )
with open(out_path, "w") as f:
    json.dump(seen, f)
jax.distributed.shutdown()
