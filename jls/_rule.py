"""`LossScaler`: what every loss-scale rule is, and what they all share.

A rule is a frozen, validated dataclass closed over by the step. Each rule
writes only ``_next``; this base class does the checks, range and counters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from jls._scaling import SINGLE_FACTOR_MAX
from jls._state import LossScaleState, check_state, make_state, overwritten
from jls._validate import positive_f32, scale_in, to_f32


def bool_scalar(name: str, value: ArrayLike) -> jax.Array:
    """``value`` as a scalar bool array, or a ``TypeError`` naming ``name``."""
    value = jnp.asarray(value)
    if value.dtype != jnp.bool_ or value.shape != ():
        raise TypeError(
            f"{name} must be a scalar bool, got dtype {value.dtype} and shape "
            f"{value.shape}"
        )
    return value


def count_if(cond: jax.Array, count: jax.Array, otherwise: jax.Array) -> jax.Array:
    """``count + 1`` (saturating at the int32 maximum) where ``cond``."""
    return jnp.where(cond, optax.safe_increment(count), otherwise)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossScaler:
    """A loss-scale rule: an immutable, hashable configuration.

    Made by `jls.dynamic_scale` and its siblings or a `jls.presets` preset.

    Attributes:
      init_scale: the scale of the first step.
      min_scale: the scale never backs off below this.
      max_scale: the scale never grows above this.
      skip_nonfinite: whether a step with non-finite gradients is dropped.

    Example:
      >>> import jls
      >>> jls.dynamic_scale(init_scale=8.0).init_scale
      8.0
    """

    init_scale: float
    min_scale: float
    max_scale: float
    skip_nonfinite: bool

    #: Whether the rule follows the gradients' measured range.
    measures = False

    @property
    def min_scale_f32(self) -> float:
        """``min_scale`` as the float32 value the state machine uses."""
        return to_f32(self.min_scale)

    @property
    def max_scale_f32(self) -> float:
        """``max_scale`` as the float32 value the state machine uses."""
        return to_f32(self.max_scale)

    @property
    def is_dynamic(self) -> bool:
        """Whether the scale can ever change."""
        return True

    @property
    def is_identity(self) -> bool:
        """Whether the scale is 1 forever (scaling and unscaling do nothing)."""
        return not self.is_dynamic and self.init_scale == 1

    @property
    def two_factor(self) -> bool:
        """Whether unscaling needs two factors (``max_scale`` above 2**126)."""
        return self.max_scale_f32 > SINGLE_FACTOR_MAX

    def in_range(self, scale: jax.Array) -> jax.Array:
        """Whether ``scale`` lies in ``[min_scale, max_scale]`` (False for nan).

        A step at an out-of-range scale is treated as non-finite and dropped.
        """
        f32 = jnp.float32
        return (scale >= f32(self.min_scale_f32)) & (scale <= f32(self.max_scale_f32))

    def check_scale(self, name: str, value: Any) -> float:
        """A concrete scale this rule can use, or an error naming ``name``."""
        return scale_in(name, value, self.min_scale_f32, self.max_scale_f32)

    def restart(self, scale: jax.Array) -> LossScaleState:
        """The state of a fresh start of this rule at ``scale``."""
        return make_state(1.0)._replace(scale=scale)

    def init(self) -> LossScaleState:
        """Returns the state before the first step, at ``init_scale``."""
        return make_state(self.init_scale)

    def adjust(
        self,
        state: LossScaleState,
        grads_finite: ArrayLike,
        *,
        applied: ArrayLike | None = None,
        magnitude: ArrayLike | None = None,
        retries: ArrayLike | None = None,
    ) -> LossScaleState:
        """Advances the state machine by one step; pure, jittable and vmappable.

        Args:
          state: the current `LossScaleState`.
          grads_finite: a scalar bool, whether the gradients were all finite.
          applied: a scalar bool, whether the update was applied.
          magnitude: a float32 scalar, the scaled gradients' largest RMS.
          retries: how many times this step's gradients were recomputed.

        Returns:
          The next `LossScaleState`.

        Raises:
          TypeError: if ``state`` or ``grads_finite`` has the wrong type.

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
        valid = self.in_range(state.scale)
        finite = bool_scalar("grads_finite", grads_finite) & valid
        if applied is None:
            # Dropped when not finite (unless the rule applies such steps).
            dropped = ~finite if self.skip_nonfinite else ~valid
        else:
            dropped = ~bool_scalar("applied", applied)
        i32 = jnp.int32
        retried = i32(0) if retries is None else jnp.asarray(retries, i32)
        retried = overwritten(state.retries, retried)
        scale, growth_count, backoff_count, headroom = self._next(
            state, finite, dropped, magnitude, retried
        )
        return LossScaleState(
            scale=self._clamped(scale),
            growth_count=growth_count,
            backoff_count=backoff_count,
            consecutive_skips=count_if(dropped, state.consecutive_skips, i32(0)),
            total_skips=count_if(dropped, state.total_skips, state.total_skips),
            consecutive_nonfinite=count_if(
                ~finite, state.consecutive_nonfinite, i32(0)
            ),
            retries=retried,
            headroom=headroom,
        )

    def retry(self, state: LossScaleState, attempt: ArrayLike) -> LossScaleState:
        """Retry ``attempt``'s state: a non-finite step's, the skip counters kept."""
        attempt = jnp.asarray(attempt, jnp.int32)
        # The overflow it follows was that of attempt ``attempt - 1``.
        nxt = self.adjust(state, jnp.asarray(False), retries=attempt - 1)
        return nxt._replace(
            consecutive_skips=state.consecutive_skips,
            total_skips=state.total_skips,
            consecutive_nonfinite=state.consecutive_nonfinite,
            retries=nxt.retries + 1,
        )

    def hold(self, state: LossScaleState, grads_finite: ArrayLike) -> LossScaleState:
        """The state after a step skipped without moving the rule (a hook's veto)."""
        state = check_state(state)
        finite = bool_scalar("grads_finite", grads_finite)
        i32 = jnp.int32
        return state._replace(
            consecutive_skips=count_if(
                jnp.asarray(True), state.consecutive_skips, i32(0)
            ),
            total_skips=optax.safe_increment(state.total_skips),
            consecutive_nonfinite=count_if(
                ~finite, state.consecutive_nonfinite, i32(0)
            ),
            retries=overwritten(state.retries, 0),
        )

    def _next(
        self,
        state: LossScaleState,
        finite: jax.Array,
        dropped: jax.Array,
        magnitude: ArrayLike | None,
        retries: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """The rule itself: ``(scale, growth_count, backoff_count, headroom)``."""
        raise NotImplementedError

    def _clamped(self, scale: jax.Array) -> jax.Array:
        """``scale`` brought into ``[min_scale, max_scale]``; nan to ``min_scale``."""
        low, high = jnp.float32(self.min_scale_f32), jnp.float32(self.max_scale_f32)
        return jnp.where(scale >= low, jnp.minimum(scale, high), low)


def bounds(fields: Mapping[str, Any], name: Callable[[str], str]) -> dict[str, float]:
    """``min_scale``, ``max_scale`` and ``init_scale``, checked against each other."""
    low = positive_f32(name("min_scale"), fields["min_scale"])
    high = positive_f32(name("max_scale"), fields["max_scale"])
    if low > high:
        raise ValueError(
            f"{name('min_scale')} must be <= {name('max_scale')}, got {low!r} and "
            f"{high!r}"
        )
    init = positive_f32(name("init_scale"), fields["init_scale"])
    if not low <= init <= high:
        raise ValueError(
            f"{name('init_scale')} must be in [{name('min_scale')}, "
            f"{name('max_scale')}] = [{low!r}, {high!r}], got {init!r}"
        )
    return {"min_scale": low, "max_scale": high, "init_scale": init}


def checked_scaler(scaler: Any) -> LossScaler:
    """``scaler`` if it is a `LossScaler`, else a ``TypeError`` saying which are."""
    if not isinstance(scaler, LossScaler):
        raise TypeError(
            "scaler must be a jls scaler (jls.dynamic_scale(), "
            "jls.measured_scale(), jls.static_scale(v), jls.no_scale() or a "
            f"jls.presets one), got {scaler!r:.200}"
        )
    return scaler


def is_pow2(value: float) -> bool:
    """Whether a positive float is a power of two."""
    return math.frexp(value)[0] == 0.5
