"""A non-finite loss skips its step without throwing the scale away."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from jls._rule import count_if
from jls._state import overwritten, unwrap
from jls._tree import find_all, plain
from jls.hooks._hooks import Hook, LossScalingState, StepInfo

# The losses not finite in a row at which the host readers warn: a healthy
# run's non-finite loss comes alone (one bad batch, a float16 log(0)); eight in
# a row is a nan that stays, named ~1000 steps before the divergence limit.
WARN_AFTER = 8


class NonfiniteLossState(NamedTuple):
    """The steps in a row, ending with the latest, whose loss was not finite.

    ``nonfinite`` (int32, saturating): 0 when the latest loss was finite.
    """

    nonfinite: jax.Array

    def metrics(self) -> dict[str, Any]:
        """``nonfinite_loss``: whether the latest step's loss was not finite."""
        return {"nonfinite_loss": plain(self.nonfinite) > 0}


@dataclasses.dataclass(frozen=True)
class NonfiniteLoss(Hook):
    """Skips a step whose loss is not finite, holding the scale rule.

    No loss scale helps a nan or inf loss, so the scale is not backed off.
    Always on, where the step has the loss (`jls.train_step`, or ``loss=``).
    It counts such steps in a row: from `WARN_AFTER`, the host readers warn
    (`warn_if_nonfinite_loss`).

    Attributes:
      skips: veto such a step (``False``, as with ``skip_nonfinite=False``:
        only record it, so `jls.metrics` keeps its keys).
    """

    skips: bool = True
    name = "nonfinite_loss"
    reads_loss = True
    holds_scale = True

    def init(self, params: Any) -> NonfiniteLossState:
        del params
        return NonfiniteLossState(jnp.zeros((), jnp.int32))

    def veto(self, state: Any, info: StepInfo) -> jax.Array | None:
        del state
        if not self.skips or info.loss is None:
            return None
        return ~jnp.isfinite(info.loss)

    def update(self, state: Any, info: StepInfo, vetoed: Any) -> NonfiniteLossState:
        del vetoed
        return self.recorded(state, info.loss)

    @staticmethod
    def recorded(state: Any, loss: Any) -> NonfiniteLossState:
        """The new state after a step whose loss is ``loss`` (``None``: not given)."""
        if loss is None:
            return NonfiniteLossState(overwritten(state.nonfinite, 0))
        return NonfiniteLossState(
            count_if(~jnp.isfinite(loss), state.nonfinite, jnp.int32(0))
        )


def warn_if_nonfinite_loss(opt_state: Any, wait: bool = True) -> None:
    """Warns (``RuntimeWarning``) on the host from `WARN_AFTER` such steps in a row.

    Inside ``jit`` it does nothing; with ``wait=False`` it adds no sync: it
    reads only a finished step's count. The message names the count's power
    of two, so a reader called every step warns once per doubling.
    """
    counts = [
        unwrap(w.hooks[NonfiniteLoss.name].nonfinite)
        for _, w in find_all(opt_state, LossScalingState)
        if NonfiniteLoss.name in w.hooks
    ]
    if any(isinstance(c, Tracer) for c in counts):
        return
    if not wait and not all(getattr(c, "is_ready", bool)() for c in counts):
        return
    count = max([int(np.max(np.asarray(c))) for c in counts], default=0)
    if count >= WARN_AFTER:
        warnings.warn(
            f"jls: the loss itself was not finite for {1 << (count.bit_length() - 1)}"
            " or more steps in a row; no loss scale causes that. Look for a nan "
            "kept in state outside the optimizer (BatchNorm statistics: "
            "jls.keep_if_skipped(new_state, state, opt_state) keeps a skipped "
            "step's nan out of it) or in the data; jls.precision.explain_step("
            "loss_fn, opt_state_before, *args) names the op that made it, given "
            "the state from before a skipped step",
            RuntimeWarning,
            stacklevel=3,
        )
