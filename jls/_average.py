"""Data-parallel averaging that gives the single-device step on every mesh.

Under ``shard_map(check_vma=True)`` jax already sums the gradient of a
parameter invariant over an axis, so `local` marks such parameters varying
and `mean` averages once (in float32 at least), dividing the summed ones by
the axis size. docs/parallelism.md has the table of meshes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jls._compat import pvary, tracked_in, varying_axes
from jls._scaling import compute_dtype


def local(trainable: Any, axes: tuple[str, ...]) -> tuple[Any, Any]:
    """``trainable`` marked varying over ``axes``, and the axes each was already.

    Returns ``(local_params, summed)``: per leaf, the axes its gradient comes
    back summed over.
    """
    if not axes or not tracked_in(trainable, axes):
        return trainable, jax.tree.map(lambda x: (), trainable)
    summed = jax.tree.map(
        lambda x: tuple(a for a in axes if a in varying_axes(x)), trainable
    )
    marked = jax.tree.map(
        lambda x, s: pvary(x, tuple(a for a in axes if a not in s)), trainable, summed
    )
    return marked, summed


def mean(grads: Any, loss: jax.Array, axes: tuple[str, ...], summed: Any) -> Any:
    """``(grads, loss)`` averaged over ``axes`` in float32 at least, in their dtypes."""

    def leaf(g: jax.Array, done: tuple[str, ...]) -> jax.Array:
        wide = g.astype(compute_dtype(g.dtype))
        todo = tuple(a for a in axes if a not in done)
        total = lax.psum(wide, todo) if todo else wide
        return (total / _size(axes)).astype(g.dtype)

    try:
        grads = jax.tree.map(leaf, grads, summed)
        loss = lax.pmean(loss.astype(jnp.float32), axes)
    except NameError as e:
        raise NameError(
            f"train_step(average_over={axes!r}): {e}. Run the step under "
            "jax.pmap or jax.shard_map with that axis name (under jit over "
            "sharded arrays the gradients are global: drop average_over)"
        ) from e
    return grads, loss


def _size(axes: tuple[str, ...]) -> jax.Array:
    """The number of replicas over ``axes``, as float32."""
    return lax.psum(jnp.float32(1), axes)
