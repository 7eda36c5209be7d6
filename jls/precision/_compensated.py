"""Low-precision parameters without a float32 copy: Kahan and stochastic rounding.

Training with bfloat16 (or float16) parameters and no float32 master copy
loses small updates: ``p + u`` rounds back to ``p`` once ``|u|`` is below
half of ``p``'s last place. Two optax-native remedies, each wrapping an
optimizer (inside or outside `jls.loss_scaling`):

* `compensated`: Kahan summation. The part of each update the parameter
  could not hold is kept in a buffer (optimizer state: an integer count of
  a fraction of the parameter's last place, int16 by default) and added to
  the next update.
* `stochastic_rounding`: the updated parameter is rounded up or down at
  random, with the probabilities that make the rounding unbiased.

Both return updates that `optax.apply_updates` (and the fused
`jls.apply_gradients`) land exactly on the rounded parameter: the update is
``new - p`` in float32 (the tests check the landing over dtypes and
exponent gaps). Kahan's lost part is at most half of the new parameter's
spacing, so it is stored relative to that spacing, to 16 bits (int16) or 8
(int8): a bfloat16 parameter with an int16 buffer holds its sum to 24
bits, as finely as a float32 copy would at every step size, for the 2
bytes a bfloat16 buffer would cost. (A buffer in the parameter's dtype
cannot add a step below its own last place to itself: in bfloat16 it
loses every step below about ``|p| * 2**-17``.) The
lost part is computed in float32: exact while ``p`` and ``new`` are within
about 13 binary orders of each other (float32's 24 bits against float16's
11). The work is elementwise and XLA fuses it into the optimizer's update.
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
        hold yet: an int16 (or int8) count of ``2**-16`` (``2**-8``) of the
        parameter's spacing (``None`` for non-floating leaves).
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


def _buffer_dtype(value: Any) -> np.dtype:
    for dtype in (np.dtype(np.int16), np.dtype(np.int8)):
        if value is not None and value is not True and value == dtype:
            return dtype
    raise ValueError(f"buffer_dtype must be 'int16' or 'int8', got {value!r}")


def _unit_exponent(new: jax.Array, dtype: Any, wide: Any) -> jax.Array:
    """``e`` with ``2**e`` the spacing of ``dtype`` just above ``|new|`` (int32).

    Clamped to the compute dtype's smallest normal exponent, so that
    ``2**-e`` and ``2**e`` are normal there (XLA:CPU flushes subnormals).
    """
    info = jnp.finfo(dtype)
    _, exponent = jnp.frexp(jnp.abs(new))  # |new| in [2**(x-1), 2**x)
    top = jnp.where(new == 0, info.minexp, jnp.maximum(exponent - 1, info.minexp))
    return jnp.maximum(top - info.nmant, jnp.finfo(wide).minexp).astype(jnp.int32)


def _buffer_value(k: Any, new: jax.Array, dtype: Any, wide: Any) -> jax.Array:
    """The compensation ``k`` holds beside the parameter ``new``, in ``wide``."""
    bits = np.dtype(k.dtype).itemsize * 8
    e = _unit_exponent(new, dtype, wide)
    frac = k.astype(wide) * np.asarray(2.0**-bits, wide)  # exact
    return frac * jnp.ldexp(jnp.ones((), wide), e)


def _units(lost: Any, new: Any, dtype: Any, wide: Any, bits: int) -> Any:
    """``lost`` in units of ``2**-bits`` of ``new``'s spacing, rounded (float)."""
    e = _unit_exponent(new, dtype, wide)
    scaled = lost * jnp.ldexp(jnp.ones((), wide), -e)  # exact: powers of two
    return jnp.round(scaled * np.asarray(2.0**bits, wide))


def _kahan(p: Any, u: Any, k: Any, buffer: Any) -> tuple[Any, Any]:
    """``(update, buffer)`` of one leaf: Kahan's sum in at least float32.

    Finite sums saturate at the dtype's largest value, as plain rounding
    does, so the buffer can never carry a finite run to inf and then nan.
    The buffer holds the lost part in units of ``2**-bits`` of the new
    parameter's spacing, rounded to nearest. The lost part is at most half
    of that spacing, which the buffer's largest count falls one unit short
    of: when a parameter that stayed has a lost part that rounds past it,
    the parameter moves one place toward it instead and the buffer keeps
    the rest (of the other sign), so steps too small to pass the half one
    at a time still carry it over (at most a unit is lost there).

    ``k`` may arrive in another dtype than ``buffer``: a checkpoint's buffer
    in the parameter's own dtype (the lost part itself), or a count of the
    other width; its value is carried over and the returned buffer is
    ``buffer``'s.
    """
    if not _floating(p) or u is None:
        return u, k
    p, u, k = _checked("compensated", p), jnp.asarray(u), jnp.asarray(k)
    wide = compute_dtype(p.dtype)
    bits = np.dtype(buffer).itemsize * 8
    top = np.asarray(2.0 ** (bits - 1) - 1, wide)
    p_wide = p.astype(wide)
    if jnp.issubdtype(k.dtype, jnp.inexact):  # the lost part itself
        held = jnp.where(jnp.isfinite(k), k, 0).astype(wide)
    else:
        held = _buffer_value(k, p_wide, p.dtype, wide)
    y = u.astype(wide) + held
    new = _saturated(p_wide + y, p.dtype).astype(p.dtype)
    units = _units(
        y - (new.astype(wide) - p_wide), new.astype(wide), p.dtype, wide, bits
    )
    # A parameter that stayed with the half (or more, saturated) to carry:
    # one place toward it. (One that moved keeps the other half, clipped.)
    toward = jnp.where(units > 0, jnp.inf, -jnp.inf).astype(p.dtype)
    after = jnp.nextafter(new, toward)
    carry = (jnp.abs(units) > top) & (new == p) & jnp.isfinite(after)
    new = jnp.where(carry, after, new)
    step = new.astype(wide) - p_wide
    units = _units(y - step, new.astype(wide), p.dtype, wide, bits)
    units = jnp.where(jnp.isfinite(units), jnp.clip(units, -top, top), 0)
    return step, units.astype(buffer)


def compensated(
    inner: optax.GradientTransformation, *, buffer_dtype: Any = "int16"
) -> optax.GradientTransformationExtraArgs:
    """Kahan-compensated parameter updates around ``inner``.

    Each parameter keeps a compensation buffer: the part of the updates that
    ``p + u`` rounded away. The next update adds it back, so small updates
    accumulate instead of vanishing. The lost part is at most half of the
    new parameter's spacing (its last place), so the buffer stores it as an
    integer count of ``2**-bits`` of that spacing: an int16 buffer (2 bytes
    per parameter, what a bfloat16 or float16 buffer costs) holds it to 16
    more bits, a bfloat16 parameter and its buffer together to float32's 24
    bits, at every step size (a buffer in the parameter's own dtype loses
    every update below about ``|p| * 2**-17`` in bfloat16: it cannot add
    them to itself). ``buffer_dtype="int8"`` costs 1 byte per parameter and
    holds 8 more bits. The returned
    update is ``new - p`` in float32 (the compute dtype, at least float32),
    where ``new`` is ``p + u + compensation`` rounded to the parameter's
    dtype: `optax.apply_updates` lands exactly on ``new`` for float16 and
    bfloat16 parameters. Inside `jls.loss_scaling` a skipped step leaves the
    buffer bitwise unchanged, like every other state.

    Args:
      inner: the optimizer whose updates are compensated (any optax
        transformation; extra arguments are forwarded).
      buffer_dtype: ``"int16"`` (default) or ``"int8"``: the buffer's
        dtype, and so its memory (2 or 1 bytes per parameter) and precision
        (16 or 8 bits below the parameter's last place).

    Returns:
      An optax transformation; its state is a ``CompensatedState``
      (``inner_state``, ``compensation``).

    Raises:
      ValueError: for a ``buffer_dtype`` other than int16 or int8.

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
    buffer = _buffer_dtype(buffer_dtype)

    def init(params: Any) -> CompensatedState:
        zeros = jax.tree.map(
            lambda p: jnp.zeros(jnp.shape(p), buffer) if _floating(p) else None,
            params,
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
        pairs = [
            _kahan(p, u, c, buffer) for p, u, c in zip(leaves, ups, comps, strict=True)
        ]
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
