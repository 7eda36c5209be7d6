"""jls: loss scaling for mixed-precision training in JAX, as optax transformations.

Wrap any optax optimizer with `loss_scaling`, multiply the loss by the
current scale with `scale_loss`, and jls unscales, checks, skips and adjusts
inside ``jit``. `apply_gradients` is the fused path and `train_step` a whole
step built on it; the rules are `dynamic_scale`, `measured_scale`,
`static_scale`, `no_scale` and the `presets`; `Hook` is the seam every
optional feature (and a user's own veto) plugs into. ``docs/design.md`` says
why each public name exists.
"""

import warnings

from jls import presets
from jls._checkpoint import upgrade_state
from jls._compensated import compensated, stochastic_rounding
from jls._diagnostics import nonfinite_paths
from jls._divergence import DivergenceError, raise_if_diverged
from jls._dynamic import dynamic_scale
from jls._finite import all_finite
from jls._hooks import Hook
from jls._loss_scaling import apply_gradients, loss_scaling, metrics
from jls._measured import measured_scale
from jls._policy import Policy, get_policy
from jls._precision import precision_report
from jls._rule import LossScaler
from jls._scale_stats import ScaleStats
from jls._scaled_state import ScaledState, scaled_state
from jls._scaling import scale_loss, unscale
from jls._set_scale import deprecated_replace_loss_scale_state, set_loss_scale
from jls._spikes import SpikeRule
from jls._stagnation import Stagnation, StagnationWarning, warn_if_stagnant
from jls._state import LossScaleState
from jls._static import no_scale, static_scale
from jls._step import StepOutput, train_step
from jls._transformation import LossScaling
from jls._tree import loss_scale_state

__version__ = "0.3.0.dev0"

__all__ = [
    "DivergenceError",
    "Hook",
    "LossScaleState",
    "LossScaler",
    "LossScaling",
    "Policy",
    "ScaleStats",
    "ScaledState",
    "SpikeRule",
    "Stagnation",
    "StagnationWarning",
    "all_finite",
    "apply_gradients",
    "compensated",
    "dynamic_scale",
    "get_policy",
    "loss_scale_state",
    "loss_scaling",
    "measured_scale",
    "metrics",
    "no_scale",
    "nonfinite_paths",
    "precision_report",
    "presets",
    "raise_if_diverged",
    "scale_loss",
    "scaled_state",
    "set_loss_scale",
    "static_scale",
    "stochastic_rounding",
    "train_step",
    "unscale",
    "upgrade_state",
    "warn_if_stagnant",
]

# Old names that keep working for one release, with a DeprecationWarning.
_DEPRECATED = {"replace_loss_scale_state": deprecated_replace_loss_scale_state}
_MOVED = {"StepOutput": (StepOutput, "the type jls.train_step's step returns")}
del StepOutput


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
    if name in _DEPRECATED:
        return _DEPRECATED[name]
    if name in _MOVED:
        obj, what = _MOVED[name]
        warnings.warn(
            f"jls.{name} is deprecated and will be removed from the top level in "
            f"jls 0.4: it is {what}; read its fields, no import needed",
            DeprecationWarning,
            stacklevel=2,
        )
        return obj
    raise AttributeError(f"module 'jls' has no attribute {name!r}")
