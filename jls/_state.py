"""The loss-scale state, and finding it inside any optax state.

`LossScaleState` is the whole dynamic part of loss scaling: one float32 scale
and four int32 counters. Every scaler (dynamic, static, none) uses the same
state type, so switching scalers never changes a checkpoint's structure and
never retraces a train step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class LossScaleState(NamedTuple):
    """The dynamic state of a loss scaler: array leaves of fixed dtype.

    Attributes:
      scale: float32 scalar, the factor the loss is multiplied by.
      growth_count: int32 scalar, consecutive finite steps counted towards the
        next growth of the scale.
      backoff_count: int32 scalar, non-finite steps counted towards the next
        back-off (Paddle's ``decr_every_n_nan_or_inf``, Megatron's and
        DeepSpeed's ``hysteresis``; always 0 for the plain rule).
      consecutive_skips: int32 scalar, how many steps in a row (ending with
        the latest) had non-finite gradients. Saturates at the int32 maximum.
      total_skips: int32 scalar, how many steps so far had non-finite
        gradients. Saturates at the int32 maximum.

    Example:
      >>> import jls
      >>> state = jls.dynamic_scale(1024.0).init()
      >>> float(state.scale), state.scale.dtype.name, state.total_skips.dtype.name
      (1024.0, 'float32', 'int32')
      >>> state = jls.dynamic_scale(1024.0).adjust(state, False)  # an overflow
      >>> float(state.scale), int(state.consecutive_skips)
      (512.0, 1)
    """

    scale: jax.Array
    growth_count: jax.Array
    backoff_count: jax.Array
    consecutive_skips: jax.Array
    total_skips: jax.Array


_FIELD_DTYPES = {
    "scale": np.dtype(np.float32),
    "growth_count": np.dtype(np.int32),
    "backoff_count": np.dtype(np.int32),
    "consecutive_skips": np.dtype(np.int32),
    "total_skips": np.dtype(np.int32),
}


def make_state(
    scale: float,
    growth_count: int = 0,
    backoff_count: int = 0,
    consecutive_skips: int = 0,
    total_skips: int = 0,
) -> LossScaleState:
    """Builds a `LossScaleState` of committed (not weakly typed) arrays."""
    return LossScaleState(
        scale=jnp.asarray(np.float32(scale)),
        growth_count=jnp.asarray(np.int32(growth_count)),
        backoff_count=jnp.asarray(np.int32(backoff_count)),
        consecutive_skips=jnp.asarray(np.int32(consecutive_skips)),
        total_skips=jnp.asarray(np.int32(total_skips)),
    )


def _unwrap(leaf: Any) -> Any:
    """Returns the array inside a flax ``nnx.Variable``-like box, else ``leaf``."""
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        return leaf
    get_value = getattr(leaf, "get_value", None)
    if callable(get_value):
        return get_value()
    return getattr(leaf, "value", leaf)


def check_state(state: Any, *, argname: str = "state") -> LossScaleState:
    """Validates a `LossScaleState` at trace time and unwraps boxed leaves.

    Args:
      state: the value to check.
      argname: the argument name used in error messages.

    Returns:
      ``state`` with every field a plain (possibly traced) array.

    Raises:
      TypeError: if ``state`` is not a `LossScaleState`, or a field has the
        wrong dtype or is not a scalar.
    """
    if not isinstance(state, LossScaleState):
        raise TypeError(
            f"{argname} must be a jls.LossScaleState, got {type(state).__name__}: "
            f"{state!r:.200}"
        )
    fields = {}
    for name, want in _FIELD_DTYPES.items():
        leaf = _unwrap(getattr(state, name))
        dtype = getattr(leaf, "dtype", None)
        shape = getattr(leaf, "shape", None)
        if dtype is None or np.dtype(dtype) != want or shape != ():
            raise TypeError(
                f"{argname}.{name} must be a {want} scalar array, got "
                f"{leaf!r:.200} (dtype {dtype}, shape {shape})"
            )
        fields[name] = leaf
    return LossScaleState(**fields)


def _is_state(x: Any) -> bool:
    return isinstance(x, LossScaleState)


def loss_scale_state(opt_state: Any) -> LossScaleState:
    """Finds the one `LossScaleState` inside a (nested) optax state.

    Works through ``optax.chain``, ``optax.MultiSteps``,
    ``optax.inject_hyperparams``, ``optax.masked`` and flax optimizer states,
    in either nesting order. Leaves boxed in flax ``nnx`` variables are
    unwrapped.

    Args:
      opt_state: an optimizer state, or a `LossScaleState` itself.

    Returns:
      The `LossScaleState`.

    Raises:
      ValueError: if ``opt_state`` holds no `LossScaleState`, or more than one.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = optax.chain(optax.clip(1.0), jls.loss_scaling(optax.sgd(0.1)))
      >>> state = tx.init({"w": jnp.zeros(3)})
      >>> jls.loss_scale_state(state).scale
      Array(32768., dtype=float32)
    """
    if isinstance(opt_state, LossScaleState):
        return check_state(opt_state, argname="opt_state")
    found = [
        x
        for x in jax.tree.leaves(opt_state, is_leaf=_is_state)
        if isinstance(x, LossScaleState)
    ]
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise ValueError(
            f"opt_state must contain exactly one jls.LossScaleState, found {what}. "
            "Pass the state of a jls.loss_scaling(...) transformation (or the "
            "LossScaleState itself); when you nest several loss_scaling wrappers, "
            "pass the sub-state you mean."
        )
    return check_state(found[0], argname="opt_state's LossScaleState")


def replace_loss_scale_state(opt_state: Any, new: LossScaleState) -> Any:
    """Returns ``opt_state`` with its one `LossScaleState` replaced by ``new``.

    Pure: ``opt_state`` itself is not changed. Use it to resume a run from
    another framework's checkpoint (see ``jls.presets.from_torch_state_dict``)
    or to set the scale by hand.

    Args:
      opt_state: an optimizer state containing exactly one `LossScaleState`
        (or a `LossScaleState`, which is then simply replaced).
      new: the replacement; checked like any state.

    Returns:
      The new optimizer state, of the same structure.

    Raises:
      ValueError: if ``opt_state`` holds no `LossScaleState`, or several.
      TypeError: if ``new`` is not a valid `LossScaleState`.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(optax.sgd(0.1))
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> new = jls.static_scale(8.0).init()
      >>> state = jls.replace_loss_scale_state(state, new)
      >>> jls.metrics(state)["loss_scale"]
      Array(8., dtype=float32)
    """
    new = check_state(new, argname="new")
    loss_scale_state(opt_state)  # exactly one, or a clear error
    return jax.tree.map(
        lambda x: new if isinstance(x, LossScaleState) else x,
        opt_state,
        is_leaf=_is_state,
    )


def set_loss_scale(opt_state: Any, scale: Any, *, reset_counters: bool = False) -> Any:
    """Returns ``opt_state`` with a new loss scale.

    The jls form of MindSpore's ``set_sense_scale``, torch's
    ``GradScaler.update(new_scale)`` and Paddle's ``set_init_loss_scaling``.
    Pure; the counters are kept unless ``reset_counters`` (then the growth
    and back-off counts restart and the skip counts go to 0).

    Args:
      opt_state: an optimizer state containing one `LossScaleState` (or the
        `LossScaleState` itself).
      scale: the new scale: a positive normal float32 number (checked now),
        or a float32-castable scalar array (e.g. computed inside ``jit``).
      reset_counters: also zero every counter.

    Returns:
      The new state, of the same structure.

    Raises:
      ValueError: if a concrete ``scale`` is not a positive normal float32.

    Example:
      >>> import jls
      >>> state = jls.set_loss_scale(jls.dynamic_scale().init(), 1024.0)
      >>> state.scale
      Array(1024., dtype=float32)
    """
    old = loss_scale_state(opt_state)
    try:
        value = float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError):
        value = None  # traced: no eager check possible
    if value is not None:
        tiny, top = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
        if not tiny <= value <= top:
            raise ValueError(
                f"scale must be a positive normal float32 (between {tiny!r} and "
                f"{top!r}), got {scale!r}"
            )
    new_scale = jnp.asarray(scale, jnp.float32).reshape(())
    if reset_counters:
        zero = jnp.int32(0)
        new = LossScaleState(new_scale, zero, zero, zero, zero)
    else:
        new = old._replace(scale=new_scale)
    if isinstance(opt_state, LossScaleState):
        return new
    return replace_loss_scale_state(opt_state, new)
