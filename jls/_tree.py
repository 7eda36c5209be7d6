"""Finding jls's states inside any optax state, and splitting a model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jls._composition import check_path
from jls._state import LossScaleState, check_state, unwrap


def find_all(tree: Any, kind: type) -> list[tuple[tuple[Any, ...], Any]]:
    """``(path, value)`` of every ``kind`` (a NamedTuple type) in ``tree``."""
    return optax.tree.get_all_with_path(tree, kind.__name__)


def find_one(tree: Any, kind: type, what: str, hint: str) -> Any:
    """The one ``kind`` (described as ``what``) inside ``tree``.

    Raises:
      ValueError: naming ``what`` and how many were found, then ``hint``; or
        if a composition hides jls from its caller (`jls._composition`).
    """
    found = find_all(tree, kind)
    if len(found) != 1:
        raise ValueError(
            f"opt_state must contain exactly one {what}, found "
            f"{len(found) or 'none'}. {hint}"
        )
    path, value = found[0]
    check_path(tree, path)
    return value


def loss_scale_state(opt_state: Any, *, batched: bool = False) -> LossScaleState:
    """Finds the one `LossScaleState` inside a (nested) optax state.

    Args:
      opt_state: an optimizer state, or a `LossScaleState` itself.
      batched: accept a state stacked by ``vmap`` or ``pmap``.

    Returns:
      The `LossScaleState`.

    Raises:
      ValueError: if it holds none, several, or one hidden by a wrapper.

    Warns:
      UserWarning: if it holds it below another transformation's state.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(optax.MultiSteps(optax.sgd(0.1), 4))
      >>> jls.loss_scale_state(tx.init({"w": jnp.zeros(3)})).scale
      Array(32768., dtype=float32)
    """
    state = find_one(
        opt_state,
        LossScaleState,
        "jls.LossScaleState",
        "Pass the state of a jls.loss_scaling(...) transformation (or the "
        "LossScaleState itself); when you nest several loss_scaling wrappers, "
        "pass the sub-state you mean.",
    )
    return check_state(state, argname="opt_state's LossScaleState", batched=batched)


def replace_loss_scale_state(opt_state: Any, new: LossScaleState) -> Any:
    """``opt_state`` with its one `LossScaleState` replaced by ``new`` (pure)."""
    loss_scale_state(opt_state)  # exactly one, or a clear error
    return jax.tree.map(
        lambda x: new if isinstance(x, LossScaleState) else x,
        opt_state,
        is_leaf=lambda x: isinstance(x, LossScaleState),
    )


def holds(tree: Any, kind: type) -> bool:
    """Whether a ``kind`` is inside ``tree`` (or is ``tree``)."""
    return bool(find_all(tree, kind))


def _is_boxed(x: Any) -> bool:
    """Whether ``x`` is a flax ``nnx.Variable``-like box around an array."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return False
    return callable(getattr(x, "get_value", None)) or hasattr(x, "value")


def plain(tree: Any) -> Any:
    """``tree`` with flax ``nnx`` boxes and ``State`` mappings made plain."""
    if isinstance(tree, Mapping):  # nnx.State is a Mapping, not a dict
        return {key: plain(value) for key, value in tree.items()}
    return jax.tree.map(unwrap, tree, is_leaf=_is_boxed)


def split_inexact(tree: Any) -> tuple[Any, Any]:
    """``(floating arrays, the rest)``, each with ``None`` for the other's leaves."""

    def inexact(x: Any) -> bool:
        is_array = isinstance(x, (jax.Array, np.ndarray, np.generic))
        return is_array and jnp.issubdtype(x.dtype, jnp.inexact)

    kept = jax.tree.map(lambda x: x if inexact(x) else None, tree)
    rest = jax.tree.map(lambda x: None if inexact(x) else x, tree)
    return kept, rest


def split_frozen(params: Any, grads: Any) -> tuple[Any, Any]:
    """``(params that have a gradient, params whose gradient is None)``.

    A ``None`` gradient means "not trained" (as in equinox): those pass by.

    Raises:
      TypeError: if ``grads`` does not have the structure of ``params``.
    """

    def is_none(x: Any) -> bool:
        return x is None

    try:
        trained = jax.tree.map(
            lambda g, p: None if g is None else p, grads, params, is_leaf=is_none
        )
        frozen = jax.tree.map(
            lambda g, p: p if g is None else None, grads, params, is_leaf=is_none
        )
    except (TypeError, ValueError) as err:
        raise TypeError(
            "grads must have the structure of params (None for a parameter that "
            f"is not trained): {jax.tree.structure(grads, is_leaf=is_none)} "
            f"against {jax.tree.structure(params, is_leaf=is_none)} ({err})"
        ) from None
    return trained, frozen


def merge(kept: Any, rest: Any) -> Any:
    """Puts a tree split by `split_inexact` or `split_frozen` back together."""
    return jax.tree.map(
        lambda a, b: b if a is None else a,
        kept,
        rest,
        is_leaf=lambda x: x is None,
    )
