"""Data-parallel averaging that gives the single-device step on every mesh.

`mean` averages once, in float32 at least; where jax sums a gradient itself
(in the dtype it gathered the parameter in), the loss is scaled by `share` and
`mean` multiplies it back, exactly.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jls._compat import pvary, tracked_in, varying_axes
from jls._scaling import compute_dtype


def local(trainable: Any, axes: tuple[str, ...]) -> tuple[Any, Any]:
    """``(trainable marked varying over axes, per leaf the axes it was already)``."""
    if not axes or not tracked_in(trainable, axes):
        return trainable, jax.tree.map(lambda x: (), trainable)
    summed = jax.tree.map(
        lambda x: tuple(a for a in axes if a in varying_axes(x)), trainable
    )
    marked = jax.tree.map(
        lambda x, s: pvary(x, tuple(a for a in axes if a not in s)), trainable, summed
    )
    return marked, summed


def pow2_at_most_inverse(k: int) -> float:
    """``2**-e`` for the smallest ``e`` with ``2**e >= k``."""
    return 2.0 ** -((k - 1).bit_length())


def replicas(axes: tuple[str, ...]) -> int:
    """The number of replicas over ``axes``; a `NameError` naming the fix if unbound."""
    try:
        return lax.axis_size(axes)
    except NameError as e:
        raise NameError(
            f"train_step(average_over={axes!r}): {e}. Run the step under "
            "jax.pmap or jax.shard_map with that axis name (under jit over "
            "sharded arrays the gradients are global: drop average_over)"
        ) from e


def share(summed: Any, axes: tuple[str, ...]) -> float:
    """``2**-k`` if jax sums any gradient over ``axes`` itself, else 1.

    Any: a float32 parameter gathered as float16 (a policy's cast, a gather in
    the compute dtype) is summed in float16 though its own dtype is float32.
    """
    # ``summed``'s leaves are the axis names: none where jax sums nothing.
    return pow2_at_most_inverse(replicas(axes)) if jax.tree.leaves(summed) else 1.0


def mean(
    grads: Any, loss: jax.Array, axes: tuple[str, ...], summed: Any, shared: float
) -> Any:
    """``(grads, loss)`` averaged over ``axes`` in float32 at least, in their dtypes.

    ``grads`` are of a loss scaled by ``shared`` (`share`) too, divided out.
    """
    n = replicas(axes)

    def leaf(g: jax.Array, done: tuple[str, ...]) -> jax.Array:
        wide = g.astype(compute_dtype(g.dtype))
        todo = tuple(a for a in axes if a not in done)
        total = lax.psum(wide, todo) if todo else wide
        return (total / jnp.asarray(n * shared, wide.dtype)).astype(g.dtype)

    loss = lax.pmean(loss.astype(jnp.float32), axes)
    return jax.tree.map(leaf, grads, summed), loss


def warn_partitioned(trainable: Any, batch: Any) -> None:
    """Warns where XLA's partitioner will sum float16 gradients across devices."""
    if any(x.dtype == jnp.float16 for x in jax.tree.leaves(trainable)) and any(
        map(_partitioned, jax.tree.leaves(batch))
    ):
        warnings.warn(
            "train_step: float16 parameters under jax.jit over a sharded batch: "
            "XLA sums their gradients across devices in float16, which jls "
            "cannot widen. Keep float32 parameters, or run the step under "
            "jax.shard_map with average_over; jls.precision.precision_report("
            "jax.jit(step).lower(*args).compile()) lists each collective's dtype",
            stacklevel=4,
        )


def _partitioned(x: Any) -> bool:
    """Whether ``x``'s traced value is split over a mesh axis of size > 1."""
    sharding = (
        getattr(jax.typeof(x), "sharding", None) if isinstance(x, jax.Array) else None
    )
    sizes = getattr(getattr(sharding, "mesh", None), "shape", None) or {}
    spec = getattr(sharding, "spec", None) or ()
    axes = [a for e in spec for a in (e if isinstance(e, tuple) else (e,))]
    return any(sizes.get(a, 1) > 1 for a in axes if a is not None)
