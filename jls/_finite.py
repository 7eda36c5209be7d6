"""The all-finite check: one pass over the gradients, exact, at memory speed.

Design (chosen by measurement; ``benchmarks/bench_all_finite.py`` re-runs it):

* For float32, bfloat16, float64 and complex leaves the check is a sum of magnitudes per
  leaf (``sum(|x| * 2**-k)``, see below; accumulated in float32, or in the leaf's own
  dtype when wider) followed by one ``isfinite`` of the total. On XLA:CPU it runs at
  0.6-0.75x a plain sum when called alone (bfloat16 in a few large leaves: 0.4x, the
  shrink's multiplication breaks XLA:CPU's fast convert-and-sum loop) (and costs nothing
  measurable inside a train step, where XLA fuses it with work it does anyway), where
  ``jnp.isfinite(x).all()`` costs 2-4x, any select 5-8x, and an integer reduction over
  the bits (exponent max) 4-10x: it does not vectorise. ``jnp.max`` is never used: on
  XLA:CPU it drops nan on large arrays.
* Why magnitudes, and not the plain sum (jls 0.1): the gradient is usually produced in
  the same ``jit``, and the compiler fuses its producer into the reduction. With a plain
  sum, ``sum(a * c)`` may be contracted into ``fma(a, c, acc)`` or factored into ``c *
  sum(a)``, so the sum sees the unrounded products while the stored gradient holds their
  rounded inf, and cancellation against other elements hides it. ``abs`` sits between
  the producer and the addition (nothing left to contract), and no term can cancel
  another: every rewrite of ``sum(|x|)`` that is exact in real arithmetic is at least
  ``|x_i|`` for every element, and float rounding is monotone, so an element that rounds
  to inf makes the sum inf whatever the compiler does. An inf or nan element makes its
  leaf's sum inf or nan, and that survives every further addition.
* The magnitudes are multiplied by a power of two, ``2**-k`` with ``2**k >= 256 *
  leaf_size``, before they are summed, so a sum of finite values cannot overflow: every
  term is at most ``float32_max / (256 * size)``, and even the worst-case rounding of
  ``size`` additions (a factor ``1 + size * 2**-24``, at most 129 for ``size < 2**31``)
  keeps the total finite. The check therefore has no false positives and no false
  negatives without a second, exact pass (the design before 0.2 confirmed a non-finite
  total with a per-leaf ``isfinite`` pass inside a ``lax.cond``, which added about 30%
  to the compile time of the README's LM). The multiplication is exact except where it
  flushes a tiny magnitude to zero, which cannot change finiteness; it is not factored
  out of the sum (``tests/test_finite.py`` checks a leaf of near-maximal values).
* Leaves of at most ``SMALL_LEAF`` elements (biases, norm scales) are checked
  together, one reduction per compute dtype over their concatenation: each
  reduction is a kernel XLA compiles, and on the README's LM 63 of the 101
  leaves are small. They are concatenated before the magnitude is taken, so
  the magnitude is one kernel, not one per leaf (a small gradient is often
  the output of a reduction that nothing else fuses into). Large leaves keep
  a reduction of their own, fused with the gradient's producer, at the
  bandwidth floor. (Adding large leaves of one shape elementwise into one
  reduction cuts the kernels further, but compiled no faster on the LM: the
  fusion with many operands costs what the kernels it saves cost.)
* float16, fp8 and fp4 leaves use ``jnp.isfinite(x).all()`` directly: it reads each
  rounded element (nothing to contract), and on XLA:CPU converting them to float32 costs
  2-5x more than testing them in their own format.

Integer, bool and float0 leaves and ``None`` are ignored; an empty tree is
finite.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import config as jax_config

from jls._scaling import compute_dtype, reciprocals, unscale_leaf, unscale_tree

_NATIVE_CHECK_MAX_BITS = 16  # float16 and fp8: test in the leaf's own format
SMALL_LEAF = 2**14  # leaves this small share one reduction


def _inexact_leaves(tree: Any) -> list[jax.Array]:
    leaves = []
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):  # Python and numpy numbers
            leaf = jnp.asarray(leaf)
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            leaves.append(leaf)
    return leaves


def _checked_natively(dtype: Any) -> bool:
    dtype = np.dtype(dtype)
    return (
        jnp.issubdtype(dtype, jnp.floating)
        and dtype.itemsize * 8 <= _NATIVE_CHECK_MAX_BITS
        and dtype != jnp.bfloat16
    )


def _sharded_in_its_type(x: jax.Array) -> bool:
    """Whether ``x``'s type names mesh axes (explicit sharding).

    Such leaves cannot be raveled or concatenated with others without saying
    how the result is sharded: they are checked one by one.
    """
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return any(axis is not None for axis in (spec or ()))


def varying_axes(x: jax.Array) -> frozenset[str]:
    """The ``shard_map`` axes ``x``'s value varies over (empty outside one).

    ``jax.typeof(x).vma`` up to jax 0.9, ``.manual_axis_type.varying`` after.
    """
    aval = jax.typeof(x)
    varying = getattr(aval, "vma", None)
    if varying is None:
        varying = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(varying or ())


def _is_complex(x: jax.Array) -> bool:
    return jnp.issubdtype(x.dtype, jnp.complexfloating)


def _exact(leaves: list[jax.Array]) -> jax.Array:
    ok = jnp.asarray(True)
    for leaf in leaves:
        ok = ok & jnp.all(jnp.isfinite(leaf))
    return ok


def _shrunk_sum(parts: list[jax.Array], size: int, dtype: Any) -> jax.Array:
    """``sum(|x| * 2**-k)`` over ``parts`` in ``dtype``, ``2**k >= 256 * size``.

    Several parts are cast and concatenated first, so that the magnitude and
    the shrink are one kernel.
    """
    shrink = jnp.asarray(2.0 ** -((size - 1).bit_length() + 8), dtype)
    if len(parts) > 1:
        flat = jnp.concatenate([x.astype(dtype).ravel() for x in parts])
    else:
        flat = parts[0].astype(dtype)
    return jnp.sum(jnp.abs(flat) * shrink, dtype=dtype)


def leaves_finite(leaves: list[jax.Array]) -> jax.Array:
    """Exact finiteness of a list of inexact arrays, in one pass.

    Each large leaf has a reduction of its own (it runs at the bandwidth
    floor, fused with the gradient's producer); the small ones (biases, norm
    scales: at most `SMALL_LEAF` elements) are checked together, in one
    reduction per compute dtype, because each reduction is a kernel XLA
    compiles: on the README's LM this removes 63 of 101.
    """
    flags = []
    small: dict[Any, list[jax.Array]] = {}
    for x in leaves:
        if _checked_natively(x.dtype):
            flags.append(jnp.all(jnp.isfinite(x)))
            continue
        parts = [jnp.real(x), jnp.imag(x)] if _is_complex(x) else [x]
        wide = compute_dtype(parts[0].dtype)
        if x.size <= SMALL_LEAF and not _sharded_in_its_type(x):
            small.setdefault(wide, []).extend(parts)
        else:
            flags.extend(jnp.isfinite(_shrunk_sum([p], p.size, wide)) for p in parts)
    for wide, parts in small.items():
        size = sum(p.size for p in parts)
        flags.append(jnp.isfinite(_shrunk_sum(parts, size, wide)))
    if not flags:
        return jnp.asarray(True)
    return jnp.all(jnp.stack(flags))


class Measured(NamedTuple):
    """What the squares check reads off the scaled gradients in its one pass.

    Attributes:
      finite: scalar bool, whether every value is finite (exact: no false
        positive however large the finite values, see `leaves_squares`). Not
        yet agreed across replicas.
      magnitude: float32 scalar, the largest root-mean-square over the
        check's reductions (one per large leaf, one per group of small
        leaves), of the whole gradient for one sharded over ``shard_map``
        axes: what the measured scaler keeps below the compute dtype's
        maximum. 0 for a tree with nothing to check.
      low: float32 scalar, the sum of the squares of every scaled value
        (inf when it overflows float32).
      high: float32 scalar, the same sum in units of ``2**-168``: finite
        whenever every value is (`norm` reads it when ``low`` overflowed).
    """

    finite: jax.Array
    magnitude: jax.Array
    low: jax.Array
    high: jax.Array


# The squares are also summed shrunk by 2**-84 (float64: 2**-532) when their
# plain sum overflows: a square is then at most 2**88 (2**960), and 2**31
# of them, with the worst rounding of the additions (a factor 129), stay
# below the float32 (float64) maximum.
_SHRINK_EXP = {np.dtype(np.float32): 84, np.dtype(np.float64): 532}
_HIGH_EXP = 2 * _SHRINK_EXP[np.dtype(np.float32)]  # Measured.high's unit


def _values(parts: list[jax.Array], dtype: Any) -> list[jax.Array]:
    """``parts`` as real arrays of ``dtype``; complex ones as two parts."""
    pieces = []
    for x in parts:
        pieces.extend([jnp.real(x), jnp.imag(x)] if _is_complex(x) else [x])
    return [p.astype(dtype) for p in pieces]


def _sum_of(parts: list[jax.Array], dtype: Any, square: Any) -> jax.Array:
    """``sum(square(x))`` over ``parts``, accumulated in ``dtype``.

    Several parts are concatenated first, so that the squares are one kernel.
    One part is not reshaped: it may be sharded in its type
    (`_sharded_in_its_type`).
    """
    pieces = _values(parts, dtype)
    if len(parts) == 1:
        return jnp.sum(functools.reduce(jnp.add, [square(p) for p in pieces]))
    return jnp.sum(square(jnp.concatenate([p.ravel() for p in pieces])))


def _tracks_varying_axes() -> bool:
    """Whether jax records which ``shard_map`` axes each value varies over.

    True inside ``shard_map(..., check_vma=True)`` (the default); under
    ``pmap``, a named ``vmap`` or ``check_vma=False`` nothing is recorded.
    """
    state = getattr(jax_config, "_check_vma", None)
    return bool(getattr(state, "value", False))


def leaves_squares(leaves: list[jax.Array], named: tuple[str, ...] = ()) -> Measured:
    """The finite check as a sum of squares, with the range and norm it gives.

    One reduction per large leaf and one per compute dtype over the small
    ones, as `leaves_finite`, each a sum of squares accumulated in float32
    (float64 for float64 leaves). It has no false negatives for the reasons
    the magnitude sum has none (a square is never negative, so nothing
    cancels, and an element that rounds to inf, whatever the compiler fused
    into it, squares to inf). A finite sum of squares is exact proof that
    every value is finite; only when some reduction's sum is not finite does
    a second pass (inside a ``lax.cond``: it costs nothing on other steps)
    sum the squares again shrunk by ``2**-84``, which no finite values can
    overflow: so finite gradients are never reported non-finite, and their
    norm and range are measured whatever their size.

    Sums over ``shard_map`` axes: a leaf sharded over an axis (its value
    varies over it) is one gradient in shards, and its sums are added over
    the axis, whether the axis is in ``named`` or not. Where jax records no
    varying axes (``pmap``, a named ``vmap``, ``check_vma=False``) a named
    axis may hold replicas or shards: a reduction whose sums are bitwise
    equal on every member is taken as replicated (kept), any other as
    sharded (added). (Shards whose sums of squares are bitwise equal would
    be read as replicas; under ``shard_map`` keep ``check_vma=True`` to
    avoid that.)
    """
    tracked = _tracks_varying_axes()
    reductions: list[tuple[list[jax.Array], Any, tuple[str, ...]]] = []
    small: dict[Any, list[jax.Array]] = {}
    group_small = tracked or not named  # replicas and shards must not share one
    for x in leaves:
        wide = compute_dtype(jnp.real(x).dtype)
        shards = tuple(sorted(varying_axes(x))) if tracked else ()
        if not x.size:
            continue
        if group_small and x.size <= SMALL_LEAF and not _sharded_in_its_type(x):
            small.setdefault((wide, shards), []).append(x)
        else:
            reductions.append(([x], wide, shards))
    reductions.extend((parts, wide, shards) for (wide, shards), parts in small.items())
    f32 = jnp.float32
    if not reductions:
        return Measured(jnp.asarray(True), f32(0), f32(0), f32(0))

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
        jnp.logical_and, [jnp.isfinite(low) for low in lows]
    )
    highs = lax.cond(every_low_finite, from_low, shrunk, None)
    finite = functools.reduce(jnp.logical_and, [jnp.isfinite(h) for h in highs])

    # Agree: add each reduction's sums over the axes it is sharded on.
    magnitudes, low_total, high_total = [], f32(0), f32(0)
    for (parts, _, shards), low, high in zip(reductions, lows, highs, strict=True):
        low = low.astype(f32)
        size = jnp.asarray(sum(p.size for p in parts), f32)
        if shards:
            low, high, size = (lax.psum(v, shards) for v in (low, high, size))
        if named and not tracked:
            pair = jnp.stack([low, high])
            same = jnp.all(lax.pmax(pair, named) == lax.pmin(pair, named))
            summed = lax.psum(jnp.stack([low, high, size]), named)
            low, high, size = (
                jnp.where(same, own, total)
                for own, total in zip((low, high, size), summed, strict=True)
            )
        rms_low = jnp.sqrt(low / size)
        rms_high = jnp.ldexp(jnp.sqrt(high / size), _HIGH_EXP // 2)
        magnitudes.append(jnp.where(jnp.isfinite(low), rms_low, rms_high))
        low_total, high_total = low_total + low, high_total + high
    magnitude = functools.reduce(jnp.maximum, magnitudes)
    return Measured(finite, magnitude, low_total, high_total)


def _in_high_units(low: jax.Array, high: Any, dtype: Any) -> jax.Array:
    """A reduction's sum of squares in float32 units of ``2**-168``.

    ``high`` is the same sum shrunk by ``2**-2k`` (`_SHRINK_EXP`), or
    ``None`` when ``low`` is finite (then ``low`` gives it: its squares below
    ``2**-42`` flush to zero, which cannot matter next to a total that
    overflowed). A float64 sum too large for those units is inf, and so is a
    non-finite one.
    """
    f32 = jnp.float32
    scaled = (low * jnp.asarray(2.0**-_HIGH_EXP, low.dtype)).astype(f32)
    if high is None:
        return scaled
    if np.dtype(dtype) == np.dtype(np.float64):
        # Its plain sum overflows only past 2**1024, far past float32 units:
        # inf there, unless a value was not finite (nan).
        return jnp.where(
            jnp.isfinite(low),
            scaled,
            jnp.where(jnp.isfinite(high), f32(jnp.inf), f32(jnp.nan)),
        )
    return jnp.where(jnp.isfinite(low), scaled, high.astype(f32))


def unscaled_norm(measured: Measured, scale: jax.Array) -> jax.Array:
    """The global norm of the unscaled gradients, ``sqrt(sum) / scale``.

    Exact to rounding for every finite norm: from the plain sum when it is
    finite, else from the shrunk one, whose exponent is applied with
    ``ldexp`` so that no intermediate overflows or flushes (inf only for a
    norm past the float32 maximum).
    """
    f32 = jnp.float32
    scale = scale.astype(f32)
    plain = jnp.sqrt(measured.low) / scale
    mantissa, exponent = jnp.frexp(jnp.sqrt(measured.high))
    s_mantissa, s_exponent = jnp.frexp(scale)
    big = jnp.ldexp(mantissa / s_mantissa, exponent - s_exponent + _HIGH_EXP // 2)
    return jnp.where(jnp.isfinite(measured.low), plain, big)


def all_finite(tree: Any) -> jax.Array:
    """Whether every floating (or complex) leaf of ``tree`` is finite.

    One reduction over the tree, exact (no false positives, no false
    negatives) and at memory speed on the finite path; see the module notes
    for how. Works inside ``jit``, ``vmap``, ``pmap`` and ``shard_map``.

    Args:
      tree: any pytree. float16, bfloat16, float32, float64, complex and fp8
        leaves are checked; integer, bool and float0 leaves and ``None`` are
        ignored.

    Returns:
      A scalar bool array; ``True`` for a tree with nothing to check.

    Example:
      >>> import jax.numpy as jnp, jls
      >>> jls.all_finite({"w": jnp.ones(3), "step": jnp.int32(7)})
      Array(True, dtype=bool)
      >>> jls.all_finite([jnp.array([1.0, jnp.nan], jnp.float16)])
      Array(False, dtype=bool)
      >>> jls.all_finite({})
      Array(True, dtype=bool)
    """
    return _all_finite_jit(tree)


@jax.jit
def _all_finite_jit(tree: Any) -> jax.Array:
    # Jitted so that an eager call is one dispatch, not one per leaf. Inside a
    # caller's jit it is a nested call that XLA inlines; the train step calls
    # it too: on XLA:CPU the step then compiles about 4% faster on the
    # README's LM (each large reduction stays one kernel instead of two).
    return leaves_finite(_inexact_leaves(tree))


_squares_jit = jax.jit(leaves_squares, static_argnums=1)


def unscaled_finite(
    grads: Any,
    scale: jax.Array,
    *,
    scale_may_be_below_one: bool,
) -> jax.Array:
    """Whether ``unscale(grads)`` is all finite, reading the scaled gradients.

    For a scale >= 1 unscaling cannot overflow (``|x / scale| <= |x|``) and
    inf/nan stay inf/nan, so the scaled gradients are finite exactly when
    the unscaled ones are: the fast check runs on them directly, and the
    unscaling is left to the optimizer's fused update. Only a scaler whose
    ``min_scale`` is below 1 can reach a scale < 1; while it is there the
    check tests the unscaled values themselves (computed inside the check,
    never stored), so a finite scaled gradient that overflows when unscaled
    is caught.
    """
    leaves = _inexact_leaves(grads)
    if not scale_may_be_below_one:
        return _all_finite_jit(leaves)
    return lax.cond(
        scale >= 1,
        _all_finite_jit,
        lambda xs: _exact(unscale_tree(xs, scale, two_factor=False)),
        leaves,
    )


def unscaled_measured(
    grads: Any,
    scale: jax.Array,
    *,
    scale_may_be_below_one: bool,
    named: tuple[str, ...] = (),
) -> Measured:
    """`unscaled_finite` as the squares check, with its range and norm.

    The measurements are of the scaled gradients; below a scale of 1 the
    finite flag is also the exact test of the unscaled values.
    """
    leaves = _inexact_leaves(grads)
    measured = _squares_jit(leaves, named)
    if not scale_may_be_below_one:
        return measured
    finite = lax.cond(
        scale >= 1,
        lambda xs: measured.finite,
        lambda xs: measured.finite & _exact(unscale_tree(xs, scale, two_factor=False)),
        leaves,
    )
    return measured._replace(finite=finite)


def _empty_slice(x: jax.Array) -> jax.Array:
    """An empty slice of ``x``, without reshaping it (it may be sharded)."""
    if not x.ndim:
        return x.reshape(1)[:0]
    return x[tuple(slice(0, 0) for _ in range(x.ndim))]


def nonfinite_leaf_flags(tree: Any, finite: jax.Array, scale: jax.Array) -> Any:
    """Per-leaf flags: which leaves of ``unscale(tree)`` are not all finite.

    ``finite`` is the step's decision. On a finite step (the common case)
    every flag is ``False`` without looking at the gradients again; only a
    non-finite step pays for a second, exact pass, inside a ``lax.cond``.
    Leaves that are not floating get ``False``.
    """

    def per_leaf(op):
        def run(xs):
            out = []
            for x in xs:
                x = x if isinstance(x, jax.Array) else jnp.asarray(x)
                inexact = jnp.issubdtype(x.dtype, jnp.inexact)
                out.append(op(x) if inexact else jnp.asarray(False))
            return out

        return run

    # The finite branch's False is derived from each leaf (an empty reduction
    # reads nothing) so both branches carry the same varying axes under
    # shard_map.
    no_flags = per_leaf(lambda x: jnp.any(jnp.isnan(_empty_slice(x))))
    leaves, treedef = jax.tree.flatten(tree)
    factors = reciprocals(scale, leaves)
    flags = per_leaf(lambda x: ~jnp.all(jnp.isfinite(unscale_leaf(x, factors))))
    return jax.tree.unflatten(treedef, lax.cond(finite, no_flags, flags, leaves))
