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

``every`` (default 16) reads one step in ``every`` (the first, then every
``every``-th call), inside a conditional of its own that runs the update
with the reads (the other steps run it without): in a step that donates
(``donated=True``) the steps between pay nothing. Without donation that
conditional would hold the gradients in memory, so ``every > 1`` needs
``donated=True`` (as `jls.hooks.ScaleStats` does), and ``every=1`` reads every
step inline. `warn_if_stagnant` turns the fraction into a warning on the
host, where you log metrics.
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
from jls._hooks import Hook, HookContext, LossScalingState, StepInfo
from jls._tree import find_all, plain
from jls._validate import integer


class StagnationState(NamedTuple):
    """The latest measured step's fraction, and where the cycle stands.

    ``stagnant_fraction`` is a float32 scalar (0 until a step is measured);
    ``phase`` (int32) is the position in the cycle of ``every`` calls (0:
    the next applied call measures).
    """

    stagnant_fraction: jax.Array
    phase: jax.Array

    def metrics(self) -> dict[str, Any]:
        """``stagnant_fraction`` (what `jls.metrics` reports of this hook)."""
        return {"stagnant_fraction": plain(self).stagnant_fraction}


class StagnationWarning(UserWarning):
    """`warn_if_stagnant`'s warning: the updates are being rounded away."""


def _counts(new: Any, u: Any) -> tuple[jax.Array, jax.Array]:
    """``(stuck, moving)`` entries of one leaf, as float32 scalars.

    ``new`` is the parameter after the update ``u``: an entry is stuck when
    ``new + u`` rounds back to ``new`` (the parameter before is not read: see
    the module notes).
    """
    new, u = jnp.asarray(new), jnp.asarray(u)
    again = jnp.asarray(new + u).astype(new.dtype)  # as optax.apply_updates adds
    moving = u != 0
    stuck = moving & (again == new)
    return (
        jnp.sum(stuck, dtype=jnp.int32).astype(jnp.float32),
        jnp.sum(moving, dtype=jnp.int32).astype(jnp.float32),
    )


def _agreed(stuck: jax.Array, moving: jax.Array, named: tuple[str, ...]) -> Any:
    """The counts over every replica and shard, as `jls.hooks.ScaleStats` adds them.

    A leaf sharded over a ``shard_map`` axis has its counts added over it;
    where jax records no varying axes (``pmap``, ``check_vma=False``) counts
    that differ across ``axis_name`` are taken as shards (added), equal ones
    as replicas (kept).
    """
    both = jnp.stack([stuck, moving])
    tracked = tracked_in(both, named)
    shards = tuple(sorted(varying_axes(both))) if tracked else ()
    if shards:
        both = lax.psum(both, shards)
    if named and not tracked:
        same = jnp.all(lax.pmax(both, named) == lax.pmin(both, named))
        both = jnp.where(same, both, lax.psum(both, named))
    return both[0], both[1]


@dataclasses.dataclass(frozen=True)
class Stagnation(Hook):
    """Records ``stagnant_fraction`` one step in ``every`` (see the module).

    Pass it as ``jls.loss_scaling(..., hooks=[jls.hooks.Stagnation()],
    donated=True)``; read it with
    ``jls.metrics(opt_state)["stagnant_fraction"]``, or warn with
    `jls.hooks.warn_if_stagnant`. ``tx.update`` must be given the parameters.

    Attributes:
      every: read one call in ``every`` (an int >= 1; default 16), holding
        the last measurement in between; a read call whose step is skipped
        measures nothing (the next is ``every`` calls later). ``every > 1``
        needs ``donated=True``; ``every=1`` reads every applied step, inline.

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

    def check(self, context: HookContext) -> None:
        """Refuses sampling (``every > 1``) in a step that does not donate.

        Without donation the conditional that samples holds the gradients
        in memory, as `jls.hooks.ScaleStats`' does.
        """
        if self.every > 1 and not context.donated:
            raise ValueError(
                f"jls.hooks.Stagnation(every={self.every}) reads one step in "
                f"{self.every} inside a lax.cond, which pays only when the step "
                "donates (donated=True, with jax.jit(..., donate_argnums=...)): "
                "without donation the conditional holds the gradients in memory. "
                "Donate, or read every step: jls.hooks.Stagnation(every=1)."
            )

    def init(self, params: Any) -> StagnationState:
        del params
        return StagnationState(jnp.float32(0), jnp.int32(0))

    def reads_updates(self, state: Any) -> Any:
        return True if self.every == 1 else state.phase == 0

    def read_updates(self, state: Any, new_params: Any, updates: Any) -> Any:
        """``(stuck, moving)``: this replica's entry counts, float32."""
        del state
        leaves, treedef = jax.tree.flatten(new_params, is_leaf=lambda x: x is None)
        ups = treedef.flatten_up_to(updates)
        stuck, moving = jnp.float32(0), jnp.float32(0)
        for p, u in zip(leaves, ups, strict=True):
            dtype = getattr(p, "dtype", None)
            if u is None or dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
                continue
            s, m = _counts(p, u)
            stuck, moving = stuck + s, moving + m
        return stuck, moving

    def update(self, state: Any, info: StepInfo, vetoed: Any) -> StagnationState:
        del vetoed
        assert info.applied is not None and info.reads is not None
        stuck, moving = info.reads[self.name]

        def measured() -> jax.Array:
            s, m = _agreed(stuck, moving, tuple(info.axis_name))
            return jnp.where(m > 0, s / jnp.maximum(m, 1), 0).astype(jnp.float32)

        fraction = lax.cond(
            info.applied & (state.phase == 0),
            measured,
            lambda: state.stagnant_fraction,
        )
        return StagnationState(fraction, (state.phase + 1) % self.every)


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
