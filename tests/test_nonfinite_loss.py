"""A non-finite loss skips its step, keeping the scale (`jls.hooks._nonfinite_loss`)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jls

W = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)}
X = jnp.linspace(0.1, 1.0, 8).reshape(4, 2)


def loss_fn(params, x, weight):
    # weight = 0 with an inf input: 0 * inf = nan, as a float16 sigmoid that
    # rounds to 1 makes 0 * log(0).
    return jnp.mean(jnp.sum((x @ params["w"]) ** 2, axis=1) * weight)


SCALERS = {
    "dynamic": jls.dynamic_scale(2.0**10, growth_interval=3),
    "measured": jls.measured_scale(init_scale=2.0**10),
    "static": jls.static_scale(2.0**10),
    "torch": jls.presets.torch(init_scale=2.0**10, growth_interval=3),
    "megatron": jls.presets.megatron(initial_scale=2.0**10, growth_interval=3),
}


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("name", list(SCALERS))
def test_a_nonfinite_loss_skips_and_keeps_the_scale(name, accumulation):
    scaler = SCALERS[name]
    tx = jls.loss_scaling(optax.adam(1e-2), scaler)
    step = jax.jit(
        jls.train_step(loss_fn, tx, max_retries=3, accumulation_steps=accumulation)
    )
    params, state = W, tx.init(W)
    weights = jnp.ones(4)
    params, state, out = step(params, state, X, weights)  # a clean step
    assert not bool(out.skipped) and not bool(out.nonfinite_loss)
    before = jls.loss_scale_state(state)
    bad = X.at[0, 0].set(jnp.inf)
    new_params, new_state, out = step(params, state, bad, weights.at[0].set(0.0))
    assert bool(out.skipped) and bool(out.nonfinite_loss)
    assert int(out.retries) == 0  # no scale helps: no retry
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
    after = jls.loss_scale_state(new_state)
    for field in ("scale", "growth_count", "backoff_count", "headroom"):
        assert getattr(after, field) == getattr(before, field), field
    m = jls.metrics(new_state)
    assert bool(m["nonfinite_loss"]) and int(m["total_skips"]) == 1
    # The next clean step goes on as if nothing happened.
    _, last, out = step(new_params, new_state, X, weights)
    assert not bool(out.skipped) and not bool(jls.metrics(last)["nonfinite_loss"])


def test_without_the_loss_the_step_is_as_before():
    # tx.update without loss=: the hook has no opinion; the step backs off.
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**10))
    _, state = tx.update({"w": jnp.full((2, 3), jnp.nan)}, tx.init(W), W)
    assert float(jls.metrics(state)["loss_scale"]) == 2.0**9
    assert not bool(jls.metrics(state)["nonfinite_loss"])
    # With loss= it holds.
    _, state = tx.update(
        {"w": jnp.full((2, 3), jnp.nan)}, tx.init(W), W, loss=jnp.float32(np.nan)
    )
    assert float(jls.metrics(state)["loss_scale"]) == 2.0**10
    assert bool(jls.metrics(state)["nonfinite_loss"])
