"""State interchange: a jls run's scale and counters to and from other frameworks.

``to_torch_state_dict``/``from_torch_state_dict``, the same for Paddle, and
``to_megatron_state_dict``/``from_megatron_state_dict`` carry a run's scale
and counters to and from those frameworks' checkpoints; pair them with
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

    The state dict is read back by the framework (and by the matching
    ``from_*_state_dict``) as ``rebuilt()``; every field but the first
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


@preset
def to_torch_state_dict(scaler: LossScaler, opt_state: Any) -> dict[str, Any]:
    """The ``torch.amp.GradScaler.state_dict()`` of a jls run.

    Args:
      scaler: the run's scaler (its config fills torch's config keys).
      opt_state: an optimizer state containing the run's `LossScaleState`,
        or the `LossScaleState`.

    Returns:
      ``{"scale", "growth_factor", "backoff_factor", "growth_interval",
      "_growth_tracker"}`` as Python numbers, ready for
      ``GradScaler.load_state_dict``; ``{}`` for a disabled scaler
      (``torch(enabled=False)``), as torch's own disabled ``state_dict()``.

    Example:
      >>> import jls
      >>> scaler = jls.presets.torch(init_scale=1024.0)
      >>> jls.presets.to_torch_state_dict(scaler, scaler.init())["scale"]
      1024.0
    """
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


@preset
def from_torch_state_dict(
    state_dict: Mapping[str, Any], **kwargs: Any
) -> tuple[LossScaler, LossScaleState]:
    """A jls scaler and state resuming a ``torch.amp.GradScaler`` checkpoint.

    Args:
      state_dict: ``GradScaler.state_dict()``; an empty dict (a disabled
        scaler's) gives the disabled preset.
      **kwargs: further `torch` preset arguments (``min_scale``,
        ``max_scale``, ``enabled``). With ``enabled=False`` the state dict is
        ignored, as torch's disabled ``load_state_dict`` ignores it.

    Returns:
      ``(scaler, state)``: the same scale, config and growth tracker.

    Example:
      >>> import jls
      >>> sd = {"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5,
      ...       "growth_interval": 100, "_growth_tracker": 7}
      >>> scaler, state = jls.presets.from_torch_state_dict(sd)
      >>> float(state.scale), int(state.growth_count), scaler.growth_interval
      (512.0, 7, 100)
    """
    state_dict = _state_dict(state_dict)
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


@preset
def to_paddle_state_dict(scaler: LossScaler, opt_state: Any) -> dict[str, Any]:
    """The ``paddle.amp.GradScaler.state_dict()`` of a jls run.

    ``scale`` is a float32 numpy array of shape ``[1]`` (Paddle keeps a
    tensor there); the counters are Python ints. A disabled scaler
    (``paddle(enable=False)``) gives ``{}``, which `from_paddle_state_dict`
    reads back as the disabled preset.

    Example:
      >>> import jls
      >>> scaler = jls.presets.paddle()
      >>> jls.presets.to_paddle_state_dict(scaler, scaler.init())["incr_count"]
      0
    """
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


@preset
def from_paddle_state_dict(
    state_dict: Mapping[str, Any], **kwargs: Any
) -> tuple[LossScaler, LossScaleState]:
    """A jls scaler and state resuming a ``paddle.amp.GradScaler`` checkpoint.

    Args:
      state_dict: ``GradScaler.state_dict()``; an empty dict (a disabled
        scaler's) gives the disabled preset.
      **kwargs: further `paddle` preset arguments (``min_scale``,
        ``max_scale``, ``enable``). With ``enable=False`` the state dict is
        ignored.

    Returns:
      ``(scaler, state)`` with Paddle's scale, ratios, ``incr_count`` and
      ``decr_count``.

    Example:
      >>> import jls
      >>> sd = {"scale": [2048.0], "incr_ratio": 2.0, "decr_ratio": 0.8,
      ...       "incr_every_n_steps": 1000, "decr_every_n_nan_or_inf": 2,
      ...       "incr_count": 999, "decr_count": 1,
      ...       "use_dynamic_loss_scaling": True}
      >>> scaler, state = jls.presets.from_paddle_state_dict(sd)
      >>> float(scaler.adjust(state, True).scale)
      4096.0
    """
    state_dict = _state_dict(state_dict)
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


@preset
def to_megatron_state_dict(scaler: LossScaler, opt_state: Any) -> dict[str, Any]:
    """The ``DynamicGradScaler.state_dict()`` of a jls run.

    ``{"scale", "growth_tracker", "hysteresis_tracker"}``; Megatron keeps its
    config in its training arguments, not in this dict.

    Example:
      >>> import jls
      >>> scaler = jls.presets.megatron()
      >>> jls.presets.to_megatron_state_dict(scaler, scaler.init())
      {'scale': 4294967296.0, 'growth_tracker': 0, 'hysteresis_tracker': 2}
    """
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


@preset
def from_megatron_state_dict(
    state_dict: Mapping[str, Any], **kwargs: Any
) -> tuple[LossScaler, LossScaleState]:
    """A jls scaler and state resuming a Megatron ``DynamicGradScaler``.

    Args:
      state_dict: ``{"scale", "growth_tracker", "hysteresis_tracker"}``.
      **kwargs: the run's `megatron` preset arguments (``min_scale``,
        ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``hysteresis``); ``initial_scale`` comes from the dict.

    Returns:
      ``(scaler, state)``. A ``hysteresis_tracker`` at or below 0 (Megatron
      lets it go negative) means the hysteresis is spent.

    Example:
      >>> import jls
      >>> sd = {"scale": 2.0**20, "growth_tracker": 3, "hysteresis_tracker": 1}
      >>> scaler, state = jls.presets.from_megatron_state_dict(sd)
      >>> int(state.backoff_count), float(scaler.adjust(state, False).scale)
      (1, 524288.0)
    """
    state_dict = _state_dict(state_dict)
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
