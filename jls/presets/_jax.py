"""Presets of the JAX peers: jmp's ``DynamicLossScale``, flax's ``DynamicScale``."""

from __future__ import annotations

from jls._rule import LossScaler
from jls._validate import F32_MAX, F32_TINY, integer
from jls.presets._common import check, dynamic_rule, preset


@preset
def jmp(
    loss_scale: float,
    counter: int = 0,
    period: int = 2000,
    factor: float = 2,
    min_loss_scale: float = 1.0,
    *,
    max_scale: float = F32_MAX,
) -> LossScaler:
    """The jmp ``DynamicLossScale`` (``loss_scale`` is required, as in jmp).

    ``counter`` resumes a run. Under ``jit`` jmp's floor becomes 1.0 and its
    division by a factor that is not a power of two is one ulp off; jls
    honours the floor and divides exactly.

    Example:
      >>> import jls
      >>> float(jls.presets.jmp(2.0**15, counter=5).init().growth_count)
      5.0
    """
    period = integer("period", period, 1)
    return dynamic_rule(
        {
            "init_scale": "loss_scale",
            "growth_factor": "factor",
            "backoff_divisor": "factor",
            "growth_interval": "period",
            "init_growth_count": "counter",
            "min_scale": "min_loss_scale",
        },
        init_scale=loss_scale,
        growth_factor=factor,
        backoff_divisor=factor,
        growth_interval=period,
        init_growth_count=counter,
        min_scale=min_loss_scale,
        max_scale=max_scale,
    )


@preset
def flax(
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    fin_steps: int = 0,
    scale: float = 65536.0,
    minimum_scale: float | None = F32_TINY,
    *,
    max_scale: float = F32_MAX,
) -> LossScaler:
    """The flax ``flax.training.dynamic_scale.DynamicScale``.

    flax grows *before* the step, so here ``growth_interval + 1``. With
    ``minimum_scale=None`` jls stops at the smallest normal float32.

    Example:
      >>> import jls
      >>> jls.presets.flax().growth_interval
      2001
    """
    interval = integer("growth_interval", growth_interval, 0)
    fin = integer("fin_steps", fin_steps, 0)
    check(
        fin <= interval,
        f"fin_steps must be in [0, growth_interval={interval}], got {fin!r}",
    )
    return dynamic_rule(
        {"init_scale": "scale", "min_scale": "minimum_scale"},
        init_scale=scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=interval + 1,
        init_growth_count=fin,
        saturate_growth=True,
        min_scale=F32_TINY if minimum_scale is None else minimum_scale,
        max_scale=max_scale,
    )
