"""The framework presets: each peer's loss scaler as configuration of jls's rule.

See `jls.presets` for what a preset promises. Every preset validates its
arguments under the framework's own names (the errors name them, prefixed
with the preset), then builds the scaler with `jls._scaler.make_dynamic` or
`make_static`, which name the fields they check through the preset's
mapping of jls's field names to the framework's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from jls._scaler import LossScaler, make_dynamic, make_static, no_scale
from jls._validate import F32_MAX, F32_TINY, I32_MAX, flag, integer, real

F = TypeVar("F", bound=Callable[..., Any])


def _preset(fn: F) -> F:
    """Prefixes the errors of ``fn`` with ``jls.presets.<name>:``."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (TypeError, ValueError) as err:
            raise type(err)(f"jls.presets.{fn.__name__}: {err}") from None

    return wrapped  # type: ignore[return-value]


def _named(names: Mapping[str, str]) -> Callable[[str], str]:
    """The framework's name for each jls field (its own where not renamed)."""
    return lambda field: names.get(field, field)


def _dynamic(names: Mapping[str, str], **fields: Any) -> LossScaler:
    return make_dynamic(_named(names), **fields)


def _static(
    names: Mapping[str, str], value: Any, skip_nonfinite: Any = True
) -> LossScaler:
    return make_static(_named(names), value, skip_nonfinite)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@_preset
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

    Growth on the ``growth_interval``-th consecutive finite step, skipped if
    the grown scale is not finite; back-off by ``backoff_factor`` on every
    non-finite step.

    Differences, only where torch breaks: torch has no floor, so repeated
    overflows take its float32 scale to 0, where it stays; and because torch
    checks the *scaled* gradients, below 2**-128 it applies steps whose
    unscaled gradients overflow. jls stops at ``min_scale`` (default the
    smallest normal float32, 2**-126) and checks the unscaled gradients.
    ``enabled=False`` is torch's pass-through: no scaling and no skipping
    (``jls.no_scale(skip_nonfinite=False)``).

    Example:
      >>> import jls
      >>> jls.presets.torch().init().scale
      Array(65536., dtype=float32)
    """
    if not flag("enabled", enabled):
        return no_scale(skip_nonfinite=False)
    growth = real("growth_factor", growth_factor)
    backoff = real("backoff_factor", backoff_factor)
    _check(growth > 1.0, f"growth_factor must be > 1.0, got {growth!r}")
    _check(backoff < 1.0, f"backoff_factor must be < 1.0, got {backoff!r}")
    return _dynamic(
        {},
        init_scale=init_scale,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=growth_interval,
        min_scale=min_scale,
        max_scale=max_scale,
    )


@_preset
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

    The defaults are ``GradScaler``'s in current Paddle (its signature; Paddle
    2.2 and ``AmpScaler`` used ``init_loss_scaling=2**15``,
    ``incr_every_n_steps=1000``). The dynamic rule is the dygraph
    ``_update``: ``incr_count``/``decr_count``, a finite step clears
    ``decr_count``, back-off once every ``decr_every_n_nan_or_inf``
    consecutive non-finite steps, growth on the ``incr_every_n_steps``-th
    consecutive finite step. (``AmpScaler``'s documentation lists
    ``decr_every_n_nan_or_inf``'s default as 2 while its signature says 1;
    pass the value you used.)

    Differences, only where Paddle breaks: the dygraph scaler has no floor
    and no growth guard, so its float32 scale can reach 0 or inf and stay
    there. jls keeps it in ``[min_scale, max_scale]`` (by default the normal
    float32 range), skipping a growth that would leave it. (Paddle's static
    ``update_loss_scaling`` op floors at 1: pass ``min_scale=1`` for that.)
    ``use_dynamic_loss_scaling=False`` is a fixed scale that still skips
    non-finite steps, as Paddle's ``minimize`` does; ``enable=False`` is a
    pass-through (no scaling, no skipping).

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
        return _static(names, init_loss_scaling)
    incr = real("incr_ratio", incr_ratio)
    decr = real("decr_ratio", decr_ratio)
    _check(incr > 1.0, f"incr_ratio must be > 1.0, got {incr!r}")
    _check(decr < 1.0, f"decr_ratio must be < 1.0, got {decr!r}")
    return _dynamic(
        names,
        init_scale=init_loss_scaling,
        growth_factor=incr,
        backoff_factor=decr,
        growth_interval=incr_every_n_steps,
        backoff_interval=decr_every_n_nan_or_inf,
        min_scale=min_scale,
        max_scale=max_scale,
    )


@_preset
def mindspore(
    init_loss_scale: float = 2.0**24,
    scale_factor: float = 2,
    scale_window: int = 2000,
    *,
    min_scale: float = 1.0,
    max_scale: float = F32_MAX,
) -> LossScaler:
    """MindSpore's ``DynamicLossScaleManager``.

    From its ``update_loss_scale``: every overflow multiplies the scale by
    ``1 / scale_factor``, never below 1 (its docstring says the scale
    decreases "per scale_window"; the code backs off on every overflow),
    and the scale grows by ``scale_factor`` on the ``scale_window``-th step
    counted from the last overflow (``(cur_iter - last_overflow_iter) %
    scale_window == 0``), i.e. every ``scale_window`` consecutive finite
    steps. Overflow steps are always dropped.

    Differences, only where MindSpore breaks: its growth is unguarded, so the
    scale grows to inf; jls stops at ``max_scale``. Its scale is a float64
    Python number: for a ``scale_factor`` that is not a power of two, jls's
    float32 scale can differ in the last bits. MindSpore raises after 1000
    consecutive overflows (more than ``bad_step_max``); for the same error
    make the transformation with
    ``jls.loss_scaling(..., max_consecutive_skips=1001)`` and call
    ``jls.raise_if_diverged(opt_state)``.

    Example:
      >>> import jls
      >>> float(jls.presets.mindspore().init().scale) == 2.0**24
      True
    """
    init = real("init_loss_scale", init_loss_scale)
    _check(init >= 1.0, f"init_loss_scale must be >= 1, got {init!r}")
    factor = real("scale_factor", scale_factor)
    _check(factor > 0, f"scale_factor must be > 0, got {factor!r}")
    _check(factor >= 1, f"scale_factor must be >= 1 in jls, got {factor!r}")
    window = integer("scale_window", scale_window, 1)
    return _dynamic(
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


@_preset
def mindspore_fixed(
    loss_scale: float = 128.0, drop_overflow_update: bool = True
) -> LossScaler:
    """MindSpore's ``FixedLossScaleManager``: a fixed scale.

    ``drop_overflow_update=False`` applies overflow steps anyway.

    Example:
      >>> import jls
      >>> jls.presets.mindspore_fixed(1024.0, False).skip_nonfinite
      False
    """
    value = real("loss_scale", loss_scale)
    _check(value >= 1, f"loss_scale must be >= 1, got {value!r}")
    drop = flag("drop_overflow_update", drop_overflow_update)
    return _static({"value": "loss_scale"}, value, skip_nonfinite=drop)


@_preset
def nnabla(
    scale: float = 8.0,
    scaling_factor: float = 2.0,
    N: int = 2000,  # noqa: N803 (nnabla's own name)
    *,
    min_scale: float = F32_TINY,
    max_scale: float = F32_MAX,
) -> LossScaler:
    """The nnabla ``DynamicLossScalingUpdater``.

    From its ``update``: an overflow divides the scale by ``scaling_factor``
    and resets the counter; after each applied update, ``if counter > N``
    the scale is multiplied by ``scaling_factor`` and the counter reset, then
    the counter is incremented. So the first growth comes on the ``N + 2``-th
    consecutive finite step after the start or an overflow and later ones
    every ``N + 1`` steps (its docstring says "every N iterations"); here
    ``growth_interval=N + 1, first_growth_interval=N + 2``.

    nnabla recomputes an overflowed step with the backed-off scale instead of
    skipping it; the sequence of scales over the gradient evaluations is the
    same. Differences, only where nnabla breaks: no floor, so the scale can
    reach 0; jls stops at ``min_scale``. Its scale is a float64 Python number
    (see the module notes).

    Example:
      >>> import jls
      >>> s = jls.presets.nnabla(N=2)
      >>> s.growth_interval, s.first_growth_interval
      (3, 4)
    """
    n = integer("N", N, 0, I32_MAX - 2)  # the first growth comes on step N + 2
    factor = real("scaling_factor", scaling_factor)
    _check(factor >= 1, f"scaling_factor must be >= 1, got {factor!r}")
    return _dynamic(
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


@_preset
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
    return _dynamic(
        {"init_scale": "initial_scale", "growth_interval": "dynamic_growth_steps"},
        init_scale=initial_scale,
        growth_factor=2.0,
        backoff_divisor=2.0,
        growth_interval=dynamic_growth_steps,
        min_scale=min_scale,
        max_scale=max_scale,
    )


@_preset
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
        _check(
            dynamic_growth_steps is None,
            "dynamic_growth_steps cannot be given when dynamic is False, got "
            f"{dynamic_growth_steps!r}",
        )
        return _static(names, initial_scale, skip_nonfinite=False)
    return _dynamic(
        dict(names, growth_interval="dynamic_growth_steps"),
        init_scale=initial_scale,
        growth_factor=2.0,
        backoff_divisor=2.0,
        growth_interval=2000 if dynamic_growth_steps is None else dynamic_growth_steps,
        min_scale=min_scale,
        max_scale=max_scale,
    )


@_preset
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
    _check(factor >= 1, f"multiplier must be >= 1, got {factor!r}")
    return _dynamic(
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


@_preset
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

    Megatron's class has no defaults; these are the ones its training
    arguments pass (``--initial-loss-scale 2**32``, ``--min-loss-scale 1``,
    ``--loss-scale-window 1000``, ``--hysteresis 2``, factors 2 and 0.5).
    Each non-finite step resets the growth tracker and spends one unit of
    hysteresis; once spent, every non-finite step backs off (never below
    ``min_scale``) until a growth, on the ``growth_interval``-th consecutive
    finite step, restores it.

    Differences, only where Megatron breaks: its growth is unguarded (the
    scale can reach inf); jls stops at ``max_scale``.

    Example:
      >>> import jls
      >>> jls.presets.megatron().hysteresis
      2
    """
    growth = real("growth_factor", growth_factor)
    backoff = real("backoff_factor", backoff_factor)
    _check(growth > 1.0, f"growth_factor must be > 1.0, got {growth!r}")
    _check(0.0 < backoff < 1.0, f"backoff_factor must be in (0, 1), got {backoff!r}")
    return _dynamic(
        {"init_scale": "initial_scale"},
        init_scale=initial_scale,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=min_scale,
        max_scale=max_scale,
    )


@_preset
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

    ``init_scale`` (default 2**32) or the config's ``initial_scale_power``;
    ``delayed_shift`` or the config's ``hysteresis`` (default 1). An overflow
    either spends one unit of hysteresis or, once spent, divides the scale by
    ``scale_factor`` (never below ``min_scale``); the scale grows by
    ``scale_factor`` when the finite steps since the last overflow, less one,
    are a positive multiple of ``scale_window``: the first growth after the
    start or an overflow comes on the ``scale_window + 1``-th finite step,
    later ones every ``scale_window`` (here
    ``first_growth_interval=scale_window + 1``). A growth restores the
    hysteresis; with ``consecutive_hysteresis`` any finite step does.

    Differences: DeepSpeed's growth is unguarded (its scale can reach inf);
    jls stops at ``max_scale``. DeepSpeed raises when an overflow comes at
    ``min_scale`` with ``raise_error_at_min_scale``; the scaler cannot raise
    (the argument is validated and otherwise unused). jls keeps skipping at
    ``min_scale``; to stop the run, use
    ``jls.loss_scaling(..., max_consecutive_skips=n)`` with
    ``jls.raise_if_diverged`` (on the host, or inside ``jit`` under checkify). The
    scale is a float64 Python number in DeepSpeed (see the module notes).

    Example:
      >>> import jls
      >>> s = jls.presets.deepspeed(initial_scale_power=16, scale_window=2)
      >>> float(s.init().scale), s.first_growth_interval
      (65536.0, 3)
    """
    if init_scale is not None and initial_scale_power is not None:
        raise ValueError(
            "give init_scale or initial_scale_power, not both; "
            f"got {init_scale!r} and {initial_scale_power!r}"
        )
    if initial_scale_power is not None:
        power = integer("initial_scale_power", initial_scale_power, -126)
        _check(
            power <= 127,
            f"initial_scale_power must be <= 127 (float32), got {power!r}",
        )
        init_scale = 2.0**power
    if delayed_shift is not None and hysteresis is not None:
        _check(
            delayed_shift == hysteresis,
            "delayed_shift and hysteresis are the same setting; got "
            f"{delayed_shift!r} and {hysteresis!r}",
        )
    shift = next((h for h in (delayed_shift, hysteresis) if h is not None), 1)
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
    return _dynamic(
        names,
        init_scale=2.0**32 if init_scale is None else init_scale,
        growth_factor=factor,
        backoff_divisor=factor,
        growth_interval=window,
        first_growth_interval=window + 1,
        hysteresis=shift,
        consecutive_hysteresis=flag("consecutive_hysteresis", consecutive_hysteresis),
        min_scale=min_scale,
        max_scale=max_scale,
    )


@_preset
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

    The scale grows by ``factor`` on the ``period``-th consecutive finite
    step (``counter == period - 1``) and is divided by ``factor`` on a
    non-finite step, never below ``min_loss_scale``. ``counter`` is the
    count of a run being resumed.

    Differences (measured against jmp 0.0.4 under ``jit`` in
    ``tests/test_live_peers.py``): jmp's hand-written ``tree_flatten`` drops
    ``min_loss_scale``, so once its state crosses a ``jit`` boundary its floor
    silently becomes 1.0; jls honours the ``min_loss_scale`` you pass. jmp
    backs off with ``x / factor``, which XLA compiles into ``x * (1 /
    factor)``: for a factor that is not a power of two its scale can be one
    float32 ulp off the exact quotient (factor 3 from 2**15: jmp 3640.8892,
    jls 3640.889); jls divides exactly. For power-of-two factors (the
    default 2) the trajectories are bitwise equal. Like jls, jmp only grows
    to a finite scale.

    Example:
      >>> import jls
      >>> float(jls.presets.jmp(2.0**15, counter=5).init().growth_count)
      5.0
    """
    period = integer("period", period, 1)
    return _dynamic(
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


@_preset
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

    flax grows when ``fin_steps == growth_interval`` *before* the step, so
    growth comes on the ``growth_interval + 1``-th consecutive finite step
    (here ``growth_interval + 1``), and a growth past the float32 maximum
    lands on it (``saturate_growth``). Back-off multiplies by
    ``backoff_factor``, never below ``minimum_scale`` (``None``: no floor).

    Differences: with ``minimum_scale=None`` flax's scale can reach 0; jls
    stops at the smallest normal float32. (flax's weakly typed default scale
    retraces once and can overflow a float16 loss on step 1; jls's state is
    always a committed float32.)

    Example:
      >>> import jls
      >>> jls.presets.flax().growth_interval
      2001
    """
    interval = integer("growth_interval", growth_interval, 0)
    fin = integer("fin_steps", fin_steps, 0)
    _check(
        fin <= interval,
        f"fin_steps must be in [0, growth_interval={interval}], got {fin!r}",
    )
    return _dynamic(
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
