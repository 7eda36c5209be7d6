"""The replica check: data-parallel replicas that forgot to average their gradients.

``jls.loss_scaling(..., axis_name=..., check_replicas=True)`` adds this
hook. ``axis_name`` makes the replicas agree on the skip and the scale; it
does not average their gradients (``lax.pmean``, or
``jls.train_step(..., average_over=...)``). A data-parallel step that
forgets to is not an error jax can see: under ``pmap`` with ``out_axes=None``
it returns replica 0's parameters, and every step used that replica's shard
of the batch alone. This hook compares a fingerprint of the gradients across
the replicas: the first element of every floating leaf, bitwise (averaged
gradients are bitwise equal on every replica; any two shards of real data
give different ones). It costs one small collective (one value per leaf)
and reads one element per leaf; ``benchmarks/bench_resnet.py`` measures it.

A non-finite step is not counted (its gradients are dropped anyway).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

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
    """Flags finite steps whose gradients differ between replicas."""

    name = "replicas"

    def init(self, params: Any) -> Any:
        del params
        return {"differ": jnp.asarray(np.bool_(False)), "steps": jnp.int32(0)}

    def update(self, state: Any, info: StepInfo, vetoed: Any) -> Any:
        del vetoed
        values = fingerprint(info.grads)
        same = info.same_on_replicas(values) if values else jnp.asarray(True)
        differ = info.finite & ~same
        return {"differ": differ, "steps": state["steps"] + differ.astype(jnp.int32)}

    @classmethod
    def metrics(cls, state: Any) -> dict[str, Any]:
        return {
            "replicas_differ": plain(state["differ"]),
            "replica_mismatches": plain(state["steps"]),
        }
