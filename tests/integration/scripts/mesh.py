"""Every mesh gives the single-device step: 8 host devices, a JSON report.

Run by tests/integration/test_mesh.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8. Each case trains a small
float32 MLP for a few steps with ``jls.train_step(..., average_over=...)``
on a mesh layout and reports the largest relative difference of its
parameters from the same steps on one device over the full batch, with the
scales and skips of both.
"""

import functools
import json
import warnings
from typing import Any

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
rng = np.random.default_rng(0)
PARAMS = {
    "w1": rng.normal(size=(8, 16)).astype(np.float32) * 0.5,
    "b1": rng.normal(size=16).astype(np.float32) * 0.1,
    "w2": rng.normal(size=(16, 4)).astype(np.float32) * 0.5,
    "b2": np.zeros(4, np.float32),
}
X = rng.normal(size=(32, 8)).astype(np.float32)
Y = rng.normal(size=(32, 4)).astype(np.float32)
STEPS = 3


def mlp(p, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def loss_fn(p, x, y):
    return jnp.mean((mlp(p, x) - y) ** 2)


# The retried cases overflow at the first scale whatever the batch split: the
# loss is multiplied by 1e30 (gradients near 2**100), the first scale is
# 2**40 (scaled, past the float32 maximum) and one back-off reaches 1.
HUGE = 1e30


def make_tx(retries):
    if retries:
        scaler = jls.dynamic_scale(2.0**40, backoff_factor=2.0**-40, growth_interval=2)
        # SGD: the update is proportional to the gradient (Adam would hide a
        # gradient N times too large).
        return jls.loss_scaling(optax.sgd(0.1 / HUGE), scaler)
    scaler = jls.dynamic_scale(2.0**10, growth_interval=2)
    return jls.loss_scaling(optax.sgd(0.1), scaler)


def options(retries, k) -> dict[str, Any]:
    return {"max_retries": 2 if retries else 0, "accumulation_steps": k}


def objective(retries):
    if not retries:
        return loss_fn
    return lambda p, x, y: loss_fn(p, x, y) * HUGE


def reference(retries, k, batch=(X, Y)):
    tx = make_tx(retries)
    step = jax.jit(jls.train_step(objective(retries), tx, **options(retries, k)))
    params, state = PARAMS, tx.init(PARAMS)
    scales = []
    for _ in range(STEPS):
        params, state, out = step(params, state, *batch)
        scales.append(float(out.next_loss_scale))
    return params, scales


def rel_diff(a, b):
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.max(np.abs(x - y)) / np.max(np.abs(y))))
    return worst


def run(step, params, state, x, y):
    scales = []
    for _ in range(STEPS):
        params, state, out = step(params, state, x, y)
        scales.append(float(np.asarray(out.next_loss_scale).reshape(-1)[0]))
    return params, scales


def first(tree):
    return jax.tree.map(lambda v: np.asarray(v)[0], tree)


# 1. Data parallel, replicated parameters, on a 1-D mesh of 8.
mesh1 = jax.make_mesh((8,), ("data",))
cases = {}
for retries in (False, True):
    for k in (1, 2):
        ref, ref_scales = reference(retries, k)
        tx = make_tx(retries)
        inner = jls.train_step(
            objective(retries), tx, average_over="data", **options(retries, k)
        )
        got = {}
        # pmap: parameters and state replicated, the batch split.
        reps = jax.tree.map(lambda v: jnp.stack([v] * 8), (PARAMS, tx.init(PARAMS)))
        pstep = jax.pmap(inner, axis_name="data")
        xs, ys = X.reshape(8, 4, 8), Y.reshape(8, 4, 4)
        params, scales = run(pstep, reps[0], reps[1], xs, ys)
        got["pmap"] = (first(params), scales)
        # A named vmap.
        vstep = jax.jit(jax.vmap(inner, axis_name="data"))
        params, scales = run(vstep, reps[0], reps[1], xs, ys)
        got["vmap"] = (first(params), scales)
        # shard_map, check_vma on and off, parameters P().
        for vma in (True, False):
            sstep = jax.jit(
                jax.shard_map(
                    inner,
                    mesh=mesh1,
                    in_specs=(P(), P(), P("data"), P("data")),
                    out_specs=(P(), P(), P()),
                    check_vma=vma,
                )
            )
            put = functools.partial(jax.device_put, device=NamedSharding(mesh1, P()))
            xd = jax.device_put(X, NamedSharding(mesh1, P("data")))
            yd = jax.device_put(Y, NamedSharding(mesh1, P("data")))
            params, scales = run(sstep, put(PARAMS), put(tx.init(PARAMS)), xd, yd)
            got[f"shard_map_vma{vma}"] = (params, scales)
        cases[f"retries{retries}_k{k}"] = {
            "ref_scales": ref_scales,
            **{
                name: {"rel": rel_diff(p, ref), "scales": s}
                for name, (p, s) in got.items()
            },
        }
report["dp"] = cases

# 2. A data x model mesh (4 x 2) under shard_map with check_vma=True: tensor
# parallelism (the hidden layer split over "model") and FSDP (the first
# layer's rows sharded over "data", gathered in the forward pass).
mesh2 = jax.make_mesh((4, 2), ("data", "model"))
TP = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
FSDP = {"w1": P("data", None), "b1": P(), "w2": P(), "b2": P()}


def tp_loss(p, x, y):
    hidden = jnp.tanh(x @ p["w1"] + p["b1"])  # this device's part of the layer
    out = lax.psum(hidden @ p["w2"], "model") + p["b2"]
    return jnp.mean((out - y) ** 2)


def fsdp_loss(p, x, y):
    full = {**p, "w1": lax.all_gather(p["w1"], "data", tiled=True)}
    return loss_fn(full, x, y)


def state_like(tx, specs):
    """The optimizer state's specs: the parameters' for their moments."""
    return optax.tree_utils.tree_map_params(
        tx,
        lambda _, spec: spec,
        tx.init(PARAMS),
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )


two_d = {}
for name, specs, fn in (("tp", TP, tp_loss), ("fsdp", FSDP, fsdp_loss)):
    for k in (1, 2):
        ref, ref_scales = reference(False, k)
        tx = make_tx(False)
        inner = jls.train_step(fn, tx, average_over="data", **options(False, k))
        state_specs = state_like(tx, specs)
        sstep = jax.jit(
            jax.shard_map(
                inner,
                mesh=mesh2,
                in_specs=(specs, state_specs, P("data"), P("data")),
                out_specs=(specs, state_specs, P()),
            )
        )
        placed = jax.tree.map(
            lambda v, s: jax.device_put(v, NamedSharding(mesh2, s)), PARAMS, specs
        )
        state = jax.tree.map(
            lambda v, s: jax.device_put(v, NamedSharding(mesh2, s)),
            tx.init(PARAMS),
            state_specs,
        )
        xd = jax.device_put(X, NamedSharding(mesh2, P("data")))
        yd = jax.device_put(Y, NamedSharding(mesh2, P("data")))
        params, scales = run(sstep, placed, state, xd, yd)
        two_d[f"{name}_k{k}"] = {
            "rel": rel_diff(params, ref),
            "scales": scales,
            "ref_scales": ref_scales,
        }
report["two_d"] = two_d

# 3. float16 gradients of 30000 on each of 4 replicas: their mean is finite,
# their float16 sum is not; the step is applied as on one device.
tx16 = jls.loss_scaling(optax.sgd(1e-6), jls.static_scale(1.0))
w16 = jnp.ones(4, jnp.float16)


def f16_loss(w, x):
    return jnp.sum((w * x[0]).astype(jnp.float32))


x16 = jnp.full((4, 1, 4), 30000.0, jnp.float16)
f16_step = jax.pmap(jls.train_step(f16_loss, tx16, average_over="r"), axis_name="r")
reps16 = jax.tree.map(lambda v: jnp.stack([v] * 4), (w16, tx16.init(w16)))
w_after, _, out16 = f16_step(*reps16, x16)
report["f16_sum"] = {
    "skipped": np.asarray(out16.skipped).tolist(),
    "moved": float(1.0 - np.asarray(w_after, np.float32)[0, 0]),
}

# 4. The user's own pmean under check_vma=True, with tx.update: the loss
# varies over "data", jax sums the gradients, and jls.scale_loss says so.
tx = make_tx(False)


def own_pmean(p, s, x, y, reduce_loss):
    def scaled(p):
        loss = loss_fn(p, x, y)
        if reduce_loss:
            loss = lax.pmean(loss, "data")
        return jls.scale_loss(loss, s)

    g = lax.pmean(jax.grad(scaled)(p), "data")
    return jls.apply_gradients(tx, g, s, p)


ref, _ = reference(False, 1)
own = {}
for reduce_loss in (False, True):
    sstep = jax.jit(
        jax.shard_map(
            functools.partial(own_pmean, reduce_loss=reduce_loss),
            mesh=mesh1,
            in_specs=(P(), P(), P("data"), P("data")),
            out_specs=(P(), P()),
        )
    )
    put = functools.partial(jax.device_put, device=NamedSharding(mesh1, P()))
    params, state = put(PARAMS), put(tx.init(PARAMS))
    xd = jax.device_put(X, NamedSharding(mesh1, P("data")))
    yd = jax.device_put(Y, NamedSharding(mesh1, P("data")))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            params, state = sstep(params, state, xd, yd)
    own[f"reduced{reduce_loss}"] = {
        "rel": rel_diff(params, ref),
        "warnings": [str(w.message) for w in seen],
    }
report["own_pmean"] = own

# 5. What jls measures across replicas on the data x model mesh: the global
# gradient norm and the replica check, given the averaged global gradients
# laid out as tensor parallelism (hidden layer over "model") and FSDP (rows
# over "data", a leaf over both axes) lay them out, with check_vma on and
# off, the data axis named alone or with the model axis; then the same
# gradients NOT averaged (each data replica its own) under check_vma=False.
GRADS = {
    "w1": rng.normal(size=(8, 16)).astype(np.float32),
    "b1": rng.normal(size=16).astype(np.float32),
    "w2": rng.normal(size=(16, 4)).astype(np.float32),
    "b2": rng.normal(size=4).astype(np.float32),
}
LAYOUTS = {
    "tp": TP,
    "fsdp": {"w1": P("data", None), "b1": P(("data", "model")), "w2": P(), "b2": P()},
}
true_norm = float(
    np.sqrt(sum((np.asarray(g, np.float64) ** 2).sum() for g in jax.tree.leaves(GRADS)))
)
measured: dict[str, Any] = {"true_norm": true_norm}
for layout, specs in LAYOUTS.items():
    placed = jax.tree.map(
        lambda v, s: jax.device_put(v, NamedSharding(mesh2, s)), GRADS, specs
    )
    for vma in (True, False):
        for axes, check in (
            (("data", "model"), "data"),
            (("data", "model"), True),
            (("data",), True),
        ):
            if not vma and len(axes) == 1:
                continue  # without vma an unnamed sharded axis is invisible
            tx = jls.loss_scaling(
                optax.sgd(0.1),
                jls.no_scale(),
                gradient_norm=True,
                axis_name=dict.fromkeys(axes, specs),  # sharded: as placed
                check_replicas=check,
            )

            def measure(g, s, tx=tx):
                _, new = tx.update(g, s, g)
                m = jls.metrics(new)
                out = [m["gradient_norm"], m["replica_mismatches"].astype(jnp.float32)]
                return jnp.stack(out)[None, None]

            key = f"{layout}_vma{vma}_{'x'.join(axes)}_check{check}"
            try:
                out = jax.jit(
                    jax.shard_map(
                        measure,
                        mesh=mesh2,
                        in_specs=(specs, P()),
                        out_specs=P("data", "model"),
                        check_vma=vma,
                    )
                )(placed, tx.init(GRADS))
                rows = np.unique(np.asarray(out).reshape(-1, 2), axis=0)
                measured[key] = rows.tolist()
            except Exception as e:  # reported: the test names the case
                measured[key] = f"{type(e).__name__}: {str(e)[:300]}"
# jit over sharded arrays: the norm of global arrays.
tx = jls.loss_scaling(optax.sgd(0.1), jls.no_scale(), gradient_norm=True)
placed = jax.tree.map(
    lambda v, s: jax.device_put(v, NamedSharding(mesh2, s)), GRADS, LAYOUTS["fsdp"]
)
measured["jit"] = float(
    jax.jit(lambda g, s: jls.metrics(tx.update(g, s, g)[1])["gradient_norm"])(
        placed, tx.init(GRADS)
    )
)
# Not averaged: each data replica has its own gradients (tensor parallel).
own = jax.tree.map(lambda g: np.stack([g * (1 + i) for i in range(4)]), GRADS)
own_specs = jax.tree.map(lambda s: P("data", *s), TP)
tx = jls.loss_scaling(
    optax.sgd(0.1), jls.no_scale(), axis_name=("data", "model"), check_replicas="data"
)


def unaveraged(g, s):
    g = jax.tree.map(lambda x: x[0], g)
    _, new = tx.update(g, s, g)
    return jls.metrics(new)["replica_mismatches"][None, None]


out = jax.jit(
    jax.shard_map(
        unaveraged,
        mesh=mesh2,
        in_specs=(own_specs, P()),
        out_specs=P("data", "model"),
        check_vma=False,
    )
)(
    jax.tree.map(
        lambda v, s: jax.device_put(v, NamedSharding(mesh2, s)), own, own_specs
    ),
    tx.init(GRADS),
)
measured["unaveraged_mismatches"] = np.unique(np.asarray(out)).tolist()
report["measured"] = measured

print(json.dumps(report))
