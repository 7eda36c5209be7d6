"""State outside the optimizer is kept on a skipped step (`jls.keep_if_skipped`)."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jls

PARAMS = {"w": jnp.ones(3)}
OLD = {"mean": jnp.arange(3.0), "count": jnp.int32(7), "half": jnp.ones(2, jnp.float16)}
NEW = {
    "mean": jnp.array([jnp.nan, jnp.inf, 1.0]),
    "count": jnp.int32(8),
    "half": jnp.full(2, jnp.nan, jnp.float16),
}
FINITE = {"w": jnp.full(3, 4.0)}
NAN = {"w": jnp.array([1.0, jnp.nan, 1.0])}


def _stepped(scaler, grads):
    tx = jls.loss_scaling(optax.sgd(0.1), scaler)
    state = tx.init(PARAMS)
    return jax.jit(lambda g, s: jls.apply_gradients(tx, g, s, PARAMS)[1])(grads, state)


def test_a_skipped_step_keeps_the_old_state_bitwise():
    tx = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(4.0))

    @jax.jit
    def step(grads, opt_state, old, new):
        _, opt_state = jls.apply_gradients(tx, grads, opt_state, PARAMS)
        return jls.keep_if_skipped(new, old, opt_state)

    kept = step(NAN, tx.init(PARAMS), OLD, NEW)
    chex.assert_trees_all_equal(kept, OLD, strict=True)
    taken = step(FINITE, tx.init(PARAMS), OLD, NEW)
    chex.assert_trees_all_equal(taken, NEW, strict=True)


def test_with_several_optimizers_any_skip_keeps_it():
    skipped = _stepped(jls.static_scale(4.0), NAN)
    applied = _stepped(jls.static_scale(4.0), FINITE)
    chex.assert_trees_all_equal(jls.keep_if_skipped(NEW, OLD, applied, skipped), OLD)
    chex.assert_trees_all_equal(jls.keep_if_skipped(NEW, OLD, skipped, applied), OLD)
    chex.assert_trees_all_equal(jls.keep_if_skipped(NEW, OLD, applied, applied), NEW)


def test_with_jls_off_nothing_is_skipped_and_new_is_returned():
    off = _stepped(jls.no_scale(skip_nonfinite=False), NAN)
    chex.assert_trees_all_equal(jls.keep_if_skipped(NEW, OLD, off), NEW)


def test_an_equinox_batchnorm_state_survives_a_nan_batch():
    # eqx.nn.BatchNorm(mode="ema") normalises with its running statistics in
    # training: one nan batch written into them makes every later batch nan.
    model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", mode="ema")

    def forward(state, x):
        return jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(x, state)

    x = jnp.ones((4, 3))
    _, state = forward(state, x)  # the statistics are populated
    _, poisoned = forward(state, x.at[0, 0].set(jnp.nan))
    skipped = _stepped(jls.static_scale(4.0), NAN)
    kept = jls.keep_if_skipped(poisoned, state, skipped)
    chex.assert_trees_all_equal(jax.tree.leaves(kept), jax.tree.leaves(state))
    out, _ = forward(kept, x)
    assert bool(jnp.all(jnp.isfinite(out)))
    out, _ = forward(poisoned, x)
    assert bool(jnp.all(jnp.isnan(out[:, 0])))  # without the call: nan for good


def test_bad_calls_are_refused_by_name():
    applied = _stepped(jls.static_scale(4.0), FINITE)
    with pytest.raises(TypeError, match=r"needs the optimizer state"):
        jls.keep_if_skipped(NEW, OLD)
    with pytest.raises(TypeError, match="new and old must have one structure"):
        jls.keep_if_skipped(NEW, {"mean": OLD["mean"]}, applied)
    with pytest.raises(ValueError, match="exactly one jls.LossScaleState"):
        jls.keep_if_skipped(NEW, OLD, optax.sgd(0.1).init(PARAMS))
    assert np.dtype(jls.keep_if_skipped(NEW, OLD, applied)["half"].dtype) == np.float16
