"""The hooks `jls.loss_scaling`'s keyword arguments stand for: one function.

Every optional feature is a hook (`jls.hooks`); the keywords are a
convenience that `hooks_from_options` turns into hook objects, put before
the ``hooks=`` the caller gives. Whether a hook fits the rest of the
transformation (an ``axis_name`` to compare over, a donating step) is the
hook's own `Hook.check`, called by `jls._config.make_config`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jls._validate import axis_names, flag
from jls.hooks._diagnostics import Diagnostics
from jls.hooks._divergence import Divergence
from jls.hooks._hooks import Hook
from jls.hooks._nonfinite_loss import NonfiniteLoss
from jls.hooks._norm import GradientNorm
from jls.hooks._replicas import ReplicaCheck
from jls.hooks._scale_stats import ScaleStats
from jls.hooks._spikes import SpikeRule


def hooks_from_options(
    hooks: Sequence[Hook],
    *,
    diagnostics: Any = False,
    max_consecutive_skips: Any = None,
    gradient_norm: Any = False,
    skip_spikes: Any = None,
    skip_nonfinite: bool = True,
    check_replicas: Any = False,
    scale_stats: Any = False,
) -> tuple[Hook, ...]:
    """The hooks the keyword arguments stand for, then ``hooks``.

    `NonfiniteLoss` is always on: it skips for every scaler that skips
    non-finite steps, and only records for one configured to apply them
    (MindSpore's ``drop_overflow_update=False``, the off switch), so the
    metrics have the same keys in every setting.

    Raises:
      TypeError: naming the keyword, for a value of the wrong type.
    """
    if isinstance(hooks, Hook) or not all(isinstance(h, Hook) for h in hooks):
        raise TypeError(
            f"hooks must be a sequence of jls.hooks.Hook, got {hooks!r:.200}"
        )
    out: list[Hook] = [NonfiniteLoss(skips=skip_nonfinite)]
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


def _replica_axes(value: Any) -> tuple[str, ...]:
    """``check_replicas`` given as axis names: a str or a tuple of str."""
    try:
        return axis_names("check_replicas", value)
    except TypeError:
        raise TypeError(
            "check_replicas must be a bool, an axis name or a tuple of axis "
            f"names, got {value!r}"
        ) from None
