"""The replica check: data-parallel gradients that were not averaged are counted."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jls
from jls._decision import same_on_replicas
from jls.hooks._replicas import fingerprint

R = 4


def _step(tx, average):
    def step(params, state, x):
        grads = jax.grad(lambda p: jls.scale_loss(jnp.mean((x @ p) ** 2), state))(
            params
        )
        if average:
            grads = jax.lax.pmean(grads, "batch")
        return jls.apply_gradients(tx, grads, state, params)

    return jax.jit(jax.vmap(step, axis_name="batch"))


def _run(average, steps=3, bad_step=None):
    tx = jls.loss_scaling(
        optax.sgd(0.1),
        jls.dynamic_scale(2.0**4),
        axis_name="batch",
        check_replicas=True,
    )
    params = jnp.stack([jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)] * R)
    state = jax.vmap(tx.init)(params)
    rng = np.random.default_rng(0)
    step = _step(tx, average)
    history = []
    for i in range(steps):
        x = rng.normal(size=(R, 5, 3)).astype(np.float32)
        if i == bad_step:
            x[1, 0, 0] = np.inf
        params, state = step(params, state, jnp.asarray(x))
        m = jls.metrics(state)
        history.append(
            (m["replicas_differ"].tolist(), m["replica_mismatches"].tolist())
        )
    return history


def test_forgotten_averaging_is_counted_on_every_replica():
    assert _run(average=False) == [
        ([True] * R, [1] * R),
        ([True] * R, [2] * R),
        ([True] * R, [3] * R),
    ]


def test_averaged_gradients_are_never_counted():
    assert _run(average=True) == [([False] * R, [0] * R)] * 3


def test_a_skipped_step_is_not_counted():
    history = _run(average=False, bad_step=1)
    assert history[1] == ([False] * R, [1] * R)
    assert history[2] == ([True] * R, [2] * R)


def test_check_replicas_needs_an_axis_name():
    with pytest.raises(ValueError, match="check_replicas compares the replicas"):
        jls.loss_scaling(optax.sgd(0.1), check_replicas=True)
    with pytest.raises(ValueError, match="check_replicas compares the replicas"):
        jls.loss_scaling(optax.sgd(0.1), check_replicas="b")
    with pytest.raises(TypeError, match="check_replicas must be a bool, an axis"):
        jls.loss_scaling(optax.sgd(0.1), axis_name="b", check_replicas=1)
    with pytest.raises(ValueError, match=r"check_replicas='yes' must name axes of"):
        jls.loss_scaling(optax.sgd(0.1), axis_name="b", check_replicas="yes")


def test_the_fingerprint_reads_one_element_of_each_floating_leaf():
    tree = {
        "w": jnp.arange(6.0).reshape(2, 3) + 7,
        "c": jnp.array([2 + 3j], jnp.complex64),
        "n": jnp.int32(4),
        "empty": jnp.zeros((0,)),
        "h": jnp.array([1.5, 9.0], jnp.float16),
    }
    values = fingerprint(tree)
    assert [float(v) for v in values] == [2.0, 1.5, 7.0]
    assert all(v.dtype == jnp.float32 for v in values)


def test_differing_bits_are_seen_where_values_compare_equal():
    # -0.0 == 0.0 as numbers; the check compares bits (pmean's results are
    # bitwise equal on every replica, so bits are the honest test).
    tx = jls.LossScaling(optax.sgd(0.1), axis_name="batch")
    same = jax.vmap(lambda v: same_on_replicas(tx.config, [v]), axis_name="batch")
    assert same(jnp.array([0.0, -0.0])).tolist() == [False, False]
    assert same(jnp.array([1.0, 1.0])).tolist() == [True, True]
    assert same(jnp.array([jnp.nan, jnp.nan])).tolist() == [True, True]


def _two_axes(check, average):
    """A data x model mesh of named vmaps (no varying axes recorded).

    The gradients are sharded over "model" and averaged, or not, over "data".
    """
    tx = jls.loss_scaling(
        optax.sgd(0.1),
        jls.no_scale(),
        axis_name=("data", "model"),
        check_replicas=check,
    )
    grads = jnp.arange(1.0, 25.0).reshape(2, 3, 4)  # [data, model, leaf]
    if average:
        grads = jnp.broadcast_to(grads.mean(0), grads.shape)

    def step(g):
        _, state = tx.update({"w": g}, tx.init({"w": g}), {"w": g})
        return jls.metrics(state)["replica_mismatches"]

    inner = jax.vmap(step, axis_name="model")
    return jax.vmap(inner, axis_name="data")(grads)


def test_on_two_axes_only_the_named_data_axis_is_compared():
    assert _two_axes("data", average=True).tolist() == [[0, 0, 0]] * 2
    assert _two_axes("data", average=False).tolist() == [[1, 1, 1]] * 2


def test_check_replicas_true_on_two_untracked_axes_names_the_fix():
    with pytest.raises(ValueError, match="check_replicas='data'"):
        _two_axes(True, average=True)


def test_under_check_vma_replicas_are_equal_by_type_and_nothing_is_compared():
    mesh = jax.make_mesh((1,), ("data",))
    tx = jls.loss_scaling(
        optax.sgd(0.1), jls.no_scale(), axis_name="data", check_replicas=True
    )
    p = {"w": jnp.ones(3)}

    def step(p, s):
        return tx.update({"w": jnp.full(3, 2.0)}, s, p)[1]

    step = jax.shard_map(step, mesh=mesh, in_specs=(P(), P()), out_specs=P())
    jaxpr = jax.make_jaxpr(step)(p, tx.init(p))
    assert "pmax" not in str(jaxpr)  # no comparison was made
    assert int(jls.metrics(jax.jit(step)(p, tx.init(p)))["replica_mismatches"]) == 0


def _mismatches(axis_name):
    """A named vmap of 4: "s" sharded (its shards differ), "r" averaged."""
    tx = jls.loss_scaling(
        optax.sgd(0.1), jls.no_scale(), axis_name=axis_name, check_replicas=True
    )
    params = {"r": jnp.ones(2), "s": jnp.ones(2)}

    def device(i):
        grads = {"r": jnp.ones(2), "s": jnp.full(2, i)}
        return jls.metrics(tx.update(grads, tx.init(params), params)[1])

    return jax.vmap(device, axis_name="batch")(jnp.arange(4.0))["replica_mismatches"]


def test_leaves_declared_sharded_are_not_compared():
    assert _mismatches({"batch": {"r": False, "s": True}}).tolist() == [0] * 4
    assert _mismatches({"batch": {"r": False, "s": P("batch")}}).tolist() == [0] * 4
    # Declared replicated, the differing shards are a mismatch; undeclared too.
    assert _mismatches({"batch": False}).tolist() == [1] * 4
    assert _mismatches("batch").tolist() == [1] * 4
