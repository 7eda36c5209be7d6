"""One gradient in shards: per-device statistics made global, on any mesh.

A sharded gradient's rows add over its shards; a replicated one's are kept.
The sharded axes are read off jax's types where it records them, else from
``axis_name`` as a dict (`named_axes`), else a statistic over shards refuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from jls._compat import tracked_in, varying_axes
from jls._validate import axis_names


class Axes(tuple):
    """``axis_name``'s axes, with which gradients are sharded over each.

    Attributes:
      sharded: per axis, a pytree prefix of the gradients of bools or
        ``PartitionSpec`` s (True, or a spec naming the axis: sharded).
    """

    sharded: dict[str, Any]

    def __new__(cls, sharded: dict[str, Any]) -> Axes:
        self = super().__new__(cls, tuple(sharded))
        self.sharded = dict(sharded)
        return self

    def __getnewargs__(self) -> tuple[Any, ...]:  # copy and pickle
        return (self.sharded,)

    def __repr__(self) -> str:
        return repr(self.sharded)


def named_axes(value: Any) -> tuple[str, ...]:
    """``axis_name`` as a tuple of str; a dict as `Axes`.

    Raises:
      TypeError: for a value that is none of None, a str, a tuple of str or a
        dict from axis names to pytrees of bools or ``PartitionSpec`` s.
    """
    if not isinstance(value, dict):
        return axis_names("axis_name", value)
    if not value or not all(isinstance(a, str) for a in value):
        raise TypeError(
            "axis_name must be None, a str, a tuple of str or a dict from axis "
            f"names, got {value!r}"
        )
    for axis, prefix in value.items():
        for leaf in jax.tree.leaves(prefix, is_leaf=lambda x: x is None or _is_spec(x)):
            if not isinstance(leaf, (bool, np.bool_, PartitionSpec)):
                raise TypeError(
                    "axis_name's values must be pytrees of bools or "
                    "PartitionSpecs (which gradients are sharded over the axis), "
                    f"got {axis!r}: {prefix!r}"
                )
    return Axes(value)


def shard_axes(tree: Any, named: tuple[str, ...], what: str) -> list[frozenset[str]]:
    """Per leaf of ``tree`` (``jax.tree.leaves``), the axes it is sharded over.

    Raises:
      ValueError: where jax records no varying axes and ``axis_name`` names
        axes without a declaration (``what`` needs it), or a declaration is
        not a prefix of ``tree``.
    """
    leaves = jax.tree.leaves(tree)
    if tracked_in(leaves, tuple(named)):
        return [varying_axes(x) for x in leaves]
    out: list[frozenset[str]] = [frozenset()] * len(leaves)
    if not named:
        return out
    declared = getattr(named, "sharded", None)
    if declared is None:
        raise ValueError(
            f"{what} sums over the gradients' shards, and jax records no varying "
            "axes here (pmap, shard_map(check_vma=False), a named vmap): say "
            "which gradients are sharded over each axis, with axis_name a dict: "
            f"axis_name={dict.fromkeys(named, False)!r} where every gradient is "
            "replicated (data parallelism), else map an axis to a pytree prefix "
            "of the gradients of bools or PartitionSpecs (True, or a spec naming "
            f"the axis: sharded over it); got axis_name={tuple(named)!r}"
        )
    for axis, prefix in declared.items():
        try:
            flags = jax.tree.map(
                lambda d, sub, a=axis: [_sharded(d, a)] * len(jax.tree.leaves(sub)),
                prefix,
                tree,
                is_leaf=_is_spec,
            )
        except (ValueError, TypeError) as err:
            raise ValueError(
                f"axis_name[{axis!r}] must be a pytree prefix of the gradients "
                f"(of bools or PartitionSpecs), got {prefix!r}: {err}"
            ) from err
        flat = jax.tree.leaves(flags)
        out = [a | {axis} if f else a for a, f in zip(out, flat, strict=True)]
    return out


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def _sharded(declared: Any, axis: str) -> bool:
    """Whether a declaration's leaf (a bool or a ``PartitionSpec``) shards ``axis``."""
    if not _is_spec(declared):
        return bool(declared)
    return any(
        axis == part or (isinstance(part, tuple) and axis in part) for part in declared
    )


def global_rows(
    rows: Sequence[jax.Array], varying: Sequence[frozenset[str]], *, added: int
) -> list[jax.Array]:
    """Per-device rows of statistics, one per reduction, made global.

    Each row's first ``added`` entries add over the axes in ``varying`` (per
    reduction, `shard_axes`), the rest take the maximum.
    """
    out = list(rows)
    # Rows are stacked only with rows of the same axes.
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, axes in enumerate(varying):
        if axes:
            groups.setdefault(tuple(sorted(axes)), []).append(i)
    for axes, members in groups.items():
        merged = _reduce(jnp.stack([out[i] for i in members]), axes, added)
        for j, i in enumerate(members):
            out[i] = merged[j]
    return out


def _reduce(stacked: jax.Array, axes: tuple[str, ...], added: int) -> jax.Array:
    """``stacked``'s first ``added`` columns summed over ``axes``, the rest maxed."""
    summed = lax.psum(stacked[:, :added], axes)
    if added == stacked.shape[1]:
        return summed
    return jnp.concatenate([summed, lax.pmax(stacked[:, added:], axes)], axis=1)
