"""Where jax's API moved between the floor (0.8.0) and the newest release.

The one module that knows jax versions: the ``shard_map`` axes a value varies
over, marking it varying, and whether jax records varying axes at all.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def varying_of(aval: Any) -> frozenset[str]:
    """The ``shard_map`` axes an abstract value (``jax.typeof(x)``) varies over."""
    varying = getattr(aval, "vma", None)
    if varying is None:
        varying = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(varying or ())


def varying_axes(x: Any) -> frozenset[str]:
    """The ``shard_map`` axes ``x``'s value varies over (empty outside one)."""
    return varying_of(jax.typeof(x))


def pvary(x: Any, axes: Any) -> Any:
    """``x`` marked as varying over ``axes`` (a no-op where jax tracks none)."""
    axes = tuple(axes)
    if not axes:
        return x
    pcast = getattr(lax, "pcast", None)
    if pcast is not None:
        return pcast(x, axes, to="varying")
    return lax.pvary(x, axes)  # pyright: ignore[reportAttributeAccessIssue]


def tracks_varying_axes(axes: tuple[str, ...]) -> bool:
    """Whether jax records which of the bound ``axes`` values vary over."""
    if not axes:
        return False
    try:
        probe = pvary(jnp.zeros((), jnp.int32), axes[:1])
    except (ValueError, NameError, TypeError, AssertionError):  # no shard_map
        return False
    return bool(varying_axes(probe))


def tracked_in(values: Any, axes: tuple[str, ...]) -> bool:
    """`tracks_varying_axes`, known already if one of ``values`` varies."""
    leaves = jax.tree.leaves(values)
    return any(varying_axes(x) for x in leaves) or tracks_varying_axes(axes)
