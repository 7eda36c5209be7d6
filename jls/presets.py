"""Presets: every peer framework's loss scaler, as configuration of jls's rule.

Each preset takes the framework's own argument names and defaults and returns
a `jls.LossScaler` whose scale trajectory, for any sequence of finite and
non-finite steps, is the framework's exactly while the framework stays sane.
Where the framework breaks (the scale reaching 0 or inf and staying there),
jls keeps the scale finite and positive; each docstring says where. Every
preset also takes jls's ``min_scale`` and ``max_scale`` to override those
bounds.

The semantics were worked out from the frameworks' code, not their prose,
where the two disagree (each docstring notes it). Frameworks that keep the
scale in float64 Python numbers (MindSpore's manager, DeepSpeed, nnabla) are
matched exactly for power-of-two factors (their defaults); with other factors
jls's float32 scale can differ from theirs in the last bits.

State interchange: ``to_torch_state_dict``/``from_torch_state_dict``, the same
for Paddle, and ``to_megatron_state_dict``/``from_megatron_state_dict`` carry
a run's scale and counters to and from those frameworks' checkpoints; pair
them with `jls.replace_loss_scale_state` to put the state into an optimizer
state.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from jls._scaler import LossScaler, dynamic_scale, no_scale, static_scale
from jls._state import LossScaleState, loss_scale_state, make_state
from jls._validate import flag, integer, real

__all__ = [
    "deepspeed",
    "flax",
    "from_megatron_state_dict",
    "from_paddle_state_dict",
    "from_torch_state_dict",
    "jmp",
    "keras",
    "megatron",
    "mindspore",
    "mindspore_fixed",
    "nnabla",
    "paddle",
    "tensorflow",
    "tensorflow_v1",
    "to_megatron_state_dict",
    "to_paddle_state_dict",
    "to_torch_state_dict",
    "torch",
]

F32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32
F32_MAX = float(np.finfo(np.float32).max)
_JLS_NAMES = re.compile(
    r"\b(init_scale|growth_factor|backoff_factor|backoff_divisor|growth_interval|"
    r"first_growth_interval|init_growth_count|backoff_interval|hysteresis|"
    r"consecutive_hysteresis|min_scale|value)\b"
)


def _build(peer: str, names: dict[str, str], make: Any, **kwargs: Any) -> LossScaler:
    """Calls a jls factory, renaming jls's argument names in its errors."""
    try:
        return make(**kwargs)
    except (TypeError, ValueError) as err:
        message = _JLS_NAMES.sub(lambda m: names.get(m.group(1), m.group(1)), str(err))
        raise type(err)(f"jls.presets.{peer}: {message}") from None


def _check(peer: str, ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"jls.presets.{peer}: {message}")


def _flag(peer: str, name: str, value: Any) -> bool:
    return flag(f"jls.presets.{peer}: {name}", value)


def _int(peer: str, name: str, value: Any, minimum: int) -> int:
    return integer(f"jls.presets.{peer}: {name}", value, minimum)


def _real(peer: str, name: str, value: Any) -> float:
    return real(f"jls.presets.{peer}: {name}", value)


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
    peer = "torch"
    if not _flag(peer, "enabled", enabled):
        return no_scale(skip_nonfinite=False)
    growth = _real(peer, "growth_factor", growth_factor)
    backoff = _real(peer, "backoff_factor", backoff_factor)
    _check(peer, growth > 1.0, f"growth_factor must be > 1.0, got {growth!r}")
    _check(peer, backoff < 1.0, f"backoff_factor must be < 1.0, got {backoff!r}")
    return _build(
        peer,
        {},
        dynamic_scale,
        init_scale=init_scale,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=growth_interval,
        min_scale=min_scale,
        max_scale=max_scale,
    )


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
    peer = "paddle"
    if not _flag(peer, "enable", enable):
        return no_scale(skip_nonfinite=False)
    names = {
        "init_scale": "init_loss_scaling",
        "value": "init_loss_scaling",
        "growth_factor": "incr_ratio",
        "backoff_factor": "decr_ratio",
        "growth_interval": "incr_every_n_steps",
        "backoff_interval": "decr_every_n_nan_or_inf",
    }
    if not _flag(peer, "use_dynamic_loss_scaling", use_dynamic_loss_scaling):
        return _build(peer, names, static_scale, value=init_loss_scaling)
    incr = _real(peer, "incr_ratio", incr_ratio)
    decr = _real(peer, "decr_ratio", decr_ratio)
    _check(peer, incr > 1.0, f"incr_ratio must be > 1.0, got {incr!r}")
    _check(peer, decr < 1.0, f"decr_ratio must be < 1.0, got {decr!r}")
    return _build(
        peer,
        names,
        dynamic_scale,
        init_scale=init_loss_scaling,
        growth_factor=incr,
        backoff_factor=decr,
        growth_interval=incr_every_n_steps,
        backoff_interval=decr_every_n_nan_or_inf,
        min_scale=min_scale,
        max_scale=max_scale,
    )


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
    peer = "mindspore"
    init = _real(peer, "init_loss_scale", init_loss_scale)
    _check(peer, init >= 1.0, f"init_loss_scale must be >= 1, got {init!r}")
    factor = _real(peer, "scale_factor", scale_factor)
    _check(peer, factor > 0, f"scale_factor must be > 0, got {factor!r}")
    _check(peer, factor >= 1, f"scale_factor must be >= 1 in jls, got {factor!r}")
    window = _int(peer, "scale_window", scale_window, 1)
    return _build(
        peer,
        {"init_scale": "init_loss_scale", "growth_interval": "scale_window"},
        dynamic_scale,
        init_scale=init,
        growth_factor=factor,
        backoff_factor=1 / factor,
        growth_interval=window,
        min_scale=min_scale,
        max_scale=max_scale,
    )


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
    peer = "mindspore_fixed"
    value = _real(peer, "loss_scale", loss_scale)
    _check(peer, value >= 1, f"loss_scale must be >= 1, got {value!r}")
    drop = _flag(peer, "drop_overflow_update", drop_overflow_update)
    return _build(
        peer, {"value": "loss_scale"}, static_scale, value=value, skip_nonfinite=drop
    )


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
    peer = "nnabla"
    n = _int(peer, "N", N, 0)
    factor = _real(peer, "scaling_factor", scaling_factor)
    _check(peer, factor >= 1, f"scaling_factor must be >= 1, got {factor!r}")
    return _build(
        peer,
        {"init_scale": "scale", "growth_factor": "scaling_factor"},
        dynamic_scale,
        init_scale=scale,
        growth_factor=factor,
        backoff_divisor=factor,
        growth_interval=n + 1,
        first_growth_interval=n + 2,
        min_scale=min_scale,
        max_scale=max_scale,
    )


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
    return _build(
        "keras",
        {"init_scale": "initial_scale", "growth_interval": "dynamic_growth_steps"},
        dynamic_scale,
        init_scale=initial_scale,
        growth_factor=2.0,
        backoff_divisor=2.0,
        growth_interval=dynamic_growth_steps,
        min_scale=min_scale,
        max_scale=max_scale,
    )


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
    peer = "tensorflow"
    names = {"init_scale": "initial_scale", "value": "initial_scale"}
    if not _flag(peer, "dynamic", dynamic):
        _check(
            peer,
            dynamic_growth_steps is None,
            "dynamic_growth_steps cannot be given when dynamic is False, got "
            f"{dynamic_growth_steps!r}",
        )
        return _build(
            peer, names, static_scale, value=initial_scale, skip_nonfinite=False
        )
    return _build(
        peer,
        dict(names, growth_interval="dynamic_growth_steps"),
        dynamic_scale,
        init_scale=initial_scale,
        growth_factor=2.0,
        backoff_divisor=2.0,
        growth_interval=2000 if dynamic_growth_steps is None else dynamic_growth_steps,
        min_scale=min_scale,
        max_scale=max_scale,
    )


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
    peer = "tensorflow_v1"
    factor = _real(peer, "multiplier", multiplier)
    _check(peer, factor >= 1, f"multiplier must be >= 1, got {factor!r}")
    return _build(
        peer,
        {"init_scale": "initial_loss_scale", "growth_interval": "increment_period"},
        dynamic_scale,
        init_scale=initial_loss_scale,
        growth_factor=factor,
        backoff_divisor=factor,
        growth_interval=increment_period,
        min_scale=min_scale,
        max_scale=max_scale,
    )


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
    peer = "megatron"
    growth = _real(peer, "growth_factor", growth_factor)
    backoff = _real(peer, "backoff_factor", backoff_factor)
    _check(peer, growth > 1.0, f"growth_factor must be > 1.0, got {growth!r}")
    _check(
        peer, 0.0 < backoff < 1.0, f"backoff_factor must be in (0, 1), got {backoff!r}"
    )
    return _build(
        peer,
        {"init_scale": "initial_scale"},
        dynamic_scale,
        init_scale=initial_scale,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=growth_interval,
        hysteresis=hysteresis,
        min_scale=min_scale,
        max_scale=max_scale,
    )


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
    ``jls.raise_if_diverged`` (a host error) or ``jls.checkify_divergence``. The
    scale is a float64 Python number in DeepSpeed (see the module notes).

    Example:
      >>> import jls
      >>> s = jls.presets.deepspeed(initial_scale_power=16, scale_window=2)
      >>> float(s.init().scale), s.first_growth_interval
      (65536.0, 3)
    """
    peer = "deepspeed"
    if init_scale is not None and initial_scale_power is not None:
        raise ValueError(
            f"jls.presets.{peer}: give init_scale or initial_scale_power, not both; "
            f"got {init_scale!r} and {initial_scale_power!r}"
        )
    if initial_scale_power is not None:
        power = _int(peer, "initial_scale_power", initial_scale_power, -126)
        _check(
            peer,
            power <= 127,
            f"initial_scale_power must be <= 127 (float32), got {power!r}",
        )
        init_scale = 2.0**power
    if delayed_shift is not None and hysteresis is not None:
        _check(
            peer,
            delayed_shift == hysteresis,
            "delayed_shift and hysteresis are the same setting; got "
            f"{delayed_shift!r} and {hysteresis!r}",
        )
    shift = next((h for h in (delayed_shift, hysteresis) if h is not None), 1)
    _flag(peer, "raise_error_at_min_scale", raise_error_at_min_scale)
    window = _int(peer, "scale_window", scale_window, 1)
    factor = _real(peer, "scale_factor", scale_factor)
    return _build(
        peer,
        {
            "growth_factor": "scale_factor",
            "backoff_divisor": "scale_factor",
            "growth_interval": "scale_window",
            "hysteresis": "delayed_shift",
        },
        dynamic_scale,
        init_scale=2.0**32 if init_scale is None else init_scale,
        growth_factor=factor,
        backoff_divisor=factor,
        growth_interval=window,
        first_growth_interval=window + 1,
        hysteresis=shift,
        consecutive_hysteresis=_flag(
            peer, "consecutive_hysteresis", consecutive_hysteresis
        ),
        min_scale=min_scale,
        max_scale=max_scale,
    )


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
    peer = "jmp"
    period = _int(peer, "period", period, 1)
    return _build(
        peer,
        {
            "init_scale": "loss_scale",
            "growth_factor": "factor",
            "backoff_divisor": "factor",
            "growth_interval": "period",
            "init_growth_count": "counter",
            "min_scale": "min_loss_scale",
        },
        dynamic_scale,
        init_scale=loss_scale,
        growth_factor=factor,
        backoff_divisor=factor,
        growth_interval=period,
        init_growth_count=counter,
        min_scale=min_loss_scale,
        max_scale=max_scale,
    )


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
    peer = "flax"
    interval = _int(peer, "growth_interval", growth_interval, 0)
    fin = _int(peer, "fin_steps", fin_steps, 0)
    _check(
        peer,
        fin <= interval,
        f"fin_steps must be in [0, growth_interval={interval}], got {fin!r}",
    )
    return _build(
        peer,
        {"init_scale": "scale", "min_scale": "minimum_scale"},
        dynamic_scale,
        init_scale=scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=interval + 1,
        init_growth_count=fin,
        saturate_growth=True,
        min_scale=F32_TINY if minimum_scale is None else minimum_scale,
        max_scale=max_scale,
    )


# State interchange ---------------------------------------------------------


def _scalar(name: str, value: Any) -> float:
    """A state dict's number: a real scalar, or an array of one element.

    Paddle keeps ``scale`` as a shape-[1] tensor (or a one-element list);
    strings and bools are refused.
    """
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, (numbers.Number, np.generic, str)) and hasattr(
        value, "__array__"
    ):
        array = np.asarray(value)
        if array.size == 1:
            value = array.reshape(())
    return real(name, value)


def _state_dict(peer: str, state_dict: Any) -> Mapping[str, Any]:
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"jls.presets.from_{peer}_state_dict: state_dict must be a dict (the "
            f"scaler's state_dict()), got {type(state_dict).__name__}: "
            f"{state_dict!r:.200}"
        )
    return state_dict


def _disabled(scaler: LossScaler) -> bool:
    """Whether ``scaler`` is torch's ``enabled=False`` / Paddle's ``enable=False``."""
    return scaler == no_scale(skip_nonfinite=False)


def to_torch_state_dict(scaler: LossScaler, state: Any) -> dict[str, Any]:
    """The ``torch.amp.GradScaler.state_dict()`` of a jls run.

    Args:
      scaler: the run's scaler (its config fills torch's config keys).
      state: its `LossScaleState`, or an optimizer state containing one.

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
    state = loss_scale_state(state)
    if _disabled(scaler):
        return {}
    return {
        "scale": _scalar("state.scale", state.scale),
        "growth_factor": scaler.growth_factor,
        "backoff_factor": scaler.backoff_factor,
        "growth_interval": scaler.growth_interval,
        "_growth_tracker": int(state.growth_count),
    }


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
    state_dict = _state_dict("torch", state_dict)
    if not state_dict or not _flag("torch", "enabled", kwargs.get("enabled", True)):
        scaler = torch(**dict(kwargs, enabled=False))
        return scaler, scaler.init()
    scale = _scalar("state_dict['scale']", state_dict["scale"])
    tracker = _int("torch", "_growth_tracker", state_dict["_growth_tracker"], 0)
    scaler = torch(
        init_scale=scale,
        growth_factor=state_dict["growth_factor"],
        backoff_factor=state_dict["backoff_factor"],
        growth_interval=state_dict["growth_interval"],
        **kwargs,
    )
    _check(
        "torch",
        tracker < scaler.growth_interval,
        f"_growth_tracker must be < growth_interval, got {tracker!r}",
    )
    return scaler, make_state(scale, growth_count=tracker)


def to_paddle_state_dict(scaler: LossScaler, state: Any) -> dict[str, Any]:
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
    state = loss_scale_state(state)
    if _disabled(scaler):
        return {}
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
    state_dict = _state_dict("paddle", state_dict)
    if not state_dict or not _flag("paddle", "enable", kwargs.get("enable", True)):
        scaler = paddle(**dict(kwargs, enable=False))
        return scaler, scaler.init()
    scale = _scalar("state_dict['scale']", state_dict["scale"])
    dynamic = _flag(
        "paddle",
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
    if not dynamic:
        return scaler, scaler.init()
    incr = _int("paddle", "incr_count", state_dict["incr_count"], 0)
    decr = _int("paddle", "decr_count", state_dict["decr_count"], 0)
    _check(
        "paddle",
        incr < scaler.growth_interval,
        f"incr_count must be < incr_every_n_steps, got {incr!r}",
    )
    _check(
        "paddle",
        decr < max(1, scaler.backoff_interval),
        f"decr_count must be < decr_every_n_nan_or_inf, got {decr!r}",
    )
    return scaler, make_state(scale, growth_count=incr, backoff_count=decr)


def to_megatron_state_dict(scaler: LossScaler, state: Any) -> dict[str, Any]:
    """The ``DynamicGradScaler.state_dict()`` of a jls run.

    ``{"scale", "growth_tracker", "hysteresis_tracker"}``; Megatron keeps its
    config in its training arguments, not in this dict.

    Example:
      >>> import jls
      >>> scaler = jls.presets.megatron()
      >>> jls.presets.to_megatron_state_dict(scaler, scaler.init())
      {'scale': 4294967296.0, 'growth_tracker': 0, 'hysteresis_tracker': 2}
    """
    state = loss_scale_state(state)
    return {
        "scale": _scalar("state.scale", state.scale),
        "growth_tracker": int(state.growth_count),
        "hysteresis_tracker": scaler.hysteresis - int(state.backoff_count),
    }


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
    state_dict = _state_dict("megatron", state_dict)
    scale = _scalar("state_dict['scale']", state_dict["scale"])
    scaler = megatron(initial_scale=scale, **kwargs)
    tracker = _int("megatron", "growth_tracker", state_dict["growth_tracker"], 0)
    _check(
        "megatron",
        tracker < scaler.growth_interval,
        f"growth_tracker must be < growth_interval, got {tracker!r}",
    )
    hyst = _int(
        "megatron", "hysteresis_tracker", state_dict["hysteresis_tracker"], -(2**31)
    )
    spent = min(max(scaler.hysteresis - int(hyst), 0), scaler.hysteresis)
    return scaler, make_state(scale, growth_count=tracker, backoff_count=spent)
