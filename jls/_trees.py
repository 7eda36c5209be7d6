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


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _is_inexact_array(x: Any) -> bool:
    return _is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def _split(tree: Any, keep: Any) -> tuple[Any, Any]:
    kept = jax.tree.map(lambda x: x if keep(x) else None, tree)
    rest = jax.tree.map(lambda x: None if keep(x) else x, tree)
    return kept, rest


def split_arrays(tree: Any) -> tuple[Any, Any]:
    """``(arrays, rest)``: ``tree`` with ``None`` for non-arrays, and the reverse."""
    return _split(tree, _is_array)


def split_inexact(tree: Any) -> tuple[Any, Any]:
    """``(floating arrays, rest)``, as `split_arrays`."""
    return _split(tree, _is_inexact_array)


def merge(kept: Any, rest: Any) -> Any:
    """Puts a tree split by `split_arrays` or `split_inexact` back together."""
    return jax.tree.map(
        lambda a, b: b if a is None else a,
        kept,
        rest,
        is_leaf=lambda x: x is None,
    )


def has_other_leaves(tree: Any) -> bool:
    """Whether ``tree`` has a leaf that is not an array (a function, a number)."""
    return not all(_is_array(x) for x in jax.tree.leaves(tree))
