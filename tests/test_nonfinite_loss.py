"""A non-finite loss skips its step, keeping the scale (`jls.hooks._nonfinite_loss`)."""

# pyright: reportAttributeAccessIssue=false

import warnings

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


def _count(state):
    return int(state.hooks["nonfinite_loss"].nonfinite)


def _quiet(read, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return read(*args)


@pytest.mark.parametrize("name", ["dynamic", "off"])
def test_the_losses_not_finite_in_a_row_are_counted_and_warned_late_enough(name):
    # One nan batch (or 7 in a row) is a healthy run's: no warning. The 8th
    # in a row is a nan that stays (state outside the optimizer, data): every
    # host reader warns, naming the remedies. Exact count, reset by a finite
    # loss, on the skipping path and the off switch's.
    scaler = jls.no_scale(skip_nonfinite=False) if name == "off" else SCALERS[name]
    tx = jls.loss_scaling(optax.sgd(0.1), scaler)
    step = jax.jit(lambda g, s, loss: jls.apply_gradients(tx, g, s, W, loss=loss))
    grads = jax.tree.map(jnp.ones_like, W)
    state, want = tx.init(W), 0
    for loss in [1.0, np.nan, 1.0, *[np.nan] * 7, 1.0, *[np.nan] * 7]:
        _, state = step(grads, state, jnp.float32(loss))
        want = want + 1 if np.isnan(loss) else 0
        assert _count(state) == want
        assert bool(_quiet(jls.metrics, state)["nonfinite_loss"]) == (want > 0)
        _quiet(jls.hooks.raise_if_diverged, state)
    _, state = step(grads, state, jnp.float32(np.nan))
    assert _count(state) == 8
    jax.jit(jls.metrics)(state)  # under jit: no warning (it cannot)
    said = "not finite for 8 or more steps.*keep_if_skipped.*explain_step"
    with pytest.warns(RuntimeWarning, match=said):
        assert bool(jls.metrics(state)["nonfinite_loss"])
    with pytest.warns(RuntimeWarning, match=said):
        jls.hooks.raise_if_diverged(state)


def test_a_nan_kept_outside_the_optimizer_is_named_by_the_readers():
    # The GAN case: a statistic outside the optimizer kept a nan (its
    # BatchNorm update was not held on the skipped step), so every later
    # loss is nan and every step skips, with the scale held.
    def loss_fn(params, stat, x):
        return jnp.mean((x @ params["w"]) ** 2) + stat

    stagnation = jls.hooks.Stagnation(every=1)
    tx = jls.loss_scaling(optax.sgd(0.1), SCALERS["dynamic"], hooks=[stagnation])
    step = jax.jit(jls.train_step(loss_fn, tx))
    params, state = W, tx.init(W)
    for i in range(1, 17):
        params, state, out = step(params, state, jnp.float32(np.nan), X)
        assert bool(out.skipped) and _count(state) == i
    assert float(jls.loss_scale_state(state).scale) == 2.0**10  # held
    with pytest.warns(RuntimeWarning, match="for 16 or more steps") as caught:
        jls.hooks.warn_if_stagnant(state)
    assert len(caught) == 1
    message = str(caught[0].message)
    for name in ("jls.keep_if_skipped(", "jls.precision.explain_step(", "data"):
        assert name in message, name


def test_the_count_saturates():
    tx = jls.loss_scaling(optax.sgd(0.1))
    state = tx.init(W)
    top = jnp.int32(np.iinfo(np.int32).max)
    state = state._replace(
        hooks={
            **state.hooks,
            "nonfinite_loss": type(state.hooks["nonfinite_loss"])(top),
        }
    )
    _, state = tx.update(W, state, W, loss=jnp.float32(np.inf))
    assert _count(state) == np.iinfo(np.int32).max


def test_metrics_reads_no_count_of_an_unfinished_step():
    # jls.metrics adds no sync: a step still running is read by a later call.
    class Running:
        def is_ready(self):
            return False

        def __array__(self, *args, **kwargs):
            raise AssertionError("read before the step finished")

    from jls.hooks._nonfinite_loss import NonfiniteLossState, warn_if_nonfinite_loss

    state = jls.loss_scaling(optax.sgd(0.1)).init(W)
    state = state._replace(
        hooks={**state.hooks, "nonfinite_loss": NonfiniteLossState(Running())}  # type: ignore[arg-type]
    )
    warn_if_nonfinite_loss(state, wait=False)
    with pytest.raises(AssertionError, match="before the step finished"):
        warn_if_nonfinite_loss(state)
