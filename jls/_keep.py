"""State outside the optimizer, kept as it was on a skipped step.

A skipped step leaves everything jls holds bitwise as it was, but a model
also updates state outside any optimizer, in its forward pass: BatchNorm's
running statistics (an equinox ``eqx.nn.State``, or statistics a user
threads by hand), an EMA of the weights, a step counter. A forward pass that
overflowed in float16 writes inf or nan into them before jls sees the
gradients; with BatchNorm normalising by its running statistics (equinox's
``mode="ema"``), every later forward pass is then nan and every later step
is skipped. `keep_if_skipped` is the one call that keeps such state as the
step keeps the parameters. (``jls.flax``'s classes do it for flax's
``batch_stats`` and ``nnx.BatchStat`` themselves.)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jls._cond import select_tree
from jls._tree import loss_scale_state


def keep_if_skipped(new: Any, old: Any, *opt_states: Any) -> Any:
    """``new`` if the step was applied, else ``old``: state outside the optimizer.

    Call it in the step, after the update, on any state the forward pass
    updated outside the optimizer (an equinox ``eqx.nn.State`` holding
    BatchNorm's running statistics, statistics you thread yourself): on a
    skipped step it is returned bitwise as it was before the step, so the
    inf or nan an overflowing forward pass wrote never reaches it, and the
    next step runs as if the skipped one never happened, as the parameters
    and the optimizer state do. Each leaf is selected (``lax.select`` on the
    decision, fused into the step; never ``0 * x``).

    With several optimizers (a GAN's generator and discriminator), pass the
    states of every step whose forward pass wrote ``new``: it is kept when
    any of them was skipped.

    Args:
      new: the state after the step's forward pass (a pytree of arrays).
      old: the same state before the step, of the same structure.
      *opt_states: the optimizer states the step returned (each holding one
        `LossScaleState`), at least one.

    Returns:
      ``new`` if no step in ``opt_states`` was skipped, else ``old``, with
      ``new``'s dtypes. With ``jls.no_scale(skip_nonfinite=False)`` (jls
      off) no step is ever skipped and ``new`` is always returned.

    Raises:
      TypeError: if no optimizer state is given, or ``new`` and ``old`` differ
        in structure.
      ValueError: if an optimizer state holds no `LossScaleState`, or several.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(8.0))
      >>> params = {"w": jnp.ones(2)}
      >>> opt_state = tx.init(params)
      >>> stats = {"mean": jnp.zeros(2)}  # say, BatchNorm's running mean
      >>> new_stats = {"mean": jnp.array([jnp.nan, 1.0])}  # a nan batch's
      >>> bad = {"w": jnp.array([jnp.nan, 1.0])}
      >>> params, opt_state = jls.apply_gradients(tx, bad, opt_state, params)
      >>> jls.keep_if_skipped(new_stats, stats, opt_state)["mean"]
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
