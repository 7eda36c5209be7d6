"""`loss_scaling`'s feature keywords are the built-in hooks, in one order."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jls
from jls._builtins import FEATURES, hooks_from_options
from jls._loss_scaling import loss_scaling
from jls._transformation import config_of
from jls.hooks._divergence import Divergence
from jls.hooks._nonfinite_loss import NonfiniteLoss
from jls.hooks._norm import GradientNorm


def test_the_keywords_are_hooks_in_order():
    rule = jls.hooks.SpikeRule()
    tx = jls.loss_scaling(
        optax.sgd(0.1),
        diagnostics=True,
        max_consecutive_skips=5,
        gradient_norm=True,
        skip_spikes=rule,
    )
    scaling = config_of(tx)
    names = [h.name for h in scaling.hooks]
    assert names == [
        "nonfinite_loss",
        "diagnostics",
        "divergence",
        "gradient_norm",
        "spikes",
    ]
    assert scaling.hooks[-1] is rule
    # On by default: the non-finite loss's hold and the divergence flag; a
    # scaler that applies non-finite steps applies a non-finite loss's too.
    default = config_of(jls.loss_scaling(optax.sgd(0.1)))
    assert [h.name for h in default.hooks] == ["nonfinite_loss", "divergence"]
    divergence = default.hooks[1]
    assert isinstance(divergence, Divergence) and divergence.limit == 1000
    applying = jls.LossScaling(optax.sgd(0.1), jls.no_scale(skip_nonfinite=False))
    # It only records a non-finite loss: the metrics keep their keys.
    (recorder,) = applying.hooks
    assert isinstance(recorder, NonfiniteLoss) and not recorder.skips


def test_hook_names_are_distinct():
    with pytest.raises(ValueError, match="distinct names"):
        jls.loss_scaling(
            optax.sgd(0.1),
            skip_spikes=jls.hooks.SpikeRule(),
            hooks=[jls.hooks.SpikeRule()],
        )
    with pytest.raises(ValueError, match="distinct names"):
        jls.LossScaling(optax.sgd(0.1), hooks=[GradientNorm(), GradientNorm()])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"diagnostics": "yes"}, TypeError, "diagnostics must be a bool"),
        ({"gradient_norm": 1}, TypeError, "gradient_norm must be a bool"),
        ({"max_consecutive_skips": 0}, ValueError, "max_consecutive_skips must be"),
        ({"skip_spikes": 6.0}, TypeError, "skip_spikes must be a jls.hooks.SpikeRule"),
    ],
)
def test_the_keywords_are_checked_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        jls.loss_scaling(optax.sgd(0.1), **kwargs)


def test_the_feature_keywords_are_loss_scalings_and_one_function_reads_them():
    # One place: loss_scaling's keywords (beyond the object's arguments and
    # the deprecated donated=) are exactly those hooks_from_options reads,
    # with the same defaults.
    ours = inspect.signature(loss_scaling).parameters
    features = {
        name: p.default
        for name, p in ours.items()
        if name not in ("inner", "scaler", "axis_name", "hooks", "donated")
    }
    assert features == FEATURES
    theirs = inspect.signature(hooks_from_options).parameters
    assert set(theirs) == {"hooks", *FEATURES}
    assert hooks_from_options() == ()
    assert hooks_from_options(**FEATURES) == (Divergence(1000),)


NAN_STEP = {"w": jnp.array([1.0, jnp.nan]), "b": jnp.array([jnp.inf])}
EVERY_HOOK = {
    "diagnostics": True,
    "gradient_norm": True,
    "skip_spikes": jls.hooks.SpikeRule(),
    "scale_stats": True,
    "check_replicas": True,
}


@pytest.mark.parametrize(
    "scaler",
    [jls.dynamic_scale(), jls.measured_scale(), jls.no_scale()],
    ids=["dynamic", "measured", "no_scale"],
)
@pytest.mark.parametrize("loss", [1.0, float("nan")], ids=["finite_loss", "nan_loss"])
def test_no_nan_reaches_any_built_in_hooks_state(scaler, loss):
    # README and docs/guarantees.md: no nan reaches any state. The gradient
    # norm hook used to record the nan norm of a nan step (now inf).
    params = {"w": jnp.ones(2), "b": jnp.ones(1)}
    tx = jls.loss_scaling(optax.sgd(0.1), scaler, axis_name={"i": False}, **EVERY_HOOK)
    states = jax.tree.map(lambda x: jnp.stack([x, x]), tx.init(params))
    names = {h.name for h in config_of(tx).hooks}
    assert names == {
        "nonfinite_loss",
        "diagnostics",
        "divergence",
        "gradient_norm",
        "spikes",
        "replicas",
        "scale_stats",
    }

    @jax.jit
    @functools.partial(jax.vmap, axis_name="i", in_axes=(None, 0, None))
    def step(grads, state, loss):
        return tx.update(grads, state, params, loss=loss)[1]

    for grads in (jax.tree.map(jnp.ones_like, params), NAN_STEP):
        states = step(grads, states, jnp.float32(loss))
        for path, leaf in jax.tree_util.tree_leaves_with_path(states.hooks):
            if jnp.issubdtype(leaf.dtype, jnp.inexact):
                assert not bool(jnp.any(jnp.isnan(leaf))), path
    m = jls.metrics(states)
    assert bool(jnp.all(m["skipped"]))
    np.testing.assert_array_equal(m["gradient_norm"], np.full(2, np.inf, np.float32))
