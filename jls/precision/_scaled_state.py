"""An optimizer's state in float16 without underflow: per-tensor scaled storage.

Adaptive optimizers fail in float16 for range, not precision: Adam's second
moment ``(1 - 0.999) * g**2`` is 0 for every ``|g|`` below about 0.0055, and
``eps=1e-8`` is 0 (optax #1754). `scaled_state` stores each floating state
array in float16 (or bfloat16) with its own float32 power-of-two scale, as
optimi's PR #15 does, and runs the optimizer itself in float32.
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
        stored narrow, divided by its scale (`ScaledState.decoded` reads it);
        floating scalars in at least float32.
      scales: one float32 power of two per stored array, in leaf order.
    """

    inner_state: Any
    scales: tuple[jax.Array, ...]

    def decoded(self) -> Any:
        """The wrapped optimizer's state in float32 (``stored * scale``)."""
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


def _encode(state: Any, dtype: Any) -> tuple[Any, tuple[jax.Array, ...]]:
    leaves, treedef = jax.tree.flatten(state)
    target = jnp.finfo(dtype).maxexp - 2  # the largest in [2**13, 2**14) (f16)
    out, scales = [], []
    for x in leaves:
        if not _stored(x):
            out.append(_wide_scalar(x))
            continue
        wide = jnp.asarray(x).astype(jnp.float32)
        top = jnp.max(jnp.abs(wide))
        _, exponent = jnp.frexp(top)  # top in [2**(e-1), 2**e)
        shift = jnp.where(jnp.isfinite(top) & (top > 0), exponent - 1 - target, 0)
        shift = jnp.clip(shift, -126, 126).astype(jnp.int32)
        scale = jnp.ldexp(jnp.float32(1), shift)
        out.append((wide * jnp.ldexp(jnp.float32(1), -shift)).astype(dtype))
        scales.append(scale)
    return jax.tree.unflatten(treedef, out), tuple(scales)


def _decode(state: Any, scales: tuple[jax.Array, ...]) -> Any:
    leaves, treedef = jax.tree.flatten(state)
    it = iter(scales)
    out = [
        jnp.asarray(x).astype(jnp.float32) * next(it) if _stored(x) else x
        for x in leaves
    ]
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
    float32 power-of-two scale that puts its largest entry a binary order
    or two under the dtype's largest, so values down to about 2**-28 of that
    entry keep full precision.
    ``inner`` runs in float32 on the decoded state and upcast gradients and
    parameters, so its ``eps`` and divisions are float32. Wrap
    `jls.precision.stochastic_rounding` or `jls.precision.compensated`
    around it and no float32 copy is left anywhere.

    Args:
      inner: any optax optimizer (extra arguments are forwarded).
      dtype: the storage dtype, ``"float16"`` (default) or ``"bfloat16"``.

    Returns:
      An optax transformation; its state is a `ScaledState`, its updates
      float32.

    Raises:
      ValueError: for a ``dtype`` other than float16 or bfloat16.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> p, zero = jnp.ones(3, jnp.float16), jnp.zeros(3, jnp.float16)
      >>> adam = optax.adam(1e-3)  # float16 state: eps and the moments are 0
      >>> adam.update(zero, adam.init(p), p)[0]
      Array([nan, nan, nan], dtype=float16)
      >>> tx = jls.precision.scaled_state(adam)
      >>> updates, state = tx.update(zero, tx.init(p), p)
      >>> updates, state.inner_state[0].nu.dtype
      (Array([-0., -0., -0.], dtype=float32), dtype('float16'))

    References:
      optimi PR #15 (per-tensor scaled optimizer state in low precision).
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
