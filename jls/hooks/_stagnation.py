"""Stagnation: the updates the parameters' own dtype rounds away.

A parameter kept in bfloat16 (or float16, or float32 at a tiny learning
rate) does not move when its update is below half of its last place:
``p + u`` rounds back to ``p``. Nothing fails; the loss just stops falling
(AReaL #1292: a plateau 3x higher; ml-by-hand #85: 0 of 768 weights moved
in 100 bfloat16 steps). `Stagnation` measures it inside the step:

* ``stagnant_fraction``: of the parameter entries whose update is nonzero,
  the fraction the update leaves unchanged in their own dtype.

It is read from the new parameter ``new`` and the update ``u`` (a hook's
`jls.hooks.Hook.read_updates`): an entry counts when ``new + u`` rounds back to
``new``, as ``optax.apply_updates`` rounds. That is ``new == p`` exactly,
except for a parameter that moved onto a power of two by less than half of
the spacing above it (there the spacing halves), which counts as stuck.
The parameter before the step is not read: on the fused path it is updated
in place, and reading it beside that makes XLA copy every parameter.

The updates are those the step applies: under `jls.precision.stochastic_rounding` or
`jls.precision.compensated` an update is ``new - p``, zero where the parameter stays,
so nothing they apply is lost and they report about 0 (each keeps what
rounding loses, in expectation or in its buffer; what they report is the
parameters that stepped outward onto a power of two, the rule's limit
above).

``every`` (default 16) spreads one reading over ``every`` applied steps:
each step reads one ``every``-th of each parameter's entries (every
``every``-th block of a few consecutive entries along one axis, the
block offset the cycle's position: `jls.hooks._blocks.read_phases`), so every entry is
read once per cycle, and the fraction is reported when a cycle completes
and held in between. A step reads 1/``every`` of the entries inline,
beside the update, with no conditional: no mode to declare and nothing
kept in memory for a conditional, whether the caller's jit donates or
not; a leaf sharded along any axis over up to 16 devices is read where
it lies (a small leaf is read whole, under a mask), except a large leaf
cut along an inner axis (`cut_axis`: a (heads, head dim, features) kernel
along its head dim, so that a step reads runs of consecutive entries)
sharded along that axis over a device count that does not divide the
rows a step reads of it. The step's slice is taken of each update and
of its new parameter (`Stagnation.read_updates`); XLA may then hold the
updates it reads in memory, where the step without the hook fuses each
into its parameter's update (``docs/performance.md`` has the cost).
``every=1`` reads every entry on every step. A
skipped step reads nothing and does not advance the cycle.
`warn_if_stagnant` turns the fraction into a warning on the host, where
you log metrics.
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

from jls._compat import tracked_in, varying_axes
from jls._finite import counts
from jls._shards import global_rows
from jls._tree import find_all, plain
from jls._validate import integer
from jls.hooks._blocks import cut_axis, read_block
from jls.hooks._hooks import Hook, LossScalingState, StepInfo


class StagnationState(NamedTuple):
    """The last completed cycle's fraction, and the cycle under way.

    ``stagnant_fraction`` is a float32 scalar (0 until a cycle completes);
    ``phase`` (int32) is the number of applied steps of the cycle read so
    far (the block offset the next reads); ``stuck`` and ``moving`` (float32)
    are this replica's entry counts of the cycle so far.
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
    """``(p, u, valid)``: the entries of a leaf read at ``phase``.

    This phase's blocks along the cut axis (`cut_axis`, `read_block`); a leaf with
    no such axis (a small one) is read whole, the entries of its last axis
    taking the phases in turn under the mask ``valid`` (`read_phases`).
    """
    cut = cut_axis(tuple(p.shape), every)
    if cut is not None:
        return read_block(p, phase, every, cut), read_block(u, phase, every, cut), True
    p, u = jnp.reshape(p, p.shape or (1,)), jnp.reshape(u, u.shape or (1,))
    last = lax.broadcasted_iota(jnp.int32, p.shape, p.ndim - 1)
    return p, u, last % every == phase


def _agreed(rows: list[jax.Array], named: tuple[str, ...]) -> tuple[Any, Any]:
    """``(stuck, moving)`` over every replica and shard, as float32 scalars.

    Each leaf's row is made global on its own (`jls._shards.global_rows`, as
    `jls.hooks.ScaleStats` does): a leaf sharded over a ``shard_map`` axis
    adds over it, a replicated leaf does not. Where jax records no varying
    axes (``pmap``, ``check_vma=False``) a row that differs across an axis
    is a shard's (added), an equal one a replica's (kept). The result is
    the same on every device, so the state stays replicated.
    """
    if not rows:
        return jnp.float32(0), jnp.float32(0)
    tracked = tracked_in(rows, named)
    varying = [varying_axes(r) if tracked else frozenset() for r in rows]
    total = jnp.sum(jnp.stack(global_rows(rows, varying, named, tracked, added=2)), 0)
    return total[0], total[1]


@dataclasses.dataclass(frozen=True)
class Stagnation(Hook):
    """Records ``stagnant_fraction`` once per ``every`` applied steps (see the module).

    Pass it as ``jls.loss_scaling(..., hooks=[jls.hooks.Stagnation()])``;
    read it with ``jls.metrics(opt_state)["stagnant_fraction"]``, or warn
    with `jls.hooks.warn_if_stagnant`. ``tx.update`` must be given the
    parameters. The read is one reduction a leaf, beside the update; where
    XLA holds an update for it rather than make it again, that update costs
    memory (docs/howto/low_precision_params.md has the measurements).

    Attributes:
      every: the cycle, in applied steps (an int >= 1; default 16): each
        step reads one ``every``-th of each parameter's entries, and the
        fraction over all of them is reported when the cycle completes,
        held in between (0 before the first). ``every=1`` reads every
        entry on every applied step.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(
      ...     optax.sgd(1e-3), jls.no_scale(), hooks=[jls.hooks.Stagnation(every=1)]
      ... )
      >>> params = jnp.asarray([1.0, 1.0, 0.01, 0.01], jnp.bfloat16)
      >>> state = tx.init(params)
      >>> params, state = jls.apply_gradients(tx, jnp.ones(4), state, params)
      >>> float(jls.metrics(state)["stagnant_fraction"])  # 1e-3 is lost on 1.0
      0.5
    """

    every: int = 16
    name = "stagnation"

    def __post_init__(self) -> None:
        object.__setattr__(self, "every", integer("every", self.every, 1))

    def init(self, params: Any) -> StagnationState:
        del params  # four arrays, none shared: a donating step donates each
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
        """Per leaf, ``[stuck, moving]``: this device's counts of the entries read.

        A list of float32 vectors, one per floating leaf (kept apart: a
        sharded leaf's counts add over its shards, a replicated leaf's do
        not, `update`); with ``every > 1``, of this phase's blocks of each
        leaf (`_blocks`).
        """
        leaves, treedef = jax.tree.flatten(new_params, is_leaf=lambda x: x is None)
        ups = treedef.flatten_up_to(updates)
        phase = state.phase % self.every  # a state from another cycle length
        rows = []
        for p, u in zip(leaves, ups, strict=True):
            dtype = getattr(p, "dtype", None)
            if u is None or dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
                continue
            p, u = jnp.asarray(p), jnp.asarray(u)
            valid: Any = True
            if self.every > 1:
                p, u, valid = _blocks(p, u, phase, self.every)
            rows.append(jnp.stack(_entry_counts(p, u, valid)))
        return rows

    def update(self, state: Any, info: StepInfo, vetoed: Any) -> StagnationState:
        del vetoed
        assert info.applied is not None and info.reads is not None
        rows = info.reads[self.name]  # zeros on a skipped step
        read_stuck, read_moving = _agreed(rows, tuple(info.axis_name))
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

    Reads ``stagnant_fraction`` of a state whose transformation has a
    `jls.hooks.Stagnation` hook, on the host (a sync point: call it where you log
    metrics), and warns once it is at least ``threshold``: that fraction of
    the entries the optimizer moves is left where it was by rounding, and
    the run has mostly stopped learning. The warning names the remedies.
    (A plain bfloat16 run can lose half of Adam's updates at its peak
    learning rate and still train as well as float32: the default threshold
    is for the stall, not for the loss of precision.)

    Args:
      opt_state: the optimizer state (batched under ``vmap``/``pmap`` too:
        the largest member's fraction counts).
      threshold: a float in ``(0, 1]`` (default 0.9).

    Returns:
      The fraction read, a Python float.

    Raises:
      ValueError: for a threshold outside ``(0, 1]``, or a state with no
        `jls.hooks.Stagnation` hook (or several).
      TypeError: inside ``jit``, where it cannot warn.

    Example:
      >>> import warnings
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(
      ...     optax.sgd(1e-4), jls.no_scale(), hooks=[jls.hooks.Stagnation(every=1)]
      ... )
      >>> params = jnp.ones(4, jnp.bfloat16)
      >>> state = tx.init(params)
      >>> params, state = jls.apply_gradients(tx, jnp.ones(4), state, params)
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     fraction = jls.hooks.warn_if_stagnant(state)
      >>> fraction, caught[0].category.__name__
      (1.0, 'StagnationWarning')
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise ValueError(f"threshold must be a float in (0, 1], got {threshold!r}")
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must be a float in (0, 1], got {threshold!r}")
    found = [
        w.hooks[Stagnation.name]
        for _, w in find_all(opt_state, LossScalingState)
        if Stagnation.name in w.hooks
    ]
    if len(found) != 1:
        raise ValueError(
            "warn_if_stagnant reads the state of a jls.loss_scaling(..., "
            "hooks=[jls.hooks.Stagnation()]) transformation; found "
            f"{len(found) or 'none'}"
        )
    fraction = plain(found[0]).stagnant_fraction
    if isinstance(fraction, Tracer):
        raise TypeError(
            "jls.hooks.warn_if_stagnant was called inside jit (or another jax "
            "transformation), where it cannot warn: call it on the host after "
            "the step, where you log metrics"
        )
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
