"""Loss scalers: immutable configurations of the one loss-scale rule.

Every scaler is a `LossScaler`: a frozen, hashable dataclass validated when
made. Its pure methods ``init()`` and ``adjust(state, grads_finite)`` are the
whole state machine; nothing about the configuration is ever stored in the
state, so it cannot be lost through ``jit`` or a checkpoint.

The dynamic rule (Micikevicius et al., 2018), in pseudo-code::

    if grads_finite:
        growth_count += 1
        if growth_count == growth_interval:      # the interval-th finite step
            growth_count = 0
            if scale * growth_factor <= max_scale:
                scale = scale * growth_factor     # else the scale stays
            backoff_count = 0                     # hysteresis restored
        if backoff_interval > 1 or consecutive_hysteresis:
            backoff_count = 0                     # Paddle, DeepSpeed
    else:
        growth_count = 0
        backoff_count += 1   # (kept at 0 when backoff_interval == hysteresis == 1)
        if backoff_count >= max(backoff_interval, hysteresis):
            scale = max(scale * backoff_factor, min_scale)
            if backoff_interval > 1: backoff_count = 0   # Paddle: restart
            # with hysteresis the count stays: every further non-finite step
            # backs off again until the scale next grows (Megatron, DeepSpeed)

A static scaler is the same rule with both factors 1; `no_scale` is the static
scaler of scale 1. Peers' variants (Paddle's ``decr_every_n_nan_or_inf``,
Megatron's ``hysteresis``, DeepSpeed's ``consecutive_hysteresis``) are
configuration of this rule, never separate code paths.

References:
  Micikevicius et al., "Mixed Precision Training", ICLR 2018.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from jls._state import LossScaleState, check_state, make_state
from jls._validate import (
    F32_MAX,
    F32_TINY,
    flag,
    integer,
    positive_f32,
    real,
    to_f32,
)

_F32_MAX = F32_MAX


def _factor(name: str, value: Any, *, below_one: bool) -> float:
    """A scale factor, ``>= 1`` or in ``(0, 1]``, that stays itself in float32.

    ``1e39`` is inf in float32 and ``0.99999999`` rounds to 1 (a factor that
    would never change the scale): both are refused.
    """
    value = real(name, value)
    if below_one and not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    if not below_one and value < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")
    f32 = to_f32(value)
    if not F32_TINY <= f32 <= F32_MAX:
        raise ValueError(
            f"{name} must be a normal float32 number, got {value!r} (float32: {f32!r})"
        )
    if (value == 1) != (f32 == 1):
        raise ValueError(
            f"{name} must differ from 1 in float32 if it differs from 1, got "
            f"{value!r}, which float32 rounds to 1.0 (the scale would never change)"
        )
    return value


@dataclasses.dataclass(frozen=True)
class LossScaler:
    """An immutable, hashable loss-scaler configuration.

    Make one with `dynamic_scale`, `static_scale`, `no_scale` or a preset;
    the constructor validates every field (the factories document them).

    Attributes:
      init_scale: the scale of the first step.
      growth_factor: the scale is multiplied by this on growth (1: never grows).
      backoff_factor: the scale is multiplied by this on back-off (1: never
        backs off).
      growth_interval: growth comes on this many consecutive finite steps.
      first_growth_interval: the same for the first growth after the start or
        a non-finite step (DeepSpeed, nnabla); ``None`` means
        ``growth_interval``.
      init_growth_count: the growth count before the first step (flax
        ``fin_steps``, jmp ``counter``); ``None`` means `growth_restart`.
      saturate_growth: a growth past ``max_scale`` lands on it (flax) instead
        of being skipped.
      backoff_divisor: back off by dividing by this instead of multiplying by
        ``backoff_factor`` (the peers that divide: Keras, TensorFlow, jmp,
        DeepSpeed, nnabla); ``backoff_factor`` is then ``1 / backoff_divisor``.
      backoff_interval: Paddle's ``decr_every_n_nan_or_inf``.
      hysteresis: Megatron's and DeepSpeed's ``hysteresis``.
      consecutive_hysteresis: DeepSpeed's ``consecutive_hysteresis``.
      min_scale: the scale never backs off below this.
      max_scale: the scale never grows above this.
      skip_nonfinite: whether a step with non-finite gradients is dropped.

    Example:
      >>> import jls
      >>> scaler = jls.dynamic_scale(2.0**10, growth_interval=2)
      >>> scaler.growth_interval, scaler == jls.dynamic_scale(1024.0, growth_interval=2)
      (2, True)
      >>> state = scaler.init()
      >>> for finite in (True, True, False):
      ...     state = scaler.adjust(state, finite)
      ...     print(float(state.scale))
      1024.0
      2048.0
      1024.0
    """

    init_scale: float = 2.0**15
    growth_factor: float = 2.0
    backoff_factor: float | None = None
    growth_interval: int = 2000
    first_growth_interval: int | None = None
    init_growth_count: int | None = None
    saturate_growth: bool = False
    backoff_divisor: float | None = None
    backoff_interval: int = 1
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    max_scale: float = _F32_MAX
    skip_nonfinite: bool = True

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "init_scale", positive_f32("init_scale", self.init_scale))
        set_(
            self,
            "growth_factor",
            _factor("growth_factor", self.growth_factor, below_one=False),
        )
        backoff = self.backoff_factor
        if self.backoff_divisor is not None:
            divisor = _factor("backoff_divisor", self.backoff_divisor, below_one=False)
            if backoff is not None and real("backoff_factor", backoff) != 1 / divisor:
                raise ValueError(
                    "give backoff_factor or backoff_divisor, not both; got "
                    f"backoff_factor={backoff!r}, backoff_divisor={divisor!r}"
                )
            set_(self, "backoff_divisor", divisor)
            backoff = 1 / divisor
        backoff = 0.5 if backoff is None else backoff
        backoff = _factor("backoff_factor", backoff, below_one=True)
        set_(self, "backoff_factor", backoff)
        set_(
            self,
            "growth_interval",
            integer("growth_interval", self.growth_interval, 1),
        )
        first = self.first_growth_interval
        first = self.growth_interval if first is None else first
        first = integer("first_growth_interval", first, 1)
        if first < self.growth_interval:
            raise ValueError(
                "first_growth_interval must be >= growth_interval "
                f"({self.growth_interval}), got {first!r}"
            )
        set_(self, "first_growth_interval", first)
        count = self.init_growth_count
        count = self.growth_restart if count is None else count
        count = integer(
            "init_growth_count",
            count,
            self.growth_restart,
            self.growth_interval - 1,
        )
        set_(self, "init_growth_count", count)
        set_(self, "saturate_growth", flag("saturate_growth", self.saturate_growth))
        set_(
            self,
            "backoff_interval",
            integer("backoff_interval", self.backoff_interval, 1),
        )
        set_(self, "hysteresis", integer("hysteresis", self.hysteresis, 1))
        if self.backoff_interval > 1 and self.hysteresis > 1:
            raise ValueError(
                "backoff_interval and hysteresis are two different peers' rules "
                "(Paddle's and Megatron/DeepSpeed's); set at most one above 1, got "
                f"backoff_interval={self.backoff_interval!r}, "
                f"hysteresis={self.hysteresis!r}"
            )
        set_(
            self,
            "consecutive_hysteresis",
            flag("consecutive_hysteresis", self.consecutive_hysteresis),
        )
        set_(self, "min_scale", positive_f32("min_scale", self.min_scale))
        set_(self, "max_scale", positive_f32("max_scale", self.max_scale))
        if self.min_scale > self.max_scale:
            raise ValueError(
                f"min_scale must be <= max_scale, got min_scale={self.min_scale!r} "
                f"and max_scale={self.max_scale!r}"
            )
        if not self.min_scale <= self.init_scale <= self.max_scale:
            raise ValueError(
                f"init_scale must be in [min_scale, max_scale] = "
                f"[{self.min_scale!r}, {self.max_scale!r}], got {self.init_scale!r}"
            )
        set_(self, "skip_nonfinite", flag("skip_nonfinite", self.skip_nonfinite))

    @property
    def growth_restart(self) -> int:
        """The growth count after a non-finite step.

        0, or negative when the first growth after the start or a non-finite
        step takes ``first_growth_interval > growth_interval`` steps.
        """
        first = self.first_growth_interval
        first = self.growth_interval if first is None else first
        return self.growth_interval - first

    @property
    def is_dynamic(self) -> bool:
        """Whether the scale can ever change."""
        return self.growth_factor != 1 or self.backoff_factor != 1

    @property
    def is_identity(self) -> bool:
        """Whether the scale is 1 forever (scaling and unscaling do nothing)."""
        return not self.is_dynamic and self.init_scale == 1

    @property
    def min_scale_f32(self) -> float:
        """``min_scale`` as the float32 value the state machine uses."""
        return to_f32(self.min_scale)

    @property
    def max_scale_f32(self) -> float:
        """``max_scale`` as the float32 value the state machine uses."""
        return to_f32(self.max_scale)

    def in_range(self, scale: jax.Array) -> jax.Array:
        """Whether ``scale`` lies in ``[min_scale, max_scale]`` (False for nan).

        A state can arrive from a checkpoint, `jls.set_loss_scale` or a
        user's hand with any scale. A step whose scale is out of range is
        treated as a non-finite step whatever its gradients (always dropped,
        even with ``skip_nonfinite=False``), and `adjust` brings the scale
        back into range, so a scale that the check was not designed for is
        never used to unscale an applied update.
        """
        f32 = jnp.float32
        return (scale >= f32(self.min_scale_f32)) & (scale <= f32(self.max_scale_f32))

    def init(self) -> LossScaleState:
        """Returns the state before the first step.

        Returns:
          A `LossScaleState` with ``scale == init_scale`` (as float32) and all
          counters 0.

        Example:
          >>> import jls
          >>> jls.dynamic_scale(init_scale=1024).init().scale
          Array(1024., dtype=float32)
        """
        count = (
            self.growth_restart
            if self.init_growth_count is None
            else self.init_growth_count
        )
        return make_state(self.init_scale, growth_count=count)

    def adjust(
        self,
        state: LossScaleState,
        grads_finite: ArrayLike,
        *,
        applied: ArrayLike | None = None,
    ) -> LossScaleState:
        """Advances the state machine by one step.

        Pure and jittable; under ``vmap`` it adjusts each state independently.

        Args:
          state: the current `LossScaleState`.
          grads_finite: a scalar bool, whether this step's gradients were all
            finite.
          applied: a scalar bool, whether the step's update was applied; it
            drives the skip counters. Default: derived here (the step is
            applied when the gradients are finite, or with
            ``skip_nonfinite=False`` when the scale is in range).
            `loss_scaling` passes the decision it took, reduced across
            replicas, so the counters say what happened.

        Returns:
          The next `LossScaleState`.

        Raises:
          TypeError: at trace time, if ``state`` is not a valid
            `LossScaleState` or ``grads_finite`` is not a scalar bool.

        Example:
          >>> import jls
          >>> scaler = jls.dynamic_scale(init_scale=8, growth_interval=2)
          >>> s = scaler.init()
          >>> for finite in [True, True, False]:
          ...     s = scaler.adjust(s, finite)
          ...     print(float(s.scale), int(s.growth_count))
          8.0 1
          16.0 0
          8.0 0
        """
        state = check_state(state)
        finite = jnp.asarray(grads_finite)
        if finite.dtype != jnp.bool_ or finite.shape != ():
            raise TypeError(
                "grads_finite must be a scalar bool, got dtype "
                f"{finite.dtype} and shape {finite.shape}"
            )
        f32, i32 = jnp.float32, jnp.int32
        scale = state.scale
        valid = self.in_range(scale)
        finite = finite & valid
        if applied is None:
            # Dropped when the gradients are not finite (unless the scaler
            # applies such steps), and always when the scale was invalid.
            dropped = ~finite if self.skip_nonfinite else ~valid
        else:
            applied = jnp.asarray(applied)
            if applied.dtype != jnp.bool_ or applied.shape != ():
                raise TypeError(
                    "applied must be a scalar bool, got dtype "
                    f"{applied.dtype} and shape {applied.shape}"
                )
            dropped = ~applied

        # Growth: on the growth_interval-th consecutive finite step (counting
        # from growth_restart after the start or a non-finite step), unless
        # the grown scale would exceed max_scale: then it stays (or, with
        # saturate_growth, lands on max_scale).
        count = state.growth_count + i32(1)
        at_interval = finite & (count >= i32(self.growth_interval))
        grown = scale * f32(self.growth_factor)
        if self.saturate_growth:
            grown = jnp.minimum(grown, f32(self.max_scale))
            grow = at_interval
        else:
            grow = at_interval & (grown <= f32(self.max_scale))
        growth_count = jnp.where(
            finite,
            jnp.where(at_interval, i32(0), count),
            i32(self.growth_restart),
        )

        # Back-off: on the backoff_after-th counted non-finite step; never below
        # min_scale.
        backoff_after = max(self.backoff_interval, self.hysteresis)
        if backoff_after == 1:  # the plain rule: every non-finite step backs off
            backoff = ~finite
            backoff_count = state.backoff_count
        else:
            bad = jnp.minimum(state.backoff_count, i32(backoff_after - 1)) + i32(1)
            backoff = ~finite & (bad >= i32(backoff_after))
            if self.backoff_interval > 1:  # Paddle: the count restarts
                after_backoff = jnp.where(backoff, i32(0), bad)
            else:  # hysteresis: stays spent until the next growth
                after_backoff = bad
            if self.backoff_interval > 1 or self.consecutive_hysteresis:
                after_finite = i32(0)
            else:
                after_finite = jnp.where(at_interval, i32(0), state.backoff_count)
            backoff_count = jnp.where(finite, after_finite, after_backoff)
        if self.backoff_divisor is not None:
            # XLA rewrites a division by a constant into a multiplication by
            # its rounded reciprocal (x / 3 -> x * 0.33333334), and an
            # optimization barrier does not survive to that pass under vmap.
            # A divisor that depends on the scale is no constant: `scale -
            # scale` is 0 for every finite scale (XLA never folds x - x for
            # floats, because of nan), and a non-finite scale is clamped below.
            divisor = f32(self.backoff_divisor) + (scale - scale)
            backed = scale / divisor
        else:
            backed = scale * f32(self.backoff_factor)
        backed = jnp.maximum(backed, f32(self.min_scale))

        if self.is_dynamic:
            scale = jnp.where(grow, grown, jnp.where(backoff, backed, scale))
        # Whatever the state held (a scale set by hand, nan), the next scale is
        # in [min_scale, max_scale]; nan goes to min_scale.
        low, high = f32(self.min_scale_f32), f32(self.max_scale_f32)
        scale = jnp.where(scale >= low, jnp.minimum(scale, high), low)
        return LossScaleState(
            scale=scale,
            growth_count=growth_count,
            backoff_count=backoff_count,
            consecutive_skips=_count_if(dropped, state.consecutive_skips, i32(0)),
            total_skips=_count_if(dropped, state.total_skips, state.total_skips),
            consecutive_nonfinite=_count_if(
                ~finite, state.consecutive_nonfinite, i32(0)
            ),
            # Derived from the input, so a donated buffer is reused, not dropped.
            retries=state.retries * i32(0),
        )


def _count_if(cond: jax.Array, count: jax.Array, otherwise: jax.Array) -> jax.Array:
    """``count + 1`` (saturating at the int32 maximum) where ``cond``."""
    return jnp.where(cond, optax.safe_increment(count), otherwise)


def dynamic_scale(
    init_scale: float = 2.0**15,
    *,
    growth_factor: float = 2.0,
    backoff_factor: float | None = None,
    growth_interval: int = 2000,
    first_growth_interval: int | None = None,
    init_growth_count: int | None = None,
    saturate_growth: bool = False,
    backoff_divisor: float | None = None,
    backoff_interval: int = 1,
    hysteresis: int = 1,
    consecutive_hysteresis: bool = False,
    min_scale: float = 1.0,
    max_scale: float = _F32_MAX,
    skip_nonfinite: bool = True,
) -> LossScaler:
    """The dynamic loss-scale rule: grow while finite, back off on overflow.

    Args:
      init_scale: the first step's scale (torch ``init_scale``, Paddle
        ``init_loss_scaling``). Must lie in ``[min_scale, max_scale]``.
      growth_factor: multiplies the scale on growth; ``>= 1``.
      backoff_factor: multiplies the scale on back-off; in ``(0, 1]``.
        Default 0.5.
      growth_interval: the scale grows on this many consecutive finite steps
        (torch ``growth_interval``, Paddle ``incr_every_n_steps``); a
        non-finite step restarts the count.
      first_growth_interval: from DeepSpeed (``scale_window + 1``) and nnabla
        (``N + 2``): the first growth after the start or after a non-finite
        step comes on this many consecutive finite steps, later ones every
        ``growth_interval``. ``>= growth_interval``; default
        ``growth_interval``.
      init_growth_count: the growth count before the first step, e.g. flax's
        ``fin_steps`` or jmp's ``counter`` of a run being resumed. Default:
        a fresh count.
      saturate_growth: from flax's ``DynamicScale``: a growth that would
        exceed ``max_scale`` lands on ``max_scale`` instead of being
        skipped (torch, TensorFlow, Paddle skip it).
      backoff_divisor: back off by dividing the scale by this (``>= 1``)
        instead of multiplying by ``backoff_factor``, as Keras, TensorFlow,
        jmp, DeepSpeed and nnabla do; in float32, ``x / 3`` and
        ``x * (1 / 3)`` differ. Give at most one of the two.
      backoff_interval: from Paddle's ``decr_every_n_nan_or_inf``: back off
        once every this many consecutive non-finite steps; a finite step
        clears the count. 1 (default) backs off on every non-finite step.
      hysteresis: from Megatron-LM's ``DynamicGradScaler`` and DeepSpeed's
        ``hysteresis`` (``delayed_shift``): the first ``hysteresis - 1``
        non-finite steps since the last growth are tolerated (skipped without
        backing off); from then on every non-finite step backs off until the
        scale next grows. At most one of ``backoff_interval`` and
        ``hysteresis`` may exceed 1.
      consecutive_hysteresis: from DeepSpeed's ``consecutive_hysteresis``:
        any finite step (not only a growth) restores the hysteresis.
      min_scale: the floor; back-off never goes below it, so the scale never
        reaches 0. May be below 1 (every scale in ``[min_scale, max_scale]``
        is handled without false negatives).
      max_scale: the ceiling; a growth that would exceed it is not taken, so
        the scale never reaches inf. Default: the float32 maximum.
      skip_nonfinite: drop a step whose gradients are not finite (default).
        ``False`` applies it anyway, like MindSpore's
        ``drop_overflow_update=False``; the step then counts in
        ``consecutive_nonfinite`` but not as a skip.

    Returns:
      A `LossScaler`.

    Raises:
      TypeError: if an argument has the wrong type (the message names it).
      ValueError: if an argument is out of range (the message names it).

    Example:
      >>> import jls
      >>> scaler = jls.dynamic_scale(init_scale=2.0**10, growth_interval=100)
      >>> scaler.init().scale
      Array(1024., dtype=float32)
      >>> jls.dynamic_scale(backoff_factor=2.0)
      Traceback (most recent call last):
      ...
      ValueError: backoff_factor must be in (0, 1], got 2.0
    """
    if backoff_factor is not None and backoff_divisor is not None:
        raise ValueError(
            "give backoff_factor or backoff_divisor, not both; got "
            f"backoff_factor={backoff_factor!r}, backoff_divisor={backoff_divisor!r}"
        )
    return LossScaler(
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        first_growth_interval=first_growth_interval,
        init_growth_count=init_growth_count,
        saturate_growth=saturate_growth,
        backoff_divisor=backoff_divisor,
        backoff_interval=backoff_interval,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive_hysteresis,
        min_scale=min_scale,
        max_scale=max_scale,
        skip_nonfinite=skip_nonfinite,
    )


def static_scale(value: float, *, skip_nonfinite: bool = True) -> LossScaler:
    """A fixed loss scale (MindSpore ``FixedLossScaleManager``).

    Non-finite steps are still detected, counted and (by default) dropped.

    Args:
      value: the scale, a positive float32-representable number.
      skip_nonfinite: drop a step whose gradients are not finite (default);
        ``False`` is MindSpore's ``drop_overflow_update=False``.

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
    value = positive_f32("value", value)
    return LossScaler(
        init_scale=value,
        growth_factor=1.0,
        backoff_factor=1.0,
        growth_interval=1,
        min_scale=value,
        max_scale=value,
        skip_nonfinite=skip_nonfinite,
    )


def no_scale(*, skip_nonfinite: bool = True) -> LossScaler:
    """Scale 1: no loss scaling, for bfloat16 or float32 training.

    Steps with non-finite gradients are still detected and (by default)
    skipped, which makes this the skip-on-nan wrapper for bfloat16.

    Args:
      skip_nonfinite: drop a step whose gradients are not finite (default).

    Returns:
      A `LossScaler` with scale 1 forever.

    Example:
      >>> import jls
      >>> jls.no_scale().init().scale
      Array(1., dtype=float32)
    """
    return static_scale(1.0, skip_nonfinite=skip_nonfinite)
