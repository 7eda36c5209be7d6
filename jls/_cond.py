"""The skip: each new leaf selected against its old one, bitwise.

The step runs the inner optimizer's update unconditionally, then keeps
each result (the parameters or the updates, every leaf of the inner
state) with `select_tree`: the new leaf where the step applies, its old
value where it does not. That is jmp's and flax's form (``lax.select``
per leaf), on public jax only. A select picks bits, it does not mask with
``0 * x`` (nan for an inf ``x``), so no nan reaches a state; a float
narrower than float32 is selected as its bits, so a nan's payload is kept;
a weakly typed old leaf stays weakly typed, so the step is traced once.
The skipped updates of ``tx.update`` are ``-0.0`` (`zeros_like`:
``p + (-0.0)`` is ``p`` bitwise), laid out as the updates are.

``benchmarks/bench_skip_modes.py`` keeps the other forms measured against
this one (a ``lax.cond``, a re-run of the update's program), and
``docs/performance.md`` what each costs in each donation mode.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jls._compat import varying_of


def zero(dtype: Any) -> Any:
    """The zero update of ``dtype``: ``-0.0`` for floats, 0 for others.

    ``p + (-0.0)`` is ``p`` bitwise for every float ``p``, ``-0.0`` included
    (``-0.0 + 0.0`` is ``+0.0``).
    """
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return complex(-0.0, -0.0)  # both parts: -0.0 + 0.0 is +0.0
    return -0.0 if jnp.issubdtype(dtype, jnp.inexact) else 0


def zeros_like(shapes: Any, *likes: Any) -> Any:
    """Zero updates of ``shapes``, laid out as the updates are.

    ``shapes``: the updates themselves (then each zero is a ``full_like`` of
    its update: the same sharding and varying axes), or their types; then
    each zero is built from the first leaf of ``likes`` (trees of the same
    structure: the gradients, the parameters) with the same shape, sharding
    and varying axes, so it has the updates' layout under explicit sharding
    and ``shard_map``. (``optax.tree.zeros_like`` makes ``+0.0``.)
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

    The one skip of jls: the step's results, `jls.keep_if_skipped` and
    ``jls.flax``'s kept fields all go through it. ``old`` has ``new``'s
    structure; each leaf is `select`-ed (``new``'s dtype and sharding,
    weakly typed where ``old`` is). ``None`` leaves stay ``None``, and a leaf
    of ``new`` that is no array (a function) is returned as it is.

    Example:
      >>> import jax.numpy as jnp
      >>> from jls._cond import select_tree
      >>> new = {"m": jnp.array([jnp.nan, 2.0])}
      >>> select_tree(jnp.asarray(False), new, {"m": jnp.zeros(2)})["m"]
      Array([0., 0.], dtype=float32)
    """
    return jax.tree.map(
        lambda n, o: select(apply, n, o) if _is_array(n) else n, new, old
    )


def _is_array(x: Any) -> bool:
    """Whether ``x`` is a value `select` takes (not a function, not a class)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def select(apply: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``apply`` (a scalar), else ``old``, bitwise.

    The result has ``new``'s dtype and sharding, weakly typed where ``old``
    is weakly typed and of that dtype, so a weakly typed state keeps its
    types and the step is traced once. Floats narrower than float32 are
    selected as their bits: XLA:CPU computes them in float32, and a select
    it widens that way would canonicalise a nan's payload.
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
    """``x``, weakly typed as ``weak`` (of its dtype, shape and layout) is.

    ``lax.cond`` joins a strong and a weakly typed branch into a weakly typed
    result (public jax has no cast to a weak type); its predicate is a
    constant, so XLA keeps ``x`` alone and no conditional runs.
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
