"""Scaling the loss and unscaling the gradients (and warning of swapped states)."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jls._compat import varying_axes
from jls._state import LossScaleState
from jls._tree import loss_scale_state


def compute_dtype(dtype: Any) -> Any:
    """float32 for narrower floats (fp8 and fp4 too), else the dtype itself."""
    dtype = np.dtype(dtype)
    return dtype if dtype.itemsize >= 4 else np.dtype(np.float32)


_SPLIT = 2.0**64
# The largest power of two whose float32 reciprocal is normal (one factor).
SINGLE_FACTOR_MAX = 2.0**126


def _reciprocal(
    scale: jax.Array, dtype: Any, two_factor: bool
) -> tuple[jax.Array, jax.Array | None]:
    """``1 / scale`` as one factor, or (``two_factor``, above 2**64) two normal ones.

    ``(2**64 / scale, 2**-64)``: XLA flushes the subnormal reciprocal of a
    scale above 2**126, and a power-of-two second factor rounds once.
    """
    scale = scale.astype(dtype)
    one = jnp.ones((), dtype)
    if not two_factor or jnp.finfo(dtype).maxexp > 128:
        return one / scale, None
    big = scale > _SPLIT
    a = jnp.where(big, jnp.asarray(_SPLIT, dtype) / scale, one / scale)
    b = jnp.where(big, jnp.asarray(1 / _SPLIT, dtype), one)
    return a, b


Factors = dict[Any, tuple[jax.Array, jax.Array | None]]


def reciprocals(scale: jax.Array, tree: Any, *, two_factor: bool = True) -> Factors:
    """The factors of ``1 / scale`` for every compute dtype of ``tree``'s leaves.

    ``two_factor=False`` promises ``scale <= SINGLE_FACTOR_MAX``.
    """
    factors = {}
    for leaf in jax.tree.leaves(tree):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            dtype = jnp.asarray(leaf).dtype
        if jnp.issubdtype(dtype, jnp.inexact):
            wide = compute_dtype(dtype)
            if wide not in factors:
                factors[wide] = _reciprocal(scale, wide, two_factor)
    return factors


def unscale_leaf(leaf: Any, factors: Factors, shrink: Any = None) -> Any:
    """``leaf * (1 / scale)`` computed in at least float32, in ``leaf``'s dtype.

    ``factors`` from `reciprocals` (empty: the scale is 1); ``shrink`` (a
    clipped spike's) multiplies the last one. Non-floating leaves pass through.
    """
    if leaf is None:
        return leaf
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.inexact):
        return leaf  # integers, bools, float0: untouched
    if not isinstance(leaf, jax.Array):  # Python and numpy numbers
        leaf = jnp.asarray(leaf)
        dtype = leaf.dtype
        if not jnp.issubdtype(dtype, jnp.inexact):
            return leaf
    wide_dtype = compute_dtype(dtype)
    wide = leaf.astype(wide_dtype)
    if not factors:  # the scale is 1: only a shrink
        if shrink is None:
            return leaf
        return (wide * shrink.astype(wide_dtype)).astype(dtype)
    a, b = factors[wide_dtype]
    if shrink is not None:
        # Into the last scalar factor: a shrink of 1 changes no bit, FMA or not.
        if b is None:
            a = a * shrink.astype(a.dtype)
        else:
            b = b * shrink.astype(b.dtype)
    wide = wide * a
    return (wide if b is None else wide * b).astype(dtype)


def unscale_tree(tree: Any, scale: jax.Array, *, two_factor: bool = True) -> Any:
    """`unscale_leaf` over ``tree``, with the factors computed once."""
    factors = reciprocals(scale, tree, two_factor=two_factor)
    return jax.tree.map(lambda x: unscale_leaf(x, factors), tree)


# Per trace, weak references to the scales `scale_loss` handed out in it.
_HANDED_OUT: weakref.WeakKeyDictionary[Any, list[weakref.ref]] = (
    weakref.WeakKeyDictionary()
)


def _trace_of(scale: Any) -> Any:
    """The trace a traced scale belongs to; ``None`` for a concrete array."""
    return getattr(scale, "_trace", None)


def _tag(scale: Any) -> None:
    """Records that `scale_loss` handed ``scale`` out (traced scales only)."""
    trace = _trace_of(scale)
    if trace is None:
        return
    try:
        _HANDED_OUT.setdefault(trace, []).append(weakref.ref(scale))
    except TypeError:  # a trace or tracer that takes no weak reference
        return


def check_scaled_with(scale: Any, stacklevel: int) -> None:
    """Warns, at trace time, if this trace's losses were scaled by other states."""
    trace = _trace_of(scale)
    refs = _HANDED_OUT.get(trace) if trace is not None else None
    if not refs or any(ref() is scale for ref in refs):
        return
    warnings.warn(
        "this update's loss scale was not the one jls.scale_loss applied in this "
        "step: scale_loss was given another jls state only (two jls optimizers, "
        "their states swapped?). The gradients are then unscaled by the wrong "
        "scale, and the update is off by the ratio of the two. Scale each loss "
        "with its own optimizer's state: jls.scale_loss(loss_g, opt_state_g) for "
        "tx_g.update(grads_g, opt_state_g, ...), jls.scale_loss(loss_d, "
        "opt_state_d) for the other",
        UserWarning,
        stacklevel=stacklevel,
    )


def _is_state(x: Any) -> bool:
    """Whether ``x`` is (or holds) a jls state: a sign of swapped arguments."""
    found = jax.tree.leaves(x, is_leaf=lambda y: isinstance(y, LossScaleState))
    return any(isinstance(y, LossScaleState) for y in found)


def scale_loss(loss: ArrayLike, opt_state: Any) -> jax.Array:
    """Multiplies the loss by the current loss scale, in float32.

    Call it on the loss inside the function you differentiate: the gradients
    come out scaled, as `loss_scaling`'s ``update`` expects.

    Args:
      loss: a floating array (usually a scalar).
      opt_state: an optimizer state with one `LossScaleState`, or it.

    Returns:
      ``loss * scale`` as float32 (float64 for a float64 loss).

    Raises:
      TypeError: if ``loss`` is not floating.
      ValueError: if the state holds no `LossScaleState`, or several.

    Example:
      >>> import jax.numpy as jnp, jls
      >>> state = jls.dynamic_scale(init_scale=2.0**17).init()
      >>> jls.scale_loss(jnp.float16(1.5), state)
      Array(196608., dtype=float32)
    """
    if _is_state(loss):
        raise TypeError(
            "scale_loss(loss, opt_state): the first argument is an optimizer "
            "state; the arguments are swapped"
        )
    loss = jnp.asarray(loss)
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"loss must be a floating array, got dtype {loss.dtype}")
    state = loss_scale_state(opt_state)
    _warn_varying(loss)
    _tag(state.scale)
    wide = compute_dtype(loss.dtype)
    return loss.astype(wide) * state.scale.astype(wide)


def _warn_varying(loss: jax.Array) -> None:
    """Warns, at trace time, of a loss whose gradients jax will sum over axes."""
    axes = tuple(sorted(varying_axes(loss)))
    if axes:
        name = axes[0] if len(axes) == 1 else axes
        warnings.warn(
            f"the loss varies over the shard_map axes {axes} (check_vma=True): "
            "jax.grad adds up the replicas' gradients of every parameter "
            "replicated over them, so they come out N times the mean, and a "
            "lax.pmean of them leaves the sum (the learning rate is N times too "
            "high). Reduce the loss before scaling it: jls.scale_loss(lax.pmean("
            f"loss, {name!r}), opt_state) for the mean's gradients (lax.psum for "
            "the sum's), or use jls.train_step(loss_fn, tx, "
            f"average_over={name!r}), which averages on every mesh",
            UserWarning,
            stacklevel=3,
        )


def unscale(tree: Any, opt_state: Any) -> Any:
    """Divides every floating leaf by the loss scale, keeping its dtype.

    Multiplies by the reciprocal in at least float32 (exact for power-of-two
    scales); non-floating leaves pass through. For a hand-written step.

    Args:
      tree: a pytree of (scaled) gradients.
      opt_state: an optimizer state with one `LossScaleState`, or it.

    Returns:
      A pytree of the same structure and dtypes.

    Example:
      >>> import jax.numpy as jnp, jls
      >>> state = jls.static_scale(8.0).init()
      >>> jls.unscale({"w": jnp.array([8.0, 16.0], jnp.float16)}, state)
      {'w': Array([1., 2.], dtype=float16)}
    """
    if _is_state(tree) and not _is_state(opt_state):
        raise TypeError(
            "unscale(tree, opt_state): the first argument is an optimizer state "
            "and the second is not; the arguments are swapped"
        )
    return unscale_tree(tree, loss_scale_state(opt_state).scale)
