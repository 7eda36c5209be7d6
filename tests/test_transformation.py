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


def test_jls_0_2s_deprecated_methods_are_gone_in_0_4():
    # LossScaling.of, .decide and .check_state warned for one release (0.3).
    scaling = jls.LossScaling(optax.sgd(0.5), jls.static_scale(2.0))
    for name in ("of", "decide", "check_state", "_step", "_decide", "_of"):
        assert not hasattr(scaling, name), name


def test_jls_0_3s_deprecated_names_are_gone_in_0_4():
    for name in ("replace_loss_scale_state", "StepOutput"):
        with pytest.raises(AttributeError, match=name):
            getattr(jls, name)


@pytest.mark.parametrize("name", sorted(jls._MOVED))
def test_names_moved_into_a_namespace_warn_and_still_work(name):
    place = getattr(jls, jls._MOVED[name])
    with pytest.warns(DeprecationWarning, match=f"jls.{name} moved to jls\\."):
        assert getattr(jls, name) is getattr(place, name)
