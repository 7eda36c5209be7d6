"""Low-precision parameters without a float32 copy: Kahan and stochastic rounding.

Both wrap any optimizer (inside or outside `jls.loss_scaling`) and return the
update ``new - p`` in float32, which `optax.apply_updates` lands exactly on
``new``. ``docs/howto/low_precision_params.md`` compares them.
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
      compensation: per parameter, what it could not hold yet.
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
    """``e``: ``2**e`` is ``dtype``'s spacing above ``|new|``, normal in ``wide``."""
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

    Finite sums saturate at the dtype's largest value. ``k`` may be a count of
    the other width or the lost part itself (an older checkpoint's float buffer).
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
    # A parameter that stayed with half a place (or more) to carry: one place.
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

    Each parameter keeps what ``p + u`` rounded away, as an integer count of a
    fraction of its last place, and the next update adds it back.

    Args:
      inner: the optimizer whose updates are compensated.
      buffer_dtype: ``"int16"`` (default) or ``"int8"`` (8 bits, 1 byte).

    Returns:
      An optax transformation; its state is a ``CompensatedState``.

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

    Finite values saturate at ``dtype``'s largest; inf and nan pass through.
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


def _rounded(p: Any, u: Any, key: jax.Array, i: int) -> Any:
    """One leaf's stochastically rounded update (leaf ``i`` folds in ``i``)."""
    if not _floating(p) or u is None:
        return u
    p = _checked("stochastic_rounding", p)
    if np.dtype(p.dtype).itemsize >= 4:
        return u
    wide = compute_dtype(p.dtype)
    x = p.astype(wide) + jnp.asarray(u).astype(wide)
    new = round_stochastically(x, p.dtype, jax.random.fold_in(key, i))
    return new.astype(wide) - p.astype(wide)


def stochastic_rounding(
    inner: optax.GradientTransformation, *, seed: int = 0
) -> optax.GradientTransformationExtraArgs:
    """Stochastically rounded parameter updates around ``inner``.

    ``p + u`` is computed in float32 and rounded to the parameter's dtype up
    or down at random, unbiased (float32 parameters take ``inner``'s update).
    The key is ``fold_in(key(seed), count)`` or ``update``'s ``key=``.

    Args:
      inner: the optimizer whose updated parameters are rounded.
      seed: the default key's seed.

    Returns:
      An optax transformation; its state is a ``StochasticRoundingState``.

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
        out = [
            _rounded(p, u, key, i)
            for i, (p, u) in enumerate(zip(leaves, ups, strict=True))
        ]
        count = jnp.asarray(optax.safe_increment(state.count))
        return jax.tree.unflatten(treedef, out), StochasticRoundingState(
            inner_state, count
        )

    return optax.GradientTransformationExtraArgs(
        init, cast(optax.TransformUpdateExtraArgsFn, update)
    )
