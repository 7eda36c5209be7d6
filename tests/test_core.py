"""The step's pure functions: one entry point, state checked once, params split once."""

# pyright: reportAttributeAccessIssue=false

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import jls
from jls import _core, _step
from jls._decision import decide
from jls._transformation import config_of

PARAMS = {"w": jnp.arange(1.0, 5.0), "b": jnp.zeros(2)}


def _tx(**kwargs):
    return jls.loss_scaling(optax.adam(0.1), jls.dynamic_scale(2.0**4), **kwargs)


@pytest.mark.parametrize("value", [1.0, jnp.inf])
def test_step_is_prepare_decide_and_finish(value):
    tx = _tx(gradient_norm=True)
    config = config_of(tx)
    state = tx.init(PARAMS)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, value), PARAMS)
    whole = _core.step(config, grads, state, PARAMS, {}, fused=True)
    checked = _core.validate(config, state, PARAMS)
    prepared = _core.prepare(config, grads, checked, {})
    decision = decide(config, grads, checked.loss_scale)
    parts = _core.split(PARAMS, grads)
    new, new_state = _core.finish(
        config, grads, prepared, parts.trained, decision, fused=True
    )
    chex.assert_trees_all_equal(whole, (new, new_state))
    chex.assert_trees_all_equal(whole, tx_apply(tx, grads, state))


def tx_apply(tx, grads, state):
    return jls.apply_gradients(tx, grads, state, PARAMS)


def _count(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_train_step_validates_the_state_once_and_splits_the_parameters_once(
    monkeypatch,
):
    # The 0.3 step validated the state three times (train_step, _step, the
    # decision) and split the parameters twice.
    validated = _count(monkeypatch, _core, "check_state")
    split = _count(monkeypatch, _step, "split_inexact")
    tx = _tx(max_consecutive_skips=5)
    step = jls.train_step(lambda p, x: jnp.sum(p["w"] * x), tx, max_retries=2)
    jax.make_jaxpr(step)(PARAMS, tx.init(PARAMS), jnp.ones(4))
    assert len(validated) == 1 and len(split) == 1


@pytest.mark.parametrize("fused", [False, True])
def test_tx_update_and_apply_gradients_validate_once(monkeypatch, fused):
    validated = _count(monkeypatch, _core, "check_state")
    tx = _tx()
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    if fused:
        jax.make_jaxpr(lambda s: jls.apply_gradients(tx, grads, s, PARAMS))(
            tx.init(PARAMS)
        )
    else:
        jax.make_jaxpr(lambda s: tx.update(grads, s, PARAMS))(tx.init(PARAMS))
    assert len(validated) == 1


def test_the_off_switch_finishes_without_a_decision():
    tx = jls.loss_scaling(optax.sgd(0.5), jls.no_scale(skip_nonfinite=False))
    config = config_of(tx)
    state = _core.validate(config, tx.init(PARAMS), PARAMS)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    prepared = _core.prepare(config, grads, state, {})
    new, _ = _core.finish(config, grads, prepared, PARAMS, None, fused=True)
    chex.assert_trees_all_equal(new, jax.tree.map(lambda p: p - 0.5, PARAMS))


@pytest.mark.parametrize("fused", [False, True])
def test_a_weakly_typed_state_is_traced_once_over_skipped_and_applied_steps(fused):
    # jnp.full(..., 0.1) is weakly typed, and so are Adam's moments made from
    # it; the new moments are strong. The skip's selects keep each old
    # leaf's type, so no step retraces (plain optax retraces once here).
    params = {"b": jnp.full((3,), 0.1)}
    tx = jls.loss_scaling(optax.adam(1e-2), jls.dynamic_scale(2.0**4))
    state = tx.init(params)
    assert jax.typeof(state.inner_state[0].mu["b"]).weak_type
    chex.clear_trace_counter()  # it counts by the function's code, over tests

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(params, state, grads):
        if fused:
            return jls.apply_gradients(tx, grads, state, params)
        # optax.apply_updates makes weak parameters strong, with or without
        # jls: the parameters are kept, the state is threaded.
        return params, tx.update(grads, state, params)[1]

    for value in (jnp.nan, 1.0, jnp.inf, 2.0, 3.0):  # strong gradients, strong moments
        params, state = step(params, state, {"b": jnp.full((3,), value, jnp.float32)})
    assert int(state.loss_scale.total_skips) == 2
    assert jax.typeof(state.inner_state[0].mu["b"]).weak_type
