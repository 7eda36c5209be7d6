"""`jls.train_step`: the one-call step, retries, accumulation, its arguments."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from step_model import W, X, loss_fn, overflowing_loss

import jls


@pytest.mark.parametrize(
    "dtype", [jnp.bool_, jnp.int8, jnp.uint8, jnp.int16, jnp.int32]
)
def test_train_step_refuses_a_loss_that_is_not_floating(dtype):
    tx = jls.loss_scaling(optax.sgd(0.1))
    params = {"w": jnp.ones(3)}
    step = jls.train_step(lambda p, x: (jnp.sum(p["w"] * x) > 0).astype(dtype), tx)
    with pytest.raises(TypeError, match=f"floating loss, got dtype {jnp.dtype(dtype)}"):
        jax.jit(step)(params, tx.init(params), jnp.ones(3))


def loss_with_aux(params, x):
    loss = loss_fn(params, x)
    return loss, {"twice": 2 * loss}


def f16_loss(params, x):
    """A float16 graph: its gradients overflow when the scale is too high."""
    p16 = jax.tree.map(lambda p: p.astype(jnp.float16), params)
    return loss_fn(p16, x.astype(jnp.float16))


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
    step = jax.jit(jls.train_step(overflowing_loss, tx), donate_argnums=(0, 1))
    params, state = jax.tree.map(jnp.copy, W), tx.init(W)
    clean, bad = jnp.zeros(4, bool), jnp.zeros(4, bool).at[1].set(True)
    before = jax.tree.map(np.asarray, params)
    params, state, out = step(params, state, X, bad)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, params), before)
    assert bool(out.skipped) and not bool(out.nonfinite_loss)
    assert float(out.loss_scale) == 256.0 and float(out.next_loss_scale) == 128.0
    params, state, out = step(params, state, X, clean)
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


def test_accumulation_equals_the_full_batch_mean():
    tx = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(2.0**10))
    full = jax.jit(jls.train_step(loss_fn, tx))(W, tx.init(W), X)
    acc = jax.jit(jls.train_step(loss_fn, tx, accumulation_steps=2))(W, tx.init(W), X)
    chex.assert_trees_all_close(acc[0], full[0], rtol=1e-6)
    halves = [loss_fn(W, X[:2]), loss_fn(W, X[2:])]
    assert float(acc[2].loss) == pytest.approx(float(np.mean(halves)))


def test_accumulation_checks_once_and_is_never_poisoned():
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**10))

    def loss_and_aux(params, x, bad):
        loss = overflowing_loss(params, x, bad)
        return loss, {"twice": 2 * loss}

    step = jax.jit(jls.train_step(loss_and_aux, tx, has_aux=True, accumulation_steps=4))
    clean = jnp.zeros(4, bool)
    bad = clean.at[2].set(True)  # one micro-batch of four overflows
    params, state, out = step(W, tx.init(W), X, bad)
    chex.assert_trees_all_equal(params, W)
    assert bool(out.skipped) and int(jls.metrics(state)["total_skips"]) == 1
    assert out.aux["twice"].shape == (4,)  # aux per micro-batch
    params, state, out = step(params, state, X, clean)  # the next window is clean
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


# average_over: data parallelism (a named vmap stands in for pmap here; the
# pmap and shard_map cases run in tests/integration/test_distributed.py).

R = 4  # replicas


def _shards():
    rng = np.random.default_rng(3)
    return jnp.asarray(rng.normal(size=(R, 8, X.shape[-1])).astype(np.float32))


def _replicated(tree):
    return jax.tree.map(lambda x: jnp.stack([x] * R), tree)


def _data_parallel(tx, steps=3, **kw):
    step = jax.vmap(jls.train_step(loss_fn, tx, **kw), axis_name="batch")
    params = _replicated(W)
    state = jax.vmap(tx.init)(params)
    x = _shards()
    for _ in range(steps):
        params, state, out = jax.jit(step)(params, state, x)
    return params, state, out


def _bitwise_same_across(tree):
    return all(
        np.array_equal(
            np.asarray(x).view(np.uint8), np.asarray(x[:1]).repeat(R, 0).view(np.uint8)
        )
        for x in jax.tree.leaves(tree)
    )


def test_average_over_keeps_replicas_bitwise_equal_and_steps_with_the_mean():
    tx = jls.loss_scaling(
        optax.adam(1e-2), jls.dynamic_scale(2.0**8), axis_name="batch"
    )
    params, state, out = _data_parallel(tx, steps=1, average_over="batch")
    assert _bitwise_same_across((params, state.inner_state))
    # One step of the replicas' mean gradient, computed here by hand.
    grads = jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))(W, _shards())
    mean = jax.tree.map(lambda g: g.mean(0), grads)
    adam = optax.adam(1e-2)
    updates, _ = adam.update(mean, adam.init(W), W)
    want = optax.apply_updates(W, updates)
    chex.assert_trees_all_close(
        jax.tree.map(lambda x: x[0], params), want, rtol=1e-6, atol=1e-7
    )
    losses = jax.vmap(loss_fn, in_axes=(None, 0))(W, _shards())
    np.testing.assert_allclose(out.loss, np.full(R, losses.mean()), rtol=1e-6)


def test_without_average_over_the_replicas_drift_apart():
    # The trap this option closes: axis_name alone agrees on the skip only.
    tx = jls.loss_scaling(
        optax.adam(1e-2), jls.dynamic_scale(2.0**8), axis_name="batch"
    )
    params, _, _ = _data_parallel(tx, steps=1)
    assert not _bitwise_same_across(params)


def test_average_over_with_accumulation_keeps_replicas_equal():
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**8), axis_name="batch")
    params, state, _ = _data_parallel(tx, average_over="batch", accumulation_steps=2)
    assert _bitwise_same_across((params, state))


def test_average_over_a_nan_on_one_replica_skips_every_replica():
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**8), axis_name="batch")
    step = jax.vmap(
        jls.train_step(loss_fn, tx, average_over="batch"), axis_name="batch"
    )
    params = _replicated(W)
    state = jax.vmap(tx.init)(params)
    x = _shards().at[2, 0, 0].set(jnp.nan)
    new, state, out = jax.jit(step)(params, state, x)
    assert out.skipped.tolist() == [True] * R
    chex.assert_trees_all_equal(new, params)


def test_average_over_refuses_an_unbound_axis_naming_the_fix():
    tx = jls.loss_scaling(optax.sgd(0.1))
    step = jls.train_step(loss_fn, tx, average_over="batch")
    with pytest.raises(NameError, match=r"average_over=\('batch',\).*pmap"):
        jax.jit(step)(W, tx.init(W), X)


@pytest.mark.parametrize("bad", [3, ("batch", 1), ()])
def test_average_over_must_name_axes(bad):
    with pytest.raises(TypeError, match="average_over must be None, a str or a tuple"):
        jls.train_step(loss_fn, jls.loss_scaling(optax.sgd(0.1)), average_over=bad)
