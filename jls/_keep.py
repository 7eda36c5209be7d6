"""State outside the optimizer (BatchNorm statistics), kept on a skipped step."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jls._cond import select_tree
from jls._tree import loss_scale_state


def keep_if_skipped(new: Any, old: Any, *opt_states: Any) -> Any:
    """``new`` if the step was applied, else ``old``: state outside the optimizer.

    For state the forward pass wrote (an equinox ``eqx.nn.State``); with
    several optimizers any skip keeps ``old``.

    Args:
      new: the state after the step's forward pass (a pytree of arrays).
      old: the same state before the step.
      *opt_states: the optimizer states the step returned, at least one.

    Returns:
      ``new`` unless a step in ``opt_states`` was skipped, else ``old``.

    Raises:
      TypeError: if no optimizer state is given, or the structures differ.
      ValueError: if an optimizer state holds no `LossScaleState`, or several.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(8.0))
      >>> params = {"w": jnp.ones(2)}
      >>> opt_state = tx.init(params)
      >>> bad = {"w": jnp.array([jnp.nan, 1.0])}
      >>> params, opt_state = jls.apply_gradients(tx, bad, opt_state, params)
      >>> jls.keep_if_skipped(bad, {"w": jnp.zeros(2)}, opt_state)["w"]
      Array([0., 0.], dtype=float32)
    """
    if not opt_states:
        raise TypeError(
            "keep_if_skipped(new, old, *opt_states) needs the optimizer state the "
            "step returned (one or more): keep_if_skipped(new_state, state, "
            "opt_state)"
        )
    applied = jnp.asarray(True)
    for opt_state in opt_states:
        applied = applied & (loss_scale_state(opt_state).consecutive_skips == 0)
    if jax.tree.structure(new) != jax.tree.structure(old):
        raise TypeError(
            "keep_if_skipped(new, old, ...): new and old must have one structure, "
            f"got {jax.tree.structure(new)} and {jax.tree.structure(old)}"
        )
    return select_tree(applied, new, old)
