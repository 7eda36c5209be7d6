"""Low-precision parameters without a float32 copy: Kahan and stochastic rounding.

Training with bfloat16 (or float16) parameters and no float32 master copy
loses small updates: ``p + u`` rounds back to ``p`` once ``|u|`` is below
half of ``p``'s last place. Two optax-native remedies, each wrapping an
optimizer (inside or outside `jls.loss_scaling`):

* `compensated`: Kahan summation. The part of each update the parameter
  could not hold is kept in a buffer (optimizer state, in the parameters'
  dtype) and added to the next update.
* `stochastic_rounding`: the updated parameter is rounded up or down at
  random, with the probabilities that make the rounding unbiased.

Both return updates that `optax.apply_updates` (and the fused
`jls.apply_gradients`) land exactly on the rounded parameter: the update is
``new - p`` in float32 (the tests check the landing over dtypes and
exponent gaps). Kahan's buffer holds the lost part as float32 computes it:
exact while ``p`` and ``new`` are within about 13 binary orders of each
other (float32's 24 bits against float16's 11); past that, and below the
buffer dtype's smallest subnormal (2**-25 in float16), what is lost stays
lost. The work is elementwise and XLA fuses it into the
optimizer's update: no extra pass over the parameters.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jls._inner import checked_inner
from jls._scaling import compute_dtype


class CompensatedState(NamedTuple):
    """`compensated`'s state.

    Attributes:
      inner_state: the wrapped optimizer's state.
      compensation: per parameter, the part of the updates it could not
        hold yet, in the parameter's dtype.
    """

    inner_state: Any
    compensation: Any


class StochasticRoundingState(NamedTuple):
    """`stochastic_rounding`'s state.

    Attributes:
      inner_state: the wrapped optimizer's state.
      count: int32, the updates made (the default key is derived from it).
    """

    inner_state: Any
    count: jax.Array


def _needs_params(name: str, params: Any) -> None:
    if params is None:
        raise TypeError(
            f"jls.{name} needs the parameters: call update(updates, state, params)"
        )


def _floating(x: Any) -> bool:
    return x is not None and jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)


def _checked(name: str, p: Any) -> jax.Array:
    """``p`` as an array; a ``TypeError`` for fp8 (no implicit promotion)."""
    p = jnp.asarray(p)
    if jnp.issubdtype(p.dtype, jnp.floating) and np.dtype(p.dtype).itemsize < 2:
        raise TypeError(
            f"jls.{name} takes float16, bfloat16 and wider parameters, got a "
            f"{p.dtype} leaf: an fp8 parameter cannot take a float32 update "
            "(JAX defines no promotion); keep it out of the wrapped tree "
            "(optax.masked)"
        )
    return p


def _saturated(x: jax.Array, dtype: Any) -> jax.Array:
    """Finite ``x`` clipped to ``dtype``'s finite range (inf and nan kept)."""
    top = jnp.asarray(jnp.finfo(dtype).max, x.dtype)
    return jnp.where(jnp.isfinite(x), jnp.clip(x, -top, top), x)


def _kahan(p: Any, u: Any, c: Any) -> tuple[Any, Any]:
    """``(update, compensation)`` of one leaf: Kahan's sum in at least float32.

    Finite sums saturate at the dtype's largest value, as plain rounding
    does, so the buffer can never carry a finite run to inf and then nan.
    """
    if not _floating(p) or u is None:
        return u, c
    p, u, c = _checked("compensated", p), jnp.asarray(u), jnp.asarray(c)
    wide = compute_dtype(p.dtype)
    y = u.astype(wide) + c.astype(wide)
    new = _saturated(p.astype(wide) + y, p.dtype).astype(p.dtype)
    step = new.astype(wide) - p.astype(wide)
    return step, _saturated(y - step, p.dtype).astype(p.dtype)


def compensated(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
    """Kahan-compensated parameter updates around ``inner``.

    Each parameter keeps a compensation buffer (in its own dtype): the part
    of the updates that ``p + u`` rounded away. The next update adds it
    back, so small updates accumulate instead of vanishing. The returned
    update is ``new - p`` in float32 (the compute dtype, at least float32),
    where ``new`` is ``p + u + compensation`` rounded to the parameter's
    dtype: `optax.apply_updates` lands exactly on ``new`` for float16 and
    bfloat16 parameters. Inside `jls.loss_scaling` a skipped step leaves the
    buffer bitwise unchanged, like every other state.

    Args:
      inner: the optimizer whose updates are compensated (any optax
        transformation; extra arguments are forwarded).

    Returns:
      An optax transformation; its state is a ``CompensatedState``
      (``inner_state``, ``compensation``).

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.precision.compensated(optax.sgd(1e-3))
      >>> p = jnp.ones(2, jnp.bfloat16)
      >>> s = tx.init(p)
      >>> for _ in range(100):
      ...     u, s = tx.update(jnp.ones(2, jnp.bfloat16), s, p)
      ...     p = optax.apply_updates(p, u)
      >>> p  # 0.9 to bfloat16's nearest; plain bfloat16 would stay at 1
      Array([0.898438, 0.898438], dtype=bfloat16)
    """
    inner = checked_inner(inner)

    def init(params: Any) -> CompensatedState:
        zeros = jax.tree.map(
            lambda p: jnp.zeros_like(p) if _floating(p) else None, params
        )
        return CompensatedState(inner.init(params), zeros)

    def update(
        updates: Any, state: CompensatedState, params: Any = None, **extra: Any
    ) -> tuple[Any, CompensatedState]:
        _needs_params("compensated", params)
        updates, inner_state = inner.update(updates, state.inner_state, params, **extra)
        leaves, treedef = jax.tree.flatten(params, is_leaf=lambda x: x is None)
        ups = treedef.flatten_up_to(updates)
        comps = treedef.flatten_up_to(state.compensation)
        pairs = [_kahan(p, u, c) for p, u, c in zip(leaves, ups, comps, strict=True)]
        steps = jax.tree.unflatten(treedef, [s for s, _ in pairs])
        comp = jax.tree.unflatten(treedef, [c for _, c in pairs])
        return steps, CompensatedState(inner_state, comp)

    return optax.GradientTransformationExtraArgs(
        init, cast(optax.TransformUpdateExtraArgsFn, update)
    )


def round_stochastically(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
    """``x`` (float32) rounded to ``dtype``, up or down at random, unbiased.

    A value ``dtype`` holds stays as it is; otherwise it becomes one of its
    two neighbours ``lo < x < hi`` in ``dtype``, ``hi`` with probability
    ``(x - lo) / (hi - lo)``. Past ``dtype``'s largest finite value (either
    sign) it saturates there; inf and nan pass through. For float16,
    bfloat16 and wider dtypes (fp8 formats without inf are refused by
    `stochastic_rounding`).
    """
    near = x.astype(dtype)
    lo = jnp.where(near.astype(x.dtype) > x, jnp.nextafter(near, -jnp.inf), near)
    top = jnp.asarray(jnp.finfo(dtype).max, dtype)
    lo = jnp.clip(lo, -top, top)  # below -max: -max (saturates), not -inf
    hi = jnp.nextafter(lo, jnp.inf)
    lo_w, hi_w = lo.astype(x.dtype), hi.astype(x.dtype)
    prob = (x - lo_w) / (hi_w - lo_w)
    draw = jax.random.uniform(key, x.shape, x.dtype)
    out = jnp.where(draw < prob, hi, lo)
    return jnp.where(jnp.isfinite(x), out, near)


def stochastic_rounding(
    inner: optax.GradientTransformation, *, seed: int = 0
) -> optax.GradientTransformationExtraArgs:
    """Stochastically rounded parameter updates around ``inner``.

    ``p + u`` is computed in float32 and rounded to the parameter's dtype up
    or down at random (unbiased: ``hi`` with probability
    ``(x - lo) / (hi - lo)``), so small updates move the
    parameter in expectation instead of vanishing. The returned update is
    ``new - p`` in float32, which `optax.apply_updates` lands on exactly.
    float32 and wider parameters are updated as ``inner`` says.

    The randomness is reproducible: each step's key is
    ``jax.random.fold_in(jax.random.key(seed), count)`` (``count`` the
    updates made, in the state), or the key passed as ``key=`` to
    ``update`` (forwarded by `jls.loss_scaling` and `jls.apply_gradients`);
    each leaf folds in its index. Replicas with the same state, gradients
    and key round identically. Inside `jls.loss_scaling` a skipped step
    leaves the count unchanged, so the next step draws the key the skipped
    one would have.

    Args:
      inner: the optimizer whose updated parameters are rounded.
      seed: the default key's seed.

    Returns:
      An optax transformation; its state is a ``StochasticRoundingState``
      (``inner_state``, ``count``).

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> tx = jls.precision.stochastic_rounding(optax.sgd(1e-3))
      >>> p = jnp.ones(1000, jnp.bfloat16)
      >>> s = tx.init(p)
      >>> u, s = tx.update(jnp.ones(1000, jnp.bfloat16), s, p)
      >>> p = optax.apply_updates(p, u)  # each entry 1 or 1 - 2**-8
      >>> bool(jnp.all((p == 1) | (p == 1 - 2**-8)))
      True
    """
    inner = checked_inner(inner)
    seed = int(seed)

    def init(params: Any) -> StochasticRoundingState:
        return StochasticRoundingState(inner.init(params), jnp.zeros((), jnp.int32))

    def update(
        updates: Any,
        state: StochasticRoundingState,
        params: Any = None,
        *,
        key: Any = None,
        **extra: Any,
    ) -> tuple[Any, StochasticRoundingState]:
        _needs_params("stochastic_rounding", params)
        updates, inner_state = inner.update(updates, state.inner_state, params, **extra)
        if key is None:
            key = jax.random.fold_in(jax.random.key(seed), state.count)
        leaves, treedef = jax.tree.flatten(params, is_leaf=lambda x: x is None)
        ups = treedef.flatten_up_to(updates)
        out = []
        for i, (p, u) in enumerate(zip(leaves, ups, strict=True)):
            if not _floating(p) or u is None:
                out.append(u)
                continue
            p = _checked("stochastic_rounding", p)
            if np.dtype(p.dtype).itemsize >= 4:
                out.append(u)
                continue
            wide = compute_dtype(p.dtype)
            x = p.astype(wide) + jnp.asarray(u).astype(wide)
            new = round_stochastically(x, p.dtype, jax.random.fold_in(key, i))
            out.append(new.astype(wide) - p.astype(wide))
        count = jnp.asarray(optax.safe_increment(state.count))
        return jax.tree.unflatten(treedef, out), StochasticRoundingState(
            inner_state, count
        )

    return optax.GradientTransformationExtraArgs(
        init, cast(optax.TransformUpdateExtraArgsFn, update)
    )
