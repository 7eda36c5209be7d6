"""Which gradient leaves overflowed: ``loss_scaling(..., diagnostics=True)``."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jls._scaling import reciprocals, unscale_leaf
from jls._tree import find_one, plain
from jls.hooks._hooks import Hook, LossScalingState, StepInfo


def _empty_slice(x: jax.Array) -> jax.Array:
    """An empty slice of ``x``, without reshaping it (it may be sharded)."""
    if not x.ndim:
        return x.reshape(1)[:0]
    return x[tuple(slice(0, 0) for _ in range(x.ndim))]


def nonfinite_leaf_flags(tree: Any, finite: jax.Array, scale: jax.Array) -> Any:
    """Per leaf: not all finite once unscaled (all ``False`` where ``finite``)."""

    def per_leaf(op):
        def run(xs):
            out = []
            for x in xs:
                x = x if isinstance(x, jax.Array) else jnp.asarray(x)
                inexact = jnp.issubdtype(x.dtype, jnp.inexact)
                out.append(op(x) if inexact else jnp.asarray(False))
            return out

        return run

    # False derived from each leaf: both branches vary over the same axes.
    no_flags = per_leaf(lambda x: jnp.any(jnp.isnan(_empty_slice(x))))
    leaves, treedef = jax.tree.flatten(tree)
    factors = reciprocals(scale, leaves)
    flags = per_leaf(lambda x: ~jnp.all(jnp.isfinite(unscale_leaf(x, factors))))
    return jax.tree.unflatten(treedef, lax.cond(finite, no_flags, flags, leaves))


class DiagnosticsState(NamedTuple):
    """Per gradient leaf, whether it was not finite on the latest step."""

    nonfinite_leaves: Any

    def metrics(self) -> dict[str, Any]:
        """``nonfinite_leaves``: a tree of bools like the parameters."""
        return {"nonfinite_leaves": plain(self.nonfinite_leaves)}


@dataclasses.dataclass(frozen=True)
class Diagnostics(Hook):
    """Records which gradient leaves were not finite on the latest step.

    ``jls.metrics(...)["nonfinite_leaves"]`` is a tree of bools like the
    parameters (flagged if not finite on any replica);
    `jls.hooks.nonfinite_paths` names them. Only a skipped step pays a second
    pass.
    """

    name = "diagnostics"

    def init(self, params: Any) -> DiagnosticsState:
        flags = jax.tree.map(lambda _: jnp.asarray(np.bool_(False)), params)
        return DiagnosticsState(flags)

    def update(self, state: Any, info: StepInfo, vetoed: Any) -> DiagnosticsState:
        del vetoed
        new = nonfinite_leaf_flags(info.grads, info.finite, info.scale)
        old = state.nonfinite_leaves
        if jax.tree.structure(new) != jax.tree.structure(old):
            raise TypeError(
                "with diagnostics=True the gradients must have the structure of "
                f"the parameters: {jax.tree.structure(old)}, got "
                f"{jax.tree.structure(new)}"
            )
        leaves, treedef = jax.tree.flatten(new)  # non-finite on any replica
        if leaves:
            new = jax.tree.unflatten(treedef, info.any_replica(leaves))
        return DiagnosticsState(new)


def nonfinite_paths(opt_state: Any) -> list[str]:
    """On the host (a sync point): the paths of the leaves that were not finite.

    Args:
      opt_state: the state of a ``loss_scaling(..., diagnostics=True)``.

    Returns:
      Key paths such as ``"['dense']['kernel']"``, in tree order.

    Raises:
      ValueError: if the state has no diagnostics.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(optax.sgd(0.1), diagnostics=True)
      >>> params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
      >>> grads = {"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}
      >>> _, state = tx.update(grads, tx.init(params), params)
      >>> jls.hooks.nonfinite_paths(state)
      ["['b']"]
    """
    wrapper = find_one(
        opt_state,
        LossScalingState,
        "jls.loss_scaling state",
        "Pass the state of a jls.loss_scaling(..., diagnostics=True) transformation.",
    )
    state = plain(wrapper.hooks).get(Diagnostics.name)
    if state is None:
        raise ValueError(
            "this state records no per-leaf diagnostics: make the transformation "
            "with jls.loss_scaling(..., diagnostics=True)"
        )
    flags = jax.tree_util.tree_flatten_with_path(state.nonfinite_leaves)[0]
    return [jax.tree_util.keystr(p) for p, f in flags if bool(np.any(np.asarray(f)))]
