"""Data-parallel float16 training with jls on 8 host devices, with a checkpoint.

Runs on a CPU-only machine: it asks XLA for 8 host devices before JAX starts.
Parameters are replicated, the batch is sharded over a ``data`` mesh axis,
and ``jit`` makes the skip decision global (no ``axis_name`` needed). Step 3
gets a nan in one device's shard: every device skips it, with one scale.
Halfway through, the state is saved with orbax and restored, and training
continues from the restored copy.

Run: ``python examples/data_parallel.py [--steps N] [--out DIR]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import functools  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jls  # noqa: E402


def loss_fn(params, x, y):
    """An MLP in float16 compute, float32 master weights."""
    h = x.astype(jnp.float16)
    for i, layer in enumerate(params):
        h = h @ layer["w"].astype(jnp.float16) + layer["b"].astype(jnp.float16)[None]
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    logits = h.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def main(argv=None) -> dict:
    """Trains, checkpoints, restores, trains on; returns a summary."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=40, help="training steps")
    parser.add_argument(
        "--out", default=None, help="checkpoint folder (default: a temporary one)"
    )
    args = parser.parse_args(argv)

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("data",))
    replicated = NamedSharding(mesh, P())
    sharded = NamedSharding(mesh, P("data"))

    key = jax.random.key(0)
    sizes = (16, 64, 4)
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
        key, sub = jax.random.split(key)
        params.append(
            {
                "w": jax.random.normal(sub, (fan_in, fan_out)) / fan_in**0.5,
                "b": jnp.zeros((fan_out,)),
            }
        )
    tx = jls.loss_scaling(
        optax.adam(1e-2), jls.dynamic_scale(2.0**12, growth_interval=10)
    )
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(tx.init(params), replicated)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, x, y):
        grads = jax.grad(lambda p: jls.scale_loss(loss_fn(p, x, y), opt_state))(params)
        params, opt_state = jls.apply_gradients(tx, grads, opt_state, params)
        return params, opt_state, jls.metrics(opt_state)

    rng = np.random.default_rng(0)
    centers = rng.normal(size=(4, 16))
    batch = 8 * len(devices)
    # Without --out, the checkpoint goes to a temporary folder removed at exit.
    scratch = tempfile.TemporaryDirectory(prefix="jls-dp-")
    out = args.out or scratch.name
    ckpt = os.path.join(os.path.abspath(out), "ckpt")
    half = args.steps // 2
    print(f"{len(devices)} devices; batch {batch} sharded over 'data'")
    m = None
    for step in range(args.steps):
        y = rng.integers(0, 4, size=batch)
        x = (centers[y] + rng.normal(size=(batch, 16))).astype(np.float32)
        if step == 3:
            x[5, 0] = np.nan  # lives on device 0's shard only
        xb = jax.device_put(x, sharded)
        yb = jax.device_put(y.astype(np.int32), sharded)
        params, opt_state, m = train_step(params, opt_state, xb, yb)
        if step == half:
            with ocp.StandardCheckpointer() as ckptr:
                ckptr.save(ckpt, {"params": params, "opt_state": opt_state}, force=True)
            target = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                {"params": params, "opt_state": opt_state},
            )
            with ocp.StandardCheckpointer() as ckptr:
                restored = ckptr.restore(ckpt, target)
            saved = {"params": params, "opt_state": opt_state}
            exact = jax.tree.structure(restored) == jax.tree.structure(saved) and all(
                a.dtype == b.dtype and bool(np.array_equal(a, b))
                for a, b in zip(
                    jax.tree.leaves(restored), jax.tree.leaves(saved), strict=False
                )
            )
            if not exact:
                raise RuntimeError("the restored state differs from the saved one")
            params, opt_state = restored["params"], restored["opt_state"]
            print(f"step {step}: saved and restored {ckpt}, bitwise equal")
        if step in (0, 3, args.steps - 1) or step % 10 == 0:
            print(
                f"step {step:3d}  loss scale {float(m['loss_scale']):8.0f}  "
                f"skipped {bool(m['skipped'])!s:5}  total skips {int(m['total_skips'])}"
            )
    assert m is not None
    scratch.cleanup()
    return {
        "devices": len(devices),
        "total_skips": int(m["total_skips"]),
        "loss_scale": float(m["loss_scale"]),
    }


if __name__ == "__main__":
    main()
