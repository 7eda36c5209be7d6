"""A non-finite loss skips its step without throwing the scale away."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jls._state import overwritten
from jls._tree import plain
from jls.hooks._hooks import Hook, StepInfo


class NonfiniteLossState(NamedTuple):
    """Whether the latest step's loss was not finite (bool)."""

    nonfinite: jax.Array

    def metrics(self) -> dict[str, Any]:
        """``nonfinite_loss``."""
        return {"nonfinite_loss": plain(self.nonfinite)}


@dataclasses.dataclass(frozen=True)
class NonfiniteLoss(Hook):
    """Skips a step whose loss is not finite, holding the scale rule.

    No loss scale helps a nan or inf loss, so the scale is not backed off.
    Always on, where the step has the loss (`jls.train_step`, or ``loss=``).

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
        return NonfiniteLossState(jnp.asarray(np.bool_(False)))

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
        """The new state: whether ``loss`` (``None``: not given) is not finite."""
        if loss is None:
            return NonfiniteLossState(overwritten(state.nonfinite, False))
        return NonfiniteLossState(~jnp.isfinite(loss))
