"""`loss_scaling`'s keyword arguments are the built-in hooks, in one order."""

import optax
import pytest

import jls
from jls._divergence import Divergence


def test_the_keywords_are_hooks_in_order():
    rule = jls.SpikeRule()
    scaling = jls.LossScaling(
        optax.sgd(0.1),
        diagnostics=True,
        max_consecutive_skips=5,
        gradient_norm=True,
        skip_spikes=rule,
    )
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
    default = jls.LossScaling(optax.sgd(0.1))
    assert [h.name for h in default.hooks] == ["nonfinite_loss", "divergence"]
    divergence = default.hooks[1]
    assert isinstance(divergence, Divergence) and divergence.limit == 1000
    applying = jls.LossScaling(
        optax.sgd(0.1), jls.no_scale(skip_nonfinite=False), max_consecutive_skips=None
    )
    assert applying.hooks == ()


def test_hook_names_are_distinct():
    with pytest.raises(ValueError, match="distinct names"):
        jls.LossScaling(
            optax.sgd(0.1), skip_spikes=jls.SpikeRule(), hooks=[jls.SpikeRule()]
        )


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"diagnostics": "yes"}, TypeError, "diagnostics must be a bool"),
        ({"gradient_norm": 1}, TypeError, "gradient_norm must be a bool"),
        ({"max_consecutive_skips": 0}, ValueError, "max_consecutive_skips must be"),
        ({"skip_spikes": 6.0}, TypeError, "skip_spikes must be a jls.SpikeRule"),
    ],
)
def test_the_keywords_are_checked_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        jls.loss_scaling(optax.sgd(0.1), **kwargs)
