"""The skip: each new leaf selected against its old one, bitwise.

One ``lax.select`` per leaf, never a ``0 * x`` mask (nan for an inf ``x``);
skipped updates are ``-0.0`` (`zeros_like`).
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
    """Zero updates of ``shapes`` (or their types, laid out as ``likes``' leaves)."""
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

    ``None`` leaves stay ``None``; a leaf of ``new`` that is no array, or a
    Python number equal to the old one, is returned as it is. A leaf the step
    widens keeps its value in the new dtype (one type for both outcomes).

    Raises:
      TypeError: at trace time, for a leaf whose new dtype cannot hold every
        value of its old one (a skip would round it), naming the leaf.
    """
    known: list[bool | None] = []  # apply's value outside a trace, found once

    def kept(path: Any, n: Any, o: Any) -> Any:
        if not _is_array(n) or _same_number(n, o):
            return n
        if _is_number(o):  # outside a trace the old number itself is kept
            known[:] = known or [_value(apply)]
            if known[0] is not None:
                return n if known[0] else o
        elif not _is_number(o) and not _holds(jnp.result_type(o), jnp.result_type(n)):
            raise TypeError(
                f"the leaf {jax.tree_util.keystr(path)} is {jnp.result_type(o)} "
                f"before the step and {jnp.result_type(n)} after it: a skipped step "
                "would round the old value into the new dtype (jit needs one type "
                "for both outcomes). Create it in the dtype the step gives it (the "
                "inner optimizer's init), or keep its dtype in the update"
            )
        return select(apply, n, o)

    return jax.tree_util.tree_map_with_path(kept, new, old)


def _holds(old: Any, new: Any) -> bool:
    """Whether every value of dtype ``old`` is one of dtype ``new``."""
    if old == new or old == jnp.bool_:
        return True
    if jnp.issubdtype(old, jnp.integer):
        return jnp.issubdtype(new, jnp.integer) and bool(np.can_cast(old, new))
    complex_ = [jnp.issubdtype(d, jnp.complexfloating) for d in (old, new)]
    if not jnp.issubdtype(new, jnp.inexact) or complex_ == [True, False]:
        return False
    a, b = jnp.finfo(old), jnp.finfo(new)
    tiny = b.minexp - b.nmant <= a.minexp - a.nmant  # subnormals included
    return b.nmant >= a.nmant and b.maxexp >= a.maxexp and tiny


def _value(apply: Any) -> bool | None:
    try:
        return bool(apply)
    except jax.errors.ConcretizationTypeError:
        return None  # traced


def _is_number(x: Any) -> bool:
    return isinstance(x, (bool, int, float, complex))


def _same_number(new: Any, old: Any) -> bool:
    """Whether ``new`` and ``old`` are one Python number (``-0.0`` is not ``0.0``)."""
    return type(new) is type(old) and _is_number(new) and repr(new) == repr(old)


def _is_array(x: Any) -> bool:
    """Whether ``x`` is a value `select` takes (not a function, not a class)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def select(apply: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``apply``, else ``old``, bitwise (narrow floats as bits)."""
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
    """``x``, weakly typed like ``weak``, by a ``lax.cond`` XLA folds away."""
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
