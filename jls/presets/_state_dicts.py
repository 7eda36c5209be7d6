"""State interchange: a run's scale and counters to and from torch, Paddle, Megatron.

The three checkpoints differ only in their keys: each is a row of `_FORMATS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from jls._dynamic import DynamicScale
from jls._rule import LossScaler
from jls._state import LossScaleState, make_state
from jls._static import no_scale
from jls._tree import loss_scale_state
from jls._validate import flag, integer, state_dict_number
from jls.presets._common import check, preset
from jls.presets._frameworks import paddle, torch
from jls.presets._llm import megatron

Resumed = tuple[LossScaler, LossScaleState]


class _Format(NamedTuple):
    """A framework's checkpoint. Its config keys are its preset's arguments."""

    title: str
    preset: Callable[..., LossScaler]
    args: dict[str, str]  # each preset argument: the jls field it sets
    keys: str  # the dict's keys, in the framework's order
    off: str | None = None  # the preset's flag whose False writes and reads {}
    scale_array: bool = False  # ``scale`` a float32 array of shape [1]


def _own(*fields: str) -> dict[str, str]:
    """Arguments named as jls's fields, and the bounds every preset takes."""
    return {f: f for f in (*fields, "min_scale", "max_scale")}


_FACTORS = ("growth_factor", "backoff_factor", "growth_interval")
_FORMATS = {
    "torch": _Format(
        "torch GradScaler",
        torch,
        _own("init_scale", *_FACTORS),
        "scale growth_factor backoff_factor growth_interval _growth_tracker",
        off="enabled",
    ),
    "paddle": _Format(
        "Paddle GradScaler",
        paddle,
        {
            "init_loss_scaling": "init_scale",
            "incr_ratio": "growth_factor",
            "decr_ratio": "backoff_factor",
            "incr_every_n_steps": "growth_interval",
            "decr_every_n_nan_or_inf": "backoff_interval",
            "use_dynamic_loss_scaling": "is_dynamic",
        }
        | _own(),
        "scale incr_ratio decr_ratio incr_every_n_steps decr_every_n_nan_or_inf "
        "incr_count decr_count use_dynamic_loss_scaling",
        off="enable",
        scale_array=True,
    ),
    "megatron": _Format(
        "Megatron DynamicGradScaler",
        megatron,
        {"initial_scale": "init_scale"} | _own("hysteresis", *_FACTORS),
        "scale growth_tracker hysteresis_tracker",
    ),
}
# Each counter's state field, and the field it stays below.
_COUNTERS = {
    "_growth_tracker": ("growth_count", "growth_interval"),
    "incr_count": ("growth_count", "growth_interval"),
    "growth_tracker": ("growth_count", "growth_interval"),
    "decr_count": ("backoff_count", "backoff_interval"),
}


def _format(framework: Any) -> _Format:
    if not isinstance(framework, str) or framework not in _FORMATS:
        raise ValueError(
            "framework must be one of 'torch', 'paddle', 'megatron', got "
            f"{framework!r:.200}"
        )
    return _FORMATS[framework]


def _arg(fmt: _Format, field: str) -> str:
    """The preset's argument that sets ``field``."""
    return next(arg for arg, f in fmt.args.items() if f == field)


def _check_exportable(scaler: LossScaler) -> DynamicScale:
    """The frameworks have the dynamic rule only: the measured one is refused."""
    if not isinstance(scaler, LossScaler):
        raise TypeError(f"scaler must be a jls.LossScaler, got {scaler!r:.200}")
    if not isinstance(scaler, DynamicScale):
        raise ValueError(
            "scaler is jls.measured_scale(...), which no framework has: its "
            "state (scale, headroom) cannot be written as that framework's "
            "state_dict"
        )
    return scaler


def _same_rule(scaler: DynamicScale, fmt: _Format) -> None:
    """Refuses ``scaler`` unless the dict reads back as the same rule."""
    try:
        other = fmt.preset(**{a: getattr(scaler, f) for a, f in fmt.args.items()})
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"scaler cannot be written as a {fmt.title} state_dict: the framework "
            f"would refuse it ({err})"
        ) from None
    fields = [
        f.name
        for f in dataclasses.fields(scaler)
        if f.name not in ("init_scale", "init_growth_count")
        and getattr(scaler, f.name) != getattr(other, f.name)
    ]
    if fields:
        what = ", ".join(
            f"{f}={getattr(scaler, f)!r} (read back as {getattr(other, f)!r})"
            for f in fields
        )
        raise ValueError(
            f"scaler cannot be written as a {fmt.title} state_dict, which cannot "
            f"hold {what}: the run would not resume as it is"
        )


def _written(fmt: _Format, key: str, scaler: DynamicScale, state: Any) -> Any:
    """The value ``fmt``'s dict holds at ``key``."""
    if key == "scale" and fmt.scale_array:
        return np.asarray([state.scale], np.float32)
    if key == "scale":
        return state_dict_number("state.scale", state.scale)
    if key == "hysteresis_tracker":
        return scaler.hysteresis - int(state.backoff_count)
    if key in _COUNTERS:
        return int(getattr(state, _COUNTERS[key][0]))
    return getattr(scaler, fmt.args[key])


def _counts(fmt: _Format, scaler: DynamicScale, sd: Mapping[str, Any]) -> dict:
    """The dict's counters as the state's, each checked below its interval."""
    counts = {}
    for key in (k for k in fmt.keys.split() if k in _COUNTERS):
        field, interval = _COUNTERS[key]
        n = integer(key, sd[key], 0)
        check(
            n < max(1, getattr(scaler, interval)),
            f"{key} must be < {_arg(fmt, interval)}, got {n!r}",
        )
        counts[field] = n
    if "hysteresis_tracker" in fmt.keys.split():
        # Megatron's can go negative: at or below 0 the hysteresis is spent.
        n = integer("hysteresis_tracker", sd["hysteresis_tracker"], -(2**31))
        counts["backoff_count"] = min(max(scaler.hysteresis - n, 0), scaler.hysteresis)
    return counts


@preset
def to_state_dict(
    scaler: LossScaler, opt_state: Any, *, framework: str
) -> dict[str, Any]:
    """The loss scaler's ``state_dict()`` that ``framework`` would write.

    Args:
      scaler: the run's scaler, a dynamic rule the framework's dict can hold.
      opt_state: an optimizer state with the run's `LossScaleState`, or it.
      framework: ``"torch"``, ``"paddle"`` or ``"megatron"`` (no config); a
        disabled torch or Paddle scaler writes ``{}``, as theirs do.

    Returns:
      The dict, ready for the framework's ``load_state_dict``.

    Raises:
      ValueError: for another ``framework``, or a scaler its dict cannot hold.

    Example:
      >>> import jls
      >>> scaler = jls.presets.megatron()
      >>> jls.presets.to_state_dict(scaler, scaler.init(), framework="megatron")
      {'scale': 4294967296.0, 'growth_tracker': 0, 'hysteresis_tracker': 2}
    """
    fmt = _format(framework)
    scaler = _check_exportable(scaler)
    state = loss_scale_state(opt_state)
    if fmt.off and scaler == no_scale(skip_nonfinite=False):
        return {}
    _same_rule(scaler, fmt)
    return {key: _written(fmt, key, scaler, state) for key in fmt.keys.split()}


@preset
def from_state_dict(
    state_dict: Mapping[str, Any], *, framework: str, **kwargs: Any
) -> Resumed:
    """A jls scaler and state resuming ``framework``'s loss scaler checkpoint.

    Args:
      state_dict: the framework's ``state_dict()``; an empty or disabled one
        gives the disabled preset.
      framework: ``"torch"``, ``"paddle"`` or ``"megatron"``.
      **kwargs: further preset arguments (Megatron's config: ``hysteresis``).

    Returns:
      ``(scaler, state)``: the dict's scale, config and counters.

    Raises:
      ValueError: for another ``framework``, or a dict it would not write.

    Example:
      >>> import jls
      >>> sd = {"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5,
      ...       "growth_interval": 100, "_growth_tracker": 7}
      >>> scaler, state = jls.presets.from_state_dict(sd, framework="torch")
      >>> float(state.scale), int(state.growth_count), scaler.growth_interval
      (512.0, 7, 100)
    """
    fmt = _format(framework)
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            "state_dict must be a dict (the scaler's state_dict()), got "
            f"{type(state_dict).__name__}: {state_dict!r:.200}"
        )
    if fmt.off and (not state_dict or not flag(fmt.off, kwargs.get(fmt.off, True))):
        scaler = fmt.preset(**dict(kwargs, **{fmt.off: False}))
        return scaler, scaler.init()
    needed = [k for k in fmt.keys.split() if k != "use_dynamic_loss_scaling"]
    missing = [k for k in needed if k not in state_dict]
    if missing:
        raise ValueError(
            f"state_dict has no {', '.join(map(repr, missing))}: a {fmt.title}'s "
            f"state_dict() holds {needed} (got the keys {sorted(state_dict)})"
        )
    scale = state_dict_number("state_dict['scale']", state_dict["scale"])
    config = {
        k: state_dict.get(k, True) if k == "use_dynamic_loss_scaling" else state_dict[k]
        for k in fmt.keys.split()
        if k in fmt.args
    }
    scaler = fmt.preset(**{_arg(fmt, "init_scale"): scale}, **config, **kwargs)
    assert isinstance(scaler, DynamicScale)
    if not scaler.is_dynamic:
        return scaler, scaler.init()
    return scaler, make_state(scale, **_counts(fmt, scaler, state_dict))
