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

    The scale doubles on the ``dynamic_growth_steps``-th consecutive finite
    step and is divided by 2 on every non-finite step.

    Differences, only where Keras breaks (measured against Keras 3.15 with
    the JAX backend in ``tests/test_live_peers.py``): no floor and no growth
    guard, so the scale can reach 0 (then 0/0 writes nan into the weights on
    every step) or inf (then every step is skipped forever); jls keeps it in
    ``[min_scale, max_scale]``. Keras checks the *scaled* gradients, so below
    scale 1 it applies a step whose unscaled gradients overflow (inf
    weights); jls checks the unscaled gradients and skips it.

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

    Dynamic: the scale doubles on the ``dynamic_growth_steps``-th (default
    2000) consecutive finite step unless the result is not finite, and is
    divided by 2 on a non-finite step, never below 1. This is jls's own rule;
    only the floor, 1, and the division differ from `jls.dynamic_scale`'s
    defaults. ``dynamic=False`` is TensorFlow's fixed scale, which applies
    every step, finite or not.

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

    The rule of `tensorflow` with a free ``multiplier``: growth by
    ``multiplier`` on the ``increment_period``-th consecutive finite step
    unless the result is not finite; division by ``multiplier`` on a
    non-finite step, never below 1.

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
