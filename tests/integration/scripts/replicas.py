"""Replicas agree: pmap, shard_map and sharded jit on 8 host devices.

Run by tests/test_distributed.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8; prints a JSON report.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jls

N = jax.device_count()
assert N == 8, N
PARAMS = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.full((4,), 0.1)}


def loss_fn(params, x):
    h = x @ params["w"] + params["b"][None, :]
    return jnp.mean(h**2)


def batches(bad_replica=None):
    x = np.linspace(0.0, 1.0, N * 2 * 3, dtype=np.float32).reshape(N, 2, 3)
    if bad_replica is not None:
        x[bad_replica, 1, 2] = np.nan
    return jnp.asarray(x)


def replicate(tree):
    return jax.tree.map(lambda x: jnp.stack([x] * N), tree)


def first(tree):
    return jax.tree.map(lambda a: a[0], tree)


def stacked(tree):
    return jax.tree.map(lambda a: a[None], tree)


def same_across(tree):
    return all(
        bool(np.all(np.asarray(x) == np.asarray(x)[:1])) for x in jax.tree.leaves(tree)
    )


report = {}
for mode in ("pmap", "shard_map"):
    for allreduce in (False, True):
        tx = jls.loss_scaling(
            optax.adam(1e-2), jls.dynamic_scale(2.0**8), axis_name="dp"
        )

        def step(params, state, x, allreduce=allreduce, tx=tx):
            grads = jax.grad(lambda p: jls.scale_loss(loss_fn(p, x), state))(params)
            if allreduce:
                grads = jax.lax.pmean(grads, "dp")
            return jls.apply_gradients(tx, grads, state, params)

        if mode == "pmap":
            run = jax.pmap(step, axis_name="dp")
            params, state = replicate(PARAMS), replicate(tx.init(PARAMS))
            xs = lambda bad: batches(bad)  # noqa: E731
        else:
            mesh = Mesh(np.array(jax.devices()), ("dp",))
            spec = P("dp")
            run = jax.jit(
                jax.shard_map(
                    lambda p, s, x, step=step: stacked(step(*first((p, s, x)))),
                    mesh=mesh,
                    in_specs=(spec, spec, spec),
                    out_specs=spec,
                )
            )
            params, state = replicate(PARAMS), replicate(tx.init(PARAMS))
            xs = lambda bad: batches(bad)  # noqa: E731
        params, state = run(params, state, xs(None))  # a finite step
        before = jax.tree.map(np.asarray, params)
        params, state = run(params, state, xs(3))  # nan on replica 3 only
        key = f"{mode}_allreduce{allreduce}"
        report[key] = {
            "scales": np.asarray(state.loss_scale.scale).tolist(),
            "skipped": np.asarray(state.loss_scale.consecutive_skips).tolist(),
            "params_unchanged": all(
                bool(np.array_equal(a, np.asarray(b)))
                for a, b in zip(
                    jax.tree.leaves(before), jax.tree.leaves(params), strict=True
                )
            ),
            "params_same_across": same_across(params) if allreduce else None,
            "no_nan": all(
                bool(np.all(np.isfinite(np.asarray(x))))
                for x in jax.tree.leaves((params, state))
            ),
        }

# The tx.update path under shard_map: zero updates on every replica.
mesh = Mesh(np.array(jax.devices()), ("dp",))
tx = jls.loss_scaling(optax.adam(1e-2), jls.dynamic_scale(2.0**8), axis_name="dp")


def update_step(params, state, x):
    grads = jax.grad(lambda p: jls.scale_loss(loss_fn(p, x), state))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


run = jax.jit(
    jax.shard_map(
        lambda p, s, x: stacked(update_step(*first((p, s, x)))),
        mesh=mesh,
        in_specs=(P("dp"), P("dp"), P("dp")),
        out_specs=P("dp"),
    )
)
params, state = replicate(PARAMS), replicate(tx.init(PARAMS))
params, state = run(params, state, batches(None))
before = jax.tree.map(np.asarray, params)
params, state = run(params, state, batches(5))
report["shard_map_update"] = {
    "scales": np.asarray(state.loss_scale.scale).tolist(),
    "params_unchanged": all(
        bool(np.array_equal(a, np.asarray(b)))
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(params), strict=True)
    ),
}

# jit over sharded arrays: no axis_name, one global decision.
mesh = Mesh(np.array(jax.devices()), ("dp",))
tx = jls.loss_scaling(optax.adam(1e-2), jls.dynamic_scale(2.0**8))
for layout in ("replicated", "sharded"):
    pspec = P() if layout == "replicated" else P(None, "dp")
    shard = {
        "w": NamedSharding(mesh, pspec),
        "b": NamedSharding(mesh, P() if layout == "replicated" else P("dp")),
    }
    params = {"w": jnp.ones((3, 8)) * 0.1, "b": jnp.zeros(8)}
    params = jax.device_put(params, shard)
    state = tx.init(params)
    data = NamedSharding(mesh, P("dp"))

    def loss8(p, x):
        return jnp.mean((x @ p["w"] + p["b"][None, :]) ** 2)

    @jax.jit
    def jit_step(params, state, x):
        grads = jax.grad(lambda p: jls.scale_loss(loss8(p, x), state))(params)
        return jls.apply_gradients(tx, grads, state, params)

    x = np.linspace(0.0, 1.0, 16 * 3, dtype=np.float32).reshape(16, 3)
    params, state = jit_step(params, state, jax.device_put(x, data))
    before = jax.tree.map(np.asarray, params)
    x[13, 1] = np.nan  # one row, on one device's shard
    params, state = jit_step(params, state, jax.device_put(x, data))
    report[f"jit_{layout}"] = {
        "scale": float(state.loss_scale.scale),
        "skipped": int(state.loss_scale.consecutive_skips),
        "params_unchanged": all(
            bool(np.array_equal(a, np.asarray(b)))
            for a, b in zip(
                jax.tree.leaves(before), jax.tree.leaves(params), strict=True
            )
        ),
        "w_sharding": list(params["w"].sharding.spec),
    }

# The check must not gather gradients onto one device.
big = {
    "w": jax.device_put(jnp.ones((1024, 64)), NamedSharding(mesh, P("dp"))),
    "v": jax.device_put(jnp.ones((64, 1024)), NamedSharding(mesh, P(None, "dp"))),
}
hlo = jax.jit(jls.all_finite).lower(big).compile().as_text() or ""
adam_state = tx.init(big)
fused = (
    jax.jit(lambda g, s, p: jls.apply_gradients(tx, g, s, p))
    .lower(big, adam_state, big)
    .compile()
    .as_text()
) or ""
report["hlo"] = {
    "check_all_gather": len(re.findall(r"all-gather", hlo)),
    "check_all_reduce": len(re.findall(r"all-reduce", hlo)),
    "fused_all_gather": len(re.findall(r"all-gather", fused)),
}
print(json.dumps(report))
