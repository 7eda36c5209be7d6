"""float16 gradients meet collectives on 8 host devices: a JSON report.

Run by tests/integration/test_f16_collectives.py (``fsdp``) and
tests/test_collectives.py (``jit``) in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8.

``fsdp``: float16 parameters sharded over "data" and gathered in the forward
pass, under ``shard_map`` with ``average_over``; each replica's scaled
gradient entry is 30000, their mean 30000 and their float16 sum inf. ``jit``:
the collectives of compiled float16 and float32 steps over sharded arrays,
and what ``jls.train_step`` warns at trace time.
"""

import json
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jls

assert jax.device_count() == 8, jax.device_count()
report: dict = {}
PART = sys.argv[1]
MESH = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
# Scaled by 1024, each replica's gradient entry is 30000 (exact in float16).
X = np.full((4, 8), 30000.0 / 1024, np.float16)


def on(spec, value):
    return jax.device_put(value, NamedSharding(MESH, spec))


def gathered_loss(w, x):
    full = lax.all_gather(w, "data", tiled=True)  # FSDP: gather the rows
    return jnp.sum((full * x[0]).astype(jnp.float32))


if PART == "fsdp":
    # lr 2**-5: the mean gradient 30000 / 1024 moves each weight 1 -> 0.0845.
    tx = jls.loss_scaling(optax.sgd(2.0**-5), jls.dynamic_scale(1024.0))
    w = jnp.ones(8, jnp.float16)
    for accumulate in (1, 2):
        step = jls.train_step(
            gathered_loss, tx, average_over="data", accumulation_steps=accumulate
        )
        step = jax.jit(
            jax.shard_map(
                step,
                mesh=MESH,
                in_specs=(P("data"), P(), P("data")),
                out_specs=(P("data"), P(), P()),
            )
        )
        x = np.repeat(X, accumulate, axis=0)
        new, _, out = step(on(P("data"), w), tx.init(w), on(P("data"), x))
        report[f"fsdp_k{accumulate}"] = {
            "skipped": bool(out.skipped),
            "next_scale": float(out.next_loss_scale),
            "params": np.asarray(new, np.float32).tolist(),
        }

print(json.dumps(report))
