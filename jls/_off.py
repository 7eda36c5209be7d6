"""The off switch: ``jls.no_scale(skip_nonfinite=False)`` is the plain optimizer.

A scaler that never scales and never skips needs no check: the step is the
inner optimizer's update, bitwise, plus two scalar selects.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jls._rule import LossScaler
from jls._state import overwritten
from jls.hooks._divergence import Divergence
from jls.hooks._hooks import Hook, LossScalingState
from jls.hooks._nonfinite_loss import NonfiniteLoss


def is_off(scaler: LossScaler, hooks: tuple[Hook, ...]) -> bool:
    """Whether a transformation with these is the plain optimizer."""
    return (
        scaler.is_identity
        and not scaler.skip_nonfinite
        and all(_records_only(h) for h in hooks)
    )


def _records_only(hook: Hook) -> bool:
    return isinstance(hook, Divergence) or (
        isinstance(hook, NonfiniteLoss) and not hook.skips
    )


def off_step(
    inner: Any,
    grads: Any,
    state: LossScalingState,
    params: Any,
    extra_args: dict[str, Any],
    fused: bool,
    loss: Any = None,
) -> tuple[Any, LossScalingState]:
    """The inner optimizer's step, as `jls._core.step` returns it.

    ``params`` are the trained floating parameters; ``loss`` is only recorded.
    """
    updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
    out = optax.apply_updates(params, updates) if fused else updates
    # Every other scalar passes through: a donated buffer is reused as it is.
    loss_scale = state.loss_scale._replace(scale=overwritten(state.loss_scale.scale, 1))
    hooks, name = dict(state.hooks), NonfiniteLoss.name
    if name in hooks:
        hooks[name] = NonfiniteLoss.recorded(hooks[name], loss)
    return out, LossScalingState(loss_scale, inner_state, hooks)


def warn_float16(grads: Any, *, off: bool) -> None:
    """Warns, at trace time, that float16 gradients are trained without a scale."""
    dtypes = {np.dtype(getattr(g, "dtype", np.float32)) for g in jax.tree.leaves(grads)}
    if np.dtype(jnp.float16) not in dtypes:
        return
    if off:
        what = (
            "float16 gradients with jls.no_scale(skip_nonfinite=False): loss "
            "scaling is off and non-finite steps are applied."
        )
    else:
        what = (
            "float16 gradients with a loss scale of 1 (jls.no_scale()): every "
            "gradient below float16's smallest subnormal (6e-8) rounds to zero "
            "in the backward pass, unscaled."
        )
    warnings.warn(
        f"{what} float16 needs a scale: use jls.measured_scale() or "
        "jls.dynamic_scale() (or jls.presets.flax()) for it, and keep "
        "jls.no_scale() for float32 and bfloat16 runs",
        UserWarning,
        stacklevel=5,
    )
