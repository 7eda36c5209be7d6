"""The wrapped optimizer: any optax transformation, extra args, MultiSteps."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from steps import (
    X,
    _assert_no_nan,
    _loss,
    _params,
    _poison,
    _scaled_grads,
    _update_path,
)

import jls


def _micro_grads(params, state, i, bad):
    g = _scaled_grads(params, state, X + i)
    return _poison(g, np.nan) if bad else g


def test_chain_with_clipping_sees_unscaled_gradients():
    params = _params()
    # A threshold between the unscaled norm and the scaled one (1024x): the
    # clip must leave the step alone, which it does only if it sees the
    # unscaled gradients.
    norm = float(optax.tree.norm(jax.grad(_loss)(params, X)))
    inner = optax.chain(optax.clip_by_global_norm(4 * norm), optax.sgd(1.0))
    tx = jls.loss_scaling(inner, jls.static_scale(2.0**10))
    state = tx.init(params)
    grads = _scaled_grads(params, state)
    new_params, _, _ = _update_path(tx)(params, state, grads)
    sgd = optax.sgd(1.0)
    unclipped = optax.apply_updates(
        params, sgd.update(jax.grad(_loss)(params, X), sgd.init(params))[0]
    )
    chex.assert_trees_all_close(new_params, unclipped, rtol=1e-6)
    plain = optax.apply_updates(
        params, inner.update(jax.grad(_loss)(params, X), inner.init(params))[0]
    )
    chex.assert_trees_all_equal(new_params, plain)


def test_extra_args_are_forwarded():
    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None, *, factor):
        return jax.tree.map(lambda u: u * factor, updates), state

    inner = optax.GradientTransformationExtraArgs(init, update)
    tx = jls.loss_scaling(inner, jls.static_scale(2.0))
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    updates, _ = jax.jit(tx.update)({"w": jnp.full(2, 6.0)}, state, params, factor=5.0)
    np.testing.assert_array_equal(updates["w"], np.full(2, 15.0, np.float32))
    updates, _ = jax.jit(tx.update)(
        {"w": jnp.array([np.nan, 6.0])}, state, params, factor=5.0
    )
    np.testing.assert_array_equal(updates["w"], np.zeros(2, np.float32))


@pytest.mark.parametrize("outer", [False, True])
def test_inject_hyperparams(outer):
    params = _params()
    if outer:
        tx = optax.inject_hyperparams(
            lambda learning_rate: jls.loss_scaling(optax.sgd(learning_rate))
        )(learning_rate=0.1)
    else:
        tx = jls.loss_scaling(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
    state = tx.init(params)
    scale = jls.loss_scale_state(state).scale
    assert float(scale) == 2.0**15
    grads = _scaled_grads(params, state)
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    expected = jax.tree.map(lambda g: -0.1 * g, jax.grad(_loss)(params, X))
    chex.assert_trees_all_close(updates, expected, rtol=1e-6)
    bad = _poison(grads, np.nan)
    updates, skipped = jax.jit(tx.update)(bad, new_state, params)
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
    assert bool(jls.metrics(skipped)["skipped"])
    if not outer:
        chex.assert_trees_all_equal(skipped.inner_state, new_state.inner_state)


def test_masked_inside():
    params = _params()
    mask = {"dense": {"w": True}, "bias": False}
    tx = jls.loss_scaling(optax.masked(optax.sgd(1.0), mask), jls.static_scale(4.0))
    state = tx.init(params)
    grads = _scaled_grads(params, state)
    updates, state = jax.jit(tx.update)(grads, state, params)
    true = jax.grad(_loss)(params, X)
    np.testing.assert_array_equal(updates["dense"]["w"], -true["dense"]["w"])
    # masked-out leaves pass through (unscaled, as jls saw them)
    np.testing.assert_array_equal(updates["bias"], true["bias"])
    bad = _poison(grads, np.nan, leaf=1)  # the masked-in leaf
    updates, state = jax.jit(tx.update)(bad, state, params)
    np.testing.assert_array_equal(updates["dense"]["w"], np.zeros((3, 4), np.float32))
    assert bool(jls.metrics(state)["skipped"])
    # The other order, masked(loss_scaling(...)), passes the masked-out leaves'
    # scaled gradients through as updates: refused (tests/test_composition.py).


def test_multisteps_inside_loss_scaling_recommended_order():
    params = _params()
    k = 3
    tx = jls.loss_scaling(optax.MultiSteps(optax.sgd(0.1), k), jls.dynamic_scale(8.0))
    state = tx.init(params)
    step = _update_path(tx)
    # A nan micro-batch (index 1) is dropped alone: the window then completes
    # with micro-batches 0, 2, 3, whatever the scale did in between.
    for i, bad in enumerate([False, True, False, False]):
        params, state, _ = step(params, state, _micro_grads(params, state, i, bad))
        if bad:
            assert float(jls.metrics(state)["loss_scale"]) == 4.0
    _assert_no_nan(state)
    ref = optax.MultiSteps(optax.sgd(0.1), k)
    ref_params = _params()
    ref_state = ref.init(ref_params)
    for i in [0, 2, 3]:
        u, ref_state = ref.update(
            jax.grad(_loss)(ref_params, X + i), ref_state, ref_params
        )
        ref_params = optax.apply_updates(ref_params, u)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-6)
    assert int(state.inner_state.gradient_step) == 1


def test_multisteps_outside_loss_scaling_is_not_poisoned():
    params = _params()
    k = 2
    tx = optax.MultiSteps(
        jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(8.0)),
        k,
        should_skip_update_fn=optax.skip_not_finite,
    )
    state = tx.init(params)
    step = _update_path(tx)
    for i, bad in enumerate([False, True, False, False, False]):
        params, state, _ = step(params, state, _micro_grads(params, state, i, bad))
    _assert_no_nan((params, state))
    assert int(state.gradient_step) == 2
    # The scale is read from inside MultiSteps and stays constant per window.
    assert float(jls.metrics(state)["loss_scale"]) == 8.0


def test_extra_args_reach_the_inner_optimizer_through_multisteps_and_fused():
    # reduce_on_plateau needs value=; MultiSteps forwards extra args to its
    # inner optimizer, and so must jls, on tx.update and on the fused path.
    inner = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=1))
    params = jnp.ones(2)
    for wrapped in (inner, optax.MultiSteps(inner, every_k_schedule=1)):
        tx = jls.loss_scaling(wrapped, jls.static_scale(2.0))
        state = tx.init(params)
        updates, _ = jax.jit(tx.update)(jnp.full(2, 2.0), state, params, value=1.0)
        np.testing.assert_array_equal(updates, [-1.0, -1.0])
        fused = functools.partial(jls.apply_gradients, tx, value=jnp.float32(1.0))
        new, _ = jax.jit(fused)(jnp.full(2, 2.0), state, params)
        np.testing.assert_array_equal(new, [0.0, 0.0])


def test_inject_hyperparams_inside_keeps_the_fused_path():
    # Wrapped around loss_scaling, inject_hyperparams rebuilds the whole
    # transformation on every update, so there is no LossScaling to reach:
    # the error says to put it inside, where the fused path works and the
    # hyperparameters stay reachable.
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
    tx = jls.loss_scaling(inner, jls.static_scale(2.0))
    params = jnp.ones(2)
    state = tx.init(params)
    state = optax.tree.set(state, learning_rate=jnp.asarray(0.25))
    new, state = jax.jit(functools.partial(jls.apply_gradients, tx))(
        jnp.full(2, 2.0), state, params
    )
    np.testing.assert_array_equal(new, [0.75, 0.75])
    outer = optax.inject_hyperparams(jls.loss_scaling)(inner=optax.sgd(0.1))
    with pytest.raises(TypeError, match="put every wrapper inside loss_scaling"):
        jls.apply_gradients(outer, jnp.ones(2), outer.init(params), params)
