"""`jls.LossScaling`: the object, its optax pair, what it takes and no longer does."""

# Optax states are loosely typed; attribute access is checked at run time.
# pyright: reportAttributeAccessIssue=false, reportIndexIssue=false
# pyright: reportCallIssue=false

import inspect
import warnings
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jls
from jls._transformation import config_of

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


MOVED_IN_0_4 = {
    "Hook": "hooks",
    "SpikeRule": "hooks",
    "ScaleStats": "hooks",
    "DivergenceError": "hooks",
    "raise_if_diverged": "hooks",
    "nonfinite_paths": "hooks",
    "Policy": "precision",
    "get_policy": "precision",
    "precision_report": "precision",
    "compensated": "precision",
    "stochastic_rounding": "precision",
}


@pytest.mark.parametrize("name", sorted(MOVED_IN_0_4))
def test_names_moved_into_a_namespace_in_0_4_are_gone_from_the_top_in_0_5(name):
    # They warned for one release (0.4), as announced; the error names the fix.
    place = MOVED_IN_0_4[name]
    with pytest.raises(AttributeError, match=rf"use jls\.{place}\.{name}$"):
        getattr(jls, name)
    with pytest.raises(AttributeError, match="no attribute 'Hooks'"):
        jls.Hooks  # noqa: B018 (any other name: Python's message)
    assert hasattr(getattr(jls, MOVED_IN_0_4[name]), name)


# Each feature keyword of loss_scaling, a value that turns it on, and what
# the TypeError of LossScaling names as its hooks (with loss_scaling's
# default divergence limit).
FEATURES = [
    ("diagnostics", True, "jls.hooks.Diagnostics()"),
    ("max_consecutive_skips", 5, "jls.hooks.Divergence(limit=5)"),
    ("gradient_norm", True, "jls.hooks.GradientNorm()"),
    ("skip_spikes", jls.hooks.SpikeRule(warmup=3), "jls.hooks.SpikeRule("),
    ("check_replicas", "data", "jls.hooks.ReplicaCheck(axes=('data',))"),
    ("scale_stats", True, "jls.hooks.ScaleStats("),
]


@pytest.mark.parametrize(("keyword", "value", "hook"), FEATURES)
def test_the_object_refuses_feature_keywords_and_names_their_hooks(
    keyword, value, hook
):
    axes = {"axis_name": "data"}  # for check_replicas
    with pytest.raises(TypeError) as err:
        jls.LossScaling(optax.sgd(0.1), jls.no_scale(), **axes, **{keyword: value})
    message = str(err.value)
    assert "jls.loss_scaling(inner, scaler, " in message, message
    assert f"{keyword}={value!r}" in message and hook in message, message
    # The hooks the message names build the object loss_scaling builds.
    fix = message.rpartition("LossScaling(inner, scaler, hooks=")[2][:-1]
    hooks = eval(fix, {"jls": jls, "dtype": np.dtype})  # noqa: S307
    scaling = jls.LossScaling(optax.sgd(0.1), jls.no_scale(), **axes, hooks=hooks)
    tx = jls.loss_scaling(optax.sgd(0.1), jls.no_scale(), **axes, **{keyword: value})
    assert scaling.hooks == config_of(tx).hooks


def test_the_object_takes_hooks_only_and_names_other_keywords_as_python_does():
    assert inspect.signature(jls.LossScaling).parameters.keys() == {
        "inner",
        "scaler",
        "axis_name",
        "hooks",
        "options",
    }
    with pytest.raises(TypeError, match="unexpected keyword argument 'axis_nam'"):
        jls.LossScaling(optax.sgd(0.1), axis_nam="batch")
    # donated= is deprecated here too (it was LossScaling's in 0.4): a warning.
    with pytest.warns(DeprecationWarning, match=r"LossScaling\(donated=True\)"):
        scaling = jls.LossScaling(optax.sgd(0.1), donated=True)
    assert scaling.hooks == jls.LossScaling(optax.sgd(0.1)).hooks
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="hooks"):
        jls.LossScaling(optax.sgd(0.1), donated=True, gradient_norm=True)
    # Bare, it has the always-on hook only: the divergence flag is
    # loss_scaling's default, or a hook.
    assert [h.name for h in jls.LossScaling(optax.sgd(0.1)).hooks] == ["nonfinite_loss"]
    assert [h.name for h in config_of(jls.loss_scaling(optax.sgd(0.1))).hooks] == [
        "nonfinite_loss",
        "divergence",
    ]


def _run(tx, fused):
    """Five jitted steps (two of them non-finite): the params and the state."""

    def step(grads, state, params):
        if fused:
            return jls.apply_gradients(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step)
    params = {"w": jnp.linspace(-1.0, 1.0, 6), "b": jnp.zeros(2)}
    state = tx.init(params)
    for value in (1.0, jnp.inf, 0.5, jnp.nan, 2.0):
        grads = {"w": jnp.full(6, value), "b": jnp.full(2, 0.25)}
        params, state = step(grads, state, params)
    return params, state


@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused"])
@pytest.mark.parametrize("donated", [True, False])
def test_donated_warns_once_and_changes_nothing(donated, fused):
    options: dict[str, Any] = {"gradient_norm": True, "scale_stats": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tx = jls.loss_scaling(
            optax.adam(0.1), jls.dynamic_scale(2.0**4), donated=donated, **options
        )
    assert len(caught) == 1, [str(w.message) for w in caught]
    (warning,) = caught
    assert warning.category is DeprecationWarning
    assert warning.filename == __file__  # the caller's line
    message = str(warning.message)
    assert f"loss_scaling(donated={donated!r}) is deprecated and ignored" in message
    assert "the same whether or not the caller donates" in message
    assert "Remove the argument" in message
    assert "removed in the next release" in message
    plain = jls.loss_scaling(optax.adam(0.1), jls.dynamic_scale(2.0**4), **options)
    assert config_of(tx).hooks == config_of(plain).hooks
    assert config_of(tx).scaler == config_of(plain).scaler
    ours, theirs = _run(tx, fused), _run(plain, fused)
    assert int(jls.metrics(ours[1])["total_skips"]) == 2
    chex.assert_trees_all_equal(ours, theirs, strict=True)
