"""Divergence: the sticky flag and `jls.hooks.raise_if_diverged`, host and checkify."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.experimental import checkify
from step_model import W, X, loss_fn

import jls


def test_raise_if_diverged_inside_jit_says_where_to_call_it():
    tx = jls.loss_scaling(optax.sgd(0.1), max_consecutive_skips=2)
    state = tx.init(jnp.zeros(2))

    def checked(s):
        jls.hooks.raise_if_diverged(s)
        return s

    with pytest.raises(TypeError, match="on the host after the step.*checkify"):
        jax.jit(checked)(state)
    from jax.experimental import checkify

    err, _ = jax.jit(checkify.checkify(checked))(state)
    assert err.get() is None


def test_divergence_error_at_the_host_check():
    tx = jls.loss_scaling(
        optax.sgd(0.1), jls.dynamic_scale(2.0**8), max_consecutive_skips=3
    )
    step = jax.jit(jls.train_step(loss_fn, tx))
    bad = X.at[0, 0].set(jnp.nan)
    params, state = W, tx.init(W)
    for _ in range(2):
        params, state, out = step(params, state, bad)
        jls.hooks.raise_if_diverged(state)
    params, state, out = step(params, state, bad)
    with pytest.raises(
        jls.hooks.DivergenceError, match="diverged: 3 consecutive"
    ) as caught:
        jls.hooks.raise_if_diverged(state)
    # It says how to find the op: the state before a skipped step.
    assert "jls.precision.explain_step(loss_fn, opt_state_before" in str(caught.value)


def test_no_divergence_error_when_steps_recover():
    tx = jls.loss_scaling(optax.sgd(0.1), max_consecutive_skips=2)
    step = jax.jit(jls.train_step(loss_fn, tx))
    params, state = W, tx.init(W)
    for i in range(6):
        x = X.at[0, 0].set(jnp.nan) if i % 2 else X
        params, state, out = step(params, state, x)
        jax.block_until_ready(out)
    jls.hooks.raise_if_diverged(state, 2)
    jls.hooks.raise_if_diverged(state)


def test_host_and_checkify_divergence_checks():
    scaler = jls.dynamic_scale()
    state = scaler.init()
    for _ in range(3):
        state = scaler.adjust(state, False)
    jls.hooks.raise_if_diverged(state, 4)
    with pytest.raises(jls.hooks.DivergenceError, match="3 consecutive skipped steps"):
        jls.hooks.raise_if_diverged(state, 3)

    def check(state):
        jls.hooks.raise_if_diverged(state, 3)
        return state

    err, _ = jax.jit(checkify.checkify(check))(state)
    with pytest.raises(checkify.JaxRuntimeError, match="loss scaling diverged"):
        err.throw()
    err, _ = jax.jit(checkify.checkify(check))(scaler.init())
    err.throw()  # no error
    with pytest.raises(ValueError, match="max_consecutive_skips must be"):
        jls.hooks.raise_if_diverged(state, 0)
    with pytest.raises(ValueError, match="max_consecutive_skips must be an int"):
        jls.loss_scaling(optax.sgd(0.1), max_consecutive_skips=0)


def test_after_the_limit_nothing_non_finite_is_ever_applied():
    # Unlike optax.apply_if_finite, which applies updates after giving up.
    # The gradient of sqrt at 0 is inf while the loss is finite: every step
    # overflows (a non-finite loss would hold the scale instead).
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**8))

    def sqrt_loss(params, x):
        return jnp.sum(jnp.sqrt(jnp.abs(params["a"] * 0.0))) + loss_fn(params, x)

    step = jax.jit(jls.train_step(sqrt_loss, tx))
    params, state = W, tx.init(W)
    for _ in range(50):
        params, state, out = step(params, state, X)
        assert bool(out.nonfinite) and not bool(out.nonfinite_loss)
    chex.assert_trees_all_equal(params, W)
    assert float(jls.metrics(state)["loss_scale"]) == 1.0


def test_a_default_transformation_flags_divergence_after_1000_skips():
    tx = jls.loss_scaling(optax.sgd(0.1))
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    assert not bool(jls.metrics(state)["diverged"])
    bad = {"w": jnp.full(2, jnp.nan)}

    def skip_many(state):
        def body(state, _):
            return tx.update(bad, state, params)[1], None

        return jax.lax.scan(body, state, None, length=999)[0]

    state = jax.jit(skip_many)(state)
    jls.hooks.raise_if_diverged(state)  # 999 in a row: not yet
    _, state = jax.jit(tx.update)(bad, state, params)
    with pytest.raises(
        jls.hooks.DivergenceError, match="1000 consecutive skipped steps"
    ):
        jls.hooks.raise_if_diverged(state)
    # The one-call step has it too, and None turns it off.
    step = jls.train_step(lambda p, x: jnp.sum(p["w"] * x), tx)
    _, state, _ = jax.jit(step)(params, state, jnp.full(2, jnp.nan))
    with pytest.raises(jls.hooks.DivergenceError):
        jls.hooks.raise_if_diverged(state)
    off = jls.loss_scaling(optax.sgd(0.1), max_consecutive_skips=None)
    assert "diverged" not in jls.metrics(off.init(params))
