"""State interchange: a jls run's scale and counters to and from other frameworks.

`to_state_dict` and `from_state_dict` carry a run's scale and counters to and
from the checkpoints of torch's and Paddle's ``GradScaler`` and Megatron's
``DynamicGradScaler`` (``framework="torch"``, ``"paddle"``, ``"megatron"``):
one pair, since the three differ only in the dict's keys. Pair them with
`jls.set_loss_scale` to put the state into an optimizer state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

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


def _state_dict(state_dict: Any) -> Mapping[str, Any]:
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            "state_dict must be a dict (the "
            f"scaler's state_dict()), got {type(state_dict).__name__}: "
            f"{state_dict!r:.200}"
        )
    return state_dict


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


def _disabled(scaler: LossScaler) -> bool:
    """Whether ``scaler`` is torch's ``enabled=False`` / Paddle's ``enable=False``."""
    return scaler == no_scale(skip_nonfinite=False)


def _same_rule(scaler: LossScaler, rebuilt: Callable[[], LossScaler], fmt: str) -> None:
    """Refuses ``scaler`` unless ``rebuilt()`` (from ``fmt``'s dict) is the same rule.

    The state dict is read back by the framework (and by `from_state_dict`)
    as ``rebuilt()``; every field but the first
    scale and growth count (the dict carries the current ones) must match,
    so that the round trip is exact. Anything else is refused, naming what
    the format cannot hold.
    """
    try:
        other = rebuilt()
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"scaler cannot be written as a {fmt} state_dict: the framework would "
            f"refuse it ({err})"
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
            f"scaler cannot be written as a {fmt} state_dict, which cannot hold "
            f"{what}: the run would not resume as it is"
        )


def _to_torch(scaler: LossScaler, opt_state: Any) -> dict[str, Any]:
    scaler = _check_exportable(scaler)
    state = loss_scale_state(opt_state)
    if _disabled(scaler):
        return {}
    _same_rule(
        scaler,
        lambda: torch(
            init_scale=scaler.init_scale,
            growth_factor=scaler.growth_factor,
            backoff_factor=scaler.backoff_factor,
            growth_interval=scaler.growth_interval,
            min_scale=scaler.min_scale,
            max_scale=scaler.max_scale,
        ),
        "torch GradScaler",
    )
    return {
        "scale": state_dict_number("state.scale", state.scale),
        "growth_factor": scaler.growth_factor,
        "backoff_factor": scaler.backoff_factor,
        "growth_interval": scaler.growth_interval,
        "_growth_tracker": int(state.growth_count),
    }


def _from_torch(state_dict: Mapping[str, Any], **kwargs: Any) -> Resumed:
    # enabled=False ignores the dict, as torch's disabled load_state_dict does.
    if not state_dict or not flag("enabled", kwargs.get("enabled", True)):
        scaler = torch(**dict(kwargs, enabled=False))
        return scaler, scaler.init()
    scale = state_dict_number("state_dict['scale']", state_dict["scale"])
    tracker = integer("_growth_tracker", state_dict["_growth_tracker"], 0)
    scaler = torch(
        init_scale=scale,
        growth_factor=state_dict["growth_factor"],
        backoff_factor=state_dict["backoff_factor"],
        growth_interval=state_dict["growth_interval"],
        **kwargs,
    )
    assert isinstance(scaler, DynamicScale)
    check(
        tracker < scaler.growth_interval,
        f"_growth_tracker must be < growth_interval, got {tracker!r}",
    )
    return scaler, make_state(scale, growth_count=tracker)


def _to_paddle(scaler: LossScaler, opt_state: Any) -> dict[str, Any]:
    scaler = _check_exportable(scaler)
    state = loss_scale_state(opt_state)
    if _disabled(scaler):
        return {}
    _same_rule(
        scaler,
        lambda: paddle(
            init_loss_scaling=scaler.init_scale,
            incr_ratio=scaler.growth_factor,
            decr_ratio=scaler.backoff_factor,
            incr_every_n_steps=scaler.growth_interval,
            decr_every_n_nan_or_inf=scaler.backoff_interval,
            use_dynamic_loss_scaling=scaler.is_dynamic,
            min_scale=scaler.min_scale,
            max_scale=scaler.max_scale,
        ),
        "Paddle GradScaler",
    )
    return {
        "scale": np.asarray([state.scale], np.float32),
        "incr_ratio": scaler.growth_factor,
        "decr_ratio": scaler.backoff_factor,
        "incr_every_n_steps": scaler.growth_interval,
        "decr_every_n_nan_or_inf": scaler.backoff_interval,
        "incr_count": int(state.growth_count),
        "decr_count": int(state.backoff_count),
        "use_dynamic_loss_scaling": scaler.is_dynamic,
    }


def _from_paddle(state_dict: Mapping[str, Any], **kwargs: Any) -> Resumed:
    if not state_dict or not flag("enable", kwargs.get("enable", True)):
        scaler = paddle(**dict(kwargs, enable=False))
        return scaler, scaler.init()
    scale = state_dict_number("state_dict['scale']", state_dict["scale"])
    dynamic = flag(
        "use_dynamic_loss_scaling",
        state_dict.get("use_dynamic_loss_scaling", True),
    )
    scaler = paddle(
        init_loss_scaling=scale,
        incr_ratio=state_dict["incr_ratio"],
        decr_ratio=state_dict["decr_ratio"],
        incr_every_n_steps=state_dict["incr_every_n_steps"],
        decr_every_n_nan_or_inf=state_dict["decr_every_n_nan_or_inf"],
        use_dynamic_loss_scaling=dynamic,
        **kwargs,
    )
    assert isinstance(scaler, DynamicScale)
    if not dynamic:
        return scaler, scaler.init()
    incr = integer("incr_count", state_dict["incr_count"], 0)
    decr = integer("decr_count", state_dict["decr_count"], 0)
    check(
        incr < scaler.growth_interval,
        f"incr_count must be < incr_every_n_steps, got {incr!r}",
    )
    check(
        decr < max(1, scaler.backoff_interval),
        f"decr_count must be < decr_every_n_nan_or_inf, got {decr!r}",
    )
    return scaler, make_state(scale, growth_count=incr, backoff_count=decr)


def _to_megatron(scaler: LossScaler, opt_state: Any) -> dict[str, Any]:
    scaler = _check_exportable(scaler)
    state = loss_scale_state(opt_state)
    _same_rule(
        scaler,
        lambda: megatron(
            initial_scale=scaler.init_scale,
            min_scale=scaler.min_scale,
            growth_factor=scaler.growth_factor,
            backoff_factor=scaler.backoff_factor,
            growth_interval=scaler.growth_interval,
            hysteresis=scaler.hysteresis,
            max_scale=scaler.max_scale,
        ),
        "Megatron DynamicGradScaler",
    )
    return {
        "scale": state_dict_number("state.scale", state.scale),
        "growth_tracker": int(state.growth_count),
        "hysteresis_tracker": scaler.hysteresis - int(state.backoff_count),
    }


def _from_megatron(state_dict: Mapping[str, Any], **kwargs: Any) -> Resumed:
    # A hysteresis_tracker at or below 0 (Megatron lets it go negative): spent.
    scale = state_dict_number("state_dict['scale']", state_dict["scale"])
    scaler = megatron(initial_scale=scale, **kwargs)
    assert isinstance(scaler, DynamicScale)
    tracker = integer("growth_tracker", state_dict["growth_tracker"], 0)
    check(
        tracker < scaler.growth_interval,
        f"growth_tracker must be < growth_interval, got {tracker!r}",
    )
    hyst = integer("hysteresis_tracker", state_dict["hysteresis_tracker"], -(2**31))
    spent = min(max(scaler.hysteresis - int(hyst), 0), scaler.hysteresis)
    return scaler, make_state(scale, growth_count=tracker, backoff_count=spent)


_WRITERS = {"torch": _to_torch, "paddle": _to_paddle, "megatron": _to_megatron}
_READERS = {"torch": _from_torch, "paddle": _from_paddle, "megatron": _from_megatron}


def _framework(framework: Any) -> str:
    if not isinstance(framework, str) or framework not in _WRITERS:
        raise ValueError(
            "framework must be one of 'torch', 'paddle', 'megatron', got "
            f"{framework!r:.200}"
        )
    return framework


@preset
def to_state_dict(
    scaler: LossScaler, opt_state: Any, *, framework: str
) -> dict[str, Any]:
    """The loss scaler's ``state_dict()`` that ``framework`` would write.

    Args:
      scaler: the run's scaler: a dynamic rule the framework can hold (a
        torch scaler has no hysteresis, Megatron no ``backoff_interval``, ...;
        anything else is refused, naming it, as the run would not resume as
        it is). Its config fills the framework's config keys.
      opt_state: an optimizer state containing the run's `LossScaleState`,
        or the `LossScaleState`.
      framework: whose dict:

        * ``"torch"``: ``torch.amp.GradScaler``'s, ``{"scale",
          "growth_factor", "backoff_factor", "growth_interval",
          "_growth_tracker"}`` as Python numbers; ``{}`` for a disabled
          scaler (``torch(enabled=False)``), as torch's own.
        * ``"paddle"``: ``paddle.amp.GradScaler``'s: ``scale`` a float32
          numpy array of shape ``[1]`` (Paddle keeps a tensor there), the
          ratios, intervals and counters (``incr_count``, ``decr_count``) as
          Python numbers; ``{}`` for ``paddle(enable=False)``.
        * ``"megatron"``: ``DynamicGradScaler``'s, ``{"scale",
          "growth_tracker", "hysteresis_tracker"}``; Megatron keeps its
          config in its training arguments, not in this dict.

    Returns:
      The dict, ready for the framework's ``load_state_dict``.

    Raises:
      ValueError: for another ``framework``, or a scaler its dict cannot hold.

    Example:
      >>> import jls
      >>> scaler = jls.presets.torch(init_scale=1024.0)
      >>> sd = jls.presets.to_state_dict(scaler, scaler.init(), framework="torch")
      >>> sd["scale"], sd["growth_interval"], sd["_growth_tracker"]
      (1024.0, 2000, 0)
      >>> scaler = jls.presets.megatron()
      >>> jls.presets.to_state_dict(scaler, scaler.init(), framework="megatron")
      {'scale': 4294967296.0, 'growth_tracker': 0, 'hysteresis_tracker': 2}
    """
    return _WRITERS[_framework(framework)](scaler, opt_state)


@preset
def from_state_dict(
    state_dict: Mapping[str, Any], *, framework: str, **kwargs: Any
) -> Resumed:
    """A jls scaler and state resuming ``framework``'s loss scaler checkpoint.

    Args:
      state_dict: the framework's ``state_dict()`` (see `to_state_dict`). An
        empty dict (a disabled torch or Paddle scaler's) gives that disabled
        preset.
      framework: ``"torch"``, ``"paddle"`` or ``"megatron"``.
      **kwargs: further arguments of that preset (`torch`, `paddle`,
        `megatron`), e.g. ``min_scale``, ``max_scale``. torch's
        ``enabled=False`` and Paddle's ``enable=False`` ignore the dict, as
        their disabled ``load_state_dict`` does. Megatron's dict holds no
        config: give the run's (``growth_interval``, ``hysteresis``, ...);
        its ``initial_scale`` comes from the dict.

    Returns:
      ``(scaler, state)``: the dict's scale, config and counters. A Megatron
      ``hysteresis_tracker`` at or below 0 (it can go negative) means the
      hysteresis is spent.

    Raises:
      ValueError: for another ``framework``, or a dict the framework would
        not write (a counter past its interval, a non-finite scale).

    Example:
      >>> import jls
      >>> sd = {"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5,
      ...       "growth_interval": 100, "_growth_tracker": 7}
      >>> scaler, state = jls.presets.from_state_dict(sd, framework="torch")
      >>> float(state.scale), int(state.growth_count), scaler.growth_interval
      (512.0, 7, 100)
      >>> sd = {"scale": 2.0**20, "growth_tracker": 3, "hysteresis_tracker": 1}
      >>> scaler, state = jls.presets.from_state_dict(sd, framework="megatron")
      >>> int(state.backoff_count), float(scaler.adjust(state, False).scale)
      (1, 524288.0)
    """
    read = _READERS[_framework(framework)]
    return read(_state_dict(state_dict), **kwargs)
