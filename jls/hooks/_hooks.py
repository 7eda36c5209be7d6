"""The seam: hooks the step consults, and the transformation's state.

Every optional feature of a step is a `Hook`, each in a module of its own
(`jls.hooks` lists them), and so is any veto a user writes. The step
(`jls._core`) knows hooks only through this class, so adding one never grows
it. A step, inside ``jit``:

1. The check decides whether the gradients are finite (and measures their
   norm if a hook asked for it); every replica agrees.
2. Each hook's `Hook.veto` may skip the step (a spike, a loss above a limit);
   the vetoes are agreed across replicas in one collective. A hook whose
   veto ``holds_scale`` also leaves the scale rule where it was. Each hook's
   `Hook.gradient_factor` may shrink the step instead (clipping a spike): a
   scalar the unscaled gradients are multiplied by, in the same pass that
   unscales them.
3. The update is applied or skipped, and the scale rule advances. A hook
   that reads the updates (`Hook.read_updates`: `jls.hooks.Stagnation`) reads
   them beside the update, on the steps its `Hook.reads_updates` says.
4. Each hook's `Hook.update` records what it keeps (statistics, flags).

A user's own veto, in a few lines::

    class SkipHighLoss(jls.hooks.Hook):
        name = "skip_high_loss"
        needs_loss = True

        def __init__(self, limit):
            self.limit = limit

        def veto(self, state, info):
            return info.loss > self.limit

    tx = jls.loss_scaling(optax.adam(1e-3), hooks=[SkipHighLoss(10.0)])

(`jls.train_step` passes the loss; with ``tx.update`` pass ``loss=``.)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax import lax

from jls._state import LossScaleState


class LossScalingState(NamedTuple):
    """The state of a `jls.loss_scaling` transformation.

    Attributes:
      loss_scale: the `jls.LossScaleState` (scale and counters).
      inner_state: the wrapped optimizer's state; bitwise unchanged by a
        skipped step.
      hooks: each hook's state, by the hook's name; a built-in hook's state
        is a NamedTuple whose ``metrics()`` `jls.metrics` reports.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(8.0))
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> isinstance(state, jls.LossScalingState), float(state.loss_scale.scale)
      (True, 8.0)
    """

    loss_scale: LossScaleState
    inner_state: Any
    hooks: dict[str, Any] = {}


# The name jls 0.3 gave it (kept for code that imported it from here).
WrapperState = LossScalingState


class HookContext(NamedTuple):
    """What a hook may check its compatibility against (`Hook.check`).

    Attributes:
      scaler: the transformation's `jls.LossScaler`.
      axis_name: its ``axis_name``, a tuple (empty without one).
      hooks: every hook of the transformation, in order.
    """

    scaler: Any
    axis_name: tuple[str, ...]
    hooks: tuple[Any, ...]


class StepInfo(NamedTuple):
    """What a hook sees of a step. Every value is agreed across replicas.

    Attributes:
      grads: the scaled gradients, as given to the step.
      scale: the float32 scale they were scaled with.
      finite: whether they are all finite and the scale was in range.
      norm: the global norm of the unscaled gradients (float32), when a hook
        has ``needs_norm``; else ``None``.
      loss: the unscaled loss (float32; the replicas' mean), when given
        (``loss=``, or by `jls.train_step`); else ``None``.
      applied: in `Hook.update`, whether the update was applied; ``None`` in
        `Hook.veto`.
      loss_scale: in `Hook.update`, the `jls.LossScaleState` after the step;
        ``None`` in `Hook.veto`.
      any_replica: reduces a list of scalar (or per-leaf) bools over the
        replicas: true where any replica's is. For a hook's own values
        computed from each replica's gradients.
      same_on_replicas: whether a list of float32 scalars is bitwise equal
        on every replica of ``axis_name`` (``True`` without one), or of the
        axes given as its second argument.
      axis_name: the transformation's ``axis_name``, a tuple (empty without
        one): the axes a hook's own collectives reduce over.
      reads: in `Hook.update`, what the hooks read of this step's updates,
        by name (`Hook.read_updates`; zeros of its types on a step that
        read nothing, and not applied values on a skipped step: check
        ``applied``). ``None`` in `Hook.veto`.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> class Seen(jls.hooks.Hook):  # records the latest norm and whether applied
      ...     name = "seen"
      ...     needs_norm = True
      ...     def init(self, params):
      ...         return (jnp.float32(0), jnp.bool_(False))
      ...     def update(self, state, info, vetoed):
      ...         return (info.norm, info.applied)
      >>> tx = jls.loss_scaling(optax.sgd(0.1), jls.no_scale(), hooks=[Seen()])
      >>> params = {"w": jnp.ones(4)}
      >>> _, state = tx.update({"w": jnp.full(4, 0.5)}, tx.init(params), params)
      >>> float(state.hooks["seen"][0]), bool(state.hooks["seen"][1])
      (1.0, True)
    """

    grads: Any
    scale: jax.Array
    finite: jax.Array
    norm: jax.Array | None
    loss: jax.Array | None
    applied: jax.Array | None
    loss_scale: LossScaleState | None
    any_replica: Callable[[list[jax.Array]], list[jax.Array]]
    same_on_replicas: Callable[..., jax.Array] = lambda values, axes=None: (
        jax.numpy.asarray(True)
    )
    axis_name: tuple[str, ...] = ()
    reads: dict[str, Any] | None = None


class Hook:
    """A veto or a statistic the step consults; override what you need.

    Subclasses set ``name`` (the key of the hook's state, unique among a
    transformation's hooks) and the flags they need; every method has a
    default that does nothing. Hooks are configuration: make them immutable
    (a frozen dataclass, say), so that a transformation is too. What
    `jls.metrics` reports of a hook is its state's: a state that is a
    NamedTuple with a ``metrics(self)`` method, as every built-in hook's.

    Attributes:
      name: the key of this hook's state in the transformation's state.
      needs_norm: the step must measure the gradients' norm (the check is
        then the sum-of-squares check; no second pass).
      needs_loss: every step must be given ``loss=`` (the unscaled loss).
      reads_loss: the hook reads the loss when the step has it (``loss=``,
        or `jls.train_step`), and works without it.
      holds_scale: a step this hook skips leaves the scale rule where it was
        (a non-finite loss says nothing about the scale); otherwise the rule
        advances as for any finite step.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> class SkipHighLoss(jls.hooks.Hook):
      ...     name = "skip_high_loss"
      ...     needs_loss = True
      ...     def veto(self, state, info):
      ...         return info.loss > 10.0
      >>> tx = jls.loss_scaling(optax.sgd(0.1), hooks=[SkipHighLoss()])
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> _, state = tx.update(params, state, params, loss=jnp.float32(50.0))
      >>> bool(jls.metrics(state)["skipped"])
      True
    """

    name: str = "hook"
    needs_norm: bool = False
    needs_loss: bool = False
    reads_loss: bool = False
    holds_scale: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if isinstance(cls.__dict__.get("metrics"), classmethod):
            warnings.warn(
                f"{cls.__name__}.metrics: a hook's metrics come from its state in "
                "jls 0.4 (jls.metrics reads the state, not a registry of hook "
                "classes): return a NamedTuple with a metrics(self) method from "
                "init and update, and drop the classmethod",
                DeprecationWarning,
                stacklevel=2,
            )

    def check(self, context: HookContext) -> None:
        """Raises if this hook cannot work with the rest of the transformation.

        Called once, when the transformation is made (e.g. a hook that needs
        an ``axis_name``, or a donating step). The default accepts anything.
        """
        del context

    def init(self, params: Any) -> Any:
        """The hook's state before the first step (a pytree of arrays).

        A NamedTuple with a ``metrics(self) -> dict`` method is reported by
        `jls.metrics`; any other state is kept but not reported.
        """
        del params
        return ()

    def veto(self, state: Any, info: StepInfo) -> jax.Array | None:
        """A scalar bool: skip this step. ``None``: no opinion."""
        del state, info
        return None

    def gradient_factor(self, state: Any, info: StepInfo) -> jax.Array | None:
        """A float32 scalar in ``[0, 1]`` the unscaled gradients are multiplied by.

        ``None`` (the default): no opinion. The step multiplies the factors
        of every hook into the unscaling, so shrinking the gradients (a
        clipped spike) costs no pass over them. Compute it from values every
        replica agrees on (``info.norm``, ``info.loss``, the hook's own state)
        so that every replica applies the same update.
        """
        del state, info
        return None

    def reads_updates(self, state: Any) -> Any:
        """Whether to read this step's updates (`read_updates`).

        ``None`` (the default): never; ``True``: every step, inline with the
        update; a traced scalar bool: the steps it is true on, which a hook
        that samples (one step in ``n``) says from its state. The step then
        reads inside a conditional of its own, so the steps between compute
        nothing (the conditional holds what it reads, the updates, in memory).
        """
        del state
        return None

    def read_updates(self, state: Any, new_params: Any, updates: Any) -> Any:
        """What the hook reads of the updates (a pytree of arrays).

        Computed beside the update, on every step `reads_updates` asks (on
        the fused path the updates are never a tree in memory unless a read
        holds them): ``updates`` are
        the inner optimizer's unscaled updates, ``new_params`` the
        parameters they make (``optax.apply_updates``; ``None`` for the
        leaves the step does not update). The parameters before the step
        are not offered: reading them beside their in-place update makes
        XLA copy them. `update` gets the result as ``info.reads[name]``
        (zeros of its types on a skipped step). A hook that reads a part of
        each leaf (`jls.hooks.Stagnation`) slices it here.
        """
        del state, new_params, updates
        return ()

    def update(self, state: Any, info: StepInfo, vetoed: jax.Array) -> Any:
        """The hook's state after the step (``vetoed``: this hook skipped it)."""
        del info, vetoed
        return state


def hook_metrics(hooks: dict[str, Any]) -> dict[str, Any]:
    """What each hook's state reports: its ``metrics()``, where it has one.

    A state without a ``metrics`` method (a user hook's plain arrays) reports
    nothing. Two states reporting the same key are refused: each key must say
    one thing.
    """
    out: dict[str, Any] = {}
    for name, state in hooks.items():
        report = getattr(state, "metrics", None)
        if not callable(report):
            continue
        reported = cast(dict[str, Any], report())
        for key, value in reported.items():
            if key in out:
                raise ValueError(
                    f"the hooks' states report {key!r} twice (hook {name!r} and "
                    "another): give the hooks' metrics distinct names"
                )
            out[key] = value
    return out


def read_hooks_updates(
    readers: list[Hook], states: dict[str, Any], params: Any, new: Any, updates: Any
) -> dict[str, Any]:
    """Each reading hook's `Hook.read_updates`, by name, on the steps it asks.

    A hook that reads every step (``reads_updates`` is ``True``) reads
    inline; one that samples reads inside a ``lax.cond`` of its own whose
    other branch gives zeros, so the steps between compute nothing. The
    step selects the reads away on a skipped step (`jls._core.recorded`).

    Raises:
      TypeError: at trace time, where a hook reads and ``params`` is ``None``.
    """
    if readers and params is None:
        raise TypeError(
            f"the hooks {[h.name for h in readers]} read the updates and need the "
            "parameters: call tx.update(grads, opt_state, params)"
        )
    reads = {}
    for hook in readers:
        state = states[hook.name]
        when = hook.reads_updates(state)
        now = lambda h=hook, s=state: h.read_updates(s, new, updates)  # noqa: E731
        if when is True:
            reads[hook.name] = now()
            continue
        types = jax.eval_shape(now)
        zeros = lambda t=types: jax.tree.map(  # noqa: E731
            lambda x: jnp.zeros(x.shape, x.dtype), t
        )
        reads[hook.name] = lax.cond(jnp.asarray(when), now, zeros)
    return reads
