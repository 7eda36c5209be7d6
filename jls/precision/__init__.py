"""Precision: what computes in which dtype, and parameters without a float32 copy.

`autocast` (and `Policy.wrap`) runs matmuls in half precision and the ops
that need range in float32; `precision_report` shows what really computes
in which dtype; `explain_step` says which op of a step overflowed, where
and in which pass; `compensated`, `stochastic_rounding` and `scaled_state`
train without a float32 copy of the parameters or the optimizer state.

Example:
  >>> import jax.numpy as jnp, jls
  >>> policy = jls.precision.get_policy("params=float32,compute=float16")
  >>> w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
  >>> jls.precision.precision_report(policy.wrap(lambda w, x: x @ w), w, x).counts
  {'float16': 1}
"""

import importlib as _importlib
import typing as _typing

from jls.precision._compensated import compensated, stochastic_rounding
from jls.precision._scaled_state import ScaledState, scaled_state

if _typing.TYPE_CHECKING:
    from jls.precision._autocast import autocast
    from jls.precision._explain import explain_step
    from jls.precision._policy import Policy, get_policy
    from jls.precision._precision import PrecisionReport, precision_report

__all__ = [
    "Policy",
    "PrecisionReport",
    "ScaledState",
    "autocast",
    "compensated",
    "explain_step",
    "get_policy",
    "precision_report",
    "scaled_state",
    "stochastic_rounding",
]

# What reads jaxprs (``jax.extend``) is imported when first reached.
_INTERPRETING = {
    "autocast": "_autocast",
    "Policy": "_policy",
    "get_policy": "_policy",
    "PrecisionReport": "_precision",
    "precision_report": "_precision",
    "explain_step": "_explain",
}


def __getattr__(name: str) -> object:
    if name in _INTERPRETING:
        module = _importlib.import_module(f"jls.precision.{_INTERPRETING[name]}")
        value = globals()[name] = getattr(module, name)
        return value
    raise AttributeError(f"module 'jls.precision' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
