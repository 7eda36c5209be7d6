"""The loss-scale state, and finding it inside any optax state.

`LossScaleState` is the whole dynamic part of loss scaling: one float32 scale
and six int32 counters. Every scaler (dynamic, static, none) uses the same
state type, so switching scalers never changes a checkpoint's structure and
never retraces a train step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from jls._validate import F32_MAX, F32_TINY, flag, positive_f32, to_f32


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
        the latest) were skipped: their update was dropped. Saturates at the
        int32 maximum.
      total_skips: int32 scalar, how many steps so far were skipped.
        Saturates at the int32 maximum.
      consecutive_nonfinite: int32 scalar, how many steps in a row (ending
        with the latest) had non-finite gradients, whether or not their update
        was dropped (with ``skip_nonfinite=False`` it is applied). Saturates.
      retries: int32 scalar, how many times the latest step's gradients were
        recomputed at a lower scale (``jls.train_step(..., max_retries=n)``);
        0 after any other step. Retries are not steps: they are not counted
        in the other counters.

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
    consecutive_nonfinite: jax.Array
    retries: jax.Array


_FIELD_DTYPES = {
    "scale": np.dtype(np.float32),
    "growth_count": np.dtype(np.int32),
    "backoff_count": np.dtype(np.int32),
    "consecutive_skips": np.dtype(np.int32),
    "total_skips": np.dtype(np.int32),
    "consecutive_nonfinite": np.dtype(np.int32),
    "retries": np.dtype(np.int32),
}


def make_state(
    scale: float,
    growth_count: int = 0,
    backoff_count: int = 0,
    consecutive_skips: int = 0,
    total_skips: int = 0,
    consecutive_nonfinite: int = 0,
    retries: int = 0,
) -> LossScaleState:
    """Builds a `LossScaleState` of committed (not weakly typed) arrays.

    Every field is a buffer of its own, so a state can always be donated.
    """
    return LossScaleState(
        scale=jnp.asarray(np.float32(scale)),
        growth_count=jnp.asarray(np.int32(growth_count)),
        backoff_count=jnp.asarray(np.int32(backoff_count)),
        consecutive_skips=jnp.asarray(np.int32(consecutive_skips)),
        total_skips=jnp.asarray(np.int32(total_skips)),
        consecutive_nonfinite=jnp.asarray(np.int32(consecutive_nonfinite)),
        retries=jnp.asarray(np.int32(retries)),
    )


def _unwrap(leaf: Any) -> Any:
    """Returns the array inside a flax ``nnx.Variable``-like box, else ``leaf``."""
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

    Args:
      state: the value to check.
      argname: the argument name used in error messages.
      batched: accept fields of one common shape (a state stacked by
        ``vmap`` or ``pmap``, read on the host), not only scalars.

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
    want_shape = getattr(_unwrap(state.scale), "shape", None) if batched else ()
    for name, want in _FIELD_DTYPES.items():
        leaf = _unwrap(getattr(state, name))
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


def _is_state(x: Any) -> bool:
    return isinstance(x, LossScaleState)


def loss_scale_state(opt_state: Any, *, batched: bool = False) -> LossScaleState:
    """Finds the one `LossScaleState` inside a (nested) optax state.

    Works through ``optax.chain``, ``optax.MultiSteps``,
    ``optax.inject_hyperparams``, ``optax.masked`` and flax optimizer states,
    in either nesting order. Leaves boxed in flax ``nnx`` variables are
    unwrapped.

    Args:
      opt_state: an optimizer state, or a `LossScaleState` itself.
      batched: accept a state stacked by ``vmap`` or ``pmap`` (fields of one
        common shape), as the host readers (`jls.metrics`,
        `jls.raise_if_diverged`) do; by default every field is a scalar.

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
        return check_state(opt_state, argname="opt_state", batched=batched)
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
    return check_state(found[0], argname="opt_state's LossScaleState", batched=batched)


def check_scale_value(state: LossScaleState, *, argname: str) -> None:
    """Refuses a concrete scale that is not a positive normal float32.

    Traced scales pass: inside ``jit`` the scaler treats a scale outside its
    ``[min_scale, max_scale]`` (nan included) as a non-finite step.
    """
    scale = state.scale
    if isinstance(scale, Tracer):
        return
    value = float(np.asarray(scale))
    if not F32_TINY <= value <= F32_MAX:
        raise ValueError(
            f"{argname}.scale must be a positive normal float32 (between "
            f"{F32_TINY!r} and {F32_MAX!r}), got {value!r}"
        )


def replace_loss_scale_state(opt_state: Any, new: LossScaleState) -> Any:
    """Returns ``opt_state`` with its one `LossScaleState` replaced by ``new``.

    Pure: ``opt_state`` itself is not changed. Use it to resume a run from
    another framework's checkpoint (see ``jls.presets.from_torch_state_dict``)
    or to restart a scaler (``scaler.init()``).

    A state whose scale lies outside its scaler's ``[min_scale, max_scale]``
    (a static scaler's other value, say) is never used as it is: the next
    step is skipped and the scale brought back into range.

    Args:
      opt_state: an optimizer state containing exactly one `LossScaleState`
        (or a `LossScaleState`, which is then simply replaced).
      new: the replacement; checked like any state.

    Returns:
      The new optimizer state, of the same structure.

    Raises:
      ValueError: if ``opt_state`` holds no `LossScaleState`, or several, or
        ``new.scale`` is concrete and not a positive normal float32.
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
    check_scale_value(new, argname="new")
    loss_scale_state(opt_state)  # exactly one, or a clear error
    return jax.tree.map(
        lambda x: new if isinstance(x, LossScaleState) else x,
        opt_state,
        is_leaf=_is_state,
    )


def set_loss_scale(
    opt_state: Any,
    scale: Any,
    *,
    scaler: Any = None,
    reset_counters: bool = False,
) -> Any:
    """Returns ``opt_state`` with a new loss scale.

    The jls form of MindSpore's ``set_sense_scale``, torch's
    ``GradScaler.update(new_scale)`` and Paddle's ``set_init_loss_scaling``.
    Pure. The counters are kept unless ``reset_counters``: then they restart
    as after a fresh start of ``scaler`` (the growth count at its restart
    value, so the next growth comes when that scaler's first growth would;
    every other counter at 0).

    Args:
      opt_state: an optimizer state containing one `LossScaleState` (or the
        `LossScaleState` itself).
      scale: the new scale: a positive normal float32 number, numpy scalar or
        concrete 0-d array (checked now), or a scalar array traced inside
        ``jit``, which cannot be checked now: a traced value that would be
        refused (nan, inf, zero, negative, subnormal, or outside the
        ``scaler``'s range) leaves the scale unchanged.
      scaler: the run's `LossScaler`; when given, ``scale`` must lie in its
        ``[min_scale, max_scale]``. Required with ``reset_counters``.
      reset_counters: restart every counter, as described above.

    Returns:
      The new state, of the same structure.

    Raises:
      TypeError: if ``scale`` is not a real number or real scalar array (a
        string or a bool, say), ``scaler`` is not a `LossScaler`, or
        ``reset_counters`` is not a bool.
      ValueError: if a concrete ``scale`` is not a positive normal float32
        or lies outside the scaler's range, or ``reset_counters`` is given
        without ``scaler``.

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
    from jls._scaler import LossScaler  # the scaler module builds on this one

    reset_counters = flag("reset_counters", reset_counters)
    if scaler is not None and not isinstance(scaler, LossScaler):
        raise TypeError(f"scaler must be a jls.LossScaler or None, got {scaler!r:.200}")

    old = loss_scale_state(opt_state)
    low, high = F32_TINY, F32_MAX
    if scaler is not None:
        low, high = scaler.min_scale_f32, scaler.max_scale_f32
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
        ok = (value >= np.float32(low)) & (value <= np.float32(high))
        new_scale = jnp.where(ok, value, old.scale)
    else:
        value = positive_f32("scale", scale)
        if not low <= to_f32(value) <= high:
            raise ValueError(
                f"scale must lie in the scaler's [min_scale, max_scale] = "
                f"[{low!r}, {high!r}], got {scale!r}"
            )
        new_scale = jnp.asarray(np.float32(value))
    if reset_counters:
        if scaler is None:
            raise ValueError(
                "reset_counters=True needs scaler=...: the growth count restarts "
                "at that scaler's restart value"
            )
        restart = make_state(1.0, growth_count=scaler.growth_restart)
        new = restart._replace(scale=new_scale)
    else:
        new = old._replace(scale=new_scale)
    if isinstance(opt_state, LossScaleState):
        return new
    return replace_loss_scale_state(opt_state, new)
