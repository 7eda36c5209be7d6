"""The step's scalar results made by one kernel, not one kernel each.

A step's state holds a dozen scalars (the scale, its counters, the inner
optimizer's step count, the hooks' records). XLA makes each one in a fusion
of its own, and on XLA:CPU each fusion is a function compiled on its own:
about 20 ms of compile time apiece on the development CPU, more than the
rest of jls's program on a small model (`benchmarks/bench_compile.py`; on a
GPU each is a kernel launch per step). `together` routes them through one
variadic ``reduce`` over two copies of each value (``max(x, x)`` is ``x``
bitwise, nan and ``-0.0`` included), which XLA compiles, with the scalars'
producers fused into it, as one kernel with every scalar as an output.

Only what cannot carry a gradient goes through it: integer and bool scalars
from anywhere in the state, and the floating scalars jls owns (the scale's
state and the hooks'), with their gradient stopped; the inner optimizer's
floating scalars (an ``inject_hyperparams`` learning rate a user may
differentiate) are left alone, as are weakly typed and complex ones.
Scalars are grouped by the ``shard_map`` axes they vary over and by floating
dtype, so that a reduce's operands share a type and a precision.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jls._compat import varying_axes


def _lowest(dtype: Any) -> Any:
    if dtype == jnp.bool_:
        return np.bool_(False)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).min
    return -np.inf


def _eligible(x: Any, floating: bool) -> bool:
    if not isinstance(x, jax.Array) or x.shape != () or jax.typeof(x).weak_type:
        return False
    if x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer):
        return True
    return floating and jnp.issubdtype(x.dtype, jnp.floating)


def _no_gradient(x: jax.Array) -> jax.Array:
    # An integer or bool value carries no tangent already (one equation less).
    return lax.stop_gradient(x) if jnp.issubdtype(x.dtype, jnp.floating) else x


def together(owned: Any, inner: Any) -> tuple[Any, Any]:
    """``(owned, inner)`` with their scalars made by one kernel (see the notes).

    ``owned``: jls's own state (all its real scalars go); ``inner``: the
    inner optimizer's (only its integer and bool scalars go). Values are
    unchanged bitwise.
    """
    trees = [owned, inner]
    flat = [jax.tree.flatten(t) for t in trees]
    # One reduce per (shard_map axes, floating dtype): XLA's verifier refuses
    # a reduce over floats of several widths. Integers and bools join the
    # first floating group of their axes.
    groups: dict[tuple[frozenset[str], Any], list[tuple[int, int]]] = {}
    for t, (leaves, _) in enumerate(flat):
        for i, x in enumerate(leaves):
            if _eligible(x, floating=t == 0):
                kind = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else None
                groups.setdefault((varying_axes(x), kind), []).append((t, i))
    for axes, kind in [key for key in groups if key[1] is None]:
        first = next((k for k in groups if k[0] == axes and k[1] is not None), None)
        if first is not None:
            groups[first] += groups.pop((axes, kind))
    leaves = [list(f[0]) for f in flat]
    for where in groups.values():
        if len(where) < 2:
            continue
        values = [_no_gradient(leaves[t][i]) for t, i in where]
        twice = [lax.broadcast(v, (2,)) for v in values]
        lowest = [jnp.asarray(_lowest(v.dtype), v.dtype) for v in values]
        made = lax.reduce(
            twice,
            lowest,
            lambda a, b: [jnp.maximum(x, y) for x, y in zip(a, b, strict=True)],
            (0,),
        )
        for (t, i), v in zip(where, made, strict=True):
            leaves[t][i] = v
    owned, inner = (
        jax.tree.unflatten(f[1], x) for f, x in zip(flat, leaves, strict=True)
    )
    return owned, inner
