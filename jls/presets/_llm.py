"""Presets of the LLM trainers: Megatron-LM and DeepSpeed (hysteresis)."""

from __future__ import annotations

from jls._rule import LossScaler
from jls._validate import F32_MAX, I32_MAX, flag, integer, real
from jls.presets._common import check, dynamic_rule, preset


@preset
def megatron(
    initial_scale: float = 2.0**32,
    min_scale: float = 1.0,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 1000,
    hysteresis: int = 2,
    *,
    max_scale: float = F32_MAX,
) -> LossScaler:
    """Megatron-LM's ``DynamicGradScaler``.

    The defaults are Megatron's training arguments'; jls stops growth at
    ``max_scale``.

    Example:
      >>> import jls
      >>> jls.presets.megatron().hysteresis
      2
    """
    growth = real("growth_factor", growth_factor)
    backoff = real("backoff_factor", backoff_factor)
    check(growth > 1.0, f"growth_factor must be > 1.0, got {growth!r}")
    check(0.0 < backoff < 1.0, f"backoff_factor must be in (0, 1), got {backoff!r}")
    return dynamic_rule(
        {"init_scale": "initial_scale"},
        init_scale=initial_scale,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=min_scale,
        max_scale=max_scale,
    )


@preset
def deepspeed(
    init_scale: float | None = None,
    scale_factor: float = 2.0,
    scale_window: int = 1000,
    min_scale: float = 1.0,
    delayed_shift: int | None = None,
    consecutive_hysteresis: bool = False,
    raise_error_at_min_scale: bool = True,
    *,
    initial_scale_power: int | None = None,
    hysteresis: int | None = None,
    max_scale: float = F32_MAX,
) -> LossScaler:
    """DeepSpeed's ``DynamicLossScaler`` (and its fp16 config block).

    The class's or the config's names. The first growth after the start or an
    overflow comes on the ``scale_window + 1``-th finite step; jls stops growth
    at ``max_scale``. ``raise_error_at_min_scale`` is validated, otherwise
    unused (see `jls.hooks.raise_if_diverged`).

    Example:
      >>> import jls
      >>> s = jls.presets.deepspeed(initial_scale_power=16, scale_window=2)
      >>> float(s.init().scale), s.first_growth_interval
      (65536.0, 3)
    """
    init_scale = _deepspeed_init_scale(init_scale, initial_scale_power)
    shift = _deepspeed_hysteresis(delayed_shift, hysteresis)
    flag("raise_error_at_min_scale", raise_error_at_min_scale)
    # The first growth comes on step scale_window + 1.
    window = integer("scale_window", scale_window, 1, I32_MAX - 1)
    factor = real("scale_factor", scale_factor)
    names = {
        "growth_factor": "scale_factor",
        "backoff_divisor": "scale_factor",
        "growth_interval": "scale_window",
        "hysteresis": "delayed_shift" if hysteresis is None else "hysteresis",
    }
    if initial_scale_power is not None:
        names["init_scale"] = "2**initial_scale_power"
    return dynamic_rule(
        names,
        init_scale=init_scale,
        growth_factor=factor,
        backoff_divisor=factor,
        growth_interval=window,
        first_growth_interval=window + 1,
        hysteresis=shift,
        consecutive_hysteresis=flag("consecutive_hysteresis", consecutive_hysteresis),
        min_scale=min_scale,
        max_scale=max_scale,
    )


def _deepspeed_init_scale(init_scale: float | None, power: int | None) -> float:
    """``init_scale``, or ``2**initial_scale_power`` (default 2**32); not both."""
    if init_scale is not None and power is not None:
        raise ValueError(
            "give init_scale or initial_scale_power, not both; "
            f"got {init_scale!r} and {power!r}"
        )
    if power is None:
        return 2.0**32 if init_scale is None else init_scale
    power = integer("initial_scale_power", power, -126)
    check(power <= 127, f"initial_scale_power must be <= 127 (float32), got {power!r}")
    return 2.0**power


def _deepspeed_hysteresis(delayed_shift: int | None, hysteresis: int | None) -> int:
    """DeepSpeed's two names of one setting (default 1); equal if both given."""
    if delayed_shift is not None and hysteresis is not None:
        check(
            delayed_shift == hysteresis,
            "delayed_shift and hysteresis are the same setting; got "
            f"{delayed_shift!r} and {hysteresis!r}",
        )
    return next((h for h in (delayed_shift, hysteresis) if h is not None), 1)
