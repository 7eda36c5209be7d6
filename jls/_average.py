"""Data-parallel averaging that gives the single-device step on every mesh.

``jls.train_step(..., average_over=axes)`` wants the gradient of the mean,
over ``axes``, of each replica's loss on its shard of the batch: the
full-batch gradient one device would compute. How jax delivers gradients
depends on the mesh, and a plain ``lax.pmean`` of them is right in only some
layouts:

* ``pmap``, a named ``vmap``, ``shard_map(check_vma=False)``: each replica's
  gradients are its own; their mean is wanted.
* ``shard_map`` with its default ``check_vma=True``: jax sums the gradient
  of a parameter that is invariant over an axis (replicated, ``P()``) over
  that axis, where a varying loss meets it; ``lax.pmean`` of the sum leaves
  the sum (N times the mean). A parameter sharded over an axis (FSDP, whose
  ``all_gather`` transposes to a ``psum_scatter``) has its gradient summed
  over it by the model's own collectives.

So, where jax records varying axes, the parameters invariant over an axis
of ``axes`` are first marked varying over it (`local`): their gradients are
then each replica's own, accumulated over micro-batches without a
collective, and averaged once (`mean`); those already varying over it come
back summed, and are divided by the axis size. Elsewhere every gradient is
a replica's own and is averaged. The mean adds in float32 at least (a
float16 sum of replicas overflows where their mean does not) and divides
once; the loss is averaged the same way.

Where jax records no varying axes, a parameter sharded over an averaged
axis cannot be told from a replicated one: its gradient, already summed by
the model's collectives, would be averaged with other shards. Such layouts
(FSDP, tensor parallelism over an averaged axis) need ``check_vma=True``,
or ``jit`` over sharded arrays, where the gradients are global and
``average_over`` is not used.
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

    Returns ``(local_params, summed)``: ``summed`` holds, per leaf, the axes
    of ``axes`` its gradient comes back summed over (it varied over them
    before), as a tuple; empty where jax records no varying axes.
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
    """``(grads, loss)`` averaged over ``axes``: each in its own dtype.

    A gradient's sum over the axes it does not hold summed yet is taken in
    float32 at least; then the whole is divided by the number of replicas.
    """

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
