"""float16 gradients meet collectives on 8 host devices: a JSON report.

Run by tests/integration/test_f16_collectives.py (``fsdp``, ``jit``) in a
subprocess with
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
    # float32 master parameters gathered in float16 (a policy's cast): jax's
    # psum_scatter is float16 though the parameter is float32.
    policy = jls.precision.get_policy("params=float32,compute=float16,output=float32")
    w32 = jnp.ones(8, jnp.float32)
    step = jax.jit(
        jax.shard_map(
            jls.train_step(policy.wrap(gathered_loss), tx, average_over="data"),
            mesh=MESH,
            in_specs=(P("data"), P(), P("data")),
            out_specs=(P("data"), P(), P()),
        )
    )
    new, _, out = step(on(P("data"), w32), tx.init(w32), on(P("data"), X))
    report["fsdp_f32_cast"] = {
        "skipped": bool(out.skipped),
        "params": np.asarray(new, np.float32).tolist(),
    }

if PART == "jit":
    AxisType = jax.sharding.AxisType

    def mean_loss(w, x):
        return jnp.mean(jnp.tanh(x @ w).astype(jnp.float32) ** 2)

    x = np.random.default_rng(0).normal(size=(32, 8)).astype(np.float16)
    for name, dtype, axis_type, shard in [
        ("f16", jnp.float16, AxisType.Explicit, True),
        ("f32", jnp.float32, AxisType.Explicit, True),
        ("f16_auto", jnp.float16, AxisType.Auto, True),
        ("f16_one_device", jnp.float16, AxisType.Explicit, False),
    ]:
        mesh = jax.make_mesh((4,), ("data",), (axis_type,), devices=jax.devices()[:4])
        tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale())
        w = jnp.full((8, 16), 0.1, dtype)
        args = (w, tx.init(w), x.astype(dtype))
        if shard:
            specs = (P(), P(), P("data"))
            args = [
                jax.device_put(a, NamedSharding(mesh, s))
                for a, s in zip(args, specs, strict=True)
            ]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = jax.jit(jls.train_step(mean_loss, tx)).lower(*args).compile()
        sent = jls.precision.precision_report(compiled).collectives
        report[name] = {
            "warnings": [str(w.message) for w in caught],
            "collectives": [list(op) for op in sent],
        }

print(json.dumps(report))
