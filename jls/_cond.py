"""The skip: one ``lax.cond`` around the update, and what its branches return.

Nothing is selected with masks (``0 * nan`` is ``nan``), so a nan can never
reach a state, and a skipped step computes nothing. The applying branch comes
first (putting the skip branch first made XLA copy every parameter and
moment), and it is traced once, by ``lax.cond`` itself: it records its
output types while it is traced, and the skip branch builds the same from
them (tracing the update ahead of the conditional, with ``jax.eval_shape``
or ``jax.make_jaxpr``, cost about what tracing the inner optimizer costs; the
skip branch falls back to ``jax.eval_shape`` should a jax ever trace it
first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def zero(dtype: Any) -> Any:
    """The zero update of ``dtype``: ``-0.0`` for floats, 0 for others.

    ``p + (-0.0)`` is ``p`` bitwise for every float ``p``, ``-0.0`` included
    (``-0.0 + 0.0`` is ``+0.0``).
    """
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return complex(-0.0, -0.0)  # both parts: -0.0 + 0.0 is +0.0
    return -0.0 if jnp.issubdtype(dtype, jnp.inexact) else 0


def zeros_like(shapes: Any, like: Any) -> Any:
    """Zero updates of ``shapes``, built from ``like``'s leaves where they match.

    So they carry the same varying axes under ``shard_map`` as the taken
    branch's updates. (``optax.tree.zeros_like`` makes ``+0.0``.)
    """
    if jax.tree.structure(shapes) == jax.tree.structure(like):
        return jax.tree.map(
            lambda s, x: (
                jnp.full_like(x, zero(s.dtype), dtype=s.dtype)
                if getattr(x, "shape", None) == s.shape
                else jnp.full(s.shape, zero(s.dtype), s.dtype)
            ),
            shapes,
            like,
        )
    return jax.tree.map(lambda s: jnp.full(s.shape, zero(s.dtype), s.dtype), shapes)


def cast_like(tree: Any, like: Any) -> Any:
    """Casts ``tree``'s leaves to the dtypes of ``like``'s (shape structs).

    Not ``optax.tree.cast_like``: that casts every leaf, and ``astype`` makes
    a weakly typed leaf strong, so a skipped step would change the state's
    types and retrace the step once.
    """
    return jax.tree.map(
        lambda x, s: x if x is None or x.dtype == s.dtype else x.astype(s.dtype),
        tree,
        like,
    )


def guarded(
    apply: jax.Array,
    step: Callable[[Any], Any],
    skip: Callable[[Any, Any], Any],
    operands: Any,
    after: Callable[[bool], Any],
) -> tuple[Any, Any]:
    """``(step(operands), after(True))`` if ``apply``, else the skip's.

    ``skip(operands, shapes)`` gets ``step``'s output types. ``after(taken)``
    is evaluated inside each branch with ``taken`` a Python constant (the
    scale rule: there the decision is a constant, so it folds to a few
    scalar ops instead of reading the step's flags, which XLA would
    recompute in each fusion that reads them).
    """
    shapes: list[Any] = []  # step's output types, once it is traced

    def taken(ops):
        new = step(ops)
        shapes.append(jax.tree.map(jax.typeof, new))
        return new, after(True)

    def skipped(ops):
        out = shapes[-1] if shapes else jax.eval_shape(step, ops)
        return skip(ops, out), after(False)

    return lax.cond(apply, taken, skipped, operands)
