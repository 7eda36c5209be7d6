"""Replicas and shards agree on everything jls reads: 4 host devices.

Run by tests/test_distributed.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=4; prints a JSON report.
Each case returns what every device computed, so the test can compare them.
"""

import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jls

N = jax.device_count()
assert N == 4, N
mesh = jax.make_mesh((N,), ("x",))
report: dict = {}


def _stack_norm(tree):
    return float(np.sqrt(sum((np.asarray(x, np.float64) ** 2).sum() for x in tree)))


# 1. The norm of a gradient sharded over a shard_map axis is the global norm,
# whether the axis is named (with the sharded leaves, as check_vma=False
# needs) or not, and whether jax records the varying axes or not. One leaf is
# sharded, one replicated, one small leaf sharded and one small replicated;
# then the same with every shard of a sharded leaf equal (mirrored).
grads = {
    "w": jnp.arange(1.0, 17.0).reshape(4, 4),
    "r": jnp.full((3,), 2.0),
    "s": jnp.arange(1.0, 9.0),
}
specs = {"w": P("x"), "r": P(), "s": P("x")}
true_norm = _stack_norm(jax.tree.leaves(grads))


def place(tree):
    return jax.tree.map(
        lambda g, s: jax.device_put(g, NamedSharding(mesh, s)), tree, specs
    )


placed = place(grads)
mirrored = {"w": jnp.tile(jnp.arange(1.0, 5.0), (4, 1)), "r": grads["r"]}
mirrored["s"] = jnp.tile(jnp.arange(1.0, 3.0), 4)
norms = {}
for check_vma, named, kind in itertools.product((True, False), (None, "x"), ("", "m")):
    declared = None if named is None else {named: specs}
    tx = jls.loss_scaling(
        optax.sgd(0.0), jls.no_scale(), gradient_norm=True, axis_name=declared
    )

    def norm_step(g, s, tx=tx):
        _, new = tx.update(g, s, g)
        return jls.metrics(new)["gradient_norm"][None]

    out = jax.jit(
        jax.shard_map(
            norm_step,
            mesh=mesh,
            in_specs=(specs, P()),
            out_specs=P("x"),
            check_vma=check_vma,
        )
    )(place(mirrored) if kind else placed, tx.init(grads))
    norms[f"vma{check_vma}_named{named}{kind}"] = np.asarray(out).tolist()
report["norm"] = {"true": true_norm, "got": norms}
report["norm"]["true_mirrored"] = _stack_norm(jax.tree.leaves(mirrored))

# 2. Data parallel under pmap: gradients averaged (replicated) keep their own
# norm, not sqrt(N) times it; under a named vmap too.
tx = jls.loss_scaling(  # averaged: replicated over "r"
    optax.sgd(0.0), jls.no_scale(), gradient_norm=True, axis_name={"r": False}
)
params = {"w": jnp.ones((4, 4)), "b": jnp.ones(3)}
per_replica = jax.tree.map(lambda p: jnp.stack([p * (i + 1) for i in range(N)]), params)


def dp_step(g, s):
    g = jax.lax.pmean(g, "r")
    _, new = tx.update(g, s, g)
    return jls.metrics(new)["gradient_norm"]


state = jax.tree.map(lambda x: jnp.stack([x] * N), tx.init(params))
mean = jax.tree.map(lambda g: np.asarray(g).mean(0), per_replica)
report["dp"] = {
    "true": _stack_norm(jax.tree.leaves(mean)),
    "pmap": np.asarray(jax.pmap(dp_step, axis_name="r")(per_replica, state)).tolist(),
    "vmap": np.asarray(jax.vmap(dp_step, axis_name="r")(per_replica, state)).tolist(),
}

# 3. The decision and the per-leaf diagnostics over a shard_map axis the user
# did not name: a nan on one shard of a model-parallel gradient skips the step
# on every shard, with and without the norm.
agree = {}
for norm in (False, True):
    tx = jls.loss_scaling(
        optax.sgd(0.1),
        jls.dynamic_scale(2.0**4),
        diagnostics=True,
        gradient_norm=norm,
    )
    bad = grads["w"].at[3, 1].set(jnp.nan)
    g = {**grads, "w": bad}
    g = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), g, specs)
    state = tx.init(grads)

    def step(g, s, p, tx=tx):
        new_p, new = jls.apply_gradients(tx, g, s, p)
        m = jls.metrics(new)
        flags = jnp.stack([m["nonfinite_leaves"][k] for k in ("r", "s", "w")])
        return (
            new_p,
            m["skipped"][None],
            m["loss_scale"][None],
            flags[None],
        )

    new_p, skipped, scales, flags = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(specs, P(), specs),
            out_specs=(specs, P("x"), P("x"), P("x")),
        )
    )(g, state, placed)
    unchanged = all(
        bool(np.array_equal(np.asarray(a), np.asarray(b)))
        for a, b in zip(jax.tree.leaves(new_p), jax.tree.leaves(placed), strict=True)
    )
    agree[f"norm{norm}"] = {
        "skipped": np.asarray(skipped).tolist(),
        "scales": np.asarray(scales).tolist(),
        "flags": np.asarray(flags).tolist(),
        "unchanged": unchanged,
    }
report["unnamed"] = agree

# 4. A spike rule watching the loss with axis_name: each replica passes its own
# loss; the statistics are fed the replicas' mean, so the states stay equal.
rule = jls.hooks.SpikeRule(watch="loss", warmup=3, threshold=3.0)
tx = jls.loss_scaling(optax.sgd(0.01), jls.no_scale(), skip_spikes=rule, axis_name="r")
p = {"w": jnp.ones(2)}
state = jax.tree.map(lambda x: jnp.stack([x] * N), tx.init(p))
rep_p = jax.tree.map(lambda x: jnp.stack([x] * N), p)


@functools.partial(jax.pmap, axis_name="r")
def pstep(params, state, loss):
    g = {"w": jnp.full(2, 0.5)}
    return jls.apply_gradients(tx, g, state, params, loss=loss)


for i in range(6):
    losses = jnp.asarray([1.0 + 0.1 * i + 0.05 * r for r in range(N)])
    rep_p, state = pstep(rep_p, state, losses)
stats = [np.asarray(x) for x in jax.tree.leaves(state.hooks["spikes"])]
report["loss_rule"] = {
    "stats_equal": all(bool(np.all(x == x[:1])) for x in stats),
    "loss_mean": float(np.asarray(state.hooks["spikes"].loss_mean)[0]),
}
# The same under shard_map with the state replicated (out_specs P()).
r_mesh = jax.make_mesh((N,), ("r",))
smap = jax.jit(
    jax.shard_map(
        lambda p, s, loss: jls.apply_gradients(
            tx, {"w": jnp.full(2, 0.5)}, s, p, loss=loss[0]
        ),
        mesh=r_mesh,
        in_specs=(P(), P(), P("r")),
        out_specs=(P(), P()),
    )
)
losses = jax.device_put(jnp.arange(1.0, N + 1.0), NamedSharding(r_mesh, P("r")))
_, s_state = smap(p, tx.init(p), losses)
report["loss_rule"]["shard_map_mean"] = float(s_state.hooks["spikes"].loss_mean)

# 6. scale_stats: the underflow fraction and headroom of sharded gradients
# (sharded leaves added, replicated ones counted once), and of replicas
# under pmap with different gradients (added): every device reports the same.
stats_grads = {
    # 8 of 16 small; the shards differ (shards with equal statistics read as
    # replicas where jax records no varying axes, as for the norm)
    "w": jnp.asarray([[0.0, 1e-6, 1.0, 2.0 * (i + 1)] for i in range(4)]),
    "r": jnp.asarray([1e-7, 4.0, 8.0], jnp.float32),  # 1 of 3 small
}
stats_specs = {"w": P("x"), "r": P()}
stats_placed = jax.tree.map(
    lambda g, s: jax.device_put(g, NamedSharding(mesh, s)), stats_grads, stats_specs
)
report["scale_stats"] = {}
for check_vma in (True, False):
    tx = jls.loss_scaling(
        optax.sgd(0.0), jls.no_scale(), scale_stats=True, axis_name={"x": stats_specs}
    )

    def stats_step(g, s, tx=tx):
        _, new = tx.update(g, s, g)
        m = jls.metrics(new)
        return jnp.stack([m["underflow_fraction"], m["headroom_bits"]])[None]

    out = jax.jit(
        jax.shard_map(
            stats_step,
            mesh=mesh,
            in_specs=(stats_specs, P()),
            out_specs=P("x"),
            check_vma=check_vma,
        )
    )(stats_placed, tx.init(stats_grads))
    report["scale_stats"][f"vma{check_vma}"] = np.asarray(out).tolist()

tx = jls.loss_scaling(  # each replica's gradient its own: added
    optax.sgd(0.0), jls.no_scale(), scale_stats=True, axis_name={"r": True}
)
per_replica = {"w": jnp.stack([jnp.full(4, 2.0**i) for i in range(N)])}


def stats_pmap(g, s):
    _, new = tx.update(g, s, g)
    m = jls.metrics(new)
    return jnp.stack([m["underflow_fraction"], m["headroom_bits"]])


one = {"w": jnp.zeros(4)}
states = jax.tree.map(lambda x: jnp.stack([x] * N), tx.init(one))
report["scale_stats"]["pmap"] = np.asarray(
    jax.pmap(stats_pmap, axis_name="r")(per_replica, states)
).tolist()

print(json.dumps(report))
