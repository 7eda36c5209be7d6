"""Stagnation: the updates the parameters' own dtype rounds away.

An entry is stuck when ``new + u`` rounds back to ``new`` in its dtype, as
``optax.apply_updates`` rounds (the old parameter is not read).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.core import Tracer

from jls._finite import counts
from jls._shards import global_rows, shard_axes
from jls._tree import plain
from jls._validate import integer
from jls.hooks._blocks import cut_axis, read_block
from jls.hooks._hooks import Hook, StepInfo, hook_state
from jls.hooks._nonfinite_loss import warn_if_nonfinite_loss


class StagnationState(NamedTuple):
    """The last completed cycle's fraction (float32), and the cycle under way.

    ``phase`` (int32): the cycle's applied steps so far; ``stuck`` and
    ``moving`` (float32): its entry counts so far.
    """

    stagnant_fraction: jax.Array
    phase: jax.Array
    stuck: jax.Array
    moving: jax.Array

    def metrics(self) -> dict[str, Any]:
        """``stagnant_fraction`` (what `jls.metrics` reports of this hook)."""
        return {"stagnant_fraction": plain(self).stagnant_fraction}


class StagnationWarning(UserWarning):
    """`warn_if_stagnant`'s warning: the updates are being rounded away."""


def _entry_counts(new: Any, u: Any, valid: Any) -> tuple[jax.Array, jax.Array]:
    """``(stuck, moving)`` of the entries ``valid`` keeps, float32."""
    again = jnp.asarray(new + u).astype(new.dtype)  # as optax.apply_updates adds
    moving = (u != 0) & valid
    stuck = moving & (again == new)
    counted = counts(*jnp.broadcast_arrays(stuck, moving))
    return counted[0].astype(jnp.float32), counted[1].astype(jnp.float32)


def _blocks(
    p: jax.Array, u: jax.Array, phase: jax.Array, every: int
) -> tuple[jax.Array, jax.Array, Any]:
    """``(p, u, valid)``: the entries of a leaf read at ``phase``."""
    cut = cut_axis(tuple(p.shape), every)
    if cut is not None:
        return read_block(p, phase, every, cut), read_block(u, phase, every, cut), True
    p, u = jnp.reshape(p, p.shape or (1,)), jnp.reshape(u, u.shape or (1,))
    last = lax.broadcasted_iota(jnp.int32, p.shape, p.ndim - 1)
    return p, u, last % every == phase


def _agreed(rows: Any, named: tuple[str, ...]) -> tuple[Any, Any]:
    """``(stuck, moving)`` of the tree of rows over every replica and shard."""
    if not jax.tree.leaves(rows):
        return jnp.float32(0), jnp.float32(0)
    varying = shard_axes(rows, named, "Stagnation")
    rows = global_rows(jax.tree.leaves(rows), varying, added=2)
    total = jnp.sum(jnp.stack(rows), 0)
    return total[0], total[1]


@dataclasses.dataclass(frozen=True)
class Stagnation(Hook):
    """Records ``stagnant_fraction``: how much of the updates rounding loses.

    Of the entries with a nonzero update, the fraction left unchanged in their
    dtype; ``tx.update`` needs the parameters.

    Attributes:
      every: the cycle in applied steps (default 16), reading 1/every each.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> stagnation = jls.hooks.Stagnation(every=1)
      >>> tx = jls.loss_scaling(optax.sgd(1e-3), jls.no_scale(), hooks=[stagnation])
      >>> params = jnp.asarray([1.0, 1.0, 0.01, 0.01], jnp.bfloat16)
      >>> params, state = jls.apply_gradients(tx, jnp.ones(4), tx.init(params), params)
      >>> float(jls.metrics(state)["stagnant_fraction"])  # 1e-3 is lost on 1.0
      0.5
    """

    every: int = 16
    name = "stagnation"

    def __post_init__(self) -> None:
        object.__setattr__(self, "every", integer("every", self.every, 1))

    def init(self, params: Any) -> StagnationState:
        del params
        return StagnationState(
            jnp.zeros((), jnp.float32),
            jnp.zeros((), jnp.int32),
            jnp.zeros((), jnp.float32),
            jnp.zeros((), jnp.float32),
        )

    def reads_updates(self, state: Any) -> Any:
        del state
        return True

    def read_updates(self, state: Any, new_params: Any, updates: Any) -> Any:
        """Per leaf, this device's ``[stuck, moving]`` (``None``: not read)."""
        leaves, treedef = jax.tree.flatten(new_params, is_leaf=lambda x: x is None)
        ups = treedef.flatten_up_to(updates)
        phase = state.phase % self.every  # a state from another cycle length
        rows = []
        for p, u in zip(leaves, ups, strict=True):
            dtype = getattr(p, "dtype", None)
            if u is None or dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
                rows.append(None)
                continue
            p, u = jnp.asarray(p), jnp.asarray(u)
            valid: Any = True
            if self.every > 1:
                p, u, valid = _blocks(p, u, phase, self.every)
            rows.append(jnp.stack(_entry_counts(p, u, valid)))
        return jax.tree.unflatten(treedef, rows)

    def update(self, state: Any, info: StepInfo, vetoed: Any) -> StagnationState:
        del vetoed
        assert info.applied is not None and info.reads is not None
        rows = info.reads[self.name]  # zeros on a skipped step
        read_stuck, read_moving = _agreed(rows, info.axis_name)
        stuck = state.stuck + read_stuck
        moving = state.moving + read_moving
        phase = jnp.where(info.applied, state.phase + 1, state.phase)
        done = phase >= self.every
        measured = jnp.where(moving > 0, stuck / jnp.maximum(moving, 1), 0)
        zero = jnp.float32(0)
        return StagnationState(
            jnp.where(done, measured, state.stagnant_fraction).astype(jnp.float32),
            jnp.where(done, 0, phase).astype(jnp.int32),
            jnp.where(done, zero, stuck),
            jnp.where(done, zero, moving),
        )


def warn_if_stagnant(opt_state: Any, threshold: float = 0.9) -> float:
    """Warns (`StagnationWarning`) when the updates are being rounded away.

    Reads `jls.hooks.Stagnation`'s ``stagnant_fraction`` on the host (a sync
    point) and warns, naming the remedies, once it reaches ``threshold``.

    Args:
      opt_state: the optimizer state (batched too: the largest member's).
      threshold: a float in ``(0, 1]`` (default 0.9).

    Returns:
      The fraction read, a Python float.

    Raises:
      ValueError: for a bad threshold, or not exactly one Stagnation hook.
      TypeError: inside ``jit``, where it cannot warn.

    Example:
      >>> import warnings, jax.numpy as jnp, optax, jls
      >>> stagnation = jls.hooks.Stagnation(every=1)
      >>> tx = jls.loss_scaling(optax.sgd(1e-4), jls.no_scale(), hooks=[stagnation])
      >>> params = jnp.ones(4, jnp.bfloat16)
      >>> params, state = jls.apply_gradients(tx, jnp.ones(4), tx.init(params), params)
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     fraction = jls.hooks.warn_if_stagnant(state)
      >>> fraction, caught[0].category.__name__
      (1.0, 'StagnationWarning')
    """
    number = isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
    if not number or not 0 < threshold <= 1:
        raise ValueError(f"threshold must be a float in (0, 1], got {threshold!r}")
    found = hook_state(
        opt_state,
        Stagnation.name,
        "warn_if_stagnant reads the state of a jls.loss_scaling(..., "
        "hooks=[jls.hooks.Stagnation()]) transformation",
    )
    fraction = plain(found).stagnant_fraction
    if isinstance(fraction, Tracer):
        raise TypeError(
            "jls.hooks.warn_if_stagnant was called inside jit (or another jax "
            "transformation), where it cannot warn: call it on the host after "
            "the step, where you log metrics"
        )
    warn_if_nonfinite_loss(opt_state)
    value = float(np.max(np.asarray(fraction)))
    if value >= threshold:
        warnings.warn(
            f"jls: {100 * value:.1f}% of the parameter entries the optimizer "
            "moves were left unchanged by rounding to their own dtype (at the "
            "latest measured step): the run has mostly stopped learning. Keep "
            "what rounding loses with jls.precision.stochastic_rounding(inner) "
            "or jls.precision.compensated(inner), keep a float32 copy of the "
            "parameters, or raise the learning rate",
            StagnationWarning,
            stacklevel=2,
        )
    return value
