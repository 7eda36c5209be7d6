"""Fixed scales: `static_scale` and `no_scale`, the dynamic rule pinned to one value."""

from __future__ import annotations

from typing import Any

from jls._dynamic import DynamicScale, Namer, own
from jls._rule import LossScaler
from jls._validate import positive_f32


def static_named(name: Namer, value: Any, skip_nonfinite: Any = True) -> LossScaler:
    """`static_scale` whose errors name the scale ``name("value")``."""
    value = positive_f32(name("value"), value)
    return DynamicScale.named(
        name,
        init_scale=value,
        growth_factor=1.0,
        backoff_factor=1.0,
        growth_interval=1,
        min_scale=value,
        max_scale=value,
        skip_nonfinite=skip_nonfinite,
    )


def static_scale(value: float, *, skip_nonfinite: bool = True) -> LossScaler:
    """A fixed loss scale; non-finite steps are still counted (and dropped).

    Args:
      value: the scale, a positive float32-representable number.
      skip_nonfinite: drop a step whose gradients are not finite (default).

    Returns:
      A `LossScaler` whose scale never changes.

    Raises:
      TypeError: if ``value`` is not a real number.
      ValueError: if ``value`` is not positive or not float32-representable.

    Example:
      >>> import jls
      >>> scaler = jls.static_scale(128.0)
      >>> scaler.adjust(scaler.init(), False).scale
      Array(128., dtype=float32)
    """
    return static_named(own, value, skip_nonfinite)


def no_scale(*, skip_nonfinite: bool = True) -> LossScaler:
    """Scale 1: no loss scaling, non-finite steps still skipped (for bfloat16).

    Args:
      skip_nonfinite: drop a step whose gradients are not finite (default).

    Returns:
      A `LossScaler` with scale 1 forever.

    Example:
      >>> import jls
      >>> jls.no_scale().init().scale
      Array(1., dtype=float32)
    """
    return static_named(own, 1.0, skip_nonfinite)
