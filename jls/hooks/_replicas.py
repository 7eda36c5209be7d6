"""The replica check: replicas that forgot to average their gradients."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jls._compat import tracked_in
from jls._finite import inexact_leaves
from jls._shards import shard_axes
from jls._tree import plain
from jls.hooks._hooks import Hook, HookContext, StepInfo


def fingerprint(grads: Any) -> list[Any]:
    """One value per floating leaf: its first element (real part), float32."""
    return [
        jnp.real(x.ravel()[0]).astype(jnp.float32)
        for x in inexact_leaves(grads)
        if x.size
    ]


class ReplicaCheckState(NamedTuple):
    """Whether the latest finite step's replicas differed, and how often."""

    differ: jax.Array
    mismatches: jax.Array

    def metrics(self) -> dict[str, Any]:
        """``replicas_differ`` and ``replica_mismatches``."""
        return {
            "replicas_differ": plain(self.differ),
            "replica_mismatches": plain(self.mismatches),
        }


@dataclasses.dataclass(frozen=True)
class ReplicaCheck(Hook):
    """Flags finite steps whose gradients differ between replicas.

    A step that forgets ``lax.pmean`` steps each replica with its own. This
    compares each floating leaf's first element bitwise across the replicas
    (``replicas_differ``, ``replica_mismatches``); sharded leaves, and all
    under ``shard_map(check_vma=True)``, are not compared.

    Attributes:
      axes: the data-parallel axes compared over; empty: ``axis_name``, then one axis.
    """

    axes: tuple[str, ...] = ()
    name = "replicas"

    def check(self, context: HookContext) -> None:
        """Refuses a check without ``axis_name``, or over axes outside it."""
        given = self.axes[0] if len(self.axes) == 1 else self.axes
        if not context.axis_name:
            raise ValueError(
                "check_replicas compares the replicas of axis_name: give the "
                "pmap/shard_map axis the batch is split over, e.g. "
                "axis_name='batch' (under jit over sharded arrays the gradients "
                "are global and there is nothing to compare)"
            )
        if not set(self.axes) <= set(context.axis_name):
            raise ValueError(
                f"check_replicas={given!r} must name axes of "
                f"axis_name={context.axis_name}"
            )

    def init(self, params: Any) -> ReplicaCheckState:
        del params
        return ReplicaCheckState(jnp.asarray(np.bool_(False)), jnp.int32(0))

    def update(self, state: Any, info: StepInfo, vetoed: Any) -> ReplicaCheckState:
        del vetoed
        axes = self.axes or tuple(info.axis_name)
        grads = jax.tree.leaves(info.grads)
        if getattr(info.axis_name, "sharded", None) is not None:  # declared
            shards = shard_axes(info.grads, info.axis_name, "check_replicas")
            grads = [g for g, a in zip(grads, shards, strict=True) if not a & set(axes)]
        values = fingerprint(grads)
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
        return ReplicaCheckState(differ, state.mismatches + differ.astype(jnp.int32))
