"""The decision: replicas agree, independent vmapped runs stay apart, hints."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from steps import X, _assert_no_nan, _loss, _params, _scaled_grads

import jls


def test_vmap_over_independent_runs():
    params = jax.tree.map(lambda x: jnp.stack([x, x, x]), _params())
    tx = jls.loss_scaling(optax.adam(1e-2), jls.dynamic_scale(16.0))
    state = jax.vmap(tx.init)(params)
    grads = jax.vmap(lambda p, s: _scaled_grads(p, s))(params, state)
    grads = jax.tree.map(lambda g: g.at[1].set(jnp.nan), grads)  # run 1 only
    new_params, new_state = jax.jit(
        jax.vmap(lambda g, s, p: jls.apply_gradients(tx, g, s, p))
    )(grads, state, params)
    np.testing.assert_array_equal(new_state.loss_scale.scale, np.float32([16, 8, 16]))
    chex.assert_trees_all_equal(
        jax.tree.map(lambda x: x[1], new_params), jax.tree.map(lambda x: x[1], params)
    )
    assert not np.array_equal(new_params["bias"][0], params["bias"][0])
    _assert_no_nan((new_params, new_state))


def test_axis_name_makes_replicas_agree():
    params = _params()
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(16.0), axis_name="batch")
    state = tx.init(params)
    xs = jnp.stack([X, X + 1, X + 2, X + 3])
    poison = jnp.array([1.0, 1.0, np.nan, 1.0])

    def replica(x, p):
        grads = jax.grad(lambda q: jls.scale_loss(_loss(q, x) * p, state))(params)
        return jls.apply_gradients(tx, grads, state, params)

    new_params, new_state = jax.jit(jax.vmap(replica, axis_name="batch"))(xs, poison)
    np.testing.assert_array_equal(new_state.loss_scale.scale, np.float32([8] * 4))
    for r in range(4):
        replica_params = jax.tree.map(lambda x, r=r: x[r], new_params)
        chex.assert_trees_all_equal(replica_params, params)
    # Without axis_name each replica decides alone.
    tx_local = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(16.0))

    def local(x, p):
        grads = jax.grad(lambda q: jls.scale_loss(_loss(q, x) * p, state))(params)
        return jls.apply_gradients(tx_local, grads, state, params)

    _, local_state = jax.jit(jax.vmap(local))(xs, poison)
    np.testing.assert_array_equal(
        local_state.loss_scale.scale, np.float32([16, 16, 8, 16])
    )


def test_bfloat16_gradients_with_a_dynamic_scale_get_a_hint():
    params = {"w": jnp.ones(3, jnp.bfloat16)}
    tx = jls.loss_scaling(optax.sgd(0.1))
    with pytest.warns(UserWarning, match=r"bfloat16.*jls.no_scale\(\)"):
        jax.jit(tx.update)(params, tx.init(params), params)
    quiet = jls.loss_scaling(optax.sgd(0.1), jls.no_scale())
    jax.jit(quiet.update)(params, quiet.init(params), params)  # no warning


SCALERS = {
    "dynamic": jls.dynamic_scale(),
    "static": jls.static_scale(4.0),
    "measured": jls.measured_scale(),
    "no_scale": jls.no_scale(),
}


def _all_reduces(scaler, mode):
    """The all-reduces of a step on gradients averaged over "data" already."""
    mesh = jax.sharding.Mesh(np.reshape(jax.devices()[:1], (1, 1)), ("data", "model"))
    params = {"w": jnp.ones((4, 2)), "b": jnp.ones(3)}
    # Without varying axes jax cannot tell shards from replicas: declared.
    axis_name = "data" if mode == "vma" else {"data": False}
    tx = jls.loss_scaling(optax.sgd(0.1), scaler, axis_name=axis_name)
    state = tx.init(params)
    step = functools.partial(jls.apply_gradients, tx)
    if mode == "pmap":
        f = jax.pmap(step, axis_name="data")
        params, state = jax.tree.map(lambda x: x[None], (params, state))
    else:  # "w" sharded over "model", as tensor parallelism lays it out
        specs = {"w": P(None, "model"), "b": P()}
        f = jax.jit(
            jax.shard_map(
                step,
                mesh=mesh,
                in_specs=(specs, P(), specs),
                out_specs=(specs, P()),
                check_vma=mode == "vma",
            )
        )
    text = f.lower(params, state, params).as_text()
    return len(re.findall(r"\ball_reduce\b", text))


@pytest.mark.parametrize("mode", ["vma", "no_vma", "pmap"])
@pytest.mark.parametrize("scaler", list(SCALERS))
def test_the_decision_is_one_all_reduce_for_every_scaler(scaler, mode):
    assert _all_reduces(SCALERS[scaler], mode) == 1


def test_the_metrics_docstring_lists_exactly_the_keys_of_every_scaler():
    # The bullets of jls.metrics' "Returns:" name the keys a transformation
    # without extra hooks reports, the same for every scaler and the off switch.
    doc = jls.metrics.__doc__ or ""
    returns = doc[doc.index("Returns:") : doc.index("Example:")]
    bullets = re.findall(r"^\s*\* ((?:``\w+``(?:, )?)+):", returns, re.M)
    named = {k for b in bullets for k in re.findall(r"``(\w+)``", b)}
    off = jls.no_scale(skip_nonfinite=False)
    for scaler in (*SCALERS.values(), off):
        tx = jls.loss_scaling(optax.sgd(0.1), scaler)
        state = tx.init({"w": jnp.zeros(2)})
        assert set(jls.metrics(state)) == named, scaler
        _, state = jax.jit(tx.update)({"w": jnp.ones(2)}, state)
        assert set(jls.metrics(state)) == named, scaler
