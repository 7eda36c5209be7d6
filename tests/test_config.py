"""The configuration: validated once when made, frozen, each hook checks itself."""

import dataclasses

import jax.numpy as jnp
import optax
import pytest

import jls
from jls._config import Config, make_config


def _make(**kwargs):
    options = {"axis_name": None, "hooks": (), "donated": False, **kwargs}
    return make_config(optax.sgd(0.1), None, **options)


def test_the_configuration_is_frozen_and_holds_every_hook_in_order():
    config = _make(gradient_norm=True, diagnostics=True)
    assert isinstance(config, Config)
    names = [h.name for h in config.hooks]
    assert names == ["nonfinite_loss", "diagnostics", "gradient_norm"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.donated = True  # pyright: ignore[reportAttributeAccessIssue]
    assert config.measures and config.reads_loss and not config.off


def test_the_off_switch_is_a_property_of_the_configuration():
    off = make_config(
        optax.sgd(0.1),
        jls.no_scale(skip_nonfinite=False),
        axis_name=None,
        hooks=(),
        donated=False,
        max_consecutive_skips=1000,
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


def test_sampled_statistics_need_a_donating_step_and_say_so():
    stats = jls.hooks.ScaleStats(every=4)
    with pytest.raises(ValueError, match=r"ScaleStats\(every=4\).*donated=True"):
        jls.loss_scaling(optax.sgd(0.1), scale_stats=stats)
    with pytest.raises(ValueError, match=r"ScaleStats\(every=4\).*donated=True"):
        jls.loss_scaling(optax.sgd(0.1), hooks=[stats])  # the same by the seam
    jls.loss_scaling(optax.sgd(0.1), hooks=[stats], donated=True)


def test_a_keyword_and_a_hook_for_the_same_feature_are_refused():
    with pytest.raises(ValueError, match="distinct names"):
        jls.loss_scaling(
            optax.sgd(0.1), gradient_norm=True, hooks=[jls.hooks.GradientNorm()]
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"donated": 1}, TypeError, "donated must be a bool"),
        ({"axis_name": 3}, TypeError, "axis_name must be None"),
        ({"hooks": jls.hooks.GradientNorm()}, TypeError, "sequence of jls.hooks"),
        ({"gradient_norm": "yes"}, TypeError, "gradient_norm must be a bool"),
        ({"skip_spikes": True}, TypeError, "skip_spikes must be a jls.hooks"),
    ],
)
def test_bad_options_name_themselves(kwargs, error, match):
    with pytest.raises(error, match=match):
        _make(**kwargs)


def test_the_configuration_is_what_every_entry_point_reads():
    tx = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(4.0), donated=True)
    from jls._transformation import config_of

    config = config_of(tx)
    assert config.donated and config.scaler == jls.static_scale(4.0)
    assert config_of(jls.LossScaling(optax.sgd(0.1))).hooks[0].name == (
        "nonfinite_loss"
    )
    assert jnp.asarray(config.scaler.init().scale) == 4.0
