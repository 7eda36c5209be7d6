"""A seeded fault-injection soak of a jls step, checked every step.

Each configuration (a scaler and an inner optimizer) is run for many steps on
both paths, ``tx.update`` + ``optax.apply_updates`` and `jls.apply_gradients`.
The scaled gradients are made on device inside the step's own ``jit`` (a
``lax.scan`` over chunks of steps) by ops XLA fuses into reductions (sums of
products, ``a * c + b`` with traced scalars), from a seeded PRNG that injects,
per leaf and step, nan, +inf, -inf, values near the dtype's maximum, values
that overflow only once unscaled at a scale below 1, products that overflow
and an infinite factor, in regimes from calm to stormy.

Every step's gradient arrays come back from the scan, and on the host an
independent model decides what the step should have done: the exact
finiteness of the unscaled gradients (numpy, not jls), the scale rule of
``tests/reference.py``'s `RefScaler`, and the counters. The step's own
outputs, recorded inside the body, are checked against it: the decision
(``jls.metrics``), the scale (bitwise) and growth count, every counter, that
a dropped step left the parameters and the inner state bitwise unchanged
(and returned ``-0.0`` updates) with no nan or inf in any state leaf, that
an applied step matches the plain inner optimizer run on the
reference-unscaled gradients (to rounding: XLA may contract the two
differently), and that the scale stays finite and in
``[min_scale, max_scale]``.

The parameters are float32 and bfloat16, the gradients float32, float16 and
bfloat16. An applied step whose finite but huge gradient overflows the inner
optimizer itself (Adam's ``g**2``) is not jls's doing: the harness then
restores the parameters and inner state to their initial values (and counts
it), so every step starts from a finite state.

Run it with ``python tests/soak.py --steps 20000``; ``tests/test_soak.py`` is
the short CI version.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
import zlib
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from reference import RefScaler

import jls
from jls import LossScalingState, presets
from jls._dynamic import DynamicScale
from jls._measured import MeasuredScale

PATHS = ("update", "apply_gradients")

# Injected fault kinds, per leaf and step ("clean": none).
KINDS = (
    "clean",
    "nan",
    "+inf",
    "-inf",
    "huge",  # +-dtype_max * 2**-k: finite; overflows once unscaled at scale < 1
    "unscaled_ovf",  # +-dtype_max * scale * (1 + a few ulps): the boundary
    "overflow",  # the producer's products overflow the dtype (some elements)
    "inf_factor",  # the producer's traced scalar factor is inf
)
_CLEAN, _NAN, _PINF, _NINF, _HUGE, _UNSC, _OVF, _INFC = range(len(KINDS))
# Relative weights of the fault kinds (index 0, clean, is never drawn).
_BAD_WEIGHTS = (0.0, 2.0, 1.0, 1.0, 3.0, 3.0, 3.0, 1.0)
_INJECTED = (_NAN, _PINF, _NINF, _HUGE, _UNSC)  # placed at masked elements

# Regimes of the per-leaf fault probability, a Markov chain over the steps:
# calm (long, so slow growth intervals are reached), rare, moderate, stormy
# and all-bad (long back-off runs down to min_scale).
_P_BAD = (0.0, 0.003, 0.03, 0.25, 0.9)
_STAY = (0.9997, 0.995, 0.99, 0.98, 0.97)
_FIRST_REGIME = 2

# The clean unscaled gradients are normal values times 2**e, e uniform in
# this range, so the scaled ones span tiny (underflowing in float16) to huge
# (overflowing float16 at the larger scales).
_LOG2_CLEAN = (-30.0, 3.0)


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One parameter leaf and how its scaled gradient is produced."""

    name: str
    shape: tuple[int, ...]
    param_dtype: Any
    grad_dtype: Any
    # "contract": sum_k (x * c)[i, k] * y[k, j] in float32 (overflowing
    # partial sums); "colsum": sum_i x[i, j] * w[i, j] * c in float32;
    # "outer": u[i] * v[j] * c in float32; "native": a * c + b computed in
    # the gradient's own (16-bit) dtype.
    producer: str


LEAVES = (
    _Leaf("dense/kernel", (8, 16), jnp.float32, jnp.float32, "contract"),
    _Leaf("dense/bias", (16,), jnp.float32, jnp.float16, "colsum"),
    _Leaf("embed/table", (4, 8), jnp.bfloat16, jnp.bfloat16, "outer"),
    _Leaf("norm/scale", (24,), jnp.float32, jnp.float16, "native"),
    _Leaf("head/w", (3, 5, 2), jnp.bfloat16, jnp.bfloat16, "native"),
)


# The CI test's smaller tree: one float32 gradient from a contraction, one
# float16 from a float32 column sum, one bfloat16 computed natively.
SMALL_LEAVES = (LEAVES[0], LEAVES[1], LEAVES[4])


def _tree(leaves: Sequence[_Leaf], values: Sequence[Any]) -> dict[str, Any]:
    """The params-like nested dict of per-leaf values, in ``leaves`` order."""
    out: dict[str, dict[str, Any]] = {}
    for leaf, value in zip(leaves, values, strict=True):
        outer, inner = leaf.name.split("/")
        out.setdefault(outer, {})[inner] = value
    return out


def _flat(leaves: Sequence[_Leaf], tree: Any) -> list[Any]:
    """The leaves of a `_tree`, in ``leaves`` order."""
    out = []
    for leaf in leaves:
        outer, inner = leaf.name.split("/")
        out.append(tree[outer][inner])
    return out


def init_params(
    seed: int = 0, leaves: Sequence[_Leaf] = LEAVES
) -> dict[str, dict[str, jax.Array]]:
    """The soak's mixed-dtype parameters (float32 and bfloat16 leaves)."""
    rng = np.random.default_rng(seed)
    return _tree(
        leaves,
        [
            jnp.asarray(
                (0.1 * rng.standard_normal(leaf.shape)).astype(leaf.param_dtype)
            )
            for leaf in leaves
        ],
    )


# Configurations --------------------------------------------------------------

_INNERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adam": lambda: optax.adam(1e-3),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "clip_adamw": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-3)
    ),
}
_INNER_ORDER = tuple(_INNERS)

_SCALERS: dict[str, Callable[[], jls.LossScaler]] = {
    "dynamic_default": lambda: jls.dynamic_scale(),
    "dynamic_fast": lambda: jls.dynamic_scale(2.0**10, growth_interval=3),
    "dynamic_below_one": lambda: jls.dynamic_scale(
        4.0, growth_interval=20, min_scale=2.0**-10
    ),
    "static": lambda: jls.static_scale(2.0**4),
    "no_scale": lambda: jls.no_scale(),
    "torch": lambda: presets.torch(init_scale=2**8, growth_interval=5),
    "paddle": lambda: presets.paddle(decr_every_n_nan_or_inf=2, incr_every_n_steps=4),
    "megatron": lambda: presets.megatron(
        initial_scale=2**12, growth_interval=4, hysteresis=3
    ),
    "deepspeed": lambda: presets.deepspeed(
        initial_scale_power=10,
        scale_window=3,
        delayed_shift=2,
        consecutive_hysteresis=True,
    ),
    "nnabla": lambda: presets.nnabla(N=3),
    "mindspore_fixed_apply": lambda: presets.mindspore_fixed(128.0, False),
    "flax": lambda: presets.flax(growth_interval=4, scale=2.0**6),
    "measured": lambda: jls.measured_scale(
        2.0**4, history=3, init_scale=2.0**8, min_scale=2.0**-4
    ),
}
CONFIGS = tuple(_SCALERS)


def make_config(name: str) -> tuple[jls.LossScaler, optax.GradientTransformation]:
    """The scaler and inner optimizer of a named configuration.

    Args:
      name: one of `CONFIGS`.

    Returns:
      ``(scaler, inner)``; the inner optimizers alternate over the configs.
    """
    if name not in _SCALERS:
        raise ValueError(f"unknown config {name!r}; known: {', '.join(CONFIGS)}")
    inner = _INNER_ORDER[CONFIGS.index(name) % len(_INNER_ORDER)]
    return _SCALERS[name](), _INNERS[inner]()


def inner_name(name: str) -> str:
    """The inner optimizer's name of a named configuration."""
    return _INNER_ORDER[CONFIGS.index(name) % len(_INNER_ORDER)]


def reference_for(scaler: jls.LossScaler) -> RefScaler:
    """The independent reference model of ``scaler``'s scale rule.

    Args:
      scaler: a `jls.LossScaler` whose growth count starts fresh.

    Returns:
      A fresh `RefScaler` with the scaler's fields.

    Raises:
      ValueError: if the scaler starts with a resumed growth count, which the
        reference model does not represent.
    """
    if isinstance(scaler, MeasuredScale):
        # Its scale is checked against its own bounds (check_records); the
        # reference model only counts.
        return RefScaler(
            init_scale=scaler.init_scale,
            growth_factor=scaler.max_growth,
            backoff_factor=scaler.backoff_factor,
            growth_interval=scaler.history,
            min_scale=scaler.min_scale,
            max_scale=scaler.max_scale,
        )
    assert isinstance(scaler, DynamicScale)
    if scaler.init_growth_count != scaler.growth_restart:
        raise ValueError("RefScaler models only a fresh growth count")
    assert scaler.backoff_factor is not None  # set by the scaler's validation
    return RefScaler(
        init_scale=scaler.init_scale,
        growth_factor=scaler.growth_factor,
        backoff_factor=scaler.backoff_factor,
        growth_interval=scaler.growth_interval,
        first_growth_interval=scaler.first_growth_interval,
        saturate_growth=scaler.saturate_growth,
        backoff_divisor=scaler.backoff_divisor,
        backoff_interval=scaler.backoff_interval,
        hysteresis=scaler.hysteresis,
        consecutive_hysteresis=scaler.consecutive_hysteresis,
        min_scale=scaler.min_scale,
        max_scale=scaler.max_scale,
    )


# The gradient stream (on device) ---------------------------------------------


def _uint(dtype: Any) -> Any:
    return {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[np.dtype(dtype).itemsize]


def _bits(x: jax.Array) -> jax.Array:
    """The bit pattern of a float array (other arrays as they are)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return lax.bitcast_convert_type(x, _uint(x.dtype))
    return x


def _all(flags: Sequence[jax.Array]) -> jax.Array:
    out = jnp.asarray(True)
    for f in flags:
        out = out & f
    return out


def _same(a: Any, b: Any) -> jax.Array:
    """Whether two trees are bitwise equal (of the same structure and dtypes)."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        raise TypeError(
            f"structures differ: {jax.tree.structure(a)} and {jax.tree.structure(b)}"
        )
    flags = []
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = jnp.asarray(x), jnp.asarray(y)
        if x.dtype != y.dtype or x.shape != y.shape:
            raise TypeError(f"leaf {x.dtype}{x.shape} vs {y.dtype}{y.shape}")
        flags.append(jnp.all(_bits(x) == _bits(y)))
    return _all(flags)


def _deviation(got: Any, want: Any, old: Any) -> jax.Array:
    """How far ``got`` is from ``want``, relative to rounding and the step.

    The largest, over the elements, of ``|got - want|`` over
    ``2**-8 * |want - old| + 8 ulp(max(|got|, |want|))``: XLA may contract or
    reorder the same arithmetic differently in two computations (an FMA in
    one, a rounded product in the other), so a plain optimizer run outside
    jls cannot be expected to agree bitwise. Equal elements and pairs of
    non-finite ones count 0; one finite and one not counts 0 when the finite
    one is within 2**-4 of the dtype's maximum (the same overflow, rounded
    differently) and inf otherwise. Integer leaves must be equal.
    """
    f32 = jnp.float32
    worst = f32(0)
    for x, y, o in zip(
        jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(old), strict=True
    ):
        x, y, o = jnp.asarray(x), jnp.asarray(y), jnp.asarray(o)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            worst = jnp.maximum(worst, jnp.where(jnp.all(x == y), f32(0), f32(jnp.inf)))
            continue
        info = jnp.finfo(x.dtype)
        eps, tiny, fmax = f32(float(info.eps)), f32(float(info.tiny)), float(info.max)
        x, y, o = x.astype(f32), y.astype(f32), o.astype(f32)
        fx, fy = jnp.isfinite(x), jnp.isfinite(y)
        big = jnp.maximum(jnp.abs(jnp.where(fx, x, 0)), jnp.abs(jnp.where(fy, y, 0)))
        both_finite = fx & fy
        tol = f32(2.0**-8) * jnp.abs(y - o) + f32(8) * eps * jnp.maximum(
            jnp.abs(x), jnp.abs(y)
        )
        dev = jnp.where(both_finite, jnp.abs(x - y) / (tol + tiny), f32(0))
        one = fx != fy
        dev = jnp.where(one & (big < f32(fmax * 2.0**-4)), f32(jnp.inf), dev)
        dev = jnp.where(x == y, f32(0), dev)
        worst = jnp.maximum(worst, jnp.max(dev))
    return worst


def _select(pred: jax.Array, a: Any, b: Any) -> Any:
    """``a`` if ``pred`` else ``b``, leaf by leaf (the harness's own select)."""
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _finite(tree: Any) -> jax.Array:
    """Whether every floating leaf of ``tree`` is finite (exact, per element)."""
    return _all(
        [
            jnp.all(jnp.isfinite(x))
            for x in jax.tree.leaves(tree)
            if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
        ]
    )


def _ref_unscale(g: jax.Array, scale: jax.Array) -> jax.Array:
    """The reference unscaling: ``(g.astype(f32) * (1 / scale)).astype(g.dtype)``."""
    f32 = jnp.float32
    return (g.astype(f32) * (f32(1) / scale)).astype(g.dtype)


# A counter-based PRNG: a 32-bit integer hash (the "lowbias32" finaliser) of
# (seed, step, index). It compiles to a handful of elementwise ops, where
# jax.random's threefry, inlined dozens of times per step, made every soak
# function take 15 s to compile on XLA:CPU.
_GOLDEN = 0x9E3779B9
_N_SCALARS = 10  # per leaf, see _leaf_grad
_N_REGIME = 2


def _mix(x: jax.Array) -> jax.Array:
    u32 = jnp.uint32
    x = x ^ (x >> u32(16))
    x = x * u32(0x7FEB352D)
    x = x ^ (x >> u32(15))
    x = x * u32(0x846CA68B)
    return x ^ (x >> u32(16))


def _normal_count(leaf: _Leaf) -> int:
    rows = leaf.shape[0]
    cols = leaf.shape[-1]
    size = int(np.prod(leaf.shape))
    return {
        "contract": rows * 4 + 4 * cols,
        "colsum": 2 * 8 * size,
        "outer": rows + cols,
        "native": size,
    }[leaf.producer]


def _layout(leaves: Sequence[_Leaf]) -> tuple[int, list[tuple[int, int]]]:
    """Where a step's uniforms go.

    Two for the regime, the leaves' scalars, four per normal (Irwin-Hall),
    then per leaf one per element for its spread mask.

    Returns:
      The total count, and per leaf the offsets of its normals (into the
      normals) and of its masks' uniforms (into the uniforms).
    """
    offset = _N_REGIME + _N_SCALARS * len(leaves)
    normals = 0
    out = []
    for leaf in leaves:
        out.append((normals, 0))
        normals += _normal_count(leaf)
    offset += 4 * normals
    for i, leaf in enumerate(leaves):
        out[i] = (out[i][0], offset)
        offset += int(np.prod(leaf.shape))
    return offset, out


def _n_normals(leaves: Sequence[_Leaf]) -> int:
    return sum(_normal_count(leaf) for leaf in leaves)


def _uniforms(seed: jax.Array, step: jax.Array, n: int) -> jax.Array:
    """``n`` uniforms in ``[0, 1)`` (multiples of 2**-24) for one step."""
    u32 = jnp.uint32
    base = _mix(_mix(seed) ^ (step * u32(_GOLDEN) + u32(0x632BE5AB)))
    bits = _mix(_mix(lax.iota(u32, n) * u32(_GOLDEN) ^ base))
    return (bits >> u32(8)).astype(jnp.float32) * jnp.float32(2.0**-24)


def _normals(u: jax.Array) -> jax.Array:
    """Approximately standard normals from 4 uniforms each (Irwin-Hall).

    Sums and no transcendental functions: cheap to compile. ``|z| < 3.47``.
    """
    f32 = jnp.float32
    four = u.reshape(4, -1)
    return (four[0] + four[1] + four[2] + four[3] - f32(2)) * f32(np.sqrt(3.0))


def _pick(kind: jax.Array, values: Sequence[Any]) -> jax.Array:
    """``values[kind]`` as a chain of selects (no gather)."""
    out = jnp.asarray(values[0])
    for i, v in enumerate(values[1:], 1):
        out = jnp.where(kind == i, v, out)
    return out


def _faults(
    leaves: Sequence[_Leaf], s: jax.Array, scale: jax.Array, p_bad: jax.Array
) -> dict[str, Any]:
    """Every leaf's fault, vectorised over the leaves (``s``: their scalars)."""
    f32 = jnp.float32
    infos = [jnp.finfo(leaf.grad_dtype) for leaf in leaves]
    fmax = jnp.asarray([float(i.max) for i in infos], f32)
    ulp = jnp.asarray([2.0 ** -(int(i.nmant) + 1) for i in infos], f32)
    sizes = jnp.asarray([int(np.prod(leaf.shape)) for leaf in leaves], jnp.int32)

    bad = s[:, 0] < p_bad
    weights = np.asarray(_BAD_WEIGHTS[1:])
    edges = jnp.asarray(np.cumsum(weights)[:-1] / weights.sum(), f32)
    drawn = 1 + jnp.sum(s[:, 1:2] >= edges[None, :], axis=1).astype(jnp.int32)
    kind = jnp.where(bad, drawn, 0).astype(jnp.int32)

    # The producer's traced scalar factor.
    lo, hi = _LOG2_CLEAN
    c = jnp.exp2(f32(lo) + f32(hi - lo) * s[:, 2]) * scale
    c = jnp.where(kind == _OVF, fmax * jnp.exp2(f32(-4) + f32(5) * s[:, 3]), c)
    c = jnp.where(kind == _INFC, f32(jnp.inf), c)

    # The injected value, for the kinds placed at masked elements.
    sign = jnp.where(s[:, 4] < 0.5, f32(1), f32(-1))
    huge = fmax * jnp.exp2(-jnp.floor(f32(5) * s[:, 5]))
    near_one = f32(1) + (jnp.floor(f32(7) * s[:, 6]) - f32(3)) * ulp
    boundary = fmax * scale * near_one
    nan, inf = f32(jnp.nan), f32(jnp.inf)
    value = _pick(kind, [f32(0), nan, inf, -inf, sign * huge, sign * boundary])
    injected = (kind >= _INJECTED[0]) & (kind <= _INJECTED[-1])
    index = jnp.minimum(jnp.floor(s[:, 7] * sizes).astype(jnp.int32), sizes - 1)
    return {
        "kind": kind,
        "bad": bad,
        "c": c,
        "value": value,
        "injected": injected,
        "index": index,
        "single": s[:, 8] < 0.5,
    }


def _leaf_grad(
    i: int, leaf: _Leaf, f: dict[str, Any], z: jax.Array, spread_u: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Leaf ``i``'s scaled gradient and whether its fault was placed."""
    f32 = jnp.float32
    dt = np.dtype(leaf.grad_dtype)
    size = int(np.prod(leaf.shape))
    c, value, injected = f["c"][i], f["value"][i], f["injected"][i]
    flat_index = lax.broadcasted_iota(jnp.int32, (size,), 0).reshape(leaf.shape)
    spread = (spread_u < f32(0.15)).reshape(leaf.shape)
    mask = jnp.where(f["single"][i], flat_index == f["index"][i], spread) & injected
    keep = jnp.where(mask, f32(0), f32(1))
    b = jnp.where(mask, value, f32(0))
    placed = jnp.where(injected, jnp.any(mask), f["bad"][i])

    if leaf.producer == "contract":
        rows, cols = leaf.shape
        x = z[: rows * 4].reshape(rows, 4)
        y = f32(0.5) * z[rows * 4 :].reshape(4, cols)
        prod = jnp.sum((x * c)[:, :, None] * y[None, :, :], axis=1)
        g = (prod * keep + b).astype(dt)
    elif leaf.producer == "colsum":
        x = z[: 8 * size].reshape(8, *leaf.shape)
        w = f32(0.35) * z[8 * size :].reshape(8, *leaf.shape)
        g = (jnp.sum(x * w * c, axis=0) * keep + b).astype(dt)
    elif leaf.producer == "outer":
        rows, cols = leaf.shape
        p = z[:rows][:, None] * z[rows:][None, :]
        g = (p * c * keep + b).astype(dt)
    elif leaf.producer == "native":
        a = z.reshape(leaf.shape).astype(dt)
        g = a * c.astype(dt) * keep.astype(dt) + b.astype(dt)
    else:
        raise ValueError(leaf.producer)
    return g, placed


def _make_grads(
    leaves: Sequence[_Leaf], u: jax.Array, scale: jax.Array, p_bad: jax.Array
) -> tuple[Any, jax.Array, jax.Array]:
    """A step's scaled gradients, each leaf's fault kind and whether placed."""
    _, offsets = _layout(leaves)
    at = _N_REGIME
    n = len(leaves)
    scalars = u[at : at + _N_SCALARS * n].reshape(n, _N_SCALARS)
    at += _N_SCALARS * n
    z = _normals(u[at : at + 4 * _n_normals(leaves)])
    f = _faults(leaves, scalars, scale, p_bad)
    grads, placed = [], []
    for i, (leaf, (at_z, at_mask)) in enumerate(zip(leaves, offsets, strict=True)):
        size = int(np.prod(leaf.shape))
        g, p = _leaf_grad(
            i,
            leaf,
            f,
            z[at_z : at_z + _normal_count(leaf)],
            u[at_mask : at_mask + size],
        )
        grads.append(g)
        placed.append(p)
    return _tree(leaves, grads), f["kind"].astype(jnp.int8), jnp.stack(placed)


def _next_regime(u: jax.Array, regime: jax.Array) -> jax.Array:
    stay = _pick(regime, [jnp.float32(p) for p in _STAY])
    new = jnp.minimum(jnp.floor(u[1] * len(_P_BAD)), len(_P_BAD) - 1)
    return jnp.where(u[0] < stay, regime, new.astype(jnp.int32))


# The step under test ---------------------------------------------------------


def _step_record(tx, inner, scaler, path, params, state, grads):
    """One step on one path; returns the new params and state and its record."""
    pre = state.loss_scale.scale
    if path == "update":
        updates, new_state = tx.update(grads, state, params)
        new_params = optax.apply_updates(params, updates)
        # -0.0 in the params' dtypes (a static property, recorded per step).
        dtypes = [u.dtype for u in jax.tree.leaves(updates)]
        same_dtypes = dtypes == [p.dtype for p in jax.tree.leaves(params)]
        negzero = _same(
            updates, jax.tree.map(lambda u: jnp.full_like(u, -0.0), updates)
        ) & jnp.asarray(same_dtypes)
    elif path == "apply_gradients":
        new_params, new_state = jls.apply_gradients(tx, grads, state, params)
        negzero = jnp.asarray(True)
    else:
        raise ValueError(f"unknown path {path!r}; known: {PATHS}")
    if jax.tree.structure(new_state) != jax.tree.structure(state):
        raise TypeError("the state's structure changed")

    # The independent oracle of an applied step: the plain inner optimizer on
    # the reference-unscaled gradients.
    own = jax.tree.map(lambda g: _ref_unscale(g, pre), grads)
    o_updates, o_inner = inner.update(own, state.inner_state, params)
    o_params = optax.apply_updates(params, o_updates)
    in_range = (pre >= jnp.float32(scaler.min_scale_f32)) & (
        pre <= jnp.float32(scaler.max_scale_f32)
    )
    ls = new_state.loss_scale
    m = jls.metrics(new_state)
    record = {
        "pre_scale": pre,
        "scale": ls.scale,
        "growth_count": ls.growth_count,
        "backoff_count": ls.backoff_count,
        "consecutive_skips": ls.consecutive_skips,
        "total_skips": ls.total_skips,
        "consecutive_nonfinite": ls.consecutive_nonfinite,
        "retries": ls.retries,
        "skipped": m["skipped"],
        "nonfinite": m["nonfinite"],
        "body_truth": in_range & _finite(own),
        "params_same": _same(new_params, params),
        "inner_same": _same(new_state.inner_state, state.inner_state),
        "updates_negzero": negzero,
        "oracle_params": _deviation(new_params, o_params, params),
        "oracle_inner": _deviation(new_state.inner_state, o_inner, state.inner_state),
        "params_finite": _finite(new_params),
        "inner_finite": _finite(new_state.inner_state),
        "loss_scale_finite": _finite(ls),
    }
    return new_params, new_state, record


def _make_chunk(
    scaler: jls.LossScaler,
    inner: optax.GradientTransformation,
    paths: Sequence[str],
    length: int,
    leaves: Sequence[_Leaf] = LEAVES,
    compiler_options: dict[str, Any] | None = None,
) -> tuple[optax.GradientTransformation, Callable[[Any], Any]]:
    """The transformation and a jitted scan of ``length`` soak steps.

    Every path steps its own parameters and state on the same gradients (made
    from the first path's scale), in the one compiled function.
    """
    tx = jls.loss_scaling(inner, scaler)
    n_uniforms, _ = _layout(leaves)

    def body(carry, _):
        seed, step, regime, runs, restore = carry
        u = _uniforms(seed, step, n_uniforms)
        regime = _next_regime(u, regime)
        scale = runs[paths[0]][1].loss_scale.scale
        p_bad = _pick(regime, [jnp.float32(p) for p in _P_BAD])
        grads, kinds, placed = _make_grads(leaves, u, scale, p_bad)
        new_runs, records = {}, {}
        for path in paths:
            params, state = runs[path]
            params, state, records[path] = _step_record(
                tx, inner, scaler, path, params, state, grads
            )
            # An applied step can overflow the inner optimizer itself (Adam's
            # g**2 of a huge finite gradient): then the harness restores the
            # parameters and inner state (the loss-scale state is kept), so
            # that every step starts from a finite state.
            ok = records[path]["params_finite"] & records[path]["inner_finite"]
            params = _select(ok, params, restore[0])
            state = state._replace(
                inner_state=_select(ok, state.inner_state, restore[1])
            )
            records[path]["restored"] = ~ok
            new_runs[path] = (params, state)
        shared = {
            "kinds": kinds,
            "placed": placed,
            "regime": regime,
            "grads": tuple(_flat(leaves, grads)),
        }
        carry = (seed, step + jnp.uint32(1), regime, new_runs, restore)
        return carry, (shared, records)

    def run(carry):
        with warnings.catch_warnings():
            # no_scale() on float16 gradients is on purpose here (the soak
            # checks the skip at scale 1); its trace-time advice is not.
            warnings.filterwarnings("ignore", "float16 gradients with a loss scale")
            return lax.scan(body, carry, None, length=length)

    return tx, jax.jit(run, compiler_options=compiler_options)


def simulate(
    config: str,
    steps: int,
    seed: int,
    paths: Sequence[str] = PATHS,
    *,
    chunk: int = 500,
    leaves: Sequence[_Leaf] = LEAVES,
    compiler_options: dict[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Runs the soak of one configuration; returns each path's per-step records.

    Args:
      config: one of `CONFIGS`.
      steps: how many steps.
      seed: the PRNG seed (mixed with the config's name).
      paths: the paths to run, each on its own parameters and state, all on
        the same gradients.
      chunk: steps per jitted ``lax.scan`` call.
      leaves: the parameter leaves (default `LEAVES`).
      compiler_options: XLA options for the jitted chunk (the CI test lowers
        the LLVM optimisation level to halve the compile time).

    Returns:
      ``{path: records}``: dicts of numpy arrays with a leading step axis
      (``"grads"``: a tuple of them, one per leaf in ``leaves`` order; shared
      between the paths), plus ``"seconds"``, the wall time of the run
      (compilation included).
    """
    for path in paths:
        if path not in PATHS:
            raise ValueError(f"unknown path {path!r}; known: {PATHS}")
    scaler, inner = make_config(config)
    chunk = max(1, min(chunk, steps))
    tx, run = _make_chunk(scaler, inner, tuple(paths), chunk, leaves, compiler_options)
    params = init_params(seed, leaves)
    mixed = zlib.crc32(f"{config}:{seed}".encode())
    state = cast(LossScalingState, tx.init(params))
    runs = {path: (params, state) for path in paths}
    restore = (params, state.inner_state)
    carry = (jnp.uint32(mixed), jnp.uint32(0), jnp.int32(_FIRST_REGIME), runs, restore)
    parts = []
    start = time.perf_counter()
    for _ in range(-(-steps // chunk)):
        carry, ys = run(carry)
        parts.append(jax.device_get(ys))
    seconds = time.perf_counter() - start
    shared, records = jax.tree.map(lambda *xs: np.concatenate(xs)[:steps], *parts)
    out = {}
    for path in paths:
        out[path] = {**records[path], **shared, "seconds": seconds}
    return out


# The host-side checker -------------------------------------------------------


def _host_truth(records: dict[str, Any], scaler: jls.LossScaler) -> np.ndarray:
    """Exact finiteness of every step's unscaled gradients, in numpy."""
    pre = np.asarray(records["pre_scale"], np.float32)
    ok = (pre >= np.float32(scaler.min_scale_f32)) & (
        pre <= np.float32(scaler.max_scale_f32)
    )
    with np.errstate(all="ignore"):
        inv = np.float32(1) / pre
        for g in records["grads"]:
            g = np.asarray(g)
            wide = g.astype(np.float32) * inv.reshape((-1,) + (1,) * (g.ndim - 1))
            unscaled = wide.astype(g.dtype)
            ok = ok & np.isfinite(unscaled.astype(np.float32)).reshape(
                len(pre), -1
            ).all(axis=1)
    return ok


def _saturating_counts(flags: np.ndarray, reset: bool) -> np.ndarray:
    """Running counts of ``flags`` (consecutive if ``reset``), int32-saturated."""
    top = np.iinfo(np.int32).max
    out = np.empty(len(flags), np.int64)
    count = 0
    for i, f in enumerate(flags):
        count = min(count + 1, top) if f else (0 if reset else count)
        out[i] = count
    return out


def check_records(
    records: dict[str, Any],
    scaler: jls.LossScaler,
    ref: RefScaler,
    *,
    path: str,
    max_messages: int = 3,
) -> list[str]:
    """Checks every step's records against the independent model.

    Args:
      records: from `simulate`.
      scaler: the configuration's scaler.
      ref: a fresh reference model of the scaler's rule (stepped here).
      path: the path the records came from.
      max_messages: the most messages per failed check.

    Returns:
      One message per failing step (up to ``max_messages`` per check, then a
      count); empty when every invariant held on every step.
    """
    n = len(records["pre_scale"])
    failures: list[str] = []
    exact = _host_truth(records, scaler)
    truth = exact
    pre = np.asarray(records["pre_scale"], np.float32)
    scale = np.asarray(records["scale"], np.float32)
    lo, hi = np.float32(scaler.min_scale_f32), np.float32(scaler.max_scale_f32)
    in_range = (pre >= lo) & (pre <= hi)
    dropped = ~truth if scaler.skip_nonfinite else ~in_range
    kinds = np.asarray(records["kinds"])

    ref_scale = np.empty(n, np.float32)
    ref_growth = np.empty(n, np.int64)
    for i in range(n):
        ref.step(bool(truth[i]))
        ref_scale[i] = ref.scale
        ref_growth[i] = ref.growth_count

    def plain(x: Any, i: int) -> Any:
        x = x[i] if isinstance(x, np.ndarray) else x
        return x.item() if isinstance(x, np.generic) else x

    def fail(name: str, bad: np.ndarray, got: Any, want: Any) -> None:
        steps = np.flatnonzero(bad)
        for i in steps[:max_messages]:
            names = [KINDS[k] for k in kinds[i]]
            failures.append(
                f"{path}: step {i}: {name}: got {plain(got, i)!r}, "
                f"want {plain(want, i)!r} (pre_scale={pre[i].item()!r}, "
                f"truth={bool(truth[i])}, kinds={names})"
            )
        if len(steps) > max_messages:
            failures.append(
                f"{path}: {name}: {len(steps) - max_messages} more failing steps"
            )

    u32 = np.uint32
    init = np.float32(scaler.init().scale)
    prev = np.concatenate([[init], scale[:-1]])
    fail("pre_scale continuity", pre.view(u32) != prev.view(u32), pre, prev)
    fail(
        "body truth == host truth",
        records["body_truth"] != exact,
        records["body_truth"],
        exact,
    )
    fail("metrics skipped", records["skipped"] != dropped, records["skipped"], dropped)
    fail(
        "metrics nonfinite",
        records["nonfinite"] != ~truth,
        records["nonfinite"],
        ~truth,
    )
    for name, flags, reset in (
        ("consecutive_skips", dropped, True),
        ("total_skips", dropped, False),
        ("consecutive_nonfinite", ~truth, True),
    ):
        want = _saturating_counts(flags, reset)
        got = np.asarray(records[name], np.int64)
        fail(name, got != want, got, want)
    retries = np.asarray(records["retries"])
    fail("retries", retries != 0, retries, 0)
    if not isinstance(scaler, MeasuredScale):
        fail(
            "scale (bitwise)", scale.view(u32) != ref_scale.view(u32), scale, ref_scale
        )
        growth = np.asarray(records["growth_count"], np.int64)
        fail("growth_count", growth != ref_growth, growth, ref_growth)
    else:
        # The measured rule follows a measurement the host does not redo:
        # its back-off is exact, its growth bounded, its scales powers of two.
        backed = np.maximum(pre * np.float32(scaler.backoff_factor), lo)
        off = ~truth & in_range
        fail("measured back-off", off & (scale != backed), scale, backed)
        grown = ~off & (scale > pre * np.float32(scaler.max_growth)) & in_range
        fail("measured growth <= max_growth", grown, scale, pre)
        _, exponent = np.frexp(scale)
        pow2 = scale == np.ldexp(np.float32(0.5), exponent)
        fail("measured scale a power of two", ~pow2, scale, "a power of two")
    with np.errstate(invalid="ignore"):
        bounded = np.isfinite(scale) & (scale > 0) & (scale >= lo) & (scale <= hi)
    fail("scale finite, > 0, in [min_scale, max_scale]", ~bounded, scale, (lo, hi))
    ls_finite = np.asarray(records["loss_scale_finite"])
    fail("loss-scale state finite", ~ls_finite, ls_finite, True)
    for name in ("params_same", "inner_same", "updates_negzero"):
        flags = np.asarray(records[name])
        fail(f"dropped step: {name}", dropped & ~flags, flags, True)
    for name in ("oracle_params", "oracle_inner"):
        dev = np.asarray(records[name])
        fail(
            f"applied step ~= plain inner step: {name}",
            ~dropped & ~(dev <= 1),
            dev,
            "<= 1",
        )
    state_finite = np.asarray(records["params_finite"]) & np.asarray(
        records["inner_finite"]
    )
    # Every step starts from finite params and inner state (the harness
    # restores them after an inner-optimizer overflow).
    fail(
        "dropped step: no nan/inf in params or inner state",
        dropped & ~state_finite,
        state_finite,
        True,
    )
    # What the step itself reported (``metrics``), restated plainly.
    reported = np.asarray(records["skipped"])
    if scaler.skip_nonfinite:
        fail("applied step: gradients were finite", ~reported & ~truth, truth, True)
    else:
        fail("skip_nonfinite=False: no step dropped", reported, reported, False)
    return failures


def summarize(
    config: str, path: str, records: dict[str, Any], failures: list[str]
) -> dict[str, Any]:
    """The summary of one soak run (counts, scale range, failures)."""
    scaler, _ = make_config(config)
    truth = _host_truth(records, scaler)
    scale = np.asarray(records["scale"], np.float32)
    placed = np.asarray(records["placed"])
    kinds = np.asarray(records["kinds"])
    injected = {
        KINDS[k]: int(np.sum(placed & (kinds == k))) for k in range(1, len(KINDS))
    }
    pre = np.asarray(records["pre_scale"], np.float32)
    return {
        "config": config,
        "path": path,
        "inner": inner_name(config),
        "steps": len(truth),
        "skipped": int(np.sum(records["skipped"])),
        "nonfinite": int(np.sum(~truth)),
        "injected": injected,
        "scale_range": (float(scale.min()), float(scale.max())),
        "steps_below_one": int(np.sum(pre < 1)),
        "growths": int(np.sum(scale > pre)),
        "backoffs": int(np.sum(scale < pre)),
        "restored": int(np.sum(records["restored"])),
        "seconds": float(records["seconds"]),
        "failures": failures,
        "ok": not failures,
    }


def run_config(
    config: str,
    steps: int,
    seed: int,
    paths: Sequence[str] = PATHS,
    *,
    chunk: int = 500,
    leaves: Sequence[_Leaf] = LEAVES,
    compiler_options: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Runs and checks the soak of one configuration on several paths at once.

    The paths share one compiled function and one gradient stream.

    Args:
      config: one of `CONFIGS`.
      steps: how many steps.
      seed: the PRNG seed.
      paths: among `PATHS`.
      chunk: steps per jitted ``lax.scan`` call.
      leaves: the parameter leaves.
      compiler_options: XLA options for the jitted chunk.

    Returns:
      One `summarize` dict per path.
    """
    scaler, _ = make_config(config)
    runs = simulate(
        config,
        steps,
        seed,
        paths,
        chunk=chunk,
        leaves=leaves,
        compiler_options=compiler_options,
    )
    return [
        summarize(
            config,
            path,
            records,
            check_records(records, scaler, reference_for(scaler), path=path),
        )
        for path, records in runs.items()
    ]


def run_soak(
    config: str,
    steps: int,
    seed: int,
    path: str,
    *,
    chunk: int = 500,
    leaves: Sequence[_Leaf] = LEAVES,
) -> dict[str, Any]:
    """Runs and checks the soak of one configuration on one path.

    Args:
      config: one of `CONFIGS`.
      steps: how many steps.
      seed: the PRNG seed.
      path: ``"update"`` or ``"apply_gradients"``.
      chunk: steps per jitted ``lax.scan`` call.
      leaves: the parameter leaves.

    Returns:
      The `summarize` dict: ``ok`` and ``failures`` say whether every
      invariant held on every step.
    """
    (summary,) = run_config(config, steps, seed, (path,), chunk=chunk, leaves=leaves)
    return summary


def format_summary(s: dict[str, Any]) -> str:
    """One line per run."""
    injected = " ".join(f"{k}:{v}" for k, v in s["injected"].items())
    lo, hi = s["scale_range"]
    return (
        f"{s['config']:<22} {s['path']:<15} {s['inner']:<12} steps={s['steps']} "
        f"skipped={s['skipped']} nonfinite={s['nonfinite']} "
        f"growths={s['growths']} backoffs={s['backoffs']} "
        f"scale=[{lo:.3g},{hi:.3g}] below1={s['steps_below_one']} "
        f"restored={s['restored']} injected[{injected}] "
        f"{s['seconds']:.1f}s {'OK' if s['ok'] else 'FAIL'}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: runs the soak, prints one line per run.

    Args:
      argv: the arguments (default ``sys.argv[1:]``).

    Returns:
      0 if every run passed, else 1.
    """
    parser = argparse.ArgumentParser(prog="python tests/soak.py", description=__doc__)
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--configs", default="all", help="comma-separated, or all")
    parser.add_argument("--paths", default="all", help="comma-separated, or all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=500)
    args = parser.parse_args(argv)
    configs = CONFIGS if args.configs == "all" else tuple(args.configs.split(","))
    paths = PATHS if args.paths == "all" else tuple(args.paths.split(","))
    failed = 0
    start = time.perf_counter()
    for config in configs:
        for summary in run_config(
            config, args.steps, args.seed, paths, chunk=args.chunk
        ):
            print(format_summary(summary), flush=True)
            for message in summary["failures"]:
                print(f"    {message}", flush=True)
            failed += not summary["ok"]
    total = len(configs) * len(paths)
    print(
        f"{total - failed}/{total} runs OK in {time.perf_counter() - start:.1f}s "
        f"(seed {args.seed}, {args.steps} steps each)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
