"""Where jax's API moved between the floor (0.8.0) and the newest release.

The one module that knows jax versions; everything else calls these. Each
is tested on the floor and on the newest jax (CI runs the suite on both).

* Which ``shard_map`` axes a value varies over: ``jax.typeof(x).vma`` up to
  jax 0.9, ``.manual_axis_type.varying`` after.
* Marking a value as varying over axes: ``lax.pvary`` (jax 0.8),
  ``lax.pcast(..., to="varying")`` (later).
* Whether jax records varying axes at all (``shard_map`` with its default
  ``check_vma=True``; not ``check_vma=False``, ``pmap`` or a named ``vmap``):
  no public flag says so, so it is probed: a value marked varying over a
  bound axis records that axis only where jax tracks them.
* A weakly typed result: no public function makes one from an array; the
  private one is used where it exists (without it a weakly typed state
  would become strong on the first step and retrace it once).
"""

from __future__ import annotations

from typing import Any, cast

import jax
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
    """Whether jax records which of the bound ``axes`` values vary over.

    True inside ``shard_map(..., check_vma=True)`` (the default); False
    under ``check_vma=False``, ``pmap``, a named ``vmap`` and without
    ``axes``. Trace-time only: the probe is a constant that is never used.
    """
    if not axes:
        return False
    try:
        probe = pvary(jax.numpy.zeros((), jax.numpy.int32), axes[:1])
    except (ValueError, NameError, TypeError, AssertionError):  # no shard_map
        return False
    return bool(varying_axes(probe))


def tracked_in(values: Any, axes: tuple[str, ...]) -> bool:
    """`tracks_varying_axes`, known already if one of ``values`` varies."""
    leaves = jax.tree.leaves(values)
    return any(varying_axes(x) for x in leaves) or tracks_varying_axes(axes)


def weakly_typed(x: jax.Array) -> jax.Array:
    """``x`` as a weakly typed array of its dtype (``lax.cond`` joins to one)."""
    try:
        from jax._src.lax.lax import _convert_element_type
    except ImportError:  # pragma: no cover - a jax without it: one retrace
        return x
    return cast(jax.Array, _convert_element_type(x, weak_type=True))


def bind(eqn: Any, invals: Any, params: dict | None = None) -> list:
    """One equation of a jaxpr bound again on ``invals``: its outputs, a list.

    As jax's own evaluation binds an equation: ``get_bind_params`` turns a
    program parameter into the function ``bind`` takes (jax 0.8 returns it
    apart, 0.9 on inside the parameters). ``params``: the equation's own
    if not given.
    """
    bound = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    subfuns, bound = bound if isinstance(bound, tuple) else ((), bound)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *invals, **bound)
    return list(out) if eqn.primitive.multiple_results else [out]
