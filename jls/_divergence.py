"""Divergence errors: a run whose loss scale keeps overflowing must stop loudly.

MindSpore raises after 1000 consecutive overflows and DeepSpeed at its
minimum scale; optax's ``apply_if_finite`` instead starts applying non-finite
updates after ``max_consecutive_errors``. jls never applies them. The signal
is plain state, so it is exact under every transformation (``vmap``,
``scan``, ``pmap``): ``loss_scaling(..., max_consecutive_skips=n)`` keeps a
sticky ``diverged`` flag, and the error is raised where a Python ``except``
can catch it: on the host by `raise_if_diverged`, or inside ``jit`` through
``jax.experimental.checkify`` by `checkify_divergence`. (jls 0.1 raised from
a ``jax.debug.callback`` inside the step: under ``vmap`` its ``lax.cond``
ran both branches, so it fired on finite steps, debug callbacks may be
dropped or repeated by design, and the error surfaced as a
``JaxRuntimeError``.)
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jls._state import loss_scale_state
from jls._transform import wrappers
from jls._validate import integer


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


def _flags(opt_state: Any, limit: int | None) -> tuple[Any, str]:
    """The divergence flag(s) of ``opt_state`` and the limit, as text."""
    state = loss_scale_state(opt_state, batched=True)
    if limit is not None:
        limit = integer("max_consecutive_skips", limit, 1)
        return state.consecutive_skips >= jnp.int32(limit), str(limit)
    found = [w for w in wrappers(opt_state) if w.diverged is not None]
    if len(found) != 1:
        raise ValueError(
            "give max_consecutive_skips, or pass the state of a "
            "jls.loss_scaling(..., max_consecutive_skips=n) transformation (it "
            "keeps the diverged flag); found "
            f"{len(found) or 'no'} such state(s)"
        )
    return found[0].diverged, "the transformation's max_consecutive_skips"


def raise_if_diverged(opt_state: Any, max_consecutive_skips: int | None = None) -> None:
    """On the host: raise `DivergenceError` if the run has diverged.

    Reads the state (a sync point); call it where you log metrics. With the
    default ``max_consecutive_skips=None`` it reads the sticky ``diverged``
    flag of a ``loss_scaling(..., max_consecutive_skips=n)`` state, which a
    breach anywhere in a ``lax.scan`` or on any ``vmap``/``pmap`` member
    sets. With a limit it compares the current ``consecutive_skips``.

    Args:
      opt_state: an optimizer state containing a `LossScaleState` (batched
        under ``vmap``/``pmap`` too: any member raises).
      max_consecutive_skips: ``None``, or a limit, an int >= 1.

    Raises:
      DivergenceError: if the flag is set, or ``consecutive_skips`` reached
        the limit.
      ValueError: if the limit is not an int >= 1, or none is given and the
        state keeps no flag.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(optax.sgd(0.1), max_consecutive_skips=2)
      >>> params = jnp.zeros(2)
      >>> state = tx.init(params)
      >>> for _ in range(2):
      ...     _, state = tx.update(jnp.full(2, jnp.nan), state, params)
      >>> try:
      ...     jls.raise_if_diverged(state)
      ... except jls.DivergenceError as err:
      ...     print(str(err)[:53])
      jls: loss scaling diverged: 2 consecutive skipped ste
    """
    flags, limit = _flags(opt_state, max_consecutive_skips)
    if np.any(np.asarray(flags)):
        state = loss_scale_state(opt_state, batched=True)
        count = int(np.max(np.asarray(state.consecutive_skips)))
        raise DivergenceError(_message(count, limit, np.min(np.asarray(state.scale))))


def checkify_divergence(
    opt_state: Any, max_consecutive_skips: int | None = None
) -> None:
    """Inside ``jit``: a ``jax.experimental.checkify`` divergence check.

    Call it in a step function that you wrap with ``checkify.checkify``; the
    returned error's ``throw()`` raises (or ``get()`` reports) the breach.
    The flag and limit are read as by `raise_if_diverged`.

    Args:
      opt_state: the step's new optimizer state.
      max_consecutive_skips: ``None`` (use the state's ``diverged`` flag) or
        a limit, an int >= 1.

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
      jls: loss scaling diverged: 1 consecutive skipped ste
    """
    flags, limit = _flags(opt_state, max_consecutive_skips)
    state = loss_scale_state(opt_state, batched=True)
    checkify.check(
        ~jnp.any(flags),
        "jls: loss scaling diverged: {count} consecutive skipped steps (limit "
        f"{limit}); loss scale {{scale}}.",
        count=state.consecutive_skips,
        scale=state.scale,
    )


def _message(count: Any, limit: str, scale: Any) -> str:
    return (
        f"jls: loss scaling diverged: {int(count)} consecutive skipped steps "
        f"(limit {limit}); loss scale {float(scale)!r}. No update with "
        "non-finite gradients was applied; look for a nan in the model or data, "
        "or a learning rate that is too high."
    )
