"""The squares check: the finite flag, the gradients' range and their norm.

One pass gives the flag, each reduction's root-mean-square and the global
norm. A finite plain sum proves every value finite; only when it is not does
a second pass (in a ``lax.cond``) sum the squares shrunk by ``2**-84``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jls._compat import pvary, tracked_in, varying_axes
from jls._finite import (
    SMALL_LEAF,
    exact,
    inexact_leaves,
    is_complex,
    runs,
    sharded_in_its_type,
)
from jls._scaling import compute_dtype, unscale_tree
from jls._shards import shard_axes


class Measured(NamedTuple):
    """What the squares check reads off the scaled gradients in its one pass.

    Attributes:
      finite: scalar bool, whether every value is finite on every device.
      magnitude: float32 scalar, the largest root-mean-square over the check's
        reductions; 0 for a tree with nothing to check.
      low: float32 scalar, the sum of the squares (inf past float32's range).
      high: float32 scalar, the same sum in units of ``2**-168``.
      flags: the caller's scalar bools, each true where it is on every device.
    """

    finite: jax.Array
    magnitude: jax.Array
    low: jax.Array
    high: jax.Array
    flags: tuple[jax.Array, ...] = ()


# Shrunk by 2**-84 (float64: 2**-532), 2**31 squares stay below the maximum.
_SHRINK_EXP = {np.dtype(np.float32): 84, np.dtype(np.float64): 532}
_HIGH_EXP = 2 * _SHRINK_EXP[np.dtype(np.float32)]  # Measured.high's unit


def _values(parts: list[jax.Array], dtype: Any) -> list[jax.Array]:
    """``parts`` as real arrays of ``dtype``; complex ones as two parts."""
    pieces = []
    for x in parts:
        pieces.extend([jnp.real(x), jnp.imag(x)] if is_complex(x) else [x])
    return [p.astype(dtype) for p in pieces]


def _sum_of(parts: list[jax.Array], dtype: Any, square: Any) -> jax.Array:
    """``sum(square(x))`` over ``parts`` (concatenated: one kernel) in ``dtype``."""
    pieces = _values(parts, dtype)
    if len(parts) == 1:
        return jnp.sum(functools.reduce(jnp.add, [square(p) for p in pieces]))
    return jnp.sum(square(jnp.concatenate([p.ravel() for p in pieces])))


def leaves_squares(
    leaves: list[jax.Array],
    shards: tuple[frozenset[str], ...] = (),
    named: tuple[str, ...] = (),
    flags: tuple = (),
) -> Measured:
    """The finite check as a sum of squares, with the range and norm it gives.

    Reductions as `leaves_finite`'s; one all-reduce in all (`_agreed`).
    """
    shards = shards or (frozenset(),) * len(leaves)
    reductions: list[tuple[list[jax.Array], Any, frozenset[str]]] = []
    small: dict[Any, list[jax.Array]] = {}
    for x, axes in zip(leaves, shards, strict=True):
        wide = compute_dtype(jnp.real(x).dtype)
        if not x.size:
            continue
        if x.size <= SMALL_LEAF and not sharded_in_its_type(x):
            small.setdefault((wide, axes), []).append(x)
        else:
            reductions.append(([x], wide, axes))
    reductions.extend(
        (run, wide, axes)
        for (wide, axes), parts in small.items()
        for run in runs(parts)
    )
    f32 = jnp.float32
    lows = [_sum_of(parts, wide, lambda v: v * v) for parts, wide, _ in reductions]

    def shrunk(_):
        out = []
        for (parts, wide, _), low in zip(reductions, lows, strict=True):
            c = jnp.asarray(2.0 ** -_SHRINK_EXP[np.dtype(wide)], wide)
            high = _sum_of(parts, wide, lambda v, c=c: jnp.square(jnp.abs(v) * c))
            out.append(_in_high_units(low, high, wide))
        return out

    def from_low(_):
        return [
            _in_high_units(low, None, wide)
            for (_, wide, _), low in zip(reductions, lows, strict=True)
        ]

    every_low_finite = functools.reduce(
        jnp.logical_and, [jnp.isfinite(low) for low in lows], jnp.asarray(True)
    )
    highs = lax.cond(every_low_finite, from_low, shrunk, None) if lows else []
    finite = functools.reduce(
        jnp.logical_and, [jnp.isfinite(h) for h in highs], jnp.asarray(True)
    )
    rows = [
        jnp.stack([low.astype(f32), high, f32(sum(p.size for p in parts))])
        for (parts, _, _), low, high in zip(reductions, lows, highs, strict=True)
    ]
    tracked = tracked_in(leaves, named)
    varying = [axes for _, _, axes in reductions]
    rows, agreed = _agreed(rows, varying, named, tracked, (finite, *flags))
    magnitudes, low_total, high_total = [f32(0)], f32(0), f32(0)
    for low, high, size in rows:
        rms_low = jnp.sqrt(low / size)
        rms_high = jnp.ldexp(jnp.sqrt(high / size), _HIGH_EXP // 2)
        magnitudes.append(jnp.where(jnp.isfinite(low), rms_low, rms_high))
        low_total, high_total = low_total + low, high_total + high
    magnitude = functools.reduce(jnp.maximum, magnitudes)
    return Measured(agreed[0], magnitude, low_total, high_total, tuple(agreed[1:]))


def _agreed(
    rows: list[jax.Array],
    varying: list[frozenset[str]],
    named: tuple[str, ...],
    tracked: bool,
    flags: tuple[jax.Array, ...],
) -> tuple[list[jax.Array], list[jax.Array]]:
    """Rows added over the axes they are sharded on, ``flags`` and-ed: one psum."""
    f32 = jnp.float32
    bad = jnp.stack([(~jnp.asarray(f)).astype(f32) for f in flags])
    axes = tuple(sorted(set(named).union(*varying, varying_axes(bad))))
    if not axes:
        return rows, list(bad == 0)
    parts = [bad]
    for row, sharded in zip(rows, varying, strict=True):
        first = [lax.axis_index(a) == 0 for a in axes if a not in sharded]
        parts.append(jnp.where(functools.reduce(jnp.logical_and, first, True), row, 0))
    if tracked:  # jax records varying axes: the psum's operand varies over all
        parts = [pvary(p, set(axes) - varying_axes(p)) for p in parts]
    total = lax.psum(jnp.concatenate(parts), axes)
    n = len(flags)
    return list(total[n:].reshape(-1, 3)), list(total[:n] == 0)


def _in_high_units(low: jax.Array, high: Any, dtype: Any) -> jax.Array:
    """A reduction's sum of squares in float32 units of ``2**-168`` (or inf)."""
    f32 = jnp.float32
    scaled = (low * jnp.asarray(2.0**-_HIGH_EXP, low.dtype)).astype(f32)
    if high is None:
        return scaled
    if np.dtype(dtype) == np.dtype(np.float64):
        # Its plain sum overflows only past 2**1024, far past float32 units.
        return jnp.where(
            jnp.isfinite(low),
            scaled,
            jnp.where(jnp.isfinite(high), f32(jnp.inf), f32(jnp.nan)),
        )
    return jnp.where(jnp.isfinite(low), scaled, high.astype(f32))


def unscaled_norm(measured: Measured, scale: jax.Array) -> jax.Array:
    """The global norm of the unscaled gradients, exact for every finite norm."""
    f32 = jnp.float32
    scale = scale.astype(f32)
    plain = jnp.sqrt(measured.low) / scale
    mantissa, exponent = jnp.frexp(jnp.sqrt(measured.high))
    s_mantissa, s_exponent = jnp.frexp(scale)
    big = jnp.ldexp(mantissa / s_mantissa, exponent - s_exponent + _HIGH_EXP // 2)
    return jnp.where(jnp.isfinite(measured.low), plain, big)


_squares_jit = jax.jit(leaves_squares, static_argnums=(1, 2))


def unscaled_measured(
    grads: Any,
    scale: jax.Array,
    *,
    scale_may_be_below_one: bool,
    named: tuple[str, ...] = (),
    flags: tuple = (),
) -> Measured:
    """`unscaled_finite` as the squares check, with its range and norm.

    The replicas over ``named`` agree on it and on ``flags`` in one all-reduce.
    """
    what = "the gradient norm (gradient_norm, skip_spikes, measured_scale)"
    pairs = [
        (y, axes)
        for x, axes in zip(
            jax.tree.leaves(grads), shard_axes(grads, named, what), strict=True
        )
        for y in inexact_leaves(x)
    ]
    leaves = [x for x, _ in pairs]
    shards = tuple(axes for _, axes in pairs)
    if not scale_may_be_below_one:
        return _squares_jit(leaves, shards, named, flags)
    unscaled = lax.cond(  # below 1, the unscaled values may overflow
        scale >= 1,
        lambda xs: jnp.asarray(True),
        lambda xs: exact(unscale_tree(xs, scale, two_factor=False)),
        leaves,
    )
    measured = _squares_jit(leaves, shards, named, (unscaled, *flags))
    finite, *agreed = measured.flags
    return measured._replace(finite=measured.finite & finite, flags=tuple(agreed))
