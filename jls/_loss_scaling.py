"""The transformation's entry points: `loss_scaling`, `apply_gradients`, `metrics`.

`loss_scaling` returns ``LossScaling(...).gradient_transformation()``;
`apply_gradients` is the same object's fused path, and `metrics` reads what a
step left in the state (the scale and counters, and each hook's metrics).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
import optax

from jls._builtins import hooks_from_options
from jls._core import step
from jls._inner import Transformation
from jls._rule import LossScaler
from jls._transformation import MISSING, LossScaling, config_of
from jls._tree import loss_scale_state
from jls.hooks._divergence import DIVERGENCE_LIMIT
from jls.hooks._hooks import Hook, LossScalingState, hook_metrics
from jls.hooks._spikes import SpikeRule


def metrics(opt_state: Any) -> dict[str, jax.Array]:
    """The loss-scale metrics of a step, for logging.

    Works inside ``jit`` and on the host, on a state batched by ``vmap`` or
    ``pmap`` too. Every value is a plain array (an ``nnx.Optimizer``'s state
    is unwrapped).

    Args:
      opt_state: a `LossScaleState` or any optimizer state containing one.

    Returns:
      A dict of scalar arrays:

      * ``loss_scale``: the scale for the next step (float32).
      * ``skipped``: whether the latest step's update was dropped (bool).
      * ``nonfinite``: whether the latest step's gradients were not all
        finite (bool). Equal to ``skipped`` unless the scaler applies such
        steps (``skip_nonfinite=False``), a hook vetoed a finite step, or the
        step's scale was outside the scaler's range (then the step counts as
        non-finite and is dropped).
      * ``consecutive_skips``: skipped steps in a row, ending with the latest.
      * ``total_skips``: skipped steps so far. Retries are not steps. A
        step counter that counts every call (flax's ``TrainState.step``)
        minus ``total_skips`` is the inner optimizer's own count.
      * ``consecutive_nonfinite``: steps in a row with non-finite gradients.
      * ``growth_count``: consecutive finite steps towards the next growth.
      * ``retries``: how many times the latest step's gradients were
        recomputed (``jls.train_step(..., max_retries=n)``).
      * ``nonfinite_loss``: whether the latest step's loss (given as
        ``loss=``, or by `jls.train_step`) was not finite; such a step is
        skipped with the scale held, unless the scaler applies non-finite
        steps (then it is only recorded). These keys are the same for every
        scaler, the off switch included: one logger serves every precision.
      * what each hook's state reports (its ``metrics()``): the built-in
        hooks' keys are listed by `jls.hooks.builtin_metrics`, read from the
        code; a user hook's are its state's.

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
    return out


def loss_scaling(
    inner: Transformation,
    scaler: LossScaler | None = None,
    *,
    axis_name: str | tuple[str, ...] | None = None,
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
    It checks them, and when every unscaled gradient is finite it unscales
    them and runs ``inner``; otherwise it returns zero updates and leaves
    ``inner``'s state bitwise unchanged (its step count and schedules do not
    advance). Either way it adjusts the loss scale. Extra arguments are
    forwarded to ``inner``. One trace serves every step.

    For the smallest overhead, apply the step with `apply_gradients` instead
    of ``update`` + ``optax.apply_updates``.

    Composition: put ``loss_scaling`` outermost. Inside it, any optax
    transformation (``chain`` with ``clip_by_global_norm``, ``masked``,
    ``inject_hyperparams``, ``MultiSteps``) sees unscaled gradients. With
    gradient accumulation, ``loss_scaling(optax.MultiSteps(inner, k))`` is
    the recommended order: each micro-batch is checked before it reaches the
    accumulator, so a non-finite micro-batch is dropped alone (the window
    waits for one more) and can never poison the accumulator, and the scale
    backs off at once. In the other order, ``MultiSteps`` accumulates scaled
    gradients and resets its accumulator as ``0 * acc``, so one nan
    micro-batch would poison every later window; that order needs
    ``MultiSteps(..., should_skip_update_fn=optax.skip_not_finite)``, and
    then jls never sees (or backs off for) the dropped micro-batches.

    Args:
      inner: the optimizer to wrap (any ``optax.GradientTransformation``).
      scaler: a `LossScaler`; default ``jls.dynamic_scale()``.
      axis_name: the ``pmap``/``shard_map`` axis name (or names) over which
        replicas agree on the skip decision and the scale. It does not
        average the gradients: for data parallelism ``lax.pmean`` them over
        the axis first (or use ``jls.train_step(..., average_over=...)``).
        Not needed under ``jit`` with sharded arrays, where the check is
        already global.
      hooks: `jls.hooks.Hook` objects the step consults (a veto of your own,
        say), after the built-in ones the feature keywords below stand for.
        The feature keywords are a convenience of this function: each is
        turned into its hook here (``gradient_norm=True`` is
        ``jls.hooks.GradientNorm()``), and `LossScaling` takes the hooks.
      diagnostics: record which gradient leaves were not finite on the latest
        step (``jls.metrics(...)["nonfinite_leaves"]``,
        `jls.hooks.nonfinite_paths`). Costs nothing on finite steps; a skipped
        step makes one more exact pass.
      max_consecutive_skips: the divergence limit, an int in ``[1, 2**31 -
        1]``: the state's ``diverged`` flag turns ``True`` on the step that
        makes this many skipped steps in a row, and stays ``True``. It is
        plain state, exact under ``vmap``, ``scan`` and ``pmap``;
        `jls.hooks.raise_if_diverged` raises `jls.hooks.DivergenceError` from it (on the
        host after the step, where you log metrics: it reads one flag; or
        inside ``jit`` under ``checkify``). Default 1000 (reading the flag
        costs nothing until you call it); ``None``: no flag.
      gradient_norm: record the global norm of each step's unscaled
        gradients (``jls.metrics(...)["gradient_norm"]``), from the finite
        check's own pass: the check becomes a sum of squares, which also
        yields the norm (no second read of the gradients, unlike
        ``optax.global_norm``), exact for every finite norm (inf past the
        float32 maximum, and inf after a non-finite step: never nan); finite
        gradients are never reported non-finite.
      skip_spikes: a `jls.hooks.SpikeRule`: also skip a step whose gradient norm
        (or loss, given as ``loss=``) is an outlier against its running
        statistics. Composes with every scaler, ``no_scale()`` included.
      check_replicas: with ``axis_name``: compare a fingerprint of the
        gradients (one element per leaf, bitwise) across the replicas and
        count the finite steps where they differ
        (``jls.metrics(...)["replicas_differ"]``, ``["replica_mismatches"]``):
        data-parallel gradients that were not averaged. ``True`` compares
        over the one ``axis_name``; with several (data x model), give the
        data-parallel ones (``check_replicas="data"``). One small
        collective per step. The fingerprint is each leaf's first element: a
        forgotten average changes every element and is caught; a difference
        confined to other elements is not. Vetoed finite steps count too.
        Under ``shard_map`` with ``check_vma=True`` jax's types already keep
        replicas equal: nothing is compared.
      scale_stats: ``True`` (or a floating dtype, default float16): record
        what the scale does to the scaled gradients in that compute dtype,
        ``jls.metrics(...)["underflow_fraction"]`` (the fraction of entries
        below its smallest normal, zeros included) and ``["headroom_bits"]``
        (``log2(dtype max / max |g|)``, ``-inf`` after a non-finite step);
        or a `jls.hooks.ScaleStats` (``every=n``: measure one step in ``n``).
      donated: deprecated and ignored (a DeprecationWarning; removed in the
        next release): the skip compiles without copies whether or not your
        step donates (``docs/performance.md``).

    Returns:
      ``LossScaling(...).gradient_transformation()``: an
      ``optax.GradientTransformationExtraArgs``; its state is described in
      `LossScaling`.

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
        warnings.warn(
            f"loss_scaling(donated={donated!r}) is deprecated and ignored: the "
            "skip compiles without copies whether or not the step donates. "
            "Remove the argument; it is removed in the next release of jls.",
            DeprecationWarning,
            stacklevel=2,
        )
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

    Equivalent to ``updates, opt_state = tx.update(grads, opt_state, params)``
    followed by ``optax.apply_updates(params, updates)``, with the same
    guarantees, but the skip decision wraps the inner update and the
    parameter update together: a skipped step returns ``params`` and the
    inner state untouched without computing anything, and a finite step costs
    one reduction over the gradients more than the plain optimizer. Donate
    ``params`` and ``opt_state`` to ``jit`` to update them in place.

    Args:
      tx: a transformation made by `loss_scaling` (not wrapped further), or
        a `LossScaling`.
      grads: the scaled gradients.
      opt_state: ``tx``'s state.
      params: the parameters (a whole model too: see
        `LossScaling.apply_gradients`).
      **extra_args: forwarded to the inner optimizer's ``update``.

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
