"""The states, and reading and writing them inside any optax state.

`LossScaleState` is the whole dynamic part of loss scaling: one float32 scale,
int32 counters and the measured rule's float32 ``headroom``. Every scaler
(dynamic, measured, static, none) uses the same state type, so switching
scalers never changes a checkpoint's structure and never retraces a train
step. `WrapperState` is the state of a
`jls.loss_scaling` transformation: a `LossScaleState`, the inner optimizer's
state and the optional diagnostics.

Everything that finds a state inside a user's optimizer state (``optax.chain``,
``MultiSteps``, ``inject_hyperparams``, flax optimizers) goes through `find`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from jls._validate import F32_MAX, F32_TINY, flag, positive_f32, scale_in


class LossScaleState(NamedTuple):
    """The dynamic state of a loss scaler: array leaves of fixed dtype.

    Attributes:
      scale: float32 scalar, the factor the loss is multiplied by.
      growth_count: int32 scalar, consecutive finite steps counted towards the
        next growth of the scale.
      backoff_count: int32 scalar, non-finite steps counted towards the next
        back-off (``backoff_interval``, ``hysteresis``; always 0 for the plain
        rule).
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
      headroom: float32 scalar, the measured rule's extra headroom, a power
        of two >= 1 learned from overflows (`jls.measured_scale`); 1, and
        unused, for every other rule.

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
        headroom=jnp.asarray(np.float32(headroom)),
    )


def _unwrap(leaf: Any) -> Any:
    """Returns the array inside a flax ``nnx.Variable``-like box, else ``leaf``."""
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        return leaf
    get_value = getattr(leaf, "get_value", None)
    if callable(get_value):
        return get_value()
    return getattr(leaf, "value", leaf)


def _is_boxed(x: Any) -> bool:
    """Whether ``x`` is a flax ``nnx.Variable``-like box around an array."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return False
    return callable(getattr(x, "get_value", None)) or hasattr(x, "value")


def plain(tree: Any) -> Any:
    """``tree`` with flax ``nnx`` boxes and ``State`` mappings made plain.

    An ``nnx.Optimizer``'s state holds every array in a variable; what jls
    returns from it (metrics, paths) is plain arrays in plain dicts.
    """
    if isinstance(tree, Mapping):  # nnx.State is a Mapping, not a dict
        return {key: plain(value) for key, value in tree.items()}
    return jax.tree.map(_unwrap, tree, is_leaf=_is_boxed)


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


class WrapperState(NamedTuple):
    """The state of a `jls.loss_scaling` transformation.

    Attributes:
      loss_scale: the `LossScaleState` (scale and counters).
      inner_state: the wrapped optimizer's state; bitwise unchanged by a
        skipped step.
      nonfinite_leaves: with ``diagnostics=True``, a tree like the parameters
        of scalar bools: which gradient leaves were not finite on the latest
        step (all ``False`` after a finite step; with ``axis_name``, on any
        replica). ``None`` otherwise.
      diverged: with ``max_consecutive_skips=n``, a scalar bool that becomes
        ``True`` on the step that makes ``n`` skipped steps in a row and stays
        ``True`` (so a breach inside a ``lax.scan`` is not lost). ``None``
        otherwise.
      gradient_norm: with ``gradient_norm=True``, a float32 scalar: the
        global norm of the latest step's unscaled gradients (inf or nan after
        a non-finite step). ``None`` otherwise.
      spikes: with ``skip_spikes=jls.SpikeRule(...)``, the rule's
        statistics. ``None`` otherwise.
    """

    loss_scale: LossScaleState
    inner_state: Any
    nonfinite_leaves: Any = None
    diverged: Any = None
    gradient_norm: Any = None
    spikes: Any = None


def find(opt_state: Any, kind: type) -> list[Any]:
    """Every ``kind`` inside ``opt_state`` (or ``opt_state`` itself), in order."""
    return [
        x
        for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kind))
        if isinstance(x, kind)
    ]


def find_one(opt_state: Any, kind: type, what: str, hint: str) -> Any:
    """The one ``kind`` (described as ``what``) inside ``opt_state``.

    Raises:
      ValueError: naming ``what`` and how many were found, then ``hint``.
    """
    found = find(opt_state, kind)
    if len(found) != 1:
        raise ValueError(
            f"opt_state must contain exactly one {what}, found "
            f"{len(found) or 'none'}. {hint}"
        )
    return found[0]


def _children(node: Any) -> list[Any]:
    """``node``'s direct pytree children (empty for a leaf)."""
    children = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)[0]
    return [] if len(children) == 1 and children[0] is node else children


def _holds_scale(node: Any) -> bool:
    found = jax.tree.leaves(node, is_leaf=lambda x: isinstance(x, LossScaleState))
    return any(isinstance(x, LossScaleState) for x in found)


def _is_transform_state(node: Any) -> bool:
    """An optax transformation's state: a NamedTuple, or a chain's tuple of them."""
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return True
    return type(node) is tuple and bool(node) and all(map(_is_transform_state, node))


def _check_not_chained(opt_state: Any) -> None:
    """Refuses a `jls.loss_scaling` state inside ``optax.chain`` beside others.

    ``optax.chain``'s state is a plain tuple of its members' states. A member
    before ``loss_scaling`` sees the scaled gradients (a clip by global norm
    then clips 2**15 times too hard and training is silently slow); one after
    it keeps changing the parameters on skipped steps.
    """
    todo = [opt_state]
    while todo:
        node = todo.pop()
        if isinstance(node, LossScaleState):
            continue
        if type(node) is tuple and len(node) > 1:
            holders = [c for c in node if _holds_scale(c)]
            others = [c for c in node if not _holds_scale(c)]
            if holders and any(map(_is_transform_state, others)):
                raise ValueError(
                    "opt_state is the state of optax.chain(..., "
                    "jls.loss_scaling(inner), ...): the transformations chained "
                    "before loss_scaling see the scaled gradients (a clip by "
                    "global norm clips loss-scale times too hard) and those "
                    "after it change the parameters on skipped steps. Put them "
                    "inside: jls.loss_scaling(optax.chain(optax.clip_by_global_"
                    "norm(1.0), inner), scaler)"
                )
        todo.extend(_children(node))


def loss_scale_state(opt_state: Any, *, batched: bool = False) -> LossScaleState:
    """Finds the one `LossScaleState` inside a (nested) optax state.

    Works through ``optax.MultiSteps``, ``optax.inject_hyperparams``,
    ``optax.masked`` and flax optimizer states, in either nesting order.
    Leaves boxed in flax ``nnx`` variables are unwrapped. A state of
    ``optax.chain`` with ``loss_scaling`` beside other transformations is
    refused: they belong inside ``loss_scaling``.

    Args:
      opt_state: an optimizer state, or a `LossScaleState` itself.
      batched: accept a state stacked by ``vmap`` or ``pmap`` (fields of one
        common shape), as the host readers (`jls.metrics`,
        `jls.raise_if_diverged`) do; by default every field is a scalar.

    Returns:
      The `LossScaleState`.

    Raises:
      ValueError: if ``opt_state`` holds no `LossScaleState`, or more than one,
        or is ``optax.chain``'s state with other transformations beside
        ``loss_scaling``.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = optax.MultiSteps(jls.loss_scaling(optax.sgd(0.1)), 4)
      >>> state = tx.init({"w": jnp.zeros(3)})
      >>> jls.loss_scale_state(state).scale
      Array(32768., dtype=float32)
    """
    _check_not_chained(opt_state)
    state = find_one(
        opt_state,
        LossScaleState,
        "jls.LossScaleState",
        "Pass the state of a jls.loss_scaling(...) transformation (or the "
        "LossScaleState itself); when you nest several loss_scaling wrappers, "
        "pass the sub-state you mean.",
    )
    return check_state(state, argname="opt_state's LossScaleState", batched=batched)


def _check_scale_value(state: LossScaleState, *, argname: str) -> None:
    """Refuses a concrete scale that is not a positive normal float32.

    Traced scales pass: inside ``jit`` the scaler treats a scale outside its
    ``[min_scale, max_scale]`` (nan included) as a non-finite step.
    """
    if not isinstance(state.scale, Tracer):
        positive_f32(f"{argname}.scale", state.scale)


def replace_loss_scale_state(opt_state: Any, new: LossScaleState) -> Any:
    """Returns ``opt_state`` with its one `LossScaleState` replaced by ``new``.

    Pure: ``opt_state`` itself is not changed. Use it to resume a run from
    another framework's checkpoint (see ``jls.presets.from_torch_state_dict``)
    or to restart a scaler (``scaler.init()``); to change only the scale, use
    `set_loss_scale`.

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
    _check_scale_value(new, argname="new")
    loss_scale_state(opt_state)  # exactly one, or a clear error
    return jax.tree.map(
        lambda x: new if isinstance(x, LossScaleState) else x,
        opt_state,
        is_leaf=lambda x: isinstance(x, LossScaleState),
    )


def set_loss_scale(
    opt_state: Any,
    scale: Any,
    *,
    scaler: Any = None,
    reset_counters: bool = False,
) -> Any:
    """Returns ``opt_state`` with a new loss scale.

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

    if isinstance(scale, (LossScaleState, WrapperState)) or isinstance(
        opt_state, (int, float)
    ):
        raise TypeError(
            "set_loss_scale(opt_state, scale): the arguments are swapped (the "
            "state comes first)"
        )
    reset_counters = flag("reset_counters", reset_counters)
    if scaler is not None and not isinstance(scaler, LossScaler):
        raise TypeError(f"scaler must be a jls.LossScaler or None, got {scaler!r:.200}")
    old = loss_scale_state(opt_state)
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
        new_scale = jnp.where(ok, value, old.scale)
    elif scaler is None:
        new_scale = jnp.asarray(np.float32(scale_in("scale", scale, F32_TINY, F32_MAX)))
    else:
        new_scale = jnp.asarray(np.float32(scaler.check_scale("scale", scale)))
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


def metrics(opt_state: Any) -> dict[str, jax.Array]:
    """The loss-scale metrics of a step, for logging.

    Works inside ``jit`` and on the host, on a state batched by ``vmap`` or
    ``pmap`` too.

    Args:
      opt_state: a `LossScaleState` or any optimizer state containing one.

    Returns:
      A dict of scalar arrays:

      * ``loss_scale``: the scale for the next step (float32).
      * ``skipped``: whether the latest step's update was dropped (bool).
      * ``nonfinite``: whether the latest step's gradients were not all
        finite (bool). Equal to ``skipped`` unless the scaler applies such
        steps (``skip_nonfinite=False``), or the step's scale was outside the
        scaler's range (then the step counts as non-finite and is dropped).
      * ``consecutive_skips``: skipped steps in a row, ending with the latest.
      * ``total_skips``: skipped steps so far. Retries are not steps. A
        step counter that counts every call (flax's ``TrainState.step``)
        minus ``total_skips`` is the inner optimizer's own count.
      * ``consecutive_nonfinite``: steps in a row with non-finite gradients.
      * ``growth_count``: consecutive finite steps towards the next growth.
      * ``retries``: how many times the latest step's gradients were
        recomputed (``jls.train_step(..., max_retries=n)``).
      * ``nonfinite_leaves``: with ``loss_scaling(..., diagnostics=True)``,
        a tree like the parameters of scalar bools: which gradient leaves
        were not finite on the latest step (no extra pass over the
        gradients on finite steps).
      * ``diverged``: with ``loss_scaling(..., max_consecutive_skips=n)``,
        whether the run has reached the limit.
      * ``gradient_norm``: with ``loss_scaling(..., gradient_norm=True)``,
        the global norm of the latest step's unscaled gradients, from the
        finite check's own pass (float32).
      * ``spike``, ``total_spikes``: with ``loss_scaling(...,
        skip_spikes=jls.SpikeRule(...))``, whether the latest step was
        skipped as a spike, and how many were so far (they count in
        ``total_skips`` too).

    Example:
      >>> import jls
      >>> m = jls.metrics(jls.dynamic_scale().init())
      >>> float(m["loss_scale"]), bool(m["skipped"]), int(m["total_skips"])
      (32768.0, False, 0)
    """
    state = loss_scale_state(opt_state, batched=True)
    out = {
        "loss_scale": state.scale,
        "skipped": state.consecutive_skips > 0,
        "nonfinite": state.consecutive_nonfinite > 0,
        "consecutive_skips": state.consecutive_skips,
        "total_skips": state.total_skips,
        "consecutive_nonfinite": state.consecutive_nonfinite,
        "growth_count": state.growth_count,
        "retries": state.retries,
    }
    wrappers = find(opt_state, WrapperState)
    if len(wrappers) == 1:
        wrapper = wrappers[0]
        if wrapper.nonfinite_leaves is not None:
            out["nonfinite_leaves"] = plain(wrapper.nonfinite_leaves)
        if wrapper.diverged is not None:
            out["diverged"] = plain(wrapper.diverged)
        if wrapper.gradient_norm is not None:
            out["gradient_norm"] = plain(wrapper.gradient_norm)
        if wrapper.spikes is not None:
            out["spike"] = plain(wrapper.spikes.spike)
            out["total_spikes"] = plain(wrapper.spikes.total_spikes)
    return out


def nonfinite_paths(opt_state: Any) -> list[str]:
    """On the host: the paths of the gradient leaves that were not finite.

    Reads the state (a sync point); use it when ``metrics()["skipped"]``.

    Args:
      opt_state: the state of a ``jls.loss_scaling(..., diagnostics=True)``
        transformation, or any optimizer state containing it.

    Returns:
      Key paths such as ``"['dense']['kernel']"``, in tree order; empty after
      a finite step.

    Raises:
      ValueError: if the state has no diagnostics.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(optax.sgd(0.1), diagnostics=True)
      >>> params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
      >>> grads = {"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}
      >>> _, state = tx.update(grads, tx.init(params), params)
      >>> jls.nonfinite_paths(state)
      ["['b']"]
    """
    flags = find_one(
        opt_state,
        WrapperState,
        "jls.loss_scaling state",
        "Pass the state of a jls.loss_scaling(..., diagnostics=True) transformation.",
    ).nonfinite_leaves
    if flags is None:
        raise ValueError(
            "this state records no per-leaf diagnostics: make the transformation "
            "with jls.loss_scaling(..., diagnostics=True)"
        )
    return [
        jax.tree_util.keystr(path)
        for path, flag in jax.tree_util.tree_flatten_with_path(plain(flags))[0]
        if bool(np.any(np.asarray(flag)))
    ]
