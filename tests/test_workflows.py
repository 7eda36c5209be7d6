"""The seeds' workflows, the JAX way.

One-call step, retries, accumulation, divergence errors, setting the scale,
per-leaf diagnostics, and flax integration.
"""

# Optax states are loosely typed; attribute access is checked at run time.
# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import chex
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.experimental import checkify

import jls

W = {"a": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.full((3,), 0.1)}
X = jnp.linspace(0.0, 1.0, 8).reshape(4, 2)


def loss_fn(params, x):
    h = x @ params["a"] + params["b"][None, :]
    return jnp.mean(h**2)


def loss_with_aux(params, x):
    loss = loss_fn(params, x)
    return loss, {"twice": 2 * loss}


def f16_loss(params, x):
    """A float16 graph: its gradients overflow when the scale is too high."""
    p16 = jax.tree.map(lambda p: p.astype(jnp.float16), params)
    return loss_fn(p16, x.astype(jnp.float16))


# One-call train step ---------------------------------------------------------


def test_train_step_equals_the_fused_path_bitwise():
    tx = jls.loss_scaling(optax.adam(1e-2), jls.dynamic_scale(2.0**8))
    step = jax.jit(jls.train_step(loss_with_aux, tx, has_aux=True))
    params, state = W, tx.init(W)
    params, state, out = step(params, state, X)

    ref_state = tx.init(W)
    grads = jax.grad(lambda p: jls.scale_loss(loss_fn(p, X), ref_state))(W)
    ref_params, ref_state = jax.jit(lambda g, s, p: jls.apply_gradients(tx, g, s, p))(
        grads, ref_state, W
    )
    chex.assert_trees_all_equal(params, ref_params, strict=True)
    chex.assert_trees_all_equal(state, ref_state, strict=True)
    assert float(out.loss) == float(loss_fn(W, X))
    assert float(out.aux["twice"]) == 2 * float(out.loss)
    assert not bool(out.skipped) and int(out.retries) == 0
    assert float(out.loss_scale) == 256.0 and float(out.next_loss_scale) == 256.0


def test_train_step_skips_nan_and_reports_it_under_donation():
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**8))
    step = jax.jit(jls.train_step(loss_fn, tx), donate_argnums=(0, 1))
    params, state = jax.tree.map(jnp.copy, W), tx.init(W)
    bad = X.at[1, 1].set(jnp.nan)
    before = jax.tree.map(np.asarray, params)
    params, state, out = step(params, state, bad)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, params), before)
    assert bool(out.skipped)
    assert float(out.loss_scale) == 256.0 and float(out.next_loss_scale) == 128.0
    params, state, out = step(params, state, X)
    assert not bool(out.skipped)


def test_train_step_one_trace():
    tx = jls.loss_scaling(optax.adam(1e-2), jls.dynamic_scale(2.0**8))

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(params, state, x):
        return jls.train_step(loss_fn, tx, max_retries=3)(params, state, x)

    params, state = W, tx.init(W)
    for i in range(20):
        x = X.at[0, 0].set(jnp.nan) if i % 5 == 0 else X + i
        params, state, _ = step(params, state, x)


# Retries (nnabla) ---------------------------------------------------------------


def test_retry_backs_off_until_the_gradients_fit():
    # At 2**24 the float16 backward pass overflows; 2**14 fits (loss ~ 1).
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**24))
    step = jax.jit(jls.train_step(f16_loss, tx, max_retries=20))
    params, state, out = step(W, tx.init(W), X)
    assert not bool(out.skipped)
    retries = int(out.retries)
    assert retries >= 1
    assert float(out.loss_scale) == 2.0 ** (24 - retries)
    assert float(out.next_loss_scale) == float(out.loss_scale)
    assert not np.array_equal(params["a"], W["a"])  # the step was applied
    m = jls.metrics(state)
    # Retries are attempts, not steps: nothing was skipped.
    assert int(m["total_skips"]) == 0 and int(m["consecutive_skips"]) == 0
    assert int(m["retries"]) == retries
    # The step equals a plain step at the scale the retries found.
    ref_tx = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(float(out.loss_scale)))
    ref_params, _, _ = jax.jit(jls.train_step(f16_loss, ref_tx))(W, ref_tx.init(W), X)
    chex.assert_trees_all_equal(params, ref_params)


def test_retry_gives_up_and_skips():
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**24))
    step = jax.jit(jls.train_step(f16_loss, tx, max_retries=2))
    params, state, out = step(W, tx.init(W), X)
    assert bool(out.skipped) and int(out.retries) == 2
    chex.assert_trees_all_equal(params, W)
    assert float(out.loss_scale) == 2.0**22 and float(out.next_loss_scale) == 2.0**21
    assert int(jls.metrics(state)["consecutive_skips"]) == 1  # one step


# Gradient accumulation --------------------------------------------------------


def test_accumulation_equals_the_full_batch_mean():
    tx = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(2.0**10))
    full = jax.jit(jls.train_step(loss_fn, tx))(W, tx.init(W), X)
    acc = jax.jit(jls.train_step(loss_fn, tx, accumulation_steps=2))(W, tx.init(W), X)
    chex.assert_trees_all_close(acc[0], full[0], rtol=1e-6)
    halves = [loss_fn(W, X[:2]), loss_fn(W, X[2:])]
    assert float(acc[2].loss) == pytest.approx(float(np.mean(halves)))


def test_accumulation_checks_once_and_is_never_poisoned():
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**10))
    step = jax.jit(
        jls.train_step(loss_with_aux, tx, has_aux=True, accumulation_steps=4)
    )
    bad = X.at[2, 0].set(jnp.inf)  # one micro-batch of four
    params, state, out = step(W, tx.init(W), bad)
    chex.assert_trees_all_equal(params, W)
    assert bool(out.skipped) and int(jls.metrics(state)["total_skips"]) == 1
    assert out.aux["twice"].shape == (4,)  # aux per micro-batch
    params, state, out = step(params, state, X)  # the next window is clean
    assert not bool(out.skipped)
    assert float(out.loss_scale) == 2.0**9  # one scale for the whole window
    with pytest.raises(ValueError, match="must divide every batch array"):
        jax.jit(jls.train_step(loss_fn, tx, accumulation_steps=3))(W, state, X)


def test_bad_train_step_arguments():
    tx = jls.loss_scaling(optax.sgd(0.1))
    with pytest.raises(ValueError, match="max_retries must be an int >= 0"):
        jls.train_step(loss_fn, tx, max_retries=-1)
    with pytest.raises(ValueError, match="accumulation_steps must be an int >= 1"):
        jls.train_step(loss_fn, tx, accumulation_steps=0)
    with pytest.raises(TypeError, match="made by jls.loss_scaling"):
        jls.train_step(loss_fn, optax.sgd(0.1))


# Divergence errors -------------------------------------------------------------


def test_divergence_error_at_the_host_check():
    tx = jls.loss_scaling(
        optax.sgd(0.1), jls.dynamic_scale(2.0**8), max_consecutive_skips=3
    )
    step = jax.jit(jls.train_step(loss_fn, tx))
    bad = X.at[0, 0].set(jnp.nan)
    params, state = W, tx.init(W)
    for _ in range(2):
        params, state, out = step(params, state, bad)
        jls.raise_if_diverged(state)
    params, state, out = step(params, state, bad)
    with pytest.raises(
        jls.DivergenceError, match="jls: loss scaling diverged: 3 consecutive"
    ):
        jls.raise_if_diverged(state)


def test_no_divergence_error_when_steps_recover():
    tx = jls.loss_scaling(optax.sgd(0.1), max_consecutive_skips=2)
    step = jax.jit(jls.train_step(loss_fn, tx))
    params, state = W, tx.init(W)
    for i in range(6):
        x = X.at[0, 0].set(jnp.nan) if i % 2 else X
        params, state, out = step(params, state, x)
        jax.block_until_ready(out)
    jls.raise_if_diverged(state, 2)
    jls.raise_if_diverged(state)


def test_host_and_checkify_divergence_checks():
    scaler = jls.dynamic_scale()
    state = scaler.init()
    for _ in range(3):
        state = scaler.adjust(state, False)
    jls.raise_if_diverged(state, 4)
    with pytest.raises(jls.DivergenceError, match="3 consecutive skipped steps"):
        jls.raise_if_diverged(state, 3)

    def check(state):
        jls.raise_if_diverged(state, 3)
        return state

    err, _ = jax.jit(checkify.checkify(check))(state)
    with pytest.raises(checkify.JaxRuntimeError, match="loss scaling diverged"):
        err.throw()
    err, _ = jax.jit(checkify.checkify(check))(scaler.init())
    err.throw()  # no error
    with pytest.raises(ValueError, match="max_consecutive_skips must be"):
        jls.raise_if_diverged(state, 0)
    with pytest.raises(ValueError, match="max_consecutive_skips must be an int"):
        jls.loss_scaling(optax.sgd(0.1), max_consecutive_skips=0)


def test_after_the_limit_nothing_non_finite_is_ever_applied():
    # Unlike optax.apply_if_finite, which applies updates after giving up.
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**8))
    step = jax.jit(jls.train_step(loss_fn, tx))
    params, state = W, tx.init(W)
    for _ in range(50):
        params, state, _ = step(params, state, X.at[0, 0].set(jnp.inf))
    chex.assert_trees_all_equal(params, W)
    assert float(jls.metrics(state)["loss_scale"]) == 1.0


# Setting the scale ------------------------------------------------------------


def test_set_loss_scale():
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**8))
    params, state = W, tx.init(W)
    params, state, _ = jax.jit(jls.train_step(loss_fn, tx))(
        params, state, X.at[0, 0].set(jnp.nan)
    )
    new = jls.set_loss_scale(state, 4096.0)
    assert float(jls.metrics(new)["loss_scale"]) == 4096.0
    assert int(jls.metrics(new)["total_skips"]) == 1  # counters kept
    scaler = jls.dynamic_scale(2.0**8)
    reset = jls.set_loss_scale(state, 4096.0, scaler=scaler, reset_counters=True)
    assert int(jls.metrics(reset)["total_skips"]) == 0
    chex.assert_trees_all_equal(new.inner_state, state.inner_state)
    # Inside jit, with a traced scale.
    halved = jax.jit(lambda s: jls.set_loss_scale(s, jls.metrics(s)["loss_scale"] / 2))(
        state
    )
    assert float(jls.metrics(halved)["loss_scale"]) == 64.0
    for bad in (0.0, -1.0, float("inf"), 1e-45):
        with pytest.raises(
            ValueError, match="scale must be (positive|represent|finite)"
        ):
            jls.set_loss_scale(state, bad)


# Per-leaf diagnostics ----------------------------------------------------------


def test_diagnostics_name_the_bad_leaves():
    tx = jls.loss_scaling(optax.adam(1e-2), diagnostics=True)
    params = {
        "enc": {"w": jnp.ones((2, 2))},
        "dec": {"w": jnp.ones(3), "b": jnp.ones(1)},
    }
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    step = jax.jit(lambda g, s, p: jls.apply_gradients(tx, g, s, p))
    _, state = step(grads, state, params)
    assert jls.nonfinite_paths(state) == []
    bad = {
        "enc": {"w": grads["enc"]["w"].at[0, 1].set(jnp.nan)},
        "dec": dict(grads["dec"], b=jnp.array([jnp.inf])),
    }
    _, state = step(bad, state, params)
    assert jls.nonfinite_paths(state) == ["['dec']['b']", "['enc']['w']"]
    flags = jls.metrics(state)["nonfinite_leaves"]
    assert bool(flags["enc"]["w"]) and not bool(flags["dec"]["w"])
    chex.assert_trees_all_equal(jls.metrics(state)["nonfinite_leaves"], flags)
    _, state = step(grads, state, params)
    assert jls.nonfinite_paths(state) == []
    with pytest.raises(ValueError, match="diagnostics=True"):
        jls.nonfinite_paths(jls.loss_scaling(optax.sgd(1.0)).init(params))


def test_diagnostics_cost_nothing_on_the_finite_path():
    params = {f"l{i}": jnp.ones((128, 128)) for i in range(4)}
    grads = jax.tree.map(jnp.ones_like, params)

    def temp_bytes(diagnostics):
        tx = jls.loss_scaling(optax.adam(1e-3), diagnostics=diagnostics)
        fn = jax.jit(
            lambda g, s, p: jls.apply_gradients(tx, g, s, p), donate_argnums=(1, 2)
        )
        stats = fn.lower(grads, tx.init(params), params).compile().memory_analysis()
        assert stats is not None
        return stats.temp_size_in_bytes

    assert temp_bytes(True) <= temp_bytes(False) + 1024


# flax -------------------------------------------------------------------------


class Model(nnx.Module):
    """A one-layer nnx model."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(2, 3, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


def test_nnx_optimizer_skips_and_its_step_counts_calls():
    model = Model(nnx.Rngs(0))
    tx = jls.loss_scaling(optax.adam(1e-2), jls.dynamic_scale(2.0**8))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        def loss(m):
            return jls.scale_loss(jnp.mean(m(x) ** 2), optimizer.opt_state)

        grads = nnx.grad(loss)(model)
        optimizer.update(model, grads)

    step(model, optimizer, X)
    kernel = np.asarray(model.lin.kernel[...])
    step(model, optimizer, X.at[0, 0].set(jnp.nan))
    np.testing.assert_array_equal(model.lin.kernel[...], kernel)
    m = jls.metrics(optimizer.opt_state)
    assert bool(m["skipped"]) and float(m["loss_scale"]) == 128.0
    # nnx counts every call; the inner Adam count (which drives schedules)
    # does not advance on a skipped step; step - total_skips reconciles them.
    assert int(optimizer.step[...]) == 2
    assert (
        int(optimizer.step[...] - jls.metrics(optimizer.opt_state)["total_skips"]) == 1
    )
    adam_count = optax.tree.get(optimizer.opt_state, "count")
    assert (
        int(adam_count[...] if hasattr(adam_count, "__getitem__") else adam_count) == 1
    )


def test_linen_train_state_with_jls():
    params = {"params": W}
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**8))
    ts = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)

    @jax.jit
    def step(ts, x):
        grads = jax.grad(
            lambda p: jls.scale_loss(loss_fn(p["params"], x), ts.opt_state)
        )(ts.params)
        return ts.apply_gradients(grads=grads)

    ts = step(ts, X)
    before = ts.params
    ts = step(ts, X.at[0, 0].set(jnp.nan))
    chex.assert_trees_all_equal(ts.params, before)
    assert (
        int(ts.step) == 2
        and int(ts.step - jls.metrics(ts.opt_state)["total_skips"]) == 1
    )
    assert bool(jls.metrics(ts.opt_state)["skipped"])
