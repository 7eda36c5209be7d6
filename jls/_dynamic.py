"""The dynamic rule: grow while finite, back off on overflow.

Micikevicius et al., "Mixed Precision Training", ICLR 2018, with the peers'
variants (docs/scalers.md). A static scaler is this rule with both factors 1,
and the presets are configuration of it, never separate code paths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jls._rule import SINGLE_FACTOR_MAX, LossScaler, bounds
from jls._state import LossScaleState, make_state
from jls._validate import factor, flag, integer, positive_f32, real

Namer = Callable[[str], str]


def own(field: str) -> str:
    """A field's own name (the `Namer` of jls's factories)."""
    return field


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamicScale(LossScaler):
    """The dynamic rule's configuration, resolved; see `dynamic_scale`."""

    init_scale: float = 2.0**15
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    first_growth_interval: int | None = None
    init_growth_count: int | None = None
    saturate_growth: bool = False
    backoff_divisor: float | None = None
    backoff_interval: int = 1
    hysteresis: int = 1
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    max_scale: float = SINGLE_FACTOR_MAX
    skip_nonfinite: bool = True

    def __post_init__(self) -> None:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for key, value in validated(fields, own).items():
            object.__setattr__(self, key, value)

    @classmethod
    def named(cls, name: Namer, **fields: Any) -> DynamicScale:
        """The rule from ``fields`` (the rest default), errors naming ``name(f)``."""
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        defaults["backoff_factor"] = None  # resolved from backoff_divisor
        unknown = set(fields) - set(defaults)
        if unknown:
            raise TypeError(f"unknown scaler fields: {sorted(unknown)}")
        return cls(**validated({**defaults, **fields}, name))

    @property
    def growth_restart(self) -> int:
        """The growth count after a non-finite step (< 0: a longer first interval)."""
        assert self.first_growth_interval is not None
        return self.growth_interval - self.first_growth_interval

    @property
    def is_dynamic(self) -> bool:
        """Whether the scale can ever change."""
        return self.growth_factor != 1 or self.backoff_factor != 1

    def init(self) -> LossScaleState:
        """Returns the state before the first step (see `jls.LossScaler.init`)."""
        count = self.init_growth_count
        return make_state(self.init_scale, growth_count=0 if count is None else count)

    def restart(self, scale: jax.Array) -> LossScaleState:
        """A fresh start at ``scale``: the growth count at its restart value."""
        return make_state(1.0, growth_count=self.growth_restart)._replace(scale=scale)

    def _next(self, state, finite, dropped, magnitude, retries):
        del dropped, magnitude, retries  # the dynamic rule reads neither
        f32, i32 = jnp.float32, jnp.int32
        scale = state.scale
        # Growth on the growth_interval-th finite step in a row, within max_scale.
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
        backoff, backoff_count = self._backoff(state, finite, at_interval)
        if not self.is_dynamic:
            return scale, growth_count, backoff_count, state.headroom
        backed = jnp.maximum(self._backed(scale), f32(self.min_scale))
        scale = jnp.where(grow, grown, jnp.where(backoff, backed, scale))
        return scale, growth_count, backoff_count, state.headroom

    def _backoff(
        self, state: LossScaleState, finite: jax.Array, at_interval: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """``(back off now, the next backoff_count)``."""
        i32 = jnp.int32
        backoff_after = max(self.backoff_interval, self.hysteresis)
        if backoff_after == 1:  # the plain rule: every non-finite step backs off
            return ~finite, state.backoff_count
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
        return backoff, jnp.where(finite, after_finite, after_backoff)

    def _backed(self, scale: jax.Array) -> jax.Array:
        """The scale after one back-off (before the floor)."""
        f32 = jnp.float32
        if self.backoff_divisor is None:
            return scale * f32(self.backoff_factor)
        # `scale - scale` (0, never folded) stops XLA's x / c -> x * (1 / c).
        return scale / (f32(self.backoff_divisor) + (scale - scale))


def validated(fields: Mapping[str, Any], name: Namer) -> dict[str, Any]:
    """The dynamic rule's fields validated and resolved; errors name ``name(field)``."""
    out = dict(fields)
    out["init_scale"] = positive_f32(name("init_scale"), fields["init_scale"])
    out["growth_factor"] = factor(
        name("growth_factor"), fields["growth_factor"], below_one=False
    )
    out["backoff_factor"], out["backoff_divisor"] = _backoff_pair(fields, name)
    interval = integer(name("growth_interval"), fields["growth_interval"], 1)
    out["growth_interval"] = interval
    first = fields["first_growth_interval"]
    out["first_growth_interval"] = first = integer(
        name("first_growth_interval"), interval if first is None else first, interval
    )
    count = fields["init_growth_count"]
    out["init_growth_count"] = integer(
        name("init_growth_count"),
        interval - first if count is None else count,
        interval - first,
        interval - 1,
    )
    for key in ("backoff_interval", "hysteresis"):
        out[key] = integer(name(key), fields[key], 1)
    if out["backoff_interval"] > 1 and out["hysteresis"] > 1:
        raise ValueError(
            f"set at most one of {name('backoff_interval')} and "
            f"{name('hysteresis')} above 1 (two different rules), got "
            f"{out['backoff_interval']!r} and {out['hysteresis']!r}"
        )
    for key in ("saturate_growth", "consecutive_hysteresis", "skip_nonfinite"):
        out[key] = flag(name(key), fields[key])
    out.update(bounds(fields, name))
    return out


def _backoff_pair(fields: Mapping[str, Any], name: Namer) -> tuple[float, float | None]:
    """``(backoff_factor, backoff_divisor)``: at most one given, both valid."""
    backoff, divisor = fields["backoff_factor"], fields["backoff_divisor"]
    if divisor is None:
        backoff = 0.5 if backoff is None else backoff
        return factor(name("backoff_factor"), backoff, below_one=True), None
    divisor = factor(name("backoff_divisor"), divisor, below_one=False)
    if backoff is not None and real(name("backoff_factor"), backoff) != 1 / divisor:
        raise ValueError(
            f"give {name('backoff_factor')} or {name('backoff_divisor')}, not "
            f"both; got {backoff!r} and {divisor!r}"
        )
    return factor(f"1 / {name('backoff_divisor')}", 1 / divisor, below_one=True), (
        divisor
    )


_D = DynamicScale  # the defaults, written once as the dataclass's


def dynamic_scale(
    init_scale: float = _D.init_scale,
    *,
    growth_factor: float = _D.growth_factor,
    backoff_factor: float | None = None,
    growth_interval: int = _D.growth_interval,
    first_growth_interval: int | None = _D.first_growth_interval,
    init_growth_count: int | None = _D.init_growth_count,
    saturate_growth: bool = _D.saturate_growth,
    backoff_divisor: float | None = _D.backoff_divisor,
    backoff_interval: int = _D.backoff_interval,
    hysteresis: int = _D.hysteresis,
    consecutive_hysteresis: bool = _D.consecutive_hysteresis,
    min_scale: float = _D.min_scale,
    max_scale: float = _D.max_scale,
    skip_nonfinite: bool = _D.skip_nonfinite,
) -> LossScaler:
    """The dynamic loss-scale rule: grow while finite, back off on overflow.

    Args:
      init_scale: the first step's scale, in ``[min_scale, max_scale]``.
      growth_factor: multiplies the scale on growth; ``>= 1``.
      backoff_factor: multiplies the scale on back-off; in ``(0, 1]`` (0.5).
      growth_interval: the scale grows on this many consecutive finite steps.
      first_growth_interval: the interval after the start or an overflow.
      init_growth_count: the growth count before the first step (to resume).
      saturate_growth: a growth past ``max_scale`` lands on it.
      backoff_divisor: divide by this (``>= 1``) instead of ``backoff_factor``.
      backoff_interval: back off on every this many non-finite steps in a row.
      hysteresis: tolerate ``hysteresis - 1`` overflows since the last growth.
      consecutive_hysteresis: any finite step restores the hysteresis.
      min_scale: the floor of back-off (may be below 1).
      max_scale: the ceiling of growth.
      skip_nonfinite: drop a step whose gradients are not finite (default).

    Returns:
      A `LossScaler`.

    Raises:
      TypeError: if an argument has the wrong type (the message names it).
      ValueError: if an argument is out of range (the message names it).

    Example:
      >>> import jls
      >>> jls.dynamic_scale(init_scale=2.0**10, growth_interval=100).init().scale
      Array(1024., dtype=float32)
    """
    return DynamicScale(**locals())  # the arguments are the fields, by name
