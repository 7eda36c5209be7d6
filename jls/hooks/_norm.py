"""The gradient-norm metric: free, from the check's own pass.

``jls.loss_scaling(..., gradient_norm=True)`` adds this hook. It asks the
step for the norm (which makes the check the sum-of-squares check of
`jls._squares`: the same one read of the gradients, unlike computing
``optax.tree.norm`` in the step) and records it, exact for every finite norm
(inf past the float32 maximum). After a non-finite step it records inf, never
the nan that a nan gradient makes of the norm: no nan reaches any state, and a
logger still sees the step was not finite.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jls._tree import plain
from jls.hooks._hooks import Hook, StepInfo


class GradientNormState(NamedTuple):
    """The latest step's global norm of the unscaled gradients (float32)."""

    norm: jax.Array

    def metrics(self) -> dict[str, Any]:
        """``gradient_norm``."""
        return {"gradient_norm": plain(self.norm)}


@dataclasses.dataclass(frozen=True)
class GradientNorm(Hook):
    """Records the global norm of each step's unscaled gradients."""

    name = "gradient_norm"
    needs_norm = True

    def init(self, params: Any) -> GradientNormState:
        del params
        return GradientNormState(jnp.asarray(np.float32(0)))

    def update(self, state: Any, info: StepInfo, vetoed: Any) -> GradientNormState:
        del state, vetoed
        norm = jnp.asarray(info.norm)  # needs_norm: the step measured it
        return GradientNormState(
            jnp.where(jnp.isnan(norm), jnp.asarray(np.inf, norm.dtype), norm)
        )
