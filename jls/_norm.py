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
from typing import Any

import jax.numpy as jnp
import numpy as np

from jls._hooks import Hook, StepInfo
from jls._tree import plain


@dataclasses.dataclass(frozen=True)
class GradientNorm(Hook):
    """Records the global norm of each step's unscaled gradients."""

    name = "gradient_norm"
    needs_norm = True

    def init(self, params: Any) -> Any:
        del params
        return jnp.asarray(np.float32(0))

    def update(self, state: Any, info: StepInfo, vetoed: Any) -> Any:
        del state, vetoed
        norm = jnp.asarray(info.norm)  # needs_norm: the step measured it
        return jnp.where(jnp.isnan(norm), jnp.asarray(np.inf, norm.dtype), norm)

    @classmethod
    def metrics(cls, state: Any) -> dict[str, Any]:
        return {"gradient_norm": plain(state)}
