"""The replica check: data-parallel replicas that forgot to average their gradients.

``jls.loss_scaling(..., axis_name=..., check_replicas=True)`` adds this
hook. ``axis_name`` makes the replicas agree on the skip and the scale; it
does not average their gradients (``lax.pmean``, or
``jls.train_step(..., average_over=...)``). A data-parallel step that
forgets to is not an error jax can see everywhere: under ``pmap``,
``check_vma=False`` or a named ``vmap`` each replica steps with its own
shard's gradients. This hook compares a fingerprint of the gradients across
the replicas: the first element of every floating leaf, bitwise (averaged
gradients are bitwise equal on every replica; any two shards of real data
give different ones). It costs one small collective per compared axis (one
value per leaf) and reads one element per leaf.

Which axes hold replicas: ``check_replicas=True`` compares over the one
``axis_name``; on a mesh of several named axes (data x model), name the
data-parallel ones, ``check_replicas="data"``: a model-parallel axis holds
shards, which differ by design. Under ``shard_map`` with ``check_vma=True``
jax's types already guarantee that a gradient invariant over an axis is
equal on its members, and one varying over it is sharded there: nothing is
left to compare, and the hook reports no mismatch at no cost (what can go
wrong there is a gradient summed rather than averaged, which
``jls.scale_loss`` warns about). Where jax records no varying axes, a leaf
sharded over a compared axis (FSDP) cannot be told from one not averaged:
use ``check_vma=True`` for such layouts.

A non-finite step is not counted (its gradients are dropped anyway).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from jls._compat import tracked_in
from jls._finite import inexact_leaves
from jls._hooks import Hook, StepInfo
from jls._tree import plain


def fingerprint(grads: Any) -> list[Any]:
    """One value per floating leaf: its first element (real part), float32."""
    return [
        jnp.real(x.ravel()[0]).astype(jnp.float32)
        for x in inexact_leaves(grads)
        if x.size
    ]


@dataclasses.dataclass(frozen=True)
class ReplicaCheck(Hook):
    """Flags finite steps whose gradients differ between replicas.

    Attributes:
      axes: the data-parallel axes compared over; empty: the
        transformation's ``axis_name``, which must then be one axis.
    """

    axes: tuple[str, ...] = ()
    name = "replicas"

    def init(self, params: Any) -> Any:
        del params
        return {"differ": jnp.asarray(np.bool_(False)), "steps": jnp.int32(0)}

    def update(self, state: Any, info: StepInfo, vetoed: Any) -> Any:
        del vetoed
        axes = self.axes or tuple(info.axis_name)
        values = fingerprint(info.grads)
        if not values or tracked_in(info.grads, axes):
            same = jnp.asarray(True)  # jax's types make replicas equal
        elif len(axes) > 1 and not self.axes:
            raise ValueError(
                f"check_replicas=True with axis_name={axes}: name the "
                "data-parallel axes whose replicas must agree, e.g. "
                f"check_replicas={axes[0]!r} (a model-parallel axis holds "
                "shards, which differ by design)"
            )
        else:
            same = info.same_on_replicas(values, axes)
        differ = info.finite & ~same
        return {"differ": differ, "steps": state["steps"] + differ.astype(jnp.int32)}

    @classmethod
    def metrics(cls, state: Any) -> dict[str, Any]:
        return {
            "replicas_differ": plain(state["differ"]),
            "replica_mismatches": plain(state["steps"]),
        }
