"""`jls.LossScaling`: the object, its optax pair, and its deprecated methods."""

# Optax states are loosely typed; attribute access is checked at run time.
# pyright: reportAttributeAccessIssue=false, reportIndexIssue=false
# pyright: reportCallIssue=false

import jax.numpy as jnp
import optax
import pytest

import jls

PARAMS = {"w": jnp.ones(3)}


def test_the_object_and_its_pair_are_one_step():
    scaling = jls.LossScaling(optax.sgd(0.5), jls.static_scale(2.0))
    tx = scaling.gradient_transformation()
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    state = tx.init(PARAMS)
    grads = {"w": jnp.full(3, 2.0)}
    updates, via_tx = tx.update(grads, state, PARAMS)
    params, via_object = scaling.apply_gradients(grads, state, PARAMS)
    assert optax.apply_updates(PARAMS, updates)["w"].tolist() == [0.5] * 3
    assert params["w"].tolist() == [0.5] * 3
    for key, value in jls.metrics(via_tx).items():
        assert jls.metrics(via_object)[key] == value, key
    assert "LossScaling(inner=" in repr(scaling)


def test_wrapped_transformations_cannot_take_the_fused_path():
    wrapped = optax.chain(jls.loss_scaling(optax.sgd(0.1)))
    with pytest.raises(TypeError, match="made by jls.loss_scaling"):
        jls.apply_gradients(wrapped, PARAMS, wrapped.init(PARAMS), PARAMS)


def test_deprecated_methods_warn_and_still_work():
    scaling = jls.LossScaling(optax.sgd(0.5), jls.static_scale(2.0))
    tx = scaling.gradient_transformation()
    state = tx.init(PARAMS)
    with pytest.warns(DeprecationWarning, match="LossScaling.of"):
        assert jls.LossScaling.of(tx) is scaling
    with pytest.warns(DeprecationWarning, match="LossScaling.decide"):
        decision = scaling.decide({"w": jnp.ones(3)}, state.loss_scale)
    assert bool(decision.finite) and bool(decision.apply)
    with pytest.warns(DeprecationWarning, match="LossScaling.check_state"):
        assert scaling.check_state(state).loss_scale.scale == 2.0
    with pytest.warns(DeprecationWarning, match="replace_loss_scale_state"):
        new = jls.replace_loss_scale_state(state, jls.static_scale(8.0).init())
    assert float(jls.metrics(new)["loss_scale"]) == 8.0
    with pytest.warns(DeprecationWarning, match="jls.StepOutput"):
        assert jls.StepOutput._fields[0] == "loss"
