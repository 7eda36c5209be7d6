"""Presets of Keras 3, TensorFlow 2 and TensorFlow 1's loss-scale rules."""

from __future__ import annotations

from jls._rule import LossScaler
from jls._validate import F32_MAX, F32_TINY, flag, real
from jls.presets._common import check, dynamic_rule, preset, static_rule


@preset
def keras(
    initial_scale: float = 32768.0,
    dynamic_growth_steps: int = 2000,
    *,
    min_scale: float = F32_TINY,
    max_scale: float = F32_MAX,
) -> LossScaler:
    """Keras 3's ``keras.optimizers.LossScaleOptimizer``.

    Keras's scale can reach 0 or inf, and it checks the *scaled* gradients;
    jls keeps the scale in ``[min_scale, max_scale]`` and checks the unscaled.

    Example:
      >>> import jls
      >>> jls.presets.keras().init().scale
      Array(32768., dtype=float32)
    """
    return dynamic_rule(
        {"init_scale": "initial_scale", "growth_interval": "dynamic_growth_steps"},
        init_scale=initial_scale,
        growth_factor=2.0,
        backoff_divisor=2.0,
        growth_interval=dynamic_growth_steps,
        min_scale=min_scale,
        max_scale=max_scale,
    )


@preset
def tensorflow(
    initial_scale: float = 2.0**15,
    dynamic_growth_steps: int | None = None,
    dynamic: bool = True,
    *,
    min_scale: float = 1.0,
    max_scale: float = F32_MAX,
) -> LossScaler:
    """TensorFlow's ``tf.keras.mixed_precision.LossScaleOptimizer``.

    The dynamic rule, dividing by 2 and never below 1. ``dynamic=False`` is
    TensorFlow's fixed scale, which applies every step, finite or not.

    Example:
      >>> import jls
      >>> jls.presets.tensorflow(dynamic_growth_steps=100).growth_interval
      100
    """
    names = {"init_scale": "initial_scale", "value": "initial_scale"}
    if not flag("dynamic", dynamic):
        check(
            dynamic_growth_steps is None,
            "dynamic_growth_steps cannot be given when dynamic is False, got "
            f"{dynamic_growth_steps!r}",
        )
        return static_rule(names, initial_scale, skip_nonfinite=False)
    return dynamic_rule(
        dict(names, growth_interval="dynamic_growth_steps"),
        init_scale=initial_scale,
        growth_factor=2.0,
        backoff_divisor=2.0,
        growth_interval=2000 if dynamic_growth_steps is None else dynamic_growth_steps,
        min_scale=min_scale,
        max_scale=max_scale,
    )


@preset
def tensorflow_v1(
    initial_loss_scale: float = 2.0**15,
    increment_period: int = 2000,
    multiplier: float = 2.0,
    *,
    min_scale: float = 1.0,
    max_scale: float = F32_MAX,
) -> LossScaler:
    """TensorFlow 1's ``tf.compat.v1.mixed_precision.DynamicLossScale``.

    `tensorflow`'s rule with a free ``multiplier``, never below 1.

    Example:
      >>> import jls
      >>> jls.presets.tensorflow_v1(multiplier=3.0).backoff_divisor
      3.0
    """
    factor = real("multiplier", multiplier)
    check(factor >= 1, f"multiplier must be >= 1, got {factor!r}")
    return dynamic_rule(
        {
            "init_scale": "initial_loss_scale",
            "growth_factor": "multiplier",
            "backoff_divisor": "multiplier",
            "growth_interval": "increment_period",
        },
        init_scale=initial_loss_scale,
        growth_factor=factor,
        backoff_divisor=factor,
        growth_interval=increment_period,
        min_scale=min_scale,
        max_scale=max_scale,
    )
