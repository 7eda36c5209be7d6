"""The hooks `jls.loss_scaling`'s feature keywords stand for."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from jls._validate import axis_names, flag
from jls.hooks._diagnostics import Diagnostics
from jls.hooks._divergence import DIVERGENCE_LIMIT, Divergence
from jls.hooks._hooks import Hook
from jls.hooks._norm import GradientNorm
from jls.hooks._replicas import ReplicaCheck
from jls.hooks._scale_stats import ScaleStats
from jls.hooks._spikes import SpikeRule

# The feature keywords of jls.loss_scaling, with their defaults.
FEATURES: dict[str, Any] = {
    "diagnostics": False,
    "max_consecutive_skips": DIVERGENCE_LIMIT,
    "gradient_norm": False,
    "skip_spikes": None,
    "check_replicas": False,
    "scale_stats": False,
}


def checked_hooks(hooks: Any) -> tuple[Hook, ...]:
    """``hooks`` as a tuple, or a TypeError naming ``hooks``."""
    if (
        isinstance(hooks, Hook)
        or not isinstance(hooks, Iterable)
        or not all(isinstance(h, Hook) for h in hooks)
    ):
        raise TypeError(
            f"hooks must be a sequence of jls.hooks.Hook, got {hooks!r:.200}"
        )
    return tuple(hooks)


def hooks_from_options(
    hooks: Sequence[Hook] = (),
    *,
    diagnostics: Any = False,
    max_consecutive_skips: Any = None,
    gradient_norm: Any = False,
    skip_spikes: Any = None,
    check_replicas: Any = False,
    scale_stats: Any = False,
) -> tuple[Hook, ...]:
    """The hooks the feature keywords stand for, then ``hooks``.

    Raises:
      TypeError, ValueError: naming the keyword, for a bad value.
    """
    hooks = checked_hooks(hooks)
    out: list[Hook] = []
    if flag("diagnostics", diagnostics):
        out.append(Diagnostics())
    if max_consecutive_skips is not None:
        out.append(Divergence(max_consecutive_skips))
    if flag("gradient_norm", gradient_norm):
        out.append(GradientNorm())
    if skip_spikes is not None:
        if not isinstance(skip_spikes, SpikeRule):
            raise TypeError(
                "skip_spikes must be a jls.hooks.SpikeRule or None, got "
                f"{skip_spikes!r:.200}"
            )
        out.append(skip_spikes)
    if not isinstance(check_replicas, (bool, np.bool_)):
        out.append(ReplicaCheck(_replica_axes(check_replicas)))
    elif check_replicas:
        out.append(ReplicaCheck())
    if scale_stats is True:
        out.append(ScaleStats())
    elif isinstance(scale_stats, ScaleStats):
        out.append(scale_stats)
    elif scale_stats is not False and scale_stats is not None:
        out.append(ScaleStats(scale_stats))  # a dtype, checked there
    return (*out, *hooks)


def keywords_refused(options: Mapping[str, Any]) -> TypeError:
    """`jls.LossScaling`'s error for keywords it does not take, naming the fix."""
    unknown = [name for name in options if name not in FEATURES]
    if unknown:
        return TypeError(
            f"LossScaling() got an unexpected keyword argument {unknown[0]!r}"
        )
    given = ", ".join(f"{name}={value!r}" for name, value in options.items())
    try:
        made = [
            f"jls.hooks.{h!r}" for h in hooks_from_options(**{**FEATURES, **options})
        ]
        hooks = f"({', '.join(made)}{',' if len(made) == 1 else ''})"
    except (TypeError, ValueError) as err:
        hooks = f"(...) once the values are right ({err})"
    return TypeError(
        f"LossScaling takes hooks, not the feature keywords of jls.loss_scaling "
        f"(got {given}). Either make the optax pair with jls.loss_scaling(inner, "
        f"scaler, {given}), or pass the hooks they stand for: LossScaling(inner, "
        f"scaler, hooks={hooks})"
    )


def _replica_axes(value: Any) -> tuple[str, ...]:
    """``check_replicas`` given as axis names: a str or a tuple of str."""
    try:
        return axis_names("check_replicas", value)
    except TypeError:
        raise TypeError(
            "check_replicas must be a bool, an axis name or a tuple of axis "
            f"names, got {value!r}"
        ) from None


def warn_donated(caller: str, donated: Any) -> None:
    """The DeprecationWarning for ``donated=``, at ``caller``'s caller."""
    warnings.warn(
        f"{caller}(donated={donated!r}) is deprecated and ignored: the step is "
        "the same whether or not the caller donates its state. Remove the "
        "argument; it is removed in the next release of jls.",
        DeprecationWarning,
        stacklevel=3,
    )
