"""The seam: hooks the step consults (adding one never grows the step)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax import lax

from jls._state import LossScaleState
from jls._tree import find_all


class LossScalingState(NamedTuple):
    """The state of a `jls.loss_scaling` transformation.

    Attributes:
      loss_scale: the `jls.LossScaleState` (scale and counters).
      inner_state: the wrapped optimizer's state.
      hooks: each hook's state, by the hook's name.

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
      norm: the unscaled gradients' global norm if needed, else ``None``.
      loss: the unscaled loss (float32, the replicas' mean), or ``None``.
      applied: whether the update was applied (``None`` in `Hook.veto`).
      loss_scale: the `jls.LossScaleState` after the step (``None`` in veto).
      any_replica: reduces a list of bools over the replicas: true where any is.
      same_on_replicas: whether float32 scalars are equal on every replica.
      axis_name: the transformation's ``axis_name``, as in `HookContext`.
      reads: what the hooks read of the updates, by name (``None`` in veto).
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

    Subclasses set ``name`` and the flags they need; every method's default
    does nothing. Make hooks immutable (a frozen dataclass).

    Attributes:
      name: the key of this hook's state, unique among the hooks.
      needs_norm: the step must measure the gradients' norm.
      needs_loss: every step must be given ``loss=`` (the unscaled loss).
      reads_loss: the hook reads the loss when the step has it.
      holds_scale: a step this hook skips leaves the scale rule where it was.

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
        """Raises if this hook cannot work with the rest of the transformation."""
        del context

    def init(self, params: Any) -> Any:
        """The hook's state before the first step (a pytree of arrays)."""
        del params
        return ()

    def veto(self, state: Any, info: StepInfo) -> jax.Array | None:
        """A scalar bool: skip this step. ``None``: no opinion."""
        del state, info
        return None

    def gradient_factor(self, state: Any, info: StepInfo) -> jax.Array | None:
        """A float32 scalar in ``[0, 1]`` the unscaled gradients are multiplied by.

        ``None``: no opinion. Compute it from values the replicas agree on.
        """
        del state, info
        return None

    def reads_updates(self, state: Any) -> Any:
        """Whether to read this step's updates (`read_updates`).

        ``None``: never; ``True``: every step; a traced bool: the steps it is
        true on (inside a ``lax.cond``).
        """
        del state
        return None

    def read_updates(self, state: Any, new_params: Any, updates: Any) -> Any:
        """What the hook reads of the updates (a pytree of arrays).

        ``new_params`` are the parameters ``updates`` make (the old ones would
        make XLA copy them); `update` gets the result as ``info.reads[name]``.
        """
        del state, new_params, updates
        return ()

    def update(self, state: Any, info: StepInfo, vetoed: jax.Array) -> Any:
        """The hook's state after the step (``vetoed``: this hook skipped it)."""
        del info, vetoed
        return state


def hook_metrics(hooks: dict[str, Any]) -> dict[str, Any]:
    """What each hook's state reports: its ``metrics()``, where it has one.

    Raises:
      ValueError: if two states report the same key.
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


def hook_state(opt_state: Any, name: str, needs: str) -> Any:
    """The state of the one hook named ``name`` in ``opt_state``.

    Raises:
      ValueError: saying what the caller ``needs``, if no transformation in
        ``opt_state`` has such a hook, or several do.
    """
    found = [
        w.hooks[name]
        for _, w in find_all(opt_state, LossScalingState)
        if name in w.hooks
    ]
    if len(found) != 1:
        raise ValueError(f"{needs}; found {len(found) or 'none'}")
    return found[0]
