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

    Works inside ``jit`` and on the host, on a state batched by ``vmap`` or
    ``pmap`` too; every value is a plain array. The keys are the same for
    every scaler, the off switch included.

    Args:
      opt_state: a `LossScaleState` or any optimizer state containing one.

    Returns:
      A dict of scalar arrays:

      * ``loss_scale``: the scale for the next step (float32).
      * ``skipped``, ``nonfinite``: whether the latest step's update was
        dropped, and whether its gradients were not all finite (or its scale
        out of range); they differ on a veto or with ``skip_nonfinite=False``.
      * ``consecutive_skips``, ``total_skips``: skipped steps in a row, and
        so far (retries are not steps).
      * ``consecutive_nonfinite``: non-finite steps in a row.
      * ``growth_count``: consecutive finite steps towards the next growth.
      * ``retries``: how often the latest step's gradients were recomputed
        (``jls.train_step(..., max_retries=n)``).
      * ``nonfinite_loss``: whether the latest step's loss (``loss=``) was
        not finite; such a step is skipped with the scale held. On the host
        (a finished step: no sync), 8 in a row warn (``RuntimeWarning``).
      * ``diverged``: whether ``max_consecutive_skips`` steps in a row were
        skipped (`loss_scaling`'s default, 1000; `jls.hooks.Divergence`).
      * each further hook state's ``metrics()`` (`jls.hooks.builtin_metrics`
        lists the built-in hooks' keys).

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

    ``update`` takes the SCALED gradients (of ``jls.scale_loss(loss, state)``).
    When every unscaled gradient is finite it unscales them and runs
    ``inner``; otherwise it returns zero updates and leaves ``inner``'s state
    bitwise unchanged. Either way it adjusts the loss scale. Put it outermost
    (``docs/howto/accumulation.md``).

    Args:
      inner: the optimizer to wrap (any ``optax.GradientTransformation``).
      scaler: a `LossScaler`; default ``jls.dynamic_scale()``.
      axis_name: the ``pmap``/``shard_map`` axis (or axes) over which replicas
        agree on the skip and the scale (not needed under ``jit``); a dict
        says which gradients each axis shards (docs/parallelism.md).
      hooks: more `jls.hooks.Hook` objects, consulted after those the keywords
        below stand for (`LossScaling` takes the hooks only).
      diagnostics: add `jls.hooks.Diagnostics` (which leaves were not finite).
      max_consecutive_skips: the limit of `jls.hooks.Divergence` (the sticky
        ``diverged`` flag); ``None``: no flag.
      gradient_norm: add `jls.hooks.GradientNorm` (each step's gradient norm).
      skip_spikes: a `jls.hooks.SpikeRule`: skip (or clip) outlier steps.
      check_replicas: add `jls.hooks.ReplicaCheck`: ``True``, or the
        data-parallel axes of ``axis_name`` to compare the gradients over.
      scale_stats: add `jls.hooks.ScaleStats`: ``True``, a dtype, or the hook.
      donated: deprecated and ignored (a DeprecationWarning).

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is a
      `LossScalingState`.

    Raises:
      TypeError: if ``inner`` is not an optax transformation, ``scaler`` is
        not a `LossScaler`, or ``axis_name`` is not a str or tuple of str.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jls
      >>> params = {"w": jnp.ones(2)}
      >>> tx = jls.loss_scaling(optax.sgd(0.5), jls.dynamic_scale(init_scale=4))
      >>> state = tx.init(params)
      >>> grads = jax.grad(lambda p: jls.scale_loss(p["w"].sum(), state))(params)
      >>> updates, state = tx.update(grads, state, params)
      >>> updates["w"], jls.metrics(state)["loss_scale"]
      (Array([-0.5, -0.5], dtype=float32), Array(4., dtype=float32))
      >>> bad = {"w": jnp.array([1.0, jnp.inf])}
      >>> updates, state = tx.update(bad, state, params)
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

    ``tx.update`` then ``optax.apply_updates``, with the same guarantees, but
    XLA fuses each update into its parameter: no updates tree in memory.

    Args:
      tx: a transformation made by `loss_scaling` (not wrapped further), or
        a `LossScaling`.
      grads: the scaled gradients.
      opt_state: ``tx``'s state.
      params: any pytree, a whole model too (an equinox ``Module``): its
        floating arrays with a gradient are stepped, other leaves returned.
      **extra_args: forwarded to the inner optimizer's ``update``;
        ``loss=`` goes to the hooks that read the loss.

    Returns:
      ``(new_params, new_opt_state)``.

    Raises:
      TypeError: if ``tx`` was not made by `loss_scaling`, or ``opt_state``
        is not its state.

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
