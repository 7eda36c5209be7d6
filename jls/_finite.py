"""The all-finite check: one pass over the gradients, exact, at memory speed.

Design (chosen by measurement: ``benchmarks/bench_all_finite.py`` re-runs it,
``docs/performance.md`` has the figures):

* For float32, bfloat16, float64 and complex leaves the check is a sum of magnitudes per
  leaf (``sum(|x| * 2**-k)``, see below; accumulated in float32, or in the leaf's own
  dtype when wider) followed by one ``isfinite`` of the total. Called alone it runs at
  about a plain sum's speed, and inside a train step XLA fuses it with work it does
  anyway; ``jnp.isfinite(x).all()``, any select and an integer reduction over the bits
  all cost several times more (they do not vectorise). ``jnp.max`` is never used: on
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
* Leaves of one size get different powers, ``2**-(k + j)`` for the ``j``-th of
  them (`TWINS` apart at most): any power at least ``2**-k`` keeps the promise, and
  a shared constant made XLA:CPU's CSE share one broadcast of it, which its YNN
  reduction fusions then read as an array beside each leaf instead of a
  scalar. On the char LM's donated step that cost 1.39x plain Adam where
  distinct powers cost 1.02x (``benchmarks/probe_char_check.py --donate``).
* Leaves of at most ``SMALL_LEAF`` elements (biases, norm scales) are checked
  together, one reduction per compute dtype over their concatenation: each
  reduction is a kernel XLA compiles, and on the README's LM 63 of the 101
  leaves are small. They are concatenated before the magnitude is taken, so
  the magnitude is one kernel, not one per leaf (a small gradient is often
  the output of a reduction that nothing else fuses into). A concatenation is
  a temporary copy, so each holds at most ``SMALL_GROUP`` elements. Large leaves keep
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

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jls._scaling import compute_dtype, unscale_tree

_NATIVE_CHECK_MAX_BITS = 16  # float16 and fp8: test in the leaf's own format
SMALL_LEAF = 2**14  # leaves this small share one reduction
SMALL_GROUP = 2**17  # elements the small leaves share a reduction over (a temporary)
TWINS = 64  # distinct shrinks for leaves of one size: 2**-(31 + 8 + 63) is normal


def runs(parts: list[Any]) -> list[list[Any]]:
    """``parts`` (small leaves) as the runs that share a reduction.

    The first `SMALL_GROUP` elements share one; each part past that has its
    own. A concatenation is a temporary copy, so sharing is capped: on a model
    of thousands of small leaves one concatenation held a copy of every
    gradient, where plain Adam holds none (``benchmarks/bench_sweep.py``).
    """
    shared: list[Any] = []
    own: list[list[Any]] = []
    size = 0
    for p in parts:
        if size + p.size <= SMALL_GROUP:
            shared.append(p)
            size += p.size
        else:
            own.append([p])
    return ([shared] if shared else []) + own


def inexact_leaves(tree: Any) -> list[jax.Array]:
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


def sharded_in_its_type(x: jax.Array) -> bool:
    """Whether ``x`` may be sharded across devices (it must not be concatenated).

    True where its type names mesh axes (explicit sharding), and where it
    lives on a mesh of several devices with automatic axes (``jit`` over
    arrays placed with ``NamedSharding``): the type then says nothing, and
    the partitioner may shard it. A concatenation of sharded leaves gathers
    them onto every device; such leaves are checked one by one, each
    reduced where it lies.
    """
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if any(axis is not None for axis in (spec or ())):
        return True
    mesh = getattr(sharding, "mesh", None)
    sizes = dict(getattr(mesh, "shape", {}) or {})
    types = getattr(mesh, "axis_types", ()) or ()
    names = getattr(mesh, "axis_names", ()) or ()
    return any(
        "Auto" in str(kind) and sizes.get(name, 1) > 1
        for name, kind in zip(names, types, strict=False)
    )


def one_reduction_is_safe(x: jax.Array) -> bool:
    """Whether several reductions of ``x`` may be one variadic ``lax.reduce``.

    Only in a process with one device: the partitioner gathers the operands
    of a sharded variadic reduction, and a leaf may be sharded where its
    type does not say so (``jax.jit(..., in_shardings=...)`` over arrays not
    yet placed), so with several devices it is two reductions.
    """
    return jax.device_count() == 1 and not sharded_in_its_type(x)


def _add(a: Any, b: Any) -> tuple[Any, ...]:
    # One function for every call: lax.reduce caches its computation by it
    # (a new lambda per call compiled the reduction anew on every eager step).
    return tuple(x + y for x, y in zip(a, b, strict=True))


def counts(*masks: jax.Array) -> tuple[jax.Array, ...]:
    """The int32 count of each of ``masks`` (bool arrays of one shape).

    One variadic reduction where that is safe (`one_reduction_is_safe`): one
    kernel reading the entries once, where a sum each made XLA:CPU write
    each mask out and read it back.
    """
    if not one_reduction_is_safe(masks[0]):
        return tuple(jnp.sum(m, dtype=jnp.int32) for m in masks)
    ints = tuple(m.astype(jnp.int32) for m in masks)
    zeros = tuple(jnp.int32(0) for _ in masks)
    return tuple(lax.reduce(ints, zeros, _add, tuple(range(masks[0].ndim))))


def is_complex(x: jax.Array) -> bool:
    return jnp.issubdtype(x.dtype, jnp.complexfloating)


def exact(leaves: list[jax.Array]) -> jax.Array:
    ok = jnp.asarray(True)
    for leaf in leaves:
        ok = ok & jnp.all(jnp.isfinite(leaf))
    return ok


def _shrunk_sum(
    parts: list[jax.Array], size: int, dtype: Any, twin: int = 0
) -> jax.Array:
    """``sum(|x| * 2**-k)`` over ``parts`` in ``dtype``, ``2**k >= 256 * size``.

    ``k`` is the least such power plus ``twin`` (the leaf's rank among those
    of its size, see the module notes). Several parts are cast and
    concatenated first, so that the magnitude and the shrink are one kernel.
    """
    exponent = (size - 1).bit_length() + 8 + twin % TWINS
    shrink = jnp.asarray(2.0**-exponent, dtype)
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
    twins: dict[Any, int] = {}  # large parts of each size and dtype so far
    for x in leaves:
        if _checked_natively(x.dtype):
            flags.append(jnp.all(jnp.isfinite(x)))
            continue
        parts = [jnp.real(x), jnp.imag(x)] if is_complex(x) else [x]
        wide = compute_dtype(parts[0].dtype)
        if x.size <= SMALL_LEAF and not sharded_in_its_type(x):
            small.setdefault(wide, []).extend(parts)
        else:
            for p in parts:
                twin = twins.get((p.size, wide), 0)
                twins[(p.size, wide)] = twin + 1
                flags.append(jnp.isfinite(_shrunk_sum([p], p.size, wide, twin)))
    for wide, parts in small.items():
        for run in runs(parts):
            size = sum(p.size for p in run)
            flags.append(jnp.isfinite(_shrunk_sum(run, size, wide)))
    if not flags:
        return jnp.asarray(True)
    return jnp.all(jnp.stack(flags))


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
    # it too: on XLA:CPU each large reduction then stays one kernel instead of
    # two, and the step compiles faster.
    return leaves_finite(inexact_leaves(tree))


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
    leaves = inexact_leaves(grads)
    if not scale_may_be_below_one:
        return _all_finite_jit(leaves)
    return lax.cond(
        scale >= 1,
        _all_finite_jit,
        lambda xs: exact(unscale_tree(xs, scale, two_factor=False)),
        leaves,
    )
