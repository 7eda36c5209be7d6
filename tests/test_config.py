"""The configuration: validated once when made, frozen, each hook checks itself."""

import dataclasses

import jax.numpy as jnp
import optax
import pytest

import jls
from jls._builtins import hooks_from_options
from jls._config import Config, make_config


def _make(**kwargs):
    options = {"axis_name": None, "hooks": (), **kwargs}
    return make_config(optax.sgd(0.1), None, **options)


def test_the_configuration_is_frozen_and_holds_every_hook_in_order():
    config = _make(hooks=(jls.hooks.Diagnostics(), jls.hooks.GradientNorm()))
    assert isinstance(config, Config)
    names = [h.name for h in config.hooks]
    assert names == ["nonfinite_loss", "diagnostics", "gradient_norm"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hooks = ()  # pyright: ignore[reportAttributeAccessIssue]
    assert config.measures and config.reads_loss and not config.off
    assert [f.name for f in dataclasses.fields(config)] == [
        "inner",
        "scaler",
        "axis_name",
        "hooks",
    ]


def test_the_configuration_takes_hooks_not_feature_keywords():
    with pytest.raises(TypeError, match="gradient_norm"):
        _make(gradient_norm=True)
    with pytest.raises(TypeError, match="donated"):
        _make(donated=True)


def test_the_off_switch_is_a_property_of_the_configuration():
    off = make_config(
        optax.sgd(0.1),
        jls.no_scale(skip_nonfinite=False),
        axis_name=None,
        hooks=hooks_from_options(max_consecutive_skips=1000),
    )
    assert off.off and not off.measures


class Picky(jls.hooks.Hook):
    """A hook that needs an axis name: it checks it itself."""

    name = "picky"

    def check(self, context):
        if not context.axis_name:
            raise ValueError("picky needs an axis_name")


def test_each_hook_checks_its_own_compatibility_when_the_transformation_is_made():
    with pytest.raises(ValueError, match="picky needs an axis_name"):
        jls.loss_scaling(optax.sgd(0.1), hooks=[Picky()])
    jls.loss_scaling(optax.sgd(0.1), hooks=[Picky()], axis_name="batch")


def test_a_keyword_and_a_hook_for_the_same_feature_are_refused():
    with pytest.raises(ValueError, match="distinct names"):
        jls.loss_scaling(
            optax.sgd(0.1), gradient_norm=True, hooks=[jls.hooks.GradientNorm()]
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"axis_name": 3}, TypeError, "axis_name must be None"),
        ({"hooks": jls.hooks.GradientNorm()}, TypeError, "sequence of jls.hooks"),
        ({"hooks": [True]}, TypeError, "sequence of jls.hooks"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, error, match):
    with pytest.raises(error, match=match):
        _make(**kwargs)


def test_the_configuration_is_what_every_entry_point_reads():
    tx = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(4.0))
    from jls._transformation import config_of

    config = config_of(tx)
    assert config.scaler == jls.static_scale(4.0)
    assert config_of(jls.LossScaling(optax.sgd(0.1))).hooks[0].name == (
        "nonfinite_loss"
    )
    assert jnp.asarray(config.scaler.init().scale) == 4.0
