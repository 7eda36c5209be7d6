"""`LossScaleState`: the whole dynamic part of loss scaling, for every rule."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


class LossScaleState(NamedTuple):
    """The dynamic state of a loss scaler: array leaves of fixed dtype.

    The int32 counters saturate at the int32 maximum.

    Attributes:
      scale: float32, the factor the loss is multiplied by.
      growth_count: int32, finite steps counted towards the next growth.
      backoff_count: int32, non-finite steps towards the next back-off.
      consecutive_skips: int32, dropped steps in a row, ending with the latest.
      total_skips: int32, steps so far whose update was dropped.
      consecutive_nonfinite: int32, steps in a row with non-finite gradients.
      retries: int32, times the latest step's gradients were recomputed.
      headroom: float32, `jls.measured_scale`'s extra headroom (else 1).

    Example:
      >>> import jls
      >>> state = jls.dynamic_scale(1024.0).init()
      >>> float(state.scale), state.scale.dtype.name, state.total_skips.dtype.name
      (1024.0, 'float32', 'int32')
    """

    scale: jax.Array
    growth_count: jax.Array
    backoff_count: jax.Array
    consecutive_skips: jax.Array
    total_skips: jax.Array
    consecutive_nonfinite: jax.Array
    retries: jax.Array
    headroom: jax.Array


_FIELD_DTYPES = {
    "scale": np.dtype(np.float32),
    "growth_count": np.dtype(np.int32),
    "backoff_count": np.dtype(np.int32),
    "consecutive_skips": np.dtype(np.int32),
    "total_skips": np.dtype(np.int32),
    "consecutive_nonfinite": np.dtype(np.int32),
    "retries": np.dtype(np.int32),
    "headroom": np.dtype(np.float32),
}


def make_state(
    scale: float,
    growth_count: int = 0,
    backoff_count: int = 0,
    consecutive_skips: int = 0,
    total_skips: int = 0,
    consecutive_nonfinite: int = 0,
    retries: int = 0,
    headroom: float = 1.0,
) -> LossScaleState:
    """A `LossScaleState` of strongly typed arrays, each its own buffer."""
    values = locals()
    return LossScaleState(
        **{
            name: jnp.asarray(dtype.type(values[name]))
            for name, dtype in _FIELD_DTYPES.items()
        }
    )


def overwritten(old: jax.Array, value: Any) -> jax.Array:
    """``value`` (of ``old``'s type) computed from ``old``: one select.

    A constant output would leave a donated ``old`` unused, and XLA would then
    copy each scalar of the state.
    """
    return jnp.where(lax.optimization_barrier(old) == value, old, value)


def unwrap(leaf: Any) -> Any:
    """The array inside a flax ``nnx.Variable``-like box, else ``leaf``."""
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        return leaf
    get_value = getattr(leaf, "get_value", None)
    if callable(get_value):
        return get_value()
    return getattr(leaf, "value", leaf)


def check_state(
    state: Any, *, argname: str = "state", batched: bool = False
) -> LossScaleState:
    """Validates a `LossScaleState` at trace time and unwraps boxed leaves.

    ``batched``: accept fields of one common shape (a ``vmap``-ed state).

    Raises:
      TypeError: if ``state`` is not a `LossScaleState`, or a field has the
        wrong dtype or shape.
    """
    if not isinstance(state, LossScaleState):
        raise TypeError(
            f"{argname} must be a jls.LossScaleState, got {type(state).__name__}: "
            f"{state!r:.200}"
        )
    fields = {}
    want_shape = getattr(unwrap(state.scale), "shape", None) if batched else ()
    for name, want in _FIELD_DTYPES.items():
        leaf = unwrap(getattr(state, name))
        dtype = getattr(leaf, "dtype", None)
        shape = getattr(leaf, "shape", None)
        if dtype is None or np.dtype(dtype) != want or shape != want_shape:
            what = "scalar array" if not batched else f"array of shape {want_shape}"
            raise TypeError(
                f"{argname}.{name} must be a {want} {what}, got "
                f"{leaf!r:.200} (dtype {dtype}, shape {shape})"
            )
        fields[name] = leaf
    return LossScaleState(**fields)
