"""An optimizer's state in float16 without underflow: per-tensor scaled storage.

Adaptive optimizers fail in float16 for range, not precision (Adam's second
moment flushes to 0, optax #1754); an array too wide for one scale is stored
as signed square roots, which need half the binary orders.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jls._inner import checked_inner
from jls._scaling import compute_dtype


class ScaledState(NamedTuple):
    """`scaled_state`'s state.

    Attributes:
      inner_state: the wrapped optimizer's state, each floating array
        stored narrow (`ScaledState.decoded` reads it).
      scales: one float32 power of two per stored array, in leaf order;
        negative where the array is stored as signed square roots.
    """

    inner_state: Any
    scales: tuple[jax.Array, ...]

    def decoded(self) -> Any:
        """The wrapped optimizer's state in float32, decoded exactly."""
        return _decode(self.inner_state, self.scales)


def _stored(x: Any) -> bool:
    """Whether a state leaf is kept narrow: a real floating array, not a scalar."""
    dtype = getattr(x, "dtype", None)
    return (
        dtype is not None
        and jnp.issubdtype(dtype, jnp.floating)
        and np.dtype(dtype).itemsize >= 2
        and np.ndim(x) >= 1
    )


def _wide_scalar(x: Any) -> Any:
    """A floating scalar leaf in at least float32; anything else as it is."""
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
        if np.dtype(dtype).itemsize >= 2 and np.ndim(x) == 0:
            return jnp.asarray(x).astype(compute_dtype(dtype))
    return x


def _shift(top: jax.Array, target: int) -> jax.Array:
    """The power of two that puts ``top`` in ``[2**target, 2**(target + 1))``."""
    _, exponent = jnp.frexp(top)  # top in [2**(e-1), 2**e)
    shift = jnp.where(jnp.isfinite(top) & (top > 0), exponent - 1 - target, 0)
    return jnp.clip(shift, -126, 126).astype(jnp.int32)


def _encoded(x: Any, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``x`` in ``dtype`` and its scale (negative: signed square roots, see above)."""
    wide = jnp.asarray(x).astype(jnp.float32)
    info = jnp.finfo(dtype)
    target = info.maxexp - 2  # the largest in [2**14, 2**15) (float16)
    # Plain reductions of ``wide``: XLA:CPU then keeps no |wide| in memory.
    top = jnp.maximum(jnp.max(wide), -jnp.min(wide))
    low = jnp.min(jnp.where(wide == 0, jnp.inf, jnp.abs(wide)))  # nonzero
    shift = _shift(top, target)
    root = jnp.ldexp(low, -shift) < info.smallest_normal
    shift = jnp.where(root, _shift(jnp.sqrt(top), target), shift)
    wide = jnp.where(root, jnp.sign(wide) * jnp.sqrt(jnp.abs(wide)), wide)
    stored = (wide * jnp.ldexp(jnp.float32(1), -shift)).astype(dtype)
    return stored, jnp.ldexp(jnp.where(root, jnp.float32(-1), 1), shift)


def _encode(state: Any, dtype: Any) -> tuple[Any, tuple[jax.Array, ...]]:
    leaves, treedef = jax.tree.flatten(state)
    out, scales = [], []
    for x in leaves:
        if _stored(x):
            stored, scale = _encoded(x, dtype)
            out.append(stored)
            scales.append(scale)
        else:
            out.append(_wide_scalar(x))
    return jax.tree.unflatten(treedef, out), tuple(scales)


def _decode(state: Any, scales: tuple[jax.Array, ...]) -> Any:
    """``stored * scale``; squared, keeping its sign, where the scale is negative."""

    def decoded(x: Any, scale: jax.Array) -> jax.Array:
        wide = jnp.asarray(x).astype(jnp.float32) * jnp.abs(scale)  # exact
        return jnp.where(scale < 0, wide * jnp.abs(wide), wide)  # 22 bits: exact

    leaves, treedef = jax.tree.flatten(state)
    it = iter(scales)
    out = [decoded(x, next(it)) if _stored(x) else x for x in leaves]
    return jax.tree.unflatten(treedef, out)


def _upcast(tree: Any) -> Any:
    def up(x: Any) -> Any:
        dtype = getattr(x, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            return x
        return jnp.asarray(x).astype(compute_dtype(dtype))

    return jax.tree.map(up, tree)


def scaled_state(
    inner: optax.GradientTransformation, *, dtype: Any = "float16"
) -> optax.GradientTransformationExtraArgs:
    """``inner`` with its state stored in ``dtype``, scaled per array, run in float32.

    Each floating array of ``inner``'s state is stored in ``dtype`` with one
    float32 power-of-two scale; ``inner`` runs in float32 on the decoded state.

    Args:
      inner: any optax optimizer (extra arguments are forwarded).
      dtype: the storage dtype, ``"float16"`` (default) or ``"bfloat16"``.

    Returns:
      An optax transformation; its state is a `ScaledState`.

    Raises:
      ValueError: for a ``dtype`` other than float16 or bfloat16.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> p, zero = jnp.ones(3, jnp.float16), jnp.zeros(3, jnp.float16)
      >>> tx = jls.precision.scaled_state(optax.adam(1e-3))
      >>> updates, state = tx.update(zero, tx.init(p), p)
      >>> updates, state.inner_state[0].nu.dtype
      (Array([-0., -0., -0.], dtype=float32), dtype('float16'))
    """
    inner = checked_inner(inner)
    given = dtype
    try:
        dtype = np.dtype(given) if given is not None else None
    except TypeError:
        dtype = None
    if dtype not in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
        raise ValueError(
            f"dtype must be 'float16' or 'bfloat16' (the storage dtype), got {given!r}"
        )

    def init(params: Any) -> ScaledState:
        return ScaledState(*_encode(inner.init(params), dtype))

    def update(
        updates: Any, state: ScaledState, params: Any = None, **extra: Any
    ) -> tuple[Any, ScaledState]:
        decoded = _decode(state.inner_state, state.scales)
        updates, new = inner.update(_upcast(updates), decoded, _upcast(params), **extra)
        return updates, ScaledState(*_encode(new, dtype))

    return optax.GradientTransformationExtraArgs(
        init, cast(optax.TransformUpdateExtraArgsFn, update)
    )
