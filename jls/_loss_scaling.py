"""The transformation's entry points: `loss_scaling`, `apply_gradients`, `metrics`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import optax

from jls._builtins import hooks_from_options, warn_donated
from jls._core import step
from jls._inner import Transformation
from jls._rule import LossScaler
from jls._transformation import MISSING, LossScaling, config_of
from jls._tree import loss_scale_state
from jls.hooks._divergence import DIVERGENCE_LIMIT
from jls.hooks._hooks import Hook, LossScalingState, hook_metrics
from jls.hooks._nonfinite_loss import warn_if_nonfinite_loss
from jls.hooks._spikes import SpikeRule


def metrics(opt_state: Any) -> dict[str, jax.Array]:
    """The loss-scale metrics of a step, for logging.

    Works inside ``jit``, on the host and on batched states; the keys are the
    same for every scaler.

    Args:
      opt_state: a `LossScaleState` or any optimizer state containing one.

    Returns:
      A dict of scalar arrays:

      * ``loss_scale``: the scale for the next step (float32).
      * ``skipped``, ``nonfinite``: the latest step was dropped; its
        gradients were not all finite (they differ on a veto).
      * ``consecutive_skips``, ``total_skips``: skipped steps in a row, ever.
      * ``consecutive_nonfinite``: non-finite steps in a row.
      * ``growth_count``: consecutive finite steps towards the next growth.
      * ``retries``: recomputations of the latest step (``max_retries``).
      * ``nonfinite_loss``: the latest ``loss=`` was not finite (step skipped,
        scale held; 8 in a row warn on the host).
      * ``diverged``: ``max_consecutive_skips`` skips in a row happened.
      * each further hook's ``metrics()`` (`jls.hooks.builtin_metrics`).

    Example:
      >>> import jls
      >>> m = jls.metrics(jls.dynamic_scale().init())
      >>> float(m["loss_scale"]), bool(m["skipped"]), int(m["total_skips"])
      (32768.0, False, 0)
    """
    state = loss_scale_state(opt_state, batched=True)
    out = {
        "loss_scale": state.scale,
        "skipped": state.consecutive_skips > 0,
        "nonfinite": state.consecutive_nonfinite > 0,
        "consecutive_skips": state.consecutive_skips,
        "total_skips": state.total_skips,
        "consecutive_nonfinite": state.consecutive_nonfinite,
        "growth_count": state.growth_count,
        "retries": state.retries,
    }
    wrappers = optax.tree.get_all_with_path(opt_state, LossScalingState.__name__)
    if len(wrappers) == 1:
        out.update(hook_metrics(dict(wrappers[0][1].hooks)))
    warn_if_nonfinite_loss(opt_state, wait=False)
    return out


def loss_scaling(
    inner: Transformation,
    scaler: LossScaler | None = None,
    *,
    axis_name: str | tuple[str, ...] | dict[str, Any] | None = None,
    hooks: Sequence[Hook] = (),
    diagnostics: bool = False,
    max_consecutive_skips: int | None = DIVERGENCE_LIMIT,
    gradient_norm: bool = False,
    skip_spikes: SpikeRule | None = None,
    check_replicas: bool | str | tuple[str, ...] = False,
    scale_stats: Any = False,
    donated: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax optimizer with loss scaling.

    ``update`` takes the SCALED gradients. When all are finite it unscales
    them and runs ``inner``; otherwise it returns zero updates and leaves
    ``inner``'s state unchanged. Either way it adjusts the scale.

    Args:
      inner: the optimizer to wrap (any ``optax.GradientTransformation``).
      scaler: a `LossScaler`; default ``jls.dynamic_scale()``.
      axis_name: the ``pmap``/``shard_map`` axis (or axes, or a dict of them)
        the replicas agree over; not needed under ``jit`` (docs/parallelism.md).
      hooks: more `jls.hooks.Hook` objects, run after the keywords' hooks.
      diagnostics: add `jls.hooks.Diagnostics` (which leaves were not finite).
      max_consecutive_skips: `jls.hooks.Divergence`'s limit; ``None``: none.
      gradient_norm: add `jls.hooks.GradientNorm` (each step's gradient norm).
      skip_spikes: a `jls.hooks.SpikeRule`: skip (or clip) outlier steps.
      check_replicas: add `jls.hooks.ReplicaCheck`: ``True`` or its axes.
      scale_stats: add `jls.hooks.ScaleStats`: ``True``, a dtype, or the hook.
      donated: deprecated and ignored (a DeprecationWarning).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` (state: `LossScalingState`).

    Raises:
      TypeError: if ``inner``, ``scaler`` or ``axis_name`` has the wrong type.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jls
      >>> params = {"w": jnp.ones(2)}
      >>> tx = jls.loss_scaling(optax.sgd(0.5), jls.dynamic_scale(init_scale=4))
      >>> state = tx.init(params)
      >>> grads = jax.grad(lambda p: jls.scale_loss(p["w"].sum(), state))(params)
      >>> updates, state = tx.update(grads, state, params)
      >>> updates["w"], jls.metrics(state)["loss_scale"]
      (Array([-0.5, -0.5], dtype=float32), Array(4., dtype=float32))
      >>> updates, state = tx.update({"w": jnp.array([1.0, jnp.inf])}, state, params)
      >>> updates["w"], jls.metrics(state)["loss_scale"]
      (Array([-0., -0.], dtype=float32), Array(2., dtype=float32))
    """
    if donated is not None:
        warn_donated("loss_scaling", donated)
    options = hooks_from_options(
        hooks,
        diagnostics=diagnostics,
        max_consecutive_skips=max_consecutive_skips,
        gradient_norm=gradient_norm,
        skip_spikes=skip_spikes,
        check_replicas=check_replicas,
        scale_stats=scale_stats,
    )
    scaling = LossScaling(inner, scaler, axis_name=axis_name, hooks=options)
    return scaling.gradient_transformation()


def apply_gradients(
    tx: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params = MISSING,
    **extra_args: Any,
) -> tuple[optax.Params, LossScalingState]:
    """Applies one loss-scaled step to the parameters: the fused path.

    ``tx.update`` then ``optax.apply_updates``, fused: no updates tree.

    Args:
      tx: a transformation made by `loss_scaling`, or a `LossScaling`.
      grads: the scaled gradients.
      opt_state: ``tx``'s state.
      params: any pytree (an equinox ``Module`` too); other leaves returned.
      **extra_args: forwarded to ``inner.update``; ``loss=`` to the hooks.

    Returns:
      ``(new_params, new_opt_state)``.

    Raises:
      TypeError: if ``tx`` or ``opt_state`` is not from `loss_scaling`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jls
      >>> params = {"w": jnp.ones(2)}
      >>> tx = jls.loss_scaling(optax.sgd(0.5), jls.static_scale(8.0))
      >>> state = tx.init(params)
      >>> grads = jax.grad(lambda p: jls.scale_loss(p["w"].sum(), state))(params)
      >>> params, state = jls.apply_gradients(tx, grads, state, params)
      >>> params["w"]
      Array([0.5, 0.5], dtype=float32)
    """
    if params is MISSING:
        got = "params" if isinstance(opt_state, LossScalingState) else "opt_state"
        raise TypeError(
            "apply_gradients(tx, grads, opt_state, params) takes four arguments; "
            f"{got} is missing (got tx, grads and one more)"
        )
    return step(config_of(tx), grads, opt_state, params, extra_args, fused=True)
