"""`set_loss_scale`: a new scale (or state), as torch's ``update(new_scale)``."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from jls._rule import LossScaler
from jls._state import LossScaleState, check_state
from jls._tree import loss_scale_state, replace_loss_scale_state
from jls._validate import F32_MAX, F32_TINY, flag, positive_f32, scale_in


def set_loss_scale(
    opt_state: Any,
    scale: Any,
    *,
    scaler: LossScaler | None = None,
    reset_counters: bool = False,
) -> Any:
    """Returns ``opt_state`` with a new loss scale, or a whole new state.

    Args:
      opt_state: an optimizer state containing one `LossScaleState`, or it.
      scale: the new scale, a positive normal float32, or a `LossScaleState`.
      scaler: the run's `LossScaler`; ``scale`` must then lie in its range.
      reset_counters: restart the counters as ``scaler`` does (default False).

    Returns:
      The new state, of the same structure.

    Raises:
      TypeError: if an argument has the wrong type.
      ValueError: if ``scale`` is refused, or ``reset_counters`` lacks ``scaler``.

    Example:
      >>> import jls
      >>> scaler = jls.dynamic_scale()
      >>> state = jls.set_loss_scale(scaler.init(), 1024.0)
      >>> state.scale
      Array(1024., dtype=float32)
      >>> state = jls.set_loss_scale(state, 8.0, scaler=scaler, reset_counters=True)
      >>> float(state.scale), int(state.growth_count)
      (8.0, 0)
    """
    if isinstance(opt_state, (int, float)):
        raise TypeError(
            "set_loss_scale(opt_state, scale): the arguments are swapped (the "
            "state comes first)"
        )
    reset_counters = flag("reset_counters", reset_counters)
    if scaler is not None and not isinstance(scaler, LossScaler):
        raise TypeError(f"scaler must be a jls.LossScaler or None, got {scaler!r:.200}")
    if isinstance(scale, LossScaleState):
        new = check_state(scale, argname="scale")
        if not isinstance(new.scale, Tracer):
            positive_f32("scale.scale", new.scale)
        return _replaced(opt_state, new)
    _check_scale_type(scale)
    old = loss_scale_state(opt_state)
    new_scale = _checked_scale(scale, old, scaler)
    if reset_counters:
        if scaler is None:
            raise ValueError(
                "reset_counters=True needs scaler=...: the growth count restarts "
                "at that scaler's restart value"
            )
        new = scaler.restart(new_scale)
    else:
        new = old._replace(scale=new_scale)
    return _replaced(opt_state, new)


def _check_scale_type(scale: Any) -> None:
    if not isinstance(scale, (Tracer, int, float, np.generic, np.ndarray)) and not (
        hasattr(scale, "dtype") and hasattr(scale, "shape")
    ):
        raise TypeError(
            "scale must be a real number, a real scalar array or a "
            f"jls.LossScaleState, got {type(scale).__name__}: {scale!r:.200}"
        )


def _checked_scale(scale: Any, old: LossScaleState, scaler: LossScaler | None) -> Any:
    """The new scale as a float32 array: checked if concrete, else guarded."""
    if isinstance(scale, Tracer):
        if scale.shape != () or not (
            jnp.issubdtype(scale.dtype, jnp.floating)
            or jnp.issubdtype(scale.dtype, jnp.integer)
        ):
            raise TypeError(
                "scale must be a real scalar, got a traced value of dtype "
                f"{scale.dtype} and shape {scale.shape}"
            )
        value = scale.astype(jnp.float32)
        if scaler is None:
            ok = (value >= np.float32(F32_TINY)) & (value <= np.float32(F32_MAX))
        else:
            ok = scaler.in_range(value)
        return jnp.where(ok, value, old.scale)
    if scaler is None:
        return jnp.asarray(np.float32(scale_in("scale", scale, F32_TINY, F32_MAX)))
    return jnp.asarray(np.float32(scaler.check_scale("scale", scale)))


def _replaced(opt_state: Any, new: LossScaleState) -> Any:
    if isinstance(opt_state, LossScaleState):
        return new
    return replace_loss_scale_state(opt_state, new)
