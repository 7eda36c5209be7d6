"""The skip: each new leaf selected against its old one, bitwise.

The step runs the inner update unconditionally, then keeps each result with
`select_tree`: one ``lax.select`` per leaf, jmp's and flax's form, never a
``0 * x`` mask (nan for an inf ``x``). Floats narrower than float32 are
selected as their bits, and weak types are kept, so the step traces once.
Skipped updates are ``-0.0`` (`zeros_like`). ``docs/performance.md`` compares
the other forms ``benchmarks/bench_skip_modes.py`` measures.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jls._compat import varying_of


def zero(dtype: Any) -> Any:
    """The zero update of ``dtype``: ``-0.0`` (``p + -0.0`` is ``p``), or 0."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return complex(-0.0, -0.0)  # both parts: -0.0 + 0.0 is +0.0
    return -0.0 if jnp.issubdtype(dtype, jnp.inexact) else 0


def zeros_like(shapes: Any, *likes: Any) -> Any:
    """Zero updates of ``shapes`` (the updates, or their types), laid out as they are.

    From a type, each zero is built like the leaf of ``likes`` (the
    gradients, the parameters) with its shape, sharding and varying axes.
    """
    leaves, treedef = jax.tree.flatten(shapes)
    candidates = [
        jax.tree.leaves(like) for like in likes if jax.tree.structure(like) == treedef
    ]

    def zero_of(i: int, s: Any) -> Any:
        if isinstance(s, jax.Array):
            return jnp.full_like(s, zero(s.dtype))
        same_shape = [
            c[i] for c in candidates if getattr(c[i], "shape", None) == s.shape
        ]
        for x in same_shape:
            t = jax.typeof(x)
            if getattr(t, "sharding", None) == getattr(s, "sharding", None) and (
                varying_of(t) == varying_of(s)
            ):
                return jnp.full_like(x, zero(s.dtype), dtype=s.dtype)
        if same_shape:
            return jnp.full_like(same_shape[0], zero(s.dtype), dtype=s.dtype)
        return jnp.full(s.shape, zero(s.dtype), s.dtype)

    return treedef.unflatten([zero_of(i, s) for i, s in enumerate(leaves)])


def select_tree(apply: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``apply`` (a scalar bool), else ``old``: every leaf, bitwise.

    The step, `jls.keep_if_skipped` and ``jls.flax`` all skip through it.
    ``None`` leaves stay ``None``; a leaf of ``new`` that is no array (a
    function) is returned as it is, and so is a Python number equal to the
    old one (an optimizer's static setting, used as a shape, stays a number).
    """

    def kept(n: Any, o: Any) -> Any:
        if not _is_array(n) or _same_number(n, o):
            return n
        return select(apply, n, o)

    return jax.tree.map(kept, new, old)


def _same_number(new: Any, old: Any) -> bool:
    """Whether ``new`` and ``old`` are one Python number (``-0.0`` is not ``0.0``)."""
    python = (bool, int, float, complex)
    return type(new) is type(old) and isinstance(new, python) and repr(new) == repr(old)


def _is_array(x: Any) -> bool:
    """Whether ``x`` is a value `select` takes (not a function, not a class)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def select(apply: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``apply`` (a scalar), else ``old``, bitwise.

    ``new``'s dtype and sharding, weakly typed where ``old`` is. Narrow
    floats are selected as bits: XLA:CPU would widen them to float32 and
    canonicalise a nan's payload.
    """
    new = jnp.asarray(new)
    old = jnp.asarray(old)
    weak = bool(jax.typeof(old).weak_type and old.dtype == new.dtype)
    if old.dtype != new.dtype:
        old = old.astype(new.dtype)
    old = _like(old, new)
    narrow = jnp.issubdtype(new.dtype, jnp.floating) and jnp.finfo(new.dtype).bits < 32
    if narrow:
        bits = _UINT[jnp.finfo(new.dtype).bits]
        chosen = lax.select(
            apply,
            lax.bitcast_convert_type(new, bits),
            lax.bitcast_convert_type(old, bits),
        )
        chosen = lax.bitcast_convert_type(chosen, new.dtype)
    else:
        chosen = lax.select(apply, new, old)
    if weak and not jax.typeof(chosen).weak_type:
        chosen = _weakly_typed(chosen, old)
    return chosen


def _weakly_typed(x: jax.Array, weak: jax.Array) -> jax.Array:
    """``x``, weakly typed like ``weak``, by a ``lax.cond`` of constant predicate.

    Public jax has no cast to a weak type; XLA folds the cond away.
    """
    return lax.cond(True, lambda: x, lambda: weak)


def _like(old: jax.Array, new: jax.Array) -> jax.Array:
    """``old`` in ``new``'s explicit sharding (jax 0.8's select requires it)."""
    want = getattr(jax.typeof(new), "sharding", None)
    have = getattr(jax.typeof(old), "sharding", None)
    if want is None or have is None or want == have:
        return old
    if not hasattr(jax.sharding, "reshard"):
        return old
    explicit = jax.sharding.AxisType.Explicit
    if want.mesh.empty or explicit not in tuple(getattr(want.mesh, "axis_types", ())):
        return old
    return jax.sharding.reshard(old, want)


_UINT = {4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16}
