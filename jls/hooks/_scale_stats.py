"""What the scale does to the gradients: underflow and headroom, each step."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jls._finite import inexact_leaves, is_complex, one_reduction_is_safe
from jls._scaling import compute_dtype
from jls._shards import global_rows, shard_axes
from jls._tree import plain
from jls._validate import integer
from jls.hooks._hooks import Hook, StepInfo


class ScaleStatsState(NamedTuple):
    """The latest measured statistics (float32), and ``phase`` (0: measure next)."""

    underflow_fraction: jax.Array
    headroom_bits: jax.Array
    phase: jax.Array

    def metrics(self) -> dict[str, Any]:
        """``underflow_fraction`` and ``headroom_bits``."""
        return {
            "underflow_fraction": plain(self.underflow_fraction),
            "headroom_bits": plain(self.headroom_bits),
        }


def _largest_part(x: jax.Array) -> jax.Array:
    return jnp.maximum(jnp.abs(jnp.real(x)), jnp.abs(jnp.imag(x)))


def _largest_and_count(x: Any, y: Any) -> tuple[Any, Any]:
    # One function for every call: lax.reduce caches its computation by it.
    return jnp.maximum(x[0], y[0]), x[1] + y[1]


def _reduce(a: jax.Array, small: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(max(a), sum(small))`` in one reduction (two where ``a`` may be sharded)."""
    if not one_reduction_is_safe(a):
        return jnp.max(a), jnp.sum(small, dtype=jnp.int32)
    dims = tuple(range(a.ndim))
    init = (jnp.zeros((), a.dtype), jnp.int32(0))
    high, count = lax.reduce((a, small), init, _largest_and_count, dims)
    return high, count


@dataclasses.dataclass(frozen=True)
class ScaleStats(Hook):
    """Records what the scale does to the scaled gradients, in a compute dtype.

    Records ``underflow_fraction`` (entries below the smallest normal) and
    ``headroom_bits``, ``log2(dtype max / max |g|)`` (docs/scalers.md).

    Attributes:
      dtype: the floating dtype judged against, of at most 32 bits (float16).
      every: measure every ``every``-th call (default 1), holding in between.

    Example:
      >>> import jax.numpy as jnp, optax, jls
      >>> stats = jls.hooks.ScaleStats(every=2)
      >>> tx = jls.loss_scaling(optax.sgd(0.1), jls.no_scale(), scale_stats=stats)
      >>> params = {"w": jnp.ones(4)}
      >>> state = tx.init(params)
      >>> for g in (1e-6, 1.0, 1.0):  # measured, held, measured
      ...     _, state = tx.update({"w": jnp.full(4, g)}, state, params)
      ...     print(float(jls.metrics(state)["underflow_fraction"]))
      1.0
      1.0
      0.0
    """

    dtype: Any = "float16"
    every: int = 1
    name = "scale_stats"

    def __post_init__(self) -> None:
        object.__setattr__(self, "every", integer("every", self.every, 1))
        if self.dtype is None:  # np.dtype(None) would be float64
            raise TypeError("scale_stats must be True or a floating dtype, got None")
        try:
            dtype = np.dtype(self.dtype)
        except TypeError as err:
            raise TypeError(
                f"scale_stats must be True or a floating dtype, got {self.dtype!r}"
            ) from err
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"scale_stats must be True or a floating dtype, got {self.dtype!r}"
            )
        if dtype.itemsize > 4 or dtype.name == "float8_e8m0fnu":
            raise TypeError(
                "scale_stats judges the gradients against a compute dtype of at "
                f"most 32 bits that holds zero, got {dtype.name}"
            )
        object.__setattr__(self, "dtype", dtype)

    def init(self, params: Any) -> ScaleStatsState:
        del params
        return ScaleStatsState(jnp.float32(0), jnp.float32(0), jnp.int32(0))

    def update(self, state: Any, info: StepInfo, vetoed: Any) -> ScaleStatsState:
        del vetoed
        if self.every == 1:
            return ScaleStatsState(*self._measure(info), state.phase)
        fraction, bits = lax.cond(
            state.phase == 0,
            lambda: self._measure(info),
            lambda: (state.underflow_fraction, state.headroom_bits),
        )
        return ScaleStatsState(fraction, bits, (state.phase + 1) % self.every)

    def _measure(self, info: StepInfo) -> tuple[jax.Array, jax.Array]:
        """This step's ``(underflow_fraction, headroom_bits)``."""
        info_ = jnp.finfo(self.dtype)
        shards = shard_axes(info.grads, info.axis_name, "ScaleStats")
        rows, varying = [], []
        for leaf, axes in zip(jax.tree.leaves(info.grads), shards, strict=True):
            x = next(iter(inexact_leaves(leaf)), None)
            if x is None or not x.size:
                continue
            wide = compute_dtype(jnp.real(x).dtype)
            # A complex entry's largest component: each overflows on its own.
            a = jnp.abs(x) if not is_complex(x) else _largest_part(x)
            a = a.astype(wide)
            tiny, top = np.asarray(info_.tiny, wide), np.asarray(info_.max, wide)
            h, c = _reduce(a, (a < tiny).astype(jnp.int32))
            # Bits short of the top, in the leaf's width: the largest is kept.
            short = (jnp.log2(h) - jnp.log2(top)).astype(jnp.float32)
            f32 = jnp.float32
            rows.append(jnp.stack([c.astype(f32), f32(x.size), short]))
            varying.append(axes)
        count, size = jnp.float32(0), jnp.float32(0)
        bits = jnp.float32(jnp.inf)
        for c, n, short in global_rows(rows, varying, added=2):
            bits = jnp.minimum(bits, -short)
            count, size = count + c, size + n
        fraction = jnp.where(size > 0, count / jnp.maximum(size, 1), 0)
        bits = jnp.where(info.finite, bits, -jnp.inf)
        return fraction.astype(jnp.float32), bits.astype(jnp.float32)
