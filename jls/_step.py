"""`train_step`: a loss function and a `loss_scaling` transformation, one call.

A pure function ``(params, opt_state, *batch) -> (params, opt_state,
StepOutput)`` to wrap in ``jit`` (with donation). It scales the loss,
differentiates, checks once, and applies the fused update
(`jls.LossScaling.apply_gradients`). Two options:

* ``max_retries``: on overflow, back
  off and recompute the gradients inside the same jitted call
  (``lax.while_loop``, bounded), so no step is lost to a too-high scale;
  after ``max_retries`` the step is skipped as usual. A retry is an attempt,
  not a step: the scale rule advances as for a non-finite step, but the skip
  counters count the step once. A retry that could not change the outcome
  (the rule would not lower the scale: a static scaler, hysteresis still
  tolerating, ``backoff_interval`` not yet reached, the
  scale at ``min_scale``) is not made.
* ``accumulation_steps``: the batch is cut
  into micro-batches whose scaled gradients are accumulated in float32 under
  one scale (``lax.scan``); the check and the skip happen once per effective
  batch, and since the
  accumulator lives inside the call a non-finite micro-batch can never
  poison a later one. Each micro-batch gradient is multiplied by ``2**-e``,
  the power of two at or below ``1 / k``, before it is added (exact, unless
  the result is below the smallest normal float32), and the total is divided
  by ``k * 2**-e`` at the end: the accumulator stays below the float32
  maximum whenever the mean does, where summing first would overflow for
  finite gradients above ``float32_max / k``. An accumulated mean can be
  reported non-finite only when it lies within a factor ``1 + k * 2**-23``
  of the float32 maximum (the rounding of ``k`` additions).
* ``average_over``: data parallelism under ``pmap`` or ``shard_map``. The
  gradients (and the reported loss) are averaged over the named axes with
  ``lax.pmean`` before the check, as flax's ``DynamicScale.value_and_grad(...,
  axis_name=...)`` does; every replica then applies the same update. Under
  ``jit`` over sharded arrays the loss is already the global batch's and
  nothing is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jls._average import local, mean
from jls._compat import pvary, varying_axes
from jls._core import finish, prepare, validate
from jls._decision import decide
from jls._scaling import compute_dtype
from jls._state import LossScaleState
from jls._transformation import LossScaling, config_of
from jls._tree import merge, split_inexact
from jls._validate import axis_names, flag, integer


class StepOutput(NamedTuple):
    """What a `train_step` call reports.

    Attributes:
      loss: the unscaled loss (float32; the mean over micro-batches).
      aux: ``loss_fn``'s auxiliary output (stacked over micro-batches), or
        ``None`` without ``has_aux``.
      nonfinite: whether the step's gradients (after any retries) were not
        all finite (or its scale was outside the scaler's range).
      skipped: whether the step's update was dropped: ``nonfinite``, unless
        the scaler applies non-finite steps (``skip_nonfinite=False``).
      loss_scale: the scale the step's (last) gradients were computed with.
      next_loss_scale: the scale for the next step.
      retries: how many times the gradients were recomputed (int32).
      nonfinite_loss: whether the loss itself was not finite: the step was
        skipped with the scale held, and not retried (no scale helps).

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**10))
      >>> step = jls.train_step(lambda p, x: jnp.sum(p * x), tx)
      >>> _, _, out = step(jnp.ones(2), tx.init(jnp.ones(2)), jnp.array([1.0, jnp.inf]))
      >>> # The loss itself is inf: skipped, the scale kept (no scale helps).
      >>> bool(out.skipped), bool(out.nonfinite_loss), float(out.next_loss_scale)
      (True, True, 1024.0)
      >>> # A gradient that overflows at this scale (the loss is finite): backed off.
      >>> _, _, out = step(jnp.ones(2), tx.init(jnp.ones(2)), jnp.array([1.0, 1e36]))
      >>> bool(out.skipped), bool(out.nonfinite_loss), float(out.next_loss_scale)
      (True, False, 512.0)
    """

    loss: jax.Array
    aux: Any
    nonfinite: jax.Array
    skipped: jax.Array
    loss_scale: jax.Array
    next_loss_scale: jax.Array
    retries: jax.Array
    nonfinite_loss: jax.Array


def _split(batch: tuple, k: int) -> tuple:
    def cut(x):
        x = jnp.asarray(x)
        if x.ndim == 0 or x.shape[0] % k:
            raise ValueError(
                f"accumulation_steps={k} must divide every batch array's leading "
                f"dimension, got shape {x.shape}"
            )
        return x.reshape((k, x.shape[0] // k) + x.shape[1:])

    return jax.tree.map(cut, batch)


def _pow2_at_most_inverse(k: int) -> float:
    """``2**-e`` for the smallest ``e`` with ``2**e >= k``."""
    return 2.0 ** -((k - 1).bit_length())


def train_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    *,
    has_aux: bool = False,
    max_retries: int = 0,
    accumulation_steps: int = 1,
    average_over: str | tuple[str, ...] | None = None,
) -> Callable[..., tuple[optax.Params, optax.OptState, StepOutput]]:
    """Makes a pure, jittable, loss-scaled train step.

    Args:
      loss_fn: ``loss_fn(params, *batch)`` returning a scalar loss, or
        ``(loss, aux)`` with ``has_aux``. Computed in any precision; jls
        scales it in float32.
      tx: a transformation made by `jls.loss_scaling` (or a `jls.LossScaling`).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      max_retries: recompute the gradients up to this many times with the
        backed-off scale when they overflow; 0 (default) skips the
        step at once. Retries are reported in ``StepOutput.retries`` and
        ``jls.metrics(opt_state)["retries"]``, and are not counted as steps.
      accumulation_steps: cut each batch into this many micro-batches along
        the leading axis and accumulate their gradients under one scale.
      average_over: the ``pmap``/``shard_map`` axis name (or names) to
        average the gradients over (``lax.pmean``, after accumulation, before
        the check), for data-parallel training: each replica computes the
        gradients of its shard of the batch and all apply their mean, so
        replicas that start equal stay bitwise equal. ``StepOutput.loss`` is
        averaged too; ``aux`` is each replica's own. The transformation's
        ``axis_name`` only makes the replicas agree on the skip and the
        scale: without ``average_over`` (or a ``lax.pmean`` of your own) each
        replica would step with its own gradients. Not needed under ``jit``
        over sharded arrays, where the loss is already the global batch's.

    Returns:
      ``step(params, opt_state, *batch) -> (params, opt_state, StepOutput)``.

    Raises:
      TypeError: if ``tx`` was not made by `jls.loss_scaling`, ``loss_fn`` is
        not callable, ``has_aux`` is not a bool or (at trace time) does not
        match what ``loss_fn`` returns.
      ValueError: if ``max_retries`` or ``accumulation_steps`` is out of range
        (or, at trace time, a batch does not split into micro-batches).
      NameError: at trace time, if an ``average_over`` axis is not bound (the
        step is not run under ``pmap``/``shard_map`` with that axis).

    Example:
      >>> import jax, jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**10))
      >>> step = jax.jit(jls.train_step(lambda p, x: jnp.mean((p * x) ** 2), tx))
      >>> params = jnp.ones(3)
      >>> params, opt_state, out = step(params, tx.init(params), jnp.ones(3))
      >>> float(out.loss), bool(out.skipped), float(out.loss_scale)
      (1.0, False, 1024.0)
    """
    if isinstance(loss_fn, (optax.GradientTransformation, LossScaling)):
        raise TypeError(
            "train_step(loss_fn, tx): loss_fn is an optax transformation; the "
            "arguments are swapped"
        )
    config = config_of(tx)
    has_aux = flag("has_aux", has_aux)
    max_retries = integer("max_retries", max_retries, 0)
    accumulation_steps = integer("accumulation_steps", accumulation_steps, 1)
    average_over = axis_names("average_over", average_over)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")
    scaler = config.scaler
    k = accumulation_steps

    def split_out(out):
        if has_aux:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise TypeError(
                    "has_aux=True: loss_fn must return a (loss, aux) pair, got "
                    f"{type(out).__name__}: {out!r:.200}"
                )
            loss, aux = out
        else:
            loss, aux = out, None
        if isinstance(loss, (tuple, list)) or jnp.shape(loss) != ():
            hint = " (pass has_aux=True for (loss, aux))" if not has_aux else ""
            raise TypeError(
                f"loss_fn must return a scalar loss{hint}; has_aux={has_aux} and "
                f"it returned {type(loss).__name__}: {loss!r:.200}"
            )
        dtype = jnp.result_type(loss)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"loss_fn must return a floating loss, got dtype {dtype}: a "
                "bool or integer loss has no gradient (jax would differentiate a "
                "float32 copy of it and every gradient would be 0). Compute the "
                "loss in floating point, e.g. jnp.mean(errors.astype(jnp.float32))"
            )
        return loss, aux

    def scaled_grads(trainable, rest, scale, batch):
        def f(p, *b):
            loss, aux = split_out(loss_fn(p, *b))
            loss = jnp.asarray(loss)
            wide = compute_dtype(loss.dtype)
            return loss.astype(wide) * scale.astype(wide), (loss, aux)

        trainable, summed = local(trainable, average_over)

        def grad(b):
            def g(t, *b):
                return f(merge(t, rest), *b)

            return jax.grad(g, has_aux=True)(trainable, *b)

        if k == 1:
            grads, (loss, aux) = grad(batch)
            return (*averaged(grads, jnp.asarray(loss, jnp.float32), summed), aux)

        pre = _pow2_at_most_inverse(k)

        def micro(acc, b):
            g, (loss, aux) = grad(b)
            acc = jax.tree.map(
                lambda a, x: a + x.astype(a.dtype) * jnp.asarray(pre, a.dtype), acc, g
            )
            return acc, (jnp.asarray(loss, jnp.float32), aux)

        micro_batches = _split(tuple(batch), k)
        # The accumulator varies over the axes the gradients do (shard_map).
        zeros = jax.tree.map(
            lambda p: pvary(
                jnp.zeros(p.shape, compute_dtype(p.dtype)), sorted(varying_axes(p))
            ),
            trainable,
        )
        total, (losses, auxes) = lax.scan(micro, zeros, micro_batches)
        # total = sum(g * pre): divide by k * pre (exact, in (1/2, 1]).
        grads = jax.tree.map(
            lambda t, p: (t / jnp.asarray(k * pre, t.dtype)).astype(p.dtype),
            total,
            trainable,
        )
        return (*averaged(grads, jnp.mean(losses), summed), auxes)

    def averaged(grads, loss, summed):
        if not average_over:
            return grads, loss
        return mean(grads, loss, average_over, summed)

    def step(params, opt_state, *batch):
        state = validate(config, opt_state, params)
        # Split once: the floating arrays are differentiated and stepped; a
        # whole model (an equinox Module) also holds functions, numbers and
        # integer arrays.
        trainable, rest = split_inexact(params)

        def attempt(loss_scale: LossScaleState):
            grads, loss, aux = scaled_grads(trainable, rest, loss_scale.scale, batch)
            return grads, loss, aux, decide(config, grads, loss_scale)

        loss_scale = state.loss_scale
        grads, loss, aux, decision = attempt(loss_scale)
        retries = jnp.int32(0)
        if max_retries:

            def again(carry):
                loss_scale, _, _, _, _, retries = carry
                loss_scale = scaler.retry(loss_scale, retries + 1)
                return (loss_scale, *attempt(loss_scale), retries + 1)

            def worth_another(carry):
                loss_scale, _, _, _, decision, retries = carry
                # A retry needs a valid scale (an out-of-range state is
                # dropped, not retried) that the rule would lower.
                lower = scaler.retry(loss_scale, retries + 1).scale < loss_scale.scale
                valid = scaler.in_range(loss_scale.scale)
                # A non-finite loss is not the scale's fault: no retry.
                worth = lower & valid & jnp.isfinite(loss)
                return ~decision.finite & (retries < max_retries) & worth

            carry = lax.while_loop(
                worth_another,
                again,
                (loss_scale, grads, loss, aux, decision, retries),
            )
            loss_scale, grads, loss, aux, decision, retries = carry
        state = state._replace(loss_scale=loss_scale)
        extra = {"loss": loss} if config.reads_loss else {}
        prepared = prepare(config, grads, state, extra)
        new, new_state = finish(
            config, grads, prepared, trainable, decision, fused=True, retries=retries
        )
        params = merge(new, rest)
        out = StepOutput(
            loss=loss,
            aux=aux,
            nonfinite=~decision.finite,
            skipped=new_state.loss_scale.consecutive_skips > 0,
            loss_scale=loss_scale.scale,
            next_loss_scale=new_state.loss_scale.scale,
            retries=retries,
            nonfinite_loss=~jnp.isfinite(loss),
        )
        return params, new_state, out

    return step
