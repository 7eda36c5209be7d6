"""`train_step`: a loss function and a `loss_scaling` transformation, one call.

The JAX form of MindSpore's ``TrainOneStepWithLossScaleCell``, Paddle's
``minimize`` and flax's ``DynamicScale.value_and_grad``: a pure function
``(params, opt_state, *batch) -> (params, opt_state, StepOutput)`` to wrap in
``jit`` (with donation). It scales the loss, differentiates, checks once,
and applies the fused update (`jls.apply_gradients`'s path). Two options
come from the seeds:

* ``max_retries`` (nnabla's ``DynamicLossScalingUpdater``): on overflow, back
  off and recompute the gradients inside the same jitted call
  (``lax.while_loop``, bounded), so no step is lost to a too-high scale;
  after ``max_retries`` the step is skipped as usual.
* ``accumulation_steps`` (nnabla's ``accum_grad``, Paddle): the batch is cut
  into micro-batches whose scaled gradients are summed in float32 under one
  scale (``lax.scan``); the check and the skip happen once per effective
  batch, and since the accumulator lives inside the call a non-finite
  micro-batch can never poison a later one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jls._scaling import compute_dtype
from jls._state import LossScaleState
from jls._transform import LossScalingState, update_of


class StepOutput(NamedTuple):
    """What a `train_step` call reports.

    Attributes:
      loss: the unscaled loss (float32; the mean over micro-batches).
      aux: ``loss_fn``'s auxiliary output (stacked over micro-batches), or
        ``None`` without ``has_aux``.
      overflowed: whether the step's gradients (after any retries) were not
        finite, so the update was skipped.
      loss_scale: the scale the step's (last) gradients were computed with.
      next_loss_scale: the scale for the next step.
      retries: how many times the gradients were recomputed (int32).

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**10))
      >>> step = jls.train_step(lambda p, x: jnp.sum(p * x), tx)
      >>> _, _, out = step(jnp.ones(2), tx.init(jnp.ones(2)), jnp.array([1.0, jnp.inf]))
      >>> bool(out.overflowed), float(out.loss_scale), float(out.next_loss_scale)
      (True, 1024.0, 512.0)
    """

    loss: jax.Array
    aux: Any
    overflowed: jax.Array
    loss_scale: jax.Array
    next_loss_scale: jax.Array
    retries: jax.Array


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


def train_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    *,
    has_aux: bool = False,
    max_retries: int = 0,
    accumulation_steps: int = 1,
) -> Callable[..., tuple[optax.Params, LossScalingState, StepOutput]]:
    """Makes a pure, jittable, loss-scaled train step.

    Args:
      loss_fn: ``loss_fn(params, *batch)`` returning a scalar loss, or
        ``(loss, aux)`` with ``has_aux``. Computed in any precision; jls
        scales it in float32.
      tx: a transformation made by `jls.loss_scaling`.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      max_retries: recompute the gradients up to this many times with the
        backed-off scale when they overflow (nnabla); 0 (default) skips the
        step at once.
      accumulation_steps: cut each batch into this many micro-batches along
        the leading axis and accumulate their gradients under one scale.

    Returns:
      ``step(params, opt_state, *batch) -> (params, opt_state, StepOutput)``.

    Raises:
      TypeError: if ``tx`` was not made by `jls.loss_scaling`.
      ValueError: if ``max_retries`` or ``accumulation_steps`` is out of range
        (or, at trace time, a batch does not split into micro-batches).

    Example:
      >>> import jax, jax.numpy as jnp, optax, jls
      >>> tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**10))
      >>> step = jax.jit(jls.train_step(lambda p, x: jnp.mean((p * x) ** 2), tx))
      >>> params = jnp.ones(3)
      >>> params, opt_state, out = step(params, tx.init(params), jnp.ones(3))
      >>> float(out.loss), bool(out.overflowed), float(out.loss_scale)
      (1.0, False, 1024.0)
    """
    update = update_of(tx)
    for name, value, low in (
        ("max_retries", max_retries, 0),
        ("accumulation_steps", accumulation_steps, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {loss_fn!r}")

    def split_out(out):
        if has_aux:
            loss, aux = out
            return loss, aux
        return out, None

    def scaled_grads(params, scale, batch):
        def f(p, *b):
            loss, aux = split_out(loss_fn(p, *b))
            loss = jnp.asarray(loss)
            wide = compute_dtype(loss.dtype)
            return loss.astype(wide) * scale.astype(wide), (loss, aux)

        if accumulation_steps == 1:
            grads, (loss, aux) = jax.grad(f, has_aux=True)(params, *batch)
            return grads, jnp.asarray(loss, jnp.float32), aux

        def micro(acc, b):
            g, (loss, aux) = jax.grad(f, has_aux=True)(params, *b)
            acc = jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, g)
            return acc, (jnp.asarray(loss, jnp.float32), aux)

        shapes = jax.eval_shape(lambda: jax.grad(f, has_aux=True)(params, *batch))[0]
        zeros = jax.tree.map(
            lambda s: jnp.zeros(s.shape, compute_dtype(s.dtype)), shapes
        )
        total, (losses, auxes) = lax.scan(
            micro, zeros, _split(tuple(batch), accumulation_steps)
        )
        k = accumulation_steps
        grads = jax.tree.map(lambda t, s: (t / k).astype(s.dtype), total, shapes)
        return grads, jnp.mean(losses), auxes

    def step(params, opt_state, *batch):
        state = update._state(opt_state)
        scaler = update.scaler

        def attempt(loss_scale: LossScaleState):
            grads, loss, aux = scaled_grads(params, loss_scale.scale, batch)
            return grads, loss, aux, update.grads_finite(grads, loss_scale)

        loss_scale = state.loss_scale
        grads, loss, aux, finite = attempt(loss_scale)
        retries = jnp.int32(0)
        if max_retries:

            def again(carry):
                loss_scale, _, _, _, _, retries = carry
                loss_scale = scaler.adjust(loss_scale, jnp.asarray(False))
                return (loss_scale, *attempt(loss_scale), retries + 1)

            carry = lax.while_loop(
                lambda c: ~c[4] & (c[5] < max_retries),
                again,
                (loss_scale, grads, loss, aux, finite, retries),
            )
            loss_scale, grads, loss, aux, finite, retries = carry
        state = state._replace(loss_scale=loss_scale)
        params, new_state = update.apply_fused(grads, state, params, finite)
        out = StepOutput(
            loss=loss,
            aux=aux,
            overflowed=~finite,
            loss_scale=loss_scale.scale,
            next_loss_scale=new_state.loss_scale.scale,
            retries=retries,
        )
        return params, new_state, out

    return step
