"""A non-finite loss skips its step without throwing the scale away.

When the unscaled loss itself is nan or inf (a float16 sigmoid rounding to
exactly 1, then ``0 * log(0)``), no loss scale can help: backing off for it
would halve the scale once per such step, down to ``min_scale``, and regrowing
takes thousands of clean steps. This hook, on by default, vetoes such a step
and holds the rule: the step is skipped (nothing changes, it counts in
``total_skips``), and the scale, growth count and headroom stay as they were;
`jls.train_step` makes no retry for it. It acts whenever the step has the
loss: `jls.train_step` always passes it, ``tx.update`` and
`jls.apply_gradients` when given ``loss=``.

A scaler that applies non-finite steps (``skip_nonfinite=False``: the off
switch, MindSpore's ``drop_overflow_update=False``) keeps the hook with
``skips=False``: it only records, so ``jls.metrics`` has the same keys in
every setting and one logger serves every precision.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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

    Attributes:
      skips: veto such a step (``False``: only record it).
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
            return NonfiniteLossState(state.nonfinite & False)
        return NonfiniteLossState(~jnp.isfinite(loss))
