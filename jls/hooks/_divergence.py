"""Divergence: a run whose loss scale keeps overflowing must stop loudly."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.experimental import checkify

from jls._tree import loss_scale_state, plain
from jls._validate import integer
from jls.hooks._hooks import Hook, StepInfo, hook_state
from jls.hooks._nonfinite_loss import warn_if_nonfinite_loss

# The default divergence limit (MindSpore stops after 1000 skips in a row).
DIVERGENCE_LIMIT = 1000


class DivergenceState(NamedTuple):
    """Whether a run skipped ``limit`` steps in a row (sticky bool)."""

    diverged: jax.Array

    def metrics(self) -> dict[str, Any]:
        """``diverged``."""
        return {"diverged": plain(self.diverged)}


@dataclasses.dataclass(frozen=True)
class Divergence(Hook):
    """A sticky ``diverged`` flag: set once ``limit`` steps in a row were skipped.

    Every `jls.loss_scaling` adds this hook (``max_consecutive_skips=1000``);
    `jls.hooks.raise_if_diverged` raises from the flag.

    Attributes:
      limit: an int in ``[1, 2**31 - 1]``.
    """

    limit: int

    name = "divergence"

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "limit", integer("max_consecutive_skips", self.limit, 1)
        )

    def init(self, params: Any) -> DivergenceState:
        del params
        return DivergenceState(jnp.asarray(np.bool_(False)))

    def update(self, state: Any, info: StepInfo, vetoed: Any) -> DivergenceState:
        del vetoed
        assert info.loss_scale is not None
        limit = info.loss_scale.consecutive_skips >= jnp.int32(self.limit)
        return DivergenceState(state.diverged | limit)


class DivergenceError(RuntimeError):
    """Raised when loss scaling keeps skipping steps: the run has diverged."""


def _flags(opt_state: Any, limit: int | None) -> tuple[Any, str]:
    """The divergence flag(s) of ``opt_state`` and the limit, as text."""
    state = loss_scale_state(opt_state, batched=True)
    if limit is not None:
        limit = integer("max_consecutive_skips", limit, 1)
        return state.consecutive_skips >= jnp.int32(limit), str(limit)
    found = hook_state(
        opt_state,
        Divergence.name,
        "give max_consecutive_skips, or pass the state of a "
        "jls.loss_scaling(..., max_consecutive_skips=n) transformation (it "
        "keeps the diverged flag)",
    )
    return plain(found.diverged), "set by loss_scaling's max_consecutive_skips"


def _under_checkify() -> bool:
    """Whether ``checkify.checkify`` traces the caller (a frame of its module)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_CHECKIFY_FILE):
            return True
        frame = frame.f_back
    return False


_CHECKIFY_FILE = os.path.join("jax", "_src", "checkify.py")


def raise_if_diverged(opt_state: Any, max_consecutive_skips: int | None = None) -> None:
    """Raises `DivergenceError` if the run has diverged.

    On the host it reads the state (a sync point); inside ``jit`` it adds a
    ``checkify`` check (docs/howto/diverging.md). It reads the ``diverged``
    flag, or with a limit compares ``consecutive_skips``.

    Args:
      opt_state: an optimizer state containing a `LossScaleState` (batched too).
      max_consecutive_skips: ``None``, or a limit, an int >= 1.

    Raises:
      DivergenceError: on the host, if the run diverged.
      ValueError: if the limit is invalid, or missing and the state has no flag.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(optax.sgd(0.1), max_consecutive_skips=2)
      >>> params = jnp.zeros(2)
      >>> state = tx.init(params)
      >>> for _ in range(2):
      ...     _, state = tx.update(jnp.full(2, jnp.nan), state, params)
      >>> try:
      ...     jls.hooks.raise_if_diverged(state)
      ... except jls.hooks.DivergenceError as err:
      ...     print(str(err)[:53])
      jls: loss scaling diverged: 2 consecutive skipped ste
    """
    flags, limit = _flags(opt_state, max_consecutive_skips)
    state = loss_scale_state(opt_state, batched=True)
    if isinstance(flags, Tracer):
        if not _under_checkify():
            raise TypeError(
                "jls.hooks.raise_if_diverged was called inside jit (or another jax "
                "transformation) without checkify, where it cannot raise. Call it "
                "on the host after the step, where you log metrics: "
                "params, opt_state = step(...); jls.hooks.raise_if_diverged(opt_state) "
                "(it reads one flag); or wrap the step in "
                "jax.experimental.checkify.checkify and call err.throw()"
            )
        checkify.check(
            ~jnp.any(flags),
            "jls: loss scaling diverged: {count} consecutive skipped steps (limit "
            f"{limit}); loss scale {{scale}}.",
            count=jnp.max(state.consecutive_skips),
            scale=jnp.min(state.scale),
        )
        return
    warn_if_nonfinite_loss(opt_state)
    if np.any(np.asarray(flags)):
        count = int(np.max(np.asarray(state.consecutive_skips)))
        raise DivergenceError(
            f"jls: loss scaling diverged: {count} consecutive skipped steps (limit "
            f"{limit}); loss scale {float(np.min(np.asarray(state.scale)))!r}. No "
            "update with non-finite gradients was applied; look for a nan in the "
            "model or data, or a learning rate that is too high. "
            "jls.precision.explain_step(loss_fn, opt_state_before, *args) names "
            "the op that overflowed in a step, given the state from before it."
        )
