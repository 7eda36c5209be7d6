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
            backoff_count = 0
    else:
        growth_count = 0
        backoff_count += 1   # (kept at 0 when backoff_interval == hysteresis == 1)
        if backoff_count >= max(backoff_interval, hysteresis):
            scale = max(scale * backoff_factor, min_scale)
            if backoff_interval > 1: backoff_count = 0   # the count restarts
            # with hysteresis the count stays: every further non-finite step
            # backs off again until the scale next grows

A static scaler is the same rule with both factors 1; `no_scale` is the static
scaler of scale 1. Other frameworks' variants are configuration of this rule
(`jls.presets`), never separate code paths.

References:
  Micikevicius et al., "Mixed Precision Training", ICLR 2018.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from jls._scaling import SINGLE_FACTOR_MAX
from jls._state import LossScaleState, check_state, make_state
from jls._validate import (
    F32_MAX,
    factor,
    flag,
    integer,
    positive_f32,
    real,
    scale_in,
    to_f32,
)

Namer = Callable[[str], str]

F16_MAX = float(jnp.finfo(jnp.float16).max)


def _own(field: str) -> str:
    return field


def _config(fields: dict[str, Any], name: Namer) -> dict[str, Any]:
    """Validates a scaler's fields; returns them normalised.

    ``name(field)`` is the argument name an error message uses: the field's
    own for `dynamic_scale`, the framework's for a preset. ``None`` for
    ``backoff_factor``, ``first_growth_interval`` or ``init_growth_count``
    means its default.
    """
    out = dict(fields)
    out["init_scale"] = positive_f32(name("init_scale"), fields["init_scale"])
    out["growth_factor"] = factor(
        name("growth_factor"), fields["growth_factor"], below_one=False
    )
    backoff, divisor = fields["backoff_factor"], fields["backoff_divisor"]
    if divisor is not None:
        divisor = factor(name("backoff_divisor"), divisor, below_one=False)
        if backoff is not None and real(name("backoff_factor"), backoff) != 1 / divisor:
            raise ValueError(
                f"give {name('backoff_factor')} or {name('backoff_divisor')}, not "
                f"both; got {backoff!r} and {divisor!r}"
            )
        # The factor the divisor implies must be a normal float32 too: named
        # after the argument the user gave.
        out["backoff_factor"] = factor(
            f"1 / {name('backoff_divisor')}", 1 / divisor, below_one=True
        )
    else:
        out["backoff_factor"] = factor(
            name("backoff_factor"), 0.5 if backoff is None else backoff, below_one=True
        )
    out["backoff_divisor"] = divisor
    interval = integer(name("growth_interval"), fields["growth_interval"], 1)
    out["growth_interval"] = interval
    first = fields["first_growth_interval"]
    out["first_growth_interval"] = first = integer(
        name("first_growth_interval"), interval if first is None else first, interval
    )
    restart = interval - first
    count = fields["init_growth_count"]
    out["init_growth_count"] = integer(
        name("init_growth_count"),
        restart if count is None else count,
        restart,
        interval - 1,
    )
    out["backoff_interval"] = integer(
        name("backoff_interval"), fields["backoff_interval"], 1
    )
    out["hysteresis"] = integer(name("hysteresis"), fields["hysteresis"], 1)
    if out["backoff_interval"] > 1 and out["hysteresis"] > 1:
        raise ValueError(
            f"set at most one of {name('backoff_interval')} and "
            f"{name('hysteresis')} above 1 (two different rules), got "
            f"{out['backoff_interval']!r} and {out['hysteresis']!r}"
        )
    for key in ("saturate_growth", "consecutive_hysteresis", "skip_nonfinite"):
        out[key] = flag(name(key), fields[key])
    low = out["min_scale"] = positive_f32(name("min_scale"), fields["min_scale"])
    high = out["max_scale"] = positive_f32(name("max_scale"), fields["max_scale"])
    if low > high:
        raise ValueError(
            f"{name('min_scale')} must be <= {name('max_scale')}, got {low!r} and "
            f"{high!r}"
        )
    margin = fields["margin"]
    if margin is not None:
        margin = real(name("margin"), margin)
        if not 1 <= margin <= F32_MAX:
            raise ValueError(
                f"{name('margin')} must be in [1, {F32_MAX!r}], got {margin!r}"
            )
        if out["backoff_interval"] != 1 or out["hysteresis"] != 1:
            raise ValueError(
                "the measured rule backs off on every non-finite step: "
                f"{name('backoff_interval')} and {name('hysteresis')} must be 1"
            )
        # Its scales are powers of two (exact unscaling): so must be every
        # number that makes or moves one.
        for key in ("init_scale", "min_scale", "growth_factor", "backoff_factor"):
            value = to_f32(out[key])
            if math.frexp(value)[0] != 0.5:
                raise ValueError(
                    f"{name(key)} must be a power of two (the measured rule keeps "
                    f"its scale one, so that unscaling is exact), got {out[key]!r}"
                )
    out["margin"] = margin
    out["compute_max"] = positive_f32(name("compute_max"), fields["compute_max"])
    if not low <= out["init_scale"] <= high:
        raise ValueError(
            f"{name('init_scale')} must be in [{name('min_scale')}, "
            f"{name('max_scale')}] = [{low!r}, {high!r}], got {out['init_scale']!r}"
        )
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossScaler:
    """An immutable, hashable loss-scaler configuration.

    Make one with `dynamic_scale`, `static_scale`, `no_scale` or a preset,
    which validate every field and document it; ``dataclasses.replace``
    validates again.

    Attributes:
      init_scale: the scale of the first step.
      growth_factor: the scale is multiplied by this on growth (1: never grows).
      backoff_factor: the scale is multiplied by this on back-off (1: never
        backs off).
      growth_interval: growth comes on this many consecutive finite steps.
      first_growth_interval: the same for the first growth after the start or
        a non-finite step.
      init_growth_count: the growth count before the first step.
      saturate_growth: a growth past ``max_scale`` lands on it instead of
        being skipped.
      backoff_divisor: when not ``None``, back off by dividing by this
        (``backoff_factor`` is then ``1 / backoff_divisor``).
      backoff_interval: back off once every this many non-finite steps.
      hysteresis: non-finite steps tolerated before backing off.
      consecutive_hysteresis: any finite step restores the hysteresis.
      min_scale: the scale never backs off below this.
      max_scale: the scale never grows above this.
      skip_nonfinite: whether a step with non-finite gradients is dropped.
      margin: ``None`` for the dynamic rule; for the measured rule
        (`measured_scale`), the headroom kept between the scaled gradients'
        largest root-mean-square and ``compute_max``.
      compute_max: the compute dtype's largest finite value (the measured
        rule's target; unused by the dynamic rule).

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

    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    first_growth_interval: int
    init_growth_count: int
    saturate_growth: bool
    backoff_divisor: float | None
    backoff_interval: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_scale: float
    max_scale: float
    skip_nonfinite: bool
    margin: float | None
    compute_max: float

    def __post_init__(self) -> None:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key, value in _config(fields, _own).items():
            object.__setattr__(self, key, value)

    @property
    def growth_restart(self) -> int:
        """The growth count after a non-finite step.

        0, or negative when the first growth after the start or a non-finite
        step takes ``first_growth_interval > growth_interval`` steps.
        """
        return self.growth_interval - self.first_growth_interval

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
        ok = (scale >= f32(self.min_scale_f32)) & (scale <= f32(self.max_scale_f32))
        if self.margin is not None:  # the measured rule's scales are powers of two
            ok = ok & _is_pow2(scale)
        return ok

    def check_scale(self, name: str, value: Any) -> float:
        """A concrete scale this scaler can use, or an error naming ``name``.

        Positive, normal in float32, in ``[min_scale, max_scale]``, and for
        the measured rule a power of two.
        """
        value = scale_in(name, value, self.min_scale_f32, self.max_scale_f32)
        if self.margin is not None and math.frexp(to_f32(value))[0] != 0.5:
            raise ValueError(
                f"{name} must be a power of two for jls.measured_scale (its "
                f"scales are powers of two, so that unscaling is exact), got "
                f"{value!r}"
            )
        return value

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
        return make_state(self.init_scale, growth_count=self.init_growth_count)

    def adjust(
        self,
        state: LossScaleState,
        grads_finite: ArrayLike,
        *,
        applied: ArrayLike | None = None,
        magnitude: ArrayLike | None = None,
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
          magnitude: a float32 scalar, the measurement the measured rule
            follows: the largest root-mean-square of the step's scaled
            gradients over the check's reductions (`jls.loss_scaling` passes
            it). Ignored by the dynamic rule; without it the measured rule
            holds the scale on a finite step.

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
        count = optax.safe_increment(state.growth_count)
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
            if self.backoff_interval > 1:  # the count restarts
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

        headroom = state.headroom
        if self.margin is not None:
            scale, headroom, growth_count = self._measured(
                state, finite, dropped, backed, magnitude
            )
        elif self.is_dynamic:
            scale = jnp.where(grow, grown, jnp.where(backoff, backed, scale))
        # Whatever the state held (a scale set by hand, nan), the next scale is
        # in [min_scale, max_scale]; nan goes to min_scale.
        low, high = f32(self.min_scale_f32), f32(self.max_scale_f32)
        scale = jnp.where(scale >= low, jnp.minimum(scale, high), low)
        if self.margin is not None:  # a scale set by hand becomes a power of two
            scale = _pow2_floor_array(scale)
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
            headroom=headroom,
        )

    def _measured(
        self,
        state: LossScaleState,
        finite: jax.Array,
        dropped: jax.Array,
        backed: jax.Array,
        magnitude: ArrayLike | None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The measured rule: ``(scale, headroom, growth_count)`` (`measured_scale`)."""
        f32, i32 = jnp.float32, jnp.int32
        scale = state.scale
        # The largest power of two the scale may reach, so that it stays one.
        cap = f32(_pow2_floor(self.max_scale_f32))
        # A headroom from a checkpoint or a user's hand that is nan, inf or
        # below 1 is read as 1.
        headroom = state.headroom
        headroom = jnp.where(
            (headroom >= 1) & (headroom <= f32(_HEADROOM_MAX)),
            _pow2_floor_array(headroom),
            f32(1),
        )
        # The first overflow of a run of them doubles the headroom (the margin
        # did not cover this model's activation gradients); every `history`
        # finite steps since halve it again, down to 1.
        first = ~finite & (state.consecutive_nonfinite == 0)
        count = optax.safe_increment(state.growth_count)
        relax = finite & (count >= i32(self.growth_interval))
        headroom = jnp.where(
            first,
            jnp.minimum(headroom / f32(self.backoff_factor), f32(_HEADROOM_MAX)),
            jnp.where(
                relax, jnp.maximum(headroom / f32(self.growth_factor), 1), headroom
            ),
        )
        growth_count = jnp.where(finite & ~relax, count, i32(0))
        # A finite step that was not applied (the spike rule vetoed it) holds
        # the scale: its gradients are an outlier, not the new range.
        hold = finite & dropped
        if magnitude is None:
            return jnp.where(finite, scale, backed), headroom, growth_count
        m = jnp.asarray(magnitude)
        if m.dtype != jnp.float32 or m.shape != ():
            raise TypeError(
                f"magnitude must be a float32 scalar, got dtype {m.dtype} and "
                f"shape {m.shape}"
            )
        assert self.margin is not None
        # The largest power of two that keeps the measured magnitude, at that
        # scale, margin * headroom below compute_max (inf for all-zero
        # gradients: the growth bound and the cap bound it).
        limit = f32(self.compute_max / self.margin) / headroom
        wanted = scale * (limit / m)
        _, exponent = jnp.frexp(wanted)
        target = jnp.where(
            jnp.isfinite(wanted) & (wanted > 0),
            jnp.ldexp(f32(1), exponent - 1),
            jnp.where(wanted > 0, cap, f32(0)),
        )
        grown = jnp.minimum(jnp.minimum(target, scale * f32(self.growth_factor)), cap)
        scale = jnp.where(finite, jnp.where(hold, scale, grown), backed)
        return scale, headroom, growth_count


def _pow2_floor(value: float) -> float:
    """The largest power of two <= ``value`` (a positive float)."""
    mantissa, exponent = math.frexp(value)
    return math.ldexp(1.0, exponent - 1) if mantissa != 0.5 else value


_HEADROOM_MAX = 2.0**64  # the most headroom overflows can add


def _is_pow2(x: jax.Array) -> jax.Array:
    """Whether each element of ``x`` is a positive, normal power of two."""
    mantissa, _ = jnp.frexp(x)
    return (mantissa == 0.5) & (x >= jnp.finfo(x.dtype).tiny) & jnp.isfinite(x)


def _pow2_floor_array(x: jax.Array) -> jax.Array:
    """The largest power of two <= ``x`` (positive and finite)."""
    _, exponent = jnp.frexp(x)
    return jnp.ldexp(jnp.ones((), x.dtype), exponent - 1)


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
    max_scale: float = SINGLE_FACTOR_MAX,
    skip_nonfinite: bool = True,
) -> LossScaler:
    """The dynamic loss-scale rule: grow while finite, back off on overflow.

    The knobs past the first five express other frameworks' rules as
    configuration of this one; `jls.presets` sets them for each framework.

    Args:
      init_scale: the first step's scale. Must lie in ``[min_scale,
        max_scale]``.
      growth_factor: multiplies the scale on growth; ``>= 1``.
      backoff_factor: multiplies the scale on back-off; in ``(0, 1]``.
        Default 0.5.
      growth_interval: the scale grows on this many consecutive finite steps;
        a non-finite step restarts the count.
      first_growth_interval: the first growth after the start or after a
        non-finite step comes on this many consecutive finite steps, later
        ones every ``growth_interval`` (DeepSpeed, nnabla).
        ``>= growth_interval``; default ``growth_interval``.
      init_growth_count: the growth count before the first step (to resume a
        run). Default: a fresh count.
      saturate_growth: a growth that would exceed ``max_scale`` lands on
        ``max_scale`` instead of being skipped (flax).
      backoff_divisor: back off by dividing the scale by this (``>= 1``)
        instead of multiplying by ``backoff_factor`` (Keras, TensorFlow, jmp,
        DeepSpeed, nnabla); in float32, ``x / 3`` and ``x * (1 / 3)``
        differ. Give at most one of the two.
      backoff_interval: back off once every this many consecutive non-finite
        steps; a finite step clears the count (Paddle). 1 (default) backs off
        on every non-finite step.
      hysteresis: the first ``hysteresis - 1`` non-finite steps since the
        last growth are tolerated (skipped without backing off); from then on
        every non-finite step backs off until the scale next grows (Megatron,
        DeepSpeed). At most one of ``backoff_interval`` and ``hysteresis``
        may exceed 1.
      consecutive_hysteresis: any finite step (not only a growth) restores
        the hysteresis (DeepSpeed).
      min_scale: the floor; back-off never goes below it, so the scale never
        reaches 0. May be below 1 (every scale in ``[min_scale, max_scale]``
        is handled without false negatives).
      max_scale: the ceiling; a growth that would exceed it is not taken, so
        the scale never reaches inf. Default 2**126, the largest power of two
        whose reciprocal is a normal float32: up to it one multiplication
        unscales exactly. A larger ``max_scale`` (up to the float32 maximum,
        as the presets of peers without a cap use) unscales with two
        factors, exactly too, at a small compile-time cost.
      skip_nonfinite: drop a step whose gradients are not finite (default).
        ``False`` applies it anyway; the step then counts in
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
    return make_dynamic(
        _own,
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


def measured_scale(
    margin: float = 2.0**8,
    *,
    history: int = 1000,
    dtype: Any = jnp.float16,
    init_scale: float = 2.0**15,
    max_growth: float = 2.0,
    backoff_factor: float = 0.5,
    min_scale: float = 1.0,
    max_scale: float = SINGLE_FACTOR_MAX,
    skip_nonfinite: bool = True,
) -> LossScaler:
    """A scale chosen from the gradients' measured range: no interval to tune.

    The dynamic rule finds its scale by overflowing: it grows blindly every
    ``growth_interval`` steps and learns it went too far by losing a step.
    This rule reads the scale off the gradients instead. The finite check
    reads every gradient once anyway; with this scaler it is a sum of
    squares (`jls.loss_scaling` switches it), which also gives each of its
    reductions' root-mean-square, at no extra memory traffic. After a finite
    step the next scale is the largest power of two at which the largest of
    those root-mean-squares stays ``margin * headroom`` below ``dtype``'s
    maximum, and at most ``max_growth`` times the current scale. So the
    scale follows the gradients down at once, without a skipped step, and
    up by at most ``max_growth`` per step.

    The gradients jls sees are the parameters'; an overflow in the backward
    pass happens in activation gradients, whose range the margin must cover.
    So the dynamic rule's fallback stays: a non-finite step is skipped (by
    default) and the scale backs off by ``backoff_factor``. The first
    overflow of a run of them also doubles the state's ``headroom`` (the
    margin did not cover this model); every ``history`` finite steps since
    halve it again, down to 1. A model whose activation gradients need more
    than ``margin`` thus loses about one step per ``history`` steps.

    Scales and the headroom are always powers of two, so unscaling is
    exact: ``init_scale``, ``min_scale``, ``max_growth`` and
    ``backoff_factor`` must be powers of two (refused otherwise), the cap is
    the largest power of two at most ``max_scale``, and a scale that is not
    one (set by hand, or from a checkpoint) is treated as out of range: its
    step is dropped and the next scale is a power of two. The state is the
    usual `jls.LossScaleState` (``headroom`` is its field), so one trace
    serves every step, and every guarantee of the other scalers holds. The
    squares check never reports finite gradients non-finite, however large
    (a plain sum of squares that overflows float32 is summed again shrunk,
    on that step only), so the rule works for every compute ``dtype``.

    Args:
      margin: the headroom, ``>= 1``, between the scaled gradients' largest
        root-mean-square and ``dtype``'s maximum. The default, 2**8, was
        chosen from ``benchmarks/bench_scalers.py``'s evidence (see the
        README's table): the only margin tried that skipped no step after
        warm-up on the demo, the LM and the stress case (its sudden jump
        aside) with underflow below the tuned dynamic rule's on all three.
      history: finite steps after which the headroom an overflow added is
        halved again.
      dtype: the compute dtype whose maximum the scaled gradients are kept
        below (float16; an fp8 type for fp8 gradients).
      init_scale: the first step's scale.
      max_growth: the most the scale grows in one step, ``>= 1``.
      backoff_factor: multiplies the scale on a non-finite step; in (0, 1].
      min_scale: the floor.
      max_scale: the cap. Default 2**126 (one-factor unscaling).
      skip_nonfinite: drop a step whose gradients are not finite (default).

    Returns:
      A `LossScaler`.

    Raises:
      TypeError: if an argument has the wrong type (the message names it).
      ValueError: if an argument is out of range (the message names it).

    Example:
      >>> import jax.numpy as jnp, jls
      >>> scaler = jls.measured_scale(margin=2.0**10, init_scale=2.0**15)
      >>> state = scaler.init()
      >>> # The scaled gradients' largest RMS is 2**-3 at 2**15: the target
      >>> # (2**24) is far above, but the scale grows at most 2x per step.
      >>> state = scaler.adjust(state, True, magnitude=jnp.float32(2.0**-3))
      >>> float(state.scale) == 2.0**16
      True
      >>> state = scaler.adjust(state, False)  # an overflow: back off
      >>> float(state.scale) == 2.0**15, float(state.headroom)
      (True, 2.0)
    """
    try:
        array = isinstance(dtype, jax.Array | np.ndarray)
        dt = None if dtype is None or array else jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {dtype!r:.100}")
    if float(jnp.finfo(dt).max) > F32_MAX:
        raise ValueError(
            f"dtype must be a compute dtype no wider than float32, got {dt.name}"
        )
    dtype = dt
    names = {
        "growth_factor": "max_growth",
        "growth_interval": "history",
        "compute_max": "dtype's maximum",
    }
    return make_dynamic(
        lambda field: names.get(field, field),
        init_scale=init_scale,
        growth_factor=max_growth,
        backoff_factor=backoff_factor,
        growth_interval=history,
        min_scale=min_scale,
        max_scale=max_scale,
        skip_nonfinite=skip_nonfinite,
        margin=margin,
        compute_max=float(jnp.finfo(dtype).max),
    )


# dynamic_scale's defaults, read from its signature so they are written once.
_DYNAMIC_DEFAULTS: dict[str, Any] = {
    name: p.default for name, p in inspect.signature(dynamic_scale).parameters.items()
}


def make_dynamic(name: Namer, **fields: Any) -> LossScaler:
    """`dynamic_scale` whose errors name each argument ``name(field)``.

    For presets, which take other frameworks' argument names. Fields not
    given take `dynamic_scale`'s defaults.
    """
    defaults = {**_DYNAMIC_DEFAULTS, "margin": None, "compute_max": F16_MAX}
    unknown = set(fields) - set(defaults)
    if unknown:
        raise TypeError(f"unknown scaler fields: {sorted(unknown)}")
    return LossScaler(**_config({**defaults, **fields}, name))


def make_static(name: Namer, value: Any, skip_nonfinite: Any = True) -> LossScaler:
    """`static_scale` whose errors name the scale ``name("value")``."""
    value = positive_f32(name("value"), value)
    return make_dynamic(
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
    """A fixed loss scale.

    Non-finite steps are still detected, counted and (by default) dropped.

    Args:
      value: the scale, a positive float32-representable number.
      skip_nonfinite: drop a step whose gradients are not finite (default);
        ``False`` applies it anyway.

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
    return make_static(_own, value, skip_nonfinite)


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
    return make_static(_own, 1.0, skip_nonfinite)
