"""The all-finite check: one pass over the gradients, exact, at memory speed.

float32, bfloat16, float64 and complex leaves: one ``isfinite`` of
``sum(|x| * 2**-k)``, ``2**k >= 256 * leaf_size`` so that finite values
cannot overflow it. Magnitudes cannot cancel (a plain sum can, under FMA
contraction) and rounding is monotone: an element that rounds to inf makes
the sum inf. (``jnp.max`` drops nan on XLA:CPU.) Small leaves share one
reduction per dtype (`SMALL_LEAF`, `SMALL_GROUP`). float16, fp8 and fp4
leaves: ``jnp.isfinite(x).all()``. docs/guarantees.md states the promise.
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
# Same-size leaves get distinct shrinks 2**-(k + j) (XLA:CPU shared constants).
TWINS = 64  # distinct shrinks for leaves of one size: 2**-(31 + 8 + 63) is normal


def runs(parts: list[Any]) -> list[list[Any]]:
    """``parts`` as reductions: the first `SMALL_GROUP` elements', then one each."""
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
    """Whether ``x`` may be sharded across devices (it must not be concatenated)."""
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

    Only with one device: the partitioner gathers a sharded one's operands.
    """
    return jax.device_count() == 1 and not sharded_in_its_type(x)


def _add(a: Any, b: Any) -> tuple[Any, ...]:
    # One function for every call: lax.reduce caches its computation by it.
    return tuple(x + y for x, y in zip(a, b, strict=True))


def counts(*masks: jax.Array) -> tuple[jax.Array, ...]:
    """The int32 count of each of ``masks`` (bool arrays of one shape), in one pass."""
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

    ``twin`` is added to the least such ``k``.
    """
    exponent = (size - 1).bit_length() + 8 + twin % TWINS
    shrink = jnp.asarray(2.0**-exponent, dtype)
    if len(parts) > 1:
        flat = jnp.concatenate([x.astype(dtype).ravel() for x in parts])
    else:
        flat = parts[0].astype(dtype)
    return jnp.sum(jnp.abs(flat) * shrink, dtype=dtype)


def leaves_finite(leaves: list[jax.Array]) -> jax.Array:
    """Exact finiteness of a list of inexact arrays, in one pass."""
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

    Exact, one pass; works inside ``jit``, ``vmap``, ``pmap`` and ``shard_map``.

    Args:
      tree: any pytree; non-floating leaves and ``None`` are ignored.

    Returns:
      A scalar bool array; ``True`` for a tree with nothing to check.

    Example:
      >>> import jax.numpy as jnp, jls
      >>> jls.all_finite({"w": jnp.ones(3), "step": jnp.int32(7)})
      Array(True, dtype=bool)
      >>> jls.all_finite([jnp.array([1.0, jnp.nan], jnp.float16)])
      Array(False, dtype=bool)
    """
    return _all_finite_jit(tree)


@jax.jit
def _all_finite_jit(tree: Any) -> jax.Array:
    # Jitted: an eager call is one dispatch; XLA inlines it in a caller's jit.
    return leaves_finite(inexact_leaves(tree))


def unscaled_finite(
    grads: Any,
    scale: jax.Array,
    *,
    scale_may_be_below_one: bool,
) -> jax.Array:
    """Whether ``unscale(grads)`` is all finite, reading the scaled gradients."""
    leaves = inexact_leaves(grads)
    if not scale_may_be_below_one:
        return _all_finite_jit(leaves)
    return lax.cond(
        scale >= 1,
        _all_finite_jit,
        lambda xs: exact(unscale_tree(xs, scale, two_factor=False)),
        leaves,
    )
