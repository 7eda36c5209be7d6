"""jls: loss scaling for mixed-precision training in JAX, as optax transformations.

Wrap any optax optimizer with `loss_scaling`, multiply the loss by the
current scale with `scale_loss`, and jls unscales, checks, skips and adjusts
inside ``jit``; docs/design.md says why each public name exists.
"""

import importlib as _importlib

from jls import hooks, precision, presets
from jls._checkpoint import upgrade_state
from jls._dynamic import dynamic_scale
from jls._finite import all_finite
from jls._keep import keep_if_skipped
from jls._loss_scaling import apply_gradients, loss_scaling, metrics
from jls._measured import measured_scale
from jls._rule import LossScaler
from jls._scaling import scale_loss, unscale
from jls._set_scale import set_loss_scale
from jls._state import LossScaleState
from jls._static import no_scale, static_scale
from jls._step import train_step
from jls._transformation import LossScaling
from jls._tree import loss_scale_state
from jls.hooks._hooks import LossScalingState

__version__ = "0.5.0.dev0"

__all__ = [
    "LossScaleState",
    "LossScaler",
    "LossScaling",
    "LossScalingState",
    "all_finite",
    "apply_gradients",
    "dynamic_scale",
    "hooks",
    "keep_if_skipped",
    "loss_scale_state",
    "loss_scaling",
    "measured_scale",
    "metrics",
    "no_scale",
    "precision",
    "presets",
    "scale_loss",
    "set_loss_scale",
    "static_scale",
    "train_step",
    "unscale",
    "upgrade_state",
]


def __getattr__(name: str) -> object:
    # ``jls.flax`` needs flax: imported when reached (or saying what to install).
    if name == "flax":
        try:
            return _importlib.import_module("jls.flax")
        except ImportError as err:
            raise AttributeError(
                "jls.flax needs flax: pip install -e '.[flax]' in a checkout of "
                f"jls, then import jls.flax ({err})"
            ) from None
    if name in _MOVED:
        raise AttributeError(
            f"jls.{name} was removed in jls 0.5: use jls.{_MOVED[name]}.{name}"
        )
    raise AttributeError(f"module 'jls' has no attribute {name!r}")


# Names the top level no longer has, with the namespace that holds them.
_MOVED = {
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
