"""Presets of the deep-learning frameworks: PyTorch, Paddle, MindSpore, nnabla."""

from __future__ import annotations

from jls._rule import LossScaler
from jls._static import no_scale
from jls._validate import F32_MAX, F32_TINY, I32_MAX, flag, integer, real
from jls.presets._common import check, dynamic_rule, preset, static_rule


@preset
def torch(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    enabled: bool = True,
    *,
    min_scale: float = F32_TINY,
    max_scale: float = F32_MAX,
) -> LossScaler:
    """PyTorch's ``torch.amp.GradScaler``.

    torch has no floor (its scale can reach 0) and checks the *scaled*
    gradients; jls stops at ``min_scale`` and checks the unscaled ones.
    ``enabled=False`` is ``jls.no_scale(skip_nonfinite=False)``.

    Example:
      >>> import jls
      >>> jls.presets.torch().init().scale
      Array(65536., dtype=float32)
    """
    if not flag("enabled", enabled):
        return no_scale(skip_nonfinite=False)
    growth = real("growth_factor", growth_factor)
    backoff = real("backoff_factor", backoff_factor)
    check(growth > 1.0, f"growth_factor must be > 1.0, got {growth!r}")
    check(backoff < 1.0, f"backoff_factor must be < 1.0, got {backoff!r}")
    return dynamic_rule(
        {},
        init_scale=init_scale,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=growth_interval,
        min_scale=min_scale,
        max_scale=max_scale,
    )


@preset
def paddle(
    enable: bool = True,
    init_loss_scaling: float = 65536.0,
    incr_ratio: float = 2.0,
    decr_ratio: float = 0.5,
    incr_every_n_steps: int = 2000,
    decr_every_n_nan_or_inf: int = 1,
    use_dynamic_loss_scaling: bool = True,
    *,
    min_scale: float = F32_TINY,
    max_scale: float = F32_MAX,
) -> LossScaler:
    """Paddle's ``paddle.amp.GradScaler`` (and the older ``AmpScaler``).

    The defaults are current ``GradScaler``'s (``AmpScaler``'s differ: pass
    yours). Its scale can reach 0 or inf; jls keeps it in ``[min_scale,
    max_scale]`` (the static ``update_loss_scaling`` op floors at 1).
    ``use_dynamic_loss_scaling=False`` is a fixed scale that still skips
    non-finite steps; ``enable=False`` is a pass-through.

    Example:
      >>> import jls
      >>> jls.presets.paddle(init_loss_scaling=1024).init().scale
      Array(1024., dtype=float32)
    """
    if not flag("enable", enable):
        return no_scale(skip_nonfinite=False)
    names = {
        "init_scale": "init_loss_scaling",
        "value": "init_loss_scaling",
        "growth_factor": "incr_ratio",
        "backoff_factor": "decr_ratio",
        "growth_interval": "incr_every_n_steps",
        "backoff_interval": "decr_every_n_nan_or_inf",
    }
    if not flag("use_dynamic_loss_scaling", use_dynamic_loss_scaling):
        return static_rule(names, init_loss_scaling)
    incr = real("incr_ratio", incr_ratio)
    decr = real("decr_ratio", decr_ratio)
    check(incr > 1.0, f"incr_ratio must be > 1.0, got {incr!r}")
    check(decr < 1.0, f"decr_ratio must be < 1.0, got {decr!r}")
    return dynamic_rule(
        names,
        init_scale=init_loss_scaling,
        growth_factor=incr,
        backoff_factor=decr,
        growth_interval=incr_every_n_steps,
        backoff_interval=decr_every_n_nan_or_inf,
        min_scale=min_scale,
        max_scale=max_scale,
    )


@preset
def mindspore(
    init_loss_scale: float = 2.0**24,
    scale_factor: float = 2,
    scale_window: int = 2000,
    *,
    min_scale: float = 1.0,
    max_scale: float = F32_MAX,
) -> LossScaler:
    """MindSpore's ``DynamicLossScaleManager``.

    As its code does, every overflow divides the scale by ``scale_factor``,
    never below 1; jls stops growth at ``max_scale``. MindSpore raises after
    1000 consecutive overflows: pass ``max_consecutive_skips=1001`` to
    `jls.loss_scaling` and call `jls.hooks.raise_if_diverged`.

    Example:
      >>> import jls
      >>> float(jls.presets.mindspore().init().scale) == 2.0**24
      True
    """
    init = real("init_loss_scale", init_loss_scale)
    check(init >= 1.0, f"init_loss_scale must be >= 1, got {init!r}")
    factor = real("scale_factor", scale_factor)
    check(factor > 0, f"scale_factor must be > 0, got {factor!r}")
    check(factor >= 1, f"scale_factor must be >= 1 in jls, got {factor!r}")
    window = integer("scale_window", scale_window, 1)
    return dynamic_rule(
        {
            "init_scale": "init_loss_scale",
            "growth_factor": "scale_factor",
            "backoff_factor": "1 / scale_factor",
            "growth_interval": "scale_window",
        },
        init_scale=init,
        growth_factor=factor,
        backoff_factor=1 / factor,
        growth_interval=window,
        min_scale=min_scale,
        max_scale=max_scale,
    )


@preset
def mindspore_fixed(
    loss_scale: float = 128.0, drop_overflow_update: bool = True
) -> LossScaler:
    """MindSpore's ``FixedLossScaleManager``: a fixed scale.

    Example:
      >>> import jls
      >>> jls.presets.mindspore_fixed(1024.0, False).skip_nonfinite
      False
    """
    value = real("loss_scale", loss_scale)
    check(value >= 1, f"loss_scale must be >= 1, got {value!r}")
    drop = flag("drop_overflow_update", drop_overflow_update)
    return static_rule({"value": "loss_scale"}, value, skip_nonfinite=drop)


@preset
def nnabla(
    scale: float = 8.0,
    scaling_factor: float = 2.0,
    N: int = 2000,  # noqa: N803 (nnabla's own name)
    *,
    min_scale: float = F32_TINY,
    max_scale: float = F32_MAX,
) -> LossScaler:
    """The nnabla ``DynamicLossScalingUpdater``.

    The first growth comes on the ``N + 2``-th consecutive finite step, later
    ones every ``N + 1``, as its code does. It has no floor; jls stops at
    ``min_scale``.

    Example:
      >>> import jls
      >>> s = jls.presets.nnabla(N=2)
      >>> s.growth_interval, s.first_growth_interval
      (3, 4)
    """
    n = integer("N", N, 0, I32_MAX - 2)  # the first growth comes on step N + 2
    factor = real("scaling_factor", scaling_factor)
    check(factor >= 1, f"scaling_factor must be >= 1, got {factor!r}")
    return dynamic_rule(
        {
            "init_scale": "scale",
            "growth_factor": "scaling_factor",
            "backoff_divisor": "scaling_factor",
        },
        init_scale=scale,
        growth_factor=factor,
        backoff_divisor=factor,
        growth_interval=n + 1,
        first_growth_interval=n + 2,
        min_scale=min_scale,
        max_scale=max_scale,
    )
