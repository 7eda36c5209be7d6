"""Splitting a model into the arrays jls steps and the leaves it passes through.

A parameter tree may be a whole model: an equinox ``Module`` holds functions
(an activation), Python numbers and integer arrays next to its weights.
Only arrays can enter a ``lax.cond`` and only floating arrays can be
differentiated, so the fused step and `jls.train_step` split the tree first
and put it back together after, as ``eqx.partition``/``eqx.combine`` do:
the other leaves come back as they were (the same objects), without jls
depending on equinox.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def split_inexact(tree: Any) -> tuple[Any, Any]:
    """``(floating arrays, the rest)``, each with ``None`` for the other's leaves."""

    def inexact(x: Any) -> bool:
        is_array = isinstance(x, (jax.Array, np.ndarray, np.generic))
        return is_array and jnp.issubdtype(x.dtype, jnp.inexact)

    kept = jax.tree.map(lambda x: x if inexact(x) else None, tree)
    rest = jax.tree.map(lambda x: None if inexact(x) else x, tree)
    return kept, rest


def merge(kept: Any, rest: Any) -> Any:
    """Puts a tree split by `split_inexact` back together."""
    return jax.tree.map(
        lambda a, b: b if a is None else a,
        kept,
        rest,
        is_leaf=lambda x: x is None,
    )


def split_frozen(params: Any, grads: Any) -> tuple[Any, Any]:
    """``(params that have a gradient, params whose gradient is None)``.

    A ``None`` gradient means "not trained" (equinox's ``filter_spec``
    partitions, ``eqx.apply_updates``): such parameters pass by unchanged.

    Raises:
      TypeError: if ``grads`` does not have the structure of ``params``.
    """

    def is_none(x: Any) -> bool:
        return x is None

    try:
        trained = jax.tree.map(
            lambda g, p: None if g is None else p, grads, params, is_leaf=is_none
        )
        frozen = jax.tree.map(
            lambda g, p: p if g is None else None, grads, params, is_leaf=is_none
        )
    except (TypeError, ValueError) as err:
        raise TypeError(
            "grads must have the structure of params (None for a parameter that "
            f"is not trained): {jax.tree.structure(grads, is_leaf=is_none)} "
            f"against {jax.tree.structure(params, is_leaf=is_none)} ({err})"
        ) from None
    return trained, frozen
