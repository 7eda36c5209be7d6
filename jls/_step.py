"""`train_step`: a loss function and a `loss_scaling` transformation, one call.

Accumulation pre-multiplies each micro-batch by a power of two at or below
``1 / k``, so the accumulator overflows only where the mean does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jls._average import local, mean, pow2_at_most_inverse, share, warn_partitioned
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
      aux: ``loss_fn``'s auxiliary output (stacked over micro-batches).
      nonfinite: whether the step's (last) gradients were not all finite.
      skipped: whether the step's update was dropped.
      loss_scale: the scale the step's (last) gradients were computed with.
      next_loss_scale: the scale for the next step.
      retries: how many times the gradients were recomputed (int32).
      nonfinite_loss: whether the loss itself was not finite.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**10))
      >>> step = jls.train_step(lambda p, x: jnp.sum(p * x), tx)
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


def _loss_and_aux(out: Any, has_aux: bool) -> tuple[Any, Any]:
    """``loss_fn``'s output as ``(loss, aux)``, the loss a floating scalar."""
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


def _gradient(loss_fn: Callable[..., Any], has_aux: bool, rest: Any) -> Callable:
    """``grad(trainable, scale, batch) -> (grads, (loss, aux))``, the loss scaled."""

    def scaled_loss(trainable, scale, *batch):
        loss, aux = _loss_and_aux(loss_fn(merge(trainable, rest), *batch), has_aux)
        loss = jnp.asarray(loss)
        wide = compute_dtype(loss.dtype)
        return loss.astype(wide) * scale.astype(wide), (loss, aux)

    def grad(trainable, scale, batch):
        return jax.grad(scaled_loss, has_aux=True)(trainable, scale, *batch)

    return grad


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


def _accumulate(grad: Callable, trainable: Any, scale: jax.Array, batch, k: int):
    """The mean gradient of ``k`` micro-batches, accumulated under one scale.

    Returns ``(grads, mean loss, stacked aux)``.
    """
    pre = pow2_at_most_inverse(k)

    def micro(acc, b):
        g, (loss, aux) = grad(trainable, scale, b)
        acc = jax.tree.map(
            lambda a, x: a + x.astype(a.dtype) * jnp.asarray(pre, a.dtype), acc, g
        )
        return acc, (jnp.asarray(loss, jnp.float32), aux)

    # The accumulator varies over the axes the gradients do (shard_map).
    zeros = jax.tree.map(
        lambda p: pvary(
            jnp.zeros(p.shape, compute_dtype(p.dtype)), sorted(varying_axes(p))
        ),
        trainable,
    )
    total, (losses, auxes) = lax.scan(micro, zeros, _split(tuple(batch), k))
    grads = jax.tree.map(
        lambda t, p: (t / jnp.asarray(k * pre, t.dtype)).astype(p.dtype),
        total,
        trainable,
    )
    return grads, jnp.mean(losses), auxes


def _scaled_grads(grad: Callable, trainable, scale, batch, k: int, average_over):
    """``(grads, loss, aux)`` of one attempt: accumulated, then averaged."""
    trainable, summed = local(trainable, average_over)
    shared = share(summed, average_over) if average_over else 1.0
    if shared != 1.0:  # jax sums float16 gradients over replicas (_average)
        scale = scale * jnp.float32(shared)
    if k == 1:
        grads, (loss, aux) = grad(trainable, scale, batch)
        loss = jnp.asarray(loss, jnp.float32)
    else:
        grads, loss, aux = _accumulate(grad, trainable, scale, batch, k)
    if average_over:
        grads, loss = mean(grads, loss, average_over, summed, shared)
    return grads, loss, aux


def _retried(scaler: Any, attempt: Callable, first: tuple, max_retries: int):
    """The last attempt's ``(loss_scale, grads, loss, aux, decision)``, and retries.

    A retry needs a valid scale that the rule would lower and a finite loss.
    """
    loss = first[2]

    def again(carry):
        loss_scale, _, _, _, _, retries = carry
        loss_scale = scaler.retry(loss_scale, retries + 1)
        return (loss_scale, *attempt(loss_scale), retries + 1)

    def worth_another(carry):
        loss_scale, _, _, _, decision, retries = carry
        lower = scaler.retry(loss_scale, retries + 1).scale < loss_scale.scale
        valid = scaler.in_range(loss_scale.scale)
        worth = lower & valid & jnp.isfinite(loss)
        return ~decision.finite & (retries < max_retries) & worth

    return lax.while_loop(worth_another, again, (*first, jnp.int32(0)))


def _make_step(config, loss_fn, has_aux, max_retries, k, average_over) -> Callable:
    """The pure step `train_step` returns, for validated arguments."""

    def step(params, opt_state, *batch):
        state = validate(config, opt_state, params)
        # Split once: only the floating arrays are differentiated and stepped.
        trainable, rest = split_inexact(params)
        grad = _gradient(loss_fn, has_aux, rest)
        if not average_over:
            warn_partitioned(trainable, batch)

        def attempt(loss_scale: LossScaleState):
            grads, loss, aux = _scaled_grads(
                grad, trainable, loss_scale.scale, batch, k, average_over
            )
            return grads, loss, aux, decide(config, grads, loss_scale)

        first = (state.loss_scale, *attempt(state.loss_scale))
        if max_retries:
            carry = _retried(config.scaler, attempt, first, max_retries)
        else:
            carry = (*first, jnp.int32(0))
        loss_scale, grads, loss, aux, decision, retries = carry
        state = state._replace(loss_scale=loss_scale)
        extra = {"loss": loss} if config.reads_loss else {}
        prepared = prepare(config, grads, state, extra)
        new, new_state = finish(
            config, grads, prepared, trainable, decision, fused=True, retries=retries
        )
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
        return merge(new, rest), new_state, out

    return step


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
      loss_fn: ``loss_fn(params, *batch) -> loss`` (or ``(loss, aux)``).
      tx: a transformation made by `jls.loss_scaling` (or a `jls.LossScaling`).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      max_retries: recompute overflowed gradients up to this many times at
        the backed-off scale; 0 (default) skips the step at once.
      accumulation_steps: micro-batches per batch (along the leading axis).
      average_over: the axis name (or names) to average gradients and loss over.

    Returns:
      ``step(params, opt_state, *batch) -> (params, opt_state, StepOutput)``.

    Raises:
      TypeError: if an argument has the wrong type, or ``has_aux`` is wrong.
      ValueError: if an argument is out of range, or a batch does not split.
      NameError: at trace time, if an ``average_over`` axis is not bound.

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
    return _make_step(
        config, loss_fn, has_aux, max_retries, accumulation_steps, average_over
    )
