"""Hooks: every optional feature of a loss-scaled step, and the seam for yours.

A hook may veto a step, shrink its gradients, and record state that
`jls.metrics` reports. Pass ``jls.loss_scaling(inner, hooks=(...))``; its
feature keywords stand for the built-in hooks (`builtin_metrics`).

Example:
  >>> import jax.numpy as jnp, optax, jls
  >>> tx = jls.loss_scaling(
  ...     optax.sgd(0.1), jls.no_scale(), hooks=(jls.hooks.GradientNorm(),)
  ... )
  >>> params = {"w": jnp.ones(4)}
  >>> _, state = tx.update({"w": jnp.full(4, 0.5)}, tx.init(params), params)
  >>> float(jls.metrics(state)["gradient_norm"])
  1.0
"""

from jls.hooks import _divergence, _nonfinite_loss
from jls.hooks._diagnostics import Diagnostics, nonfinite_paths
from jls.hooks._divergence import Divergence, DivergenceError, raise_if_diverged
from jls.hooks._hooks import Hook, HookContext, StepInfo
from jls.hooks._norm import GradientNorm
from jls.hooks._replicas import ReplicaCheck
from jls.hooks._scale_stats import ScaleStats
from jls.hooks._spikes import SpikeRule
from jls.hooks._stagnation import Stagnation, StagnationWarning, warn_if_stagnant

# Every built-in hook, with the keyword of jls.loss_scaling that adds it.
_BUILTIN: dict[type[Hook], str] = {
    _nonfinite_loss.NonfiniteLoss: "(always)",
    Divergence: "max_consecutive_skips=",
    Diagnostics: "diagnostics=True",
    GradientNorm: "gradient_norm=True",
    SpikeRule: "skip_spikes=",
    ReplicaCheck: "check_replicas=",
    ScaleStats: "scale_stats=",
    Stagnation: "hooks=(Stagnation(),)",
}


def builtin_metrics() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """``(class, state name, keyword, metric keys)`` of every built-in hook.

    Example:
      >>> import jls
      >>> rows = {row[0]: row[3] for row in jls.hooks.builtin_metrics()}
      >>> rows["GradientNorm"]
      ('gradient_norm',)
    """
    import jax.numpy as jnp  # here, so that the namespace holds only its names

    rows = []
    limit = _divergence.DIVERGENCE_LIMIT
    for cls, keyword in _BUILTIN.items():
        hook = cls(limit) if cls is Divergence else cls()  # type: ignore[call-arg]
        keys = tuple(hook.init({"w": jnp.zeros(2)}).metrics())
        rows.append((cls.__name__, hook.name, keyword, keys))
    return rows


__all__ = [
    "Diagnostics",
    "Divergence",
    "DivergenceError",
    "GradientNorm",
    "Hook",
    "HookContext",
    "ReplicaCheck",
    "ScaleStats",
    "SpikeRule",
    "Stagnation",
    "StagnationWarning",
    "StepInfo",
    "builtin_metrics",
    "nonfinite_paths",
    "raise_if_diverged",
    "warn_if_stagnant",
]
