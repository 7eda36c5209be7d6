"""One gradient in shards: per-device statistics made global, on any mesh.

A sharded gradient's rows add over its shards; a replicated one's are kept.
Where jax records no varying axes (``pmap``, ``check_vma=False``), a row
bitwise equal on every member of an axis reads as a replica's.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax


def global_rows(
    rows: Sequence[jax.Array],
    varying: Sequence[frozenset[str]],
    named: tuple[str, ...],
    tracked: bool,
    *,
    added: int,
) -> list[jax.Array]:
    """Per-device rows of statistics, one per reduction, made global.

    Args:
      rows: per reduction, a float32 vector: its first ``added`` entries add
        over shards, the rest take the maximum.
      varying: per reduction, the ``shard_map`` axes its gradient varies over.
      named: the axes named by the caller (``axis_name``).
      tracked: whether jax records varying axes (`jls._compat`).
      added: how many leading entries of each row add.

    Returns:
      The rows over the whole gradients, equal on every device.
    """
    out = list(rows)
    if tracked:
        # Rows are stacked only with rows of the same axes: a stack of rows
        # varying over other axes would vary over them all.
        groups: dict[tuple[str, ...], list[int]] = {}
        for i, axes in enumerate(varying):
            if axes:
                groups.setdefault(tuple(sorted(axes)), []).append(i)
        for axes, members in groups.items():
            merged = _reduce(jnp.stack([out[i] for i in members]), axes, added)
            for j, i in enumerate(members):
                out[i] = merged[j]
        return out
    if not named or not out:
        return out
    stacked = jnp.stack(out)
    for axis in named:
        same = jnp.all(lax.pmax(stacked, axis) == lax.pmin(stacked, axis), axis=1)
        stacked = jnp.where(same[:, None], stacked, _reduce(stacked, axis, added))
    return list(stacked)


def _reduce(stacked: jax.Array, axes: str | tuple[str, ...], added: int) -> jax.Array:
    """``stacked``'s first ``added`` columns summed over ``axes``, the rest maxed."""
    summed = lax.psum(stacked[:, :added], axes)
    if added == stacked.shape[1]:
        return summed
    return jnp.concatenate([summed, lax.pmax(stacked[:, added:], axes)], axis=1)
