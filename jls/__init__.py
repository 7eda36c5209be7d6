"""jls: loss scaling for mixed-precision training in JAX, as optax transformations.

Wrap any optax optimizer with `loss_scaling`, multiply the loss by the
current scale with `scale_loss`, and jls unscales, checks, skips and adjusts
inside ``jit``. `LossScaling` is the object that owns the step: `loss_scaling`
returns its optax pair, `apply_gradients` its fused path and `train_step` a
whole step built on it.
"""

from jls import presets
from jls._checkpoint import upgrade_state
from jls._divergence import DivergenceError, raise_if_diverged
from jls._finite import all_finite
from jls._loss_scaling import LossScaling, apply_gradients, loss_scaling
from jls._policy import Policy, get_policy
from jls._scaler import (
    LossScaler,
    dynamic_scale,
    measured_scale,
    no_scale,
    static_scale,
)
from jls._scaling import scale_loss, unscale
from jls._spikes import SpikeRule
from jls._state import (
    LossScaleState,
    loss_scale_state,
    metrics,
    nonfinite_paths,
    replace_loss_scale_state,
    set_loss_scale,
)
from jls._step import StepOutput, train_step

__version__ = "0.3.0.dev0"


def __getattr__(name: str) -> object:
    # ``jls.flax`` needs flax, so ``import jls`` does not import it; reaching
    # for it without ``import jls.flax`` imports it here (or says what to
    # install), instead of an AttributeError that names nothing.
    if name == "flax":
        import importlib

        try:
            return importlib.import_module("jls.flax")
        except ImportError as err:
            raise AttributeError(
                "jls.flax needs flax: pip install -e '.[flax]' in a checkout of "
                f"jls, then import jls.flax ({err})"
            ) from None
    raise AttributeError(f"module 'jls' has no attribute {name!r}")


__all__ = [
    "DivergenceError",
    "LossScaleState",
    "LossScaler",
    "LossScaling",
    "Policy",
    "SpikeRule",
    "StepOutput",
    "all_finite",
    "apply_gradients",
    "dynamic_scale",
    "get_policy",
    "loss_scale_state",
    "loss_scaling",
    "measured_scale",
    "metrics",
    "no_scale",
    "nonfinite_paths",
    "presets",
    "raise_if_diverged",
    "replace_loss_scale_state",
    "scale_loss",
    "set_loss_scale",
    "static_scale",
    "train_step",
    "unscale",
    "upgrade_state",
]
