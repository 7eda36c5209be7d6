"""The measured rule: the scale read off the gradients' range.

The check is then a sum of squares (`jls._squares`), which gives the range.
Scales and headroom are powers of two: unscaling is exact.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jls._rule import SINGLE_FACTOR_MAX, LossScaler, bounds, is_pow2
from jls._validate import F32_MAX, factor, flag, integer, real, to_f32

_HEADROOM_MAX = 2.0**64  # the most headroom overflows can add


def _is_pow2_array(x: jax.Array) -> jax.Array:
    """Whether each element of ``x`` is a positive, normal power of two."""
    mantissa, _ = jnp.frexp(x)
    return (mantissa == 0.5) & (x >= jnp.finfo(x.dtype).tiny) & jnp.isfinite(x)


def _pow2_floor(x: jax.Array) -> jax.Array:
    """The largest power of two <= ``x`` (positive and finite)."""
    _, exponent = jnp.frexp(x)
    return jnp.ldexp(jnp.ones((), x.dtype), exponent - 1)


def _compute_dtype(dtype: Any) -> np.dtype:
    """``dtype`` as a floating numpy dtype no wider than float32."""
    try:
        is_array = isinstance(dtype, jax.Array | np.ndarray)
        dt = None if dtype is None or is_array else np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {dtype!r:.100}")
    if float(jnp.finfo(dt).max) > F32_MAX:
        raise ValueError(
            f"dtype must be a compute dtype no wider than float32, got {dt.name}"
        )
    return dt


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeasuredScale(LossScaler):
    """The measured rule's configuration; see `measured_scale` for each field."""

    margin: float = 2.0**8
    history: int = 1000
    dtype: Any = np.dtype(np.float16)
    init_scale: float = 2.0**15
    max_growth: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    max_scale: float = SINGLE_FACTOR_MAX
    skip_nonfinite: bool = True

    measures = True

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        margin = real("margin", self.margin)
        if not 1 <= margin <= F32_MAX:
            raise ValueError(f"margin must be in [1, {F32_MAX!r}], got {margin!r}")
        set_(self, "margin", margin)
        set_(self, "history", integer("history", self.history, 1))
        set_(self, "dtype", _compute_dtype(self.dtype))
        set_(self, "max_growth", factor("max_growth", self.max_growth, below_one=False))
        set_(
            self,
            "backoff_factor",
            factor("backoff_factor", self.backoff_factor, below_one=True),
        )
        set_(self, "skip_nonfinite", flag("skip_nonfinite", self.skip_nonfinite))
        for key, value in bounds(self.__dict__, lambda field: field).items():
            set_(self, key, value)
        for key in ("init_scale", "min_scale", "max_growth", "backoff_factor"):
            value = getattr(self, key)
            if not is_pow2(to_f32(value)):
                raise ValueError(
                    f"{key} must be a power of two (the measured rule keeps its "
                    f"scale one, so that unscaling is exact), got {value!r}"
                )

    @property
    def compute_max(self) -> float:
        """The compute dtype's largest finite value (what the rule keeps below)."""
        return float(jnp.finfo(self.dtype).max)

    @property
    def cap(self) -> float:
        """The largest power of two the scale may reach (<= ``max_scale``)."""
        mantissa, exponent = math.frexp(self.max_scale_f32)
        return math.ldexp(1.0, exponent - 1) if mantissa != 0.5 else self.max_scale_f32

    def in_range(self, scale: jax.Array) -> jax.Array:
        """Whether ``scale`` is a power of two in ``[min_scale, max_scale]``."""
        return super().in_range(scale) & _is_pow2_array(scale)

    def check_scale(self, name: str, value: Any) -> float:
        """A concrete power-of-two scale in range, or an error naming ``name``."""
        value = super().check_scale(name, value)
        if not is_pow2(to_f32(value)):
            raise ValueError(
                f"{name} must be a power of two for jls.measured_scale (its scales "
                f"are powers of two, so that unscaling is exact), got {value!r}"
            )
        return value

    def _clamped(self, scale: jax.Array) -> jax.Array:
        """In range, and a power of two (a scale set by hand becomes one)."""
        return _pow2_floor(super()._clamped(scale))

    def _next(self, state, finite, dropped, magnitude, retries):
        f32, i32 = jnp.float32, jnp.int32
        scale = state.scale
        backed = jnp.maximum(scale * f32(self.backoff_factor), f32(self.min_scale))
        # A headroom out of range reads as 1; others are rounded to a power of two.
        headroom = state.headroom
        headroom = jnp.where(
            (headroom >= 1) & (headroom <= f32(_HEADROOM_MAX)),
            _pow2_floor(headroom),
            f32(1),
        )
        # A run's first overflow doubles it; every `history` finite steps halve it.
        first = ~finite & (state.consecutive_nonfinite == 0) & (retries == 0)
        count = optax.safe_increment(state.growth_count)
        relax = finite & (count >= i32(self.history))
        headroom = jnp.where(
            first,
            jnp.minimum(headroom / f32(self.backoff_factor), f32(_HEADROOM_MAX)),
            jnp.where(relax, jnp.maximum(headroom / f32(self.max_growth), 1), headroom),
        )
        growth_count = jnp.where(finite & ~relax, count, i32(0))
        if magnitude is None:
            backoff_count = state.backoff_count
            return (
                jnp.where(finite, scale, backed),
                growth_count,
                backoff_count,
                headroom,
            )
        m = jnp.asarray(magnitude)
        if m.dtype != jnp.float32 or m.shape != ():
            raise TypeError(
                f"magnitude must be a float32 scalar, got dtype {m.dtype} and "
                f"shape {m.shape}"
            )
        # The largest power of two keeping the magnitude margin * headroom below.
        cap = f32(self.cap)
        limit = f32(self.compute_max / self.margin) / headroom
        wanted = scale * (limit / m)
        target = jnp.where(
            jnp.isfinite(wanted) & (wanted > 0),
            _pow2_floor(jnp.where(wanted > 0, wanted, 1)),
            jnp.where(wanted > 0, cap, f32(0)),
        )
        grown = jnp.minimum(jnp.minimum(target, scale * f32(self.max_growth)), cap)
        # A finite step a hook vetoed holds the scale (an outlier, not the range).
        hold = finite & dropped
        scale = jnp.where(finite, jnp.where(hold, scale, grown), backed)
        return scale, growth_count, state.backoff_count, headroom


_M = MeasuredScale  # the defaults, written once as the dataclass's


def measured_scale(
    margin: float = _M.margin,
    *,
    history: int = _M.history,
    dtype: Any = jnp.float16,
    init_scale: float = _M.init_scale,
    max_growth: float = _M.max_growth,
    backoff_factor: float = _M.backoff_factor,
    min_scale: float = _M.min_scale,
    max_scale: float = _M.max_scale,
    skip_nonfinite: bool = _M.skip_nonfinite,
) -> LossScaler:
    """A scale chosen from the gradients' measured range: no interval to tune.

    After a finite step the next scale is the largest power of two keeping the
    scaled gradients' largest RMS ``margin * headroom`` below ``dtype``'s max.

    Args:
      margin: the headroom below ``dtype``'s maximum, ``>= 1``.
      history: finite steps that halve the headroom an overflow added.
      dtype: the gradients' dtype (float16; an fp8 type).
      init_scale: the first step's scale, a power of two.
      max_growth: the most the scale grows in one step, a power of two ``>= 1``.
      backoff_factor: the back-off, a power of two in (0, 1].
      min_scale: the floor, a power of two.
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
      >>> state = scaler.adjust(scaler.init(), True, magnitude=jnp.float32(2.0**-3))
      >>> float(state.scale) == 2.0**16
      True
    """
    return MeasuredScale(**locals())  # the arguments are the fields, by name
