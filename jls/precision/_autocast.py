"""`autocast`: matmuls in half precision, the ops that need range in float32.

Per op, as torch's ``autocast``: the function is traced once and its program
run again by `jls.precision._cast_eval`'s rules.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jls.precision._cast_eval import evaluate
from jls.precision._interpret import trace


def floating_dtype(name: str, dtype: Any) -> np.dtype:
    """``dtype`` as a numpy dtype, refused unless floating (``name`` in the error)."""
    if dtype is None:  # numpy reads None as float64
        raise TypeError(f"{name} must be a floating dtype, got None")
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be a floating dtype, got {dtype!r}") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating dtype, got {dtype}")
    return dtype


def is_nnx_module(x: Any) -> bool:
    """Whether ``x`` is a flax nnx Module (flax imported or not)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Module)


def autocast(
    fn: Callable[..., Any], dtype: Any = jnp.float16, *, float32: Any = None
) -> Callable[..., Any]:
    """``fn`` with its matmuls in ``dtype`` and its range-sensitive ops in float32.

    Matmuls and convolutions compute in ``dtype``; softmax, ``exp``/``log``,
    powers, sums and means in float32; other ops in their operands' dtype.
    The arguments are not cast (float32 parameters get float32 gradients).

    Args:
      fn: the function: a loss, a forward pass, a flax ``apply``.
      dtype: the compute dtype of the matmuls (float16, bfloat16).
      float32: the ops kept wholly in float32: a name-stack path
        (``"Decoder/lm_head"``), a tuple of them, or a predicate
        ``(primitive_name, name_stack) -> bool``.

    Returns:
      A function with ``fn``'s signature and result dtypes.

    Raises:
      TypeError: if an argument has the wrong type.

    Example:
      >>> import jax, jax.numpy as jnp, jls
      >>> loss = lambda w, x: jax.nn.logsumexp(x @ w)
      >>> w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
      >>> cast = jls.precision.autocast(loss, jnp.float16)
      >>> report = jls.precision.precision_report(cast, w, x)
      >>> report.counts, report.numerics["exp"], report.numerics["log"]
      ({'float16': 1}, {'float32': 1}, {'float32': 1})
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    dtype, keep = floating_dtype("dtype", dtype), _keep_rule(float32)

    @functools.wraps(fn)
    def cast_fn(*args: Any, **kwargs: Any) -> Any:
        found = jax.tree.leaves((args, kwargs), is_leaf=is_nnx_module)
        modules = list({id(m): m for m in found if is_nnx_module(m)}.values())
        if modules:
            return _with_nnx(fn, dtype, modules, args, kwargs, keep)
        return _autocast_call(fn, dtype, args, kwargs, keep)

    return cast_fn


def _keep_rule(float32: Any) -> Callable[..., Any] | None:
    """``float32`` as a predicate ``(primitive_name, name_stack) -> bool``."""
    if float32 is None or callable(float32):
        return float32
    names = (float32,) if isinstance(float32, str) else float32
    ok = isinstance(names, tuple) and all(isinstance(n, str) for n in names)
    if not ok or not names or not all(n.strip("/") for n in names):
        raise TypeError(
            "float32 must be a name path, a tuple of them or a predicate "
            f"(primitive_name, name_stack) -> bool, got {float32!r}"
        )
    paths = [n.strip("/").split("/") for n in names]

    def keep(primitive: str, stack: str) -> bool:
        # A component under a transform (``jvp(lm_head)``) is read bare.
        parts = [re.sub(r"^(\w+\()+|\)+$", "", c) for c in stack.split("/")]
        return any(parts[i : i + len(p)] == p for p in paths for i in range(len(parts)))

    return keep


def _autocast_call(
    fn: Callable, dtype: np.dtype, args: tuple, kwargs: dict, keep: Any = None
) -> Any:
    traced = trace(fn, args, kwargs)
    outs = evaluate(traced.closed, traced.arrays, dtype, keep)
    # Each result in the dtype fn returns it in (a constant, too).
    return traced.rebuild(
        x
        if isinstance(x, jax.Array) and x.dtype == v.aval.dtype
        else jax.lax.convert_element_type(x, v.aval.dtype)
        for x, v in zip(outs, traced.closed.jaxpr.outvars, strict=True)
    )


class _Slot:
    """Where an nnx Module stood in the arguments (a static leaf)."""

    def __init__(self, index: int) -> None:
        self.index = index


def _with_nnx(
    fn: Callable, dtype: np.dtype, modules: list, args: tuple, kwargs: dict, keep: Any
) -> Any:
    from flax import nnx

    index = {id(m): i for i, m in enumerate(modules)}
    slotted = jax.tree.map(
        lambda x: _Slot(index[id(x)]) if is_nnx_module(x) else x,
        (args, kwargs),
        is_leaf=is_nnx_module,
    )
    graphdef, state = nnx.split(modules)

    def pure(state: Any, slotted: Any) -> Any:
        copies = nnx.merge(graphdef, state)
        a, k = jax.tree.map(
            lambda x: copies[x.index] if isinstance(x, _Slot) else x,
            slotted,
            is_leaf=lambda x: isinstance(x, _Slot),
        )
        return fn(*a, **k), nnx.state(copies)

    out, after = _autocast_call(pure, dtype, (state, slotted), {}, keep)
    nnx.update(modules, after)
    return out
