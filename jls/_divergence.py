"""Divergence errors: a run whose loss scale keeps overflowing must stop loudly.

MindSpore raises after 1000 consecutive overflows and DeepSpeed at its
minimum scale; optax's ``apply_if_finite`` instead starts applying non-finite
updates after ``max_consecutive_errors``. jls never applies them: it offers
an error on the host (at the next sync point), a ``checkify`` error inside
``jit``, and a host-side check for a training loop.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import checkify

from jls._state import LossScaleState, loss_scale_state


class DivergenceError(RuntimeError):
    """Raised when loss scaling keeps skipping steps: the run has diverged.

    Example:
      >>> import jls
      >>> scaler = jls.dynamic_scale()
      >>> state = scaler.init()
      >>> for _ in range(5):
      ...     state = scaler.adjust(state, False)
      >>> try:
      ...     jls.raise_if_diverged(state, max_consecutive_skips=3)
      ... except jls.DivergenceError as e:
      ...     print(type(e).__name__)
      DivergenceError
    """


def _message(count: Any, limit: int, scale: Any) -> str:
    return (
        f"jls: loss scaling diverged: {int(count)} consecutive steps with "
        f"non-finite gradients (limit {limit}); loss scale {float(scale)!r}. "
        "Every one was skipped; look for a nan in the model or data, or a "
        "learning rate that is too high."
    )


def _raise(count: Any, scale: Any, limit: int) -> None:
    raise DivergenceError(_message(count, limit, scale))


def check_divergence_on_host(loss_scale: LossScaleState, limit: int) -> None:
    """Inside a jitted step: raise `DivergenceError` on the host on a breach.

    A ``jax.debug.callback`` inside a ``lax.cond``, so it runs (and costs
    anything) only on the step that reaches the limit; the error surfaces at
    the next sync point (``block_until_ready``, a host read of any output).
    """
    lax.cond(
        loss_scale.consecutive_skips >= jnp.int32(limit),
        lambda: jax.debug.callback(
            lambda c, s: _raise(c, s, limit),
            loss_scale.consecutive_skips,
            loss_scale.scale,
        ),
        lambda: None,
    )


def _check_limit(max_consecutive_skips: Any) -> int:
    if (
        isinstance(max_consecutive_skips, bool)
        or not isinstance(max_consecutive_skips, int)
        or max_consecutive_skips < 1
    ):
        raise ValueError(
            f"max_consecutive_skips must be an int >= 1, got {max_consecutive_skips!r}"
        )
    return max_consecutive_skips


def raise_if_diverged(opt_state: Any, max_consecutive_skips: int) -> None:
    """On the host: raise `DivergenceError` if the limit has been reached.

    Reads the state (a sync point); call it where you log metrics.

    Args:
      opt_state: an optimizer state containing a `LossScaleState`.
      max_consecutive_skips: the limit, an int >= 1.

    Raises:
      DivergenceError: if ``consecutive_skips >= max_consecutive_skips``.
      ValueError: if the limit is not an int >= 1.

    Example:
      >>> import jls
      >>> scaler = jls.dynamic_scale()
      >>> state = scaler.adjust(scaler.adjust(scaler.init(), False), False)
      >>> jls.raise_if_diverged(state, 3)
      >>> jls.raise_if_diverged(state, 2)
      Traceback (most recent call last):
      ...
      jls._divergence.DivergenceError: jls: loss scaling diverged: 2 consecutive ...
    """
    limit = _check_limit(max_consecutive_skips)
    state = loss_scale_state(opt_state)
    count = int(state.consecutive_skips)
    if count >= limit:
        raise DivergenceError(_message(count, limit, state.scale))


def checkify_divergence(opt_state: Any, max_consecutive_skips: int) -> None:
    """Inside ``jit``: a ``jax.experimental.checkify`` divergence check.

    Call it in a step function that you wrap with ``checkify.checkify``; the
    returned error's ``throw()`` raises (or ``get()`` reports) the breach.

    Args:
      opt_state: the step's new optimizer state.
      max_consecutive_skips: the limit, an int >= 1.

    Example:
      >>> import jax, jls
      >>> from jax.experimental import checkify
      >>> scaler = jls.dynamic_scale()
      >>> def step(state):
      ...     state = scaler.adjust(state, False)
      ...     jls.checkify_divergence(state, 1)
      ...     return state
      >>> err, _ = jax.jit(checkify.checkify(step))(scaler.init())
      >>> print(err.get().splitlines()[0][:53])
      jls: loss scaling diverged: 1 consecutive steps with
    """
    limit = _check_limit(max_consecutive_skips)
    state = loss_scale_state(opt_state)
    checkify.check(
        state.consecutive_skips < jnp.int32(limit),
        "jls: loss scaling diverged: {count} consecutive steps with non-finite "
        f"gradients (limit {limit}); loss scale {{scale}}.",
        count=state.consecutive_skips,
        scale=state.scale,
    )
