"""The interpreter behind `jls.precision.autocast`: a traced program run again.

`evaluate` binds each primitive of a closed jaxpr again, its operands cast:
a matmul's (`jls.precision._primitives.CAST`) to the compute dtype, a
range-sensitive op's (`jls.precision._primitives.FLOAT32`) to float32 at
least, any other's promoted to the widest. A value computed wider is held
wide (the program's cast back is not bound) until a dtype is required: a
matmul's operand, an output, a loop's carry. An equation the keep rule
matches (its primitive's name and its whole name stack) computes in float32,
a matmul or a cast to float16 too, its result held wide likewise. Nested
programs run by the same rules; ``custom_jvp``/``custom_vjp``, ``shard_map``
and callbacks as traced.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jls.precision._interpret import (
    as_traced,
    bind,
    cast,
    dtype_of,
    interpret,
    is_literal,
    is_program,
    located,
    loop,
    program,
)
from jls.precision._primitives import CAST, FLOAT32, TRACED_DTYPE

_F32 = np.dtype(np.float32)
# The keep rule, the name stack a nested program runs under (its own is relative).
_KEEP: contextvars.ContextVar = contextvars.ContextVar("keep", default=(None, ""))


def evaluate(closed: Any, args: Sequence, dtype: np.dtype, keep: Any = None) -> list:
    """``closed`` run on ``args``, autocast to ``dtype``, ``keep``'s ops in float32."""
    token = _KEEP.set((keep, ""))
    try:
        return _evaluate(closed, args, dtype)
    finally:
        _KEEP.reset(token)


@contextlib.contextmanager
def _kept(eqn: Any) -> Iterator[bool]:
    """Whether ``keep(primitive_name, name_stack)`` takes ``eqn``; evaluate resets."""
    keep, outer = _KEEP.get()
    names = "/".join(filter(None, (outer, str(eqn.source_info.name_stack))))
    token = _KEEP.set((keep, names))  # the outer name stack of its nested programs
    yield keep is not None and bool(keep(eqn.primitive.name, names))
    _KEEP.reset(token)


def _evaluate(closed: Any, args: Sequence[Any], dtype: np.dtype) -> list[Any]:
    """``closed`` (a ``ClosedJaxpr``) run on ``args``, autocast to ``dtype``."""
    # The narrowest floating width (bytes) each value was computed from.
    narrowest: dict[Any, int] = {}

    def step(eqn: Any, invals: list) -> list:
        seen = min(
            [
                _width(v, x) if is_literal(v) else narrowest.get(v) or _width(v, x)
                for v, x in zip(eqn.invars, invals, strict=True)
            ],
            default=_WIDEST,
        )
        if _casts_back(eqn, invals, seen):
            outs = invals  # held in the wider dtype it was computed in
        else:
            with located(eqn), _kept(eqn) as kept:
                outs = _apply(eqn, invals, _F32 if kept else dtype, kept)
        for v, x in zip(eqn.outvars, outs, strict=True):
            narrowest[v] = min(seen, _width(v, x))
        return outs

    return interpret(closed, args, step)


_WIDEST = 16


def _width(v: Any, value: Any) -> int:
    """The bytes of ``v``'s floating dtype, traced or now (the narrower)."""
    traced = getattr(v.aval, "dtype", None)  # None: a token
    dtypes = [d for d in (traced, getattr(value, "dtype", traced)) if d is not None]
    return min((np.dtype(d).itemsize for d in dtypes if _floating(d)), default=_WIDEST)


def _casts_back(eqn: Any, invals: list, seen: int) -> bool:
    """Whether ``eqn`` narrows a value to a width it was computed from."""
    if eqn.primitive.name != "convert_element_type":
        return False
    to, now = np.dtype(eqn.params["new_dtype"]), dtype_of(invals[0], eqn.invars[0].aval)
    return _floating(to) and _floating(now) and seen <= to.itemsize < now.itemsize


def _floating(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _promote(eqn: Any, invals: list, floor: np.dtype | None = None) -> list:
    """Operands traced in one dtype brought to one dtype again (the widest)."""
    groups: dict[np.dtype, list[int]] = {}
    for i, v in enumerate(eqn.invars):
        if _floating(v.aval.dtype):
            groups.setdefault(np.dtype(v.aval.dtype), []).append(i)
    out = list(invals)
    for members in groups.values():
        now = [dtype_of(out[i], eqn.invars[i].aval) for i in members]
        # A literal is a scalar the program inlined (``h * 2.0``): weak.
        weak = [
            is_literal(v) or v.aval.weak_type for v in (eqn.invars[i] for i in members)
        ]
        strong = [d for d, w in zip(now, weak, strict=True) if not w]
        target = jnp.result_type(*(strong or now))
        if floor is not None:
            target = jnp.promote_types(target, floor)
        for i in members:
            out[i] = cast(out[i], eqn.invars[i].aval, target)
    return out


def _holds_program(value: Any) -> bool:
    """Whether a parameter is a program, a function or a typed result."""
    if isinstance(value, (tuple, list)):
        return any(_holds_program(v) for v in value)
    if is_program(value) or callable(value):
        return True
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _apply(eqn: Any, invals: list, dtype: Any, kept: bool = False) -> list:
    name = eqn.primitive.name
    if name in _NESTED:
        return _NESTED[name](eqn, invals, dtype)
    if name in CAST:
        return _matmul(eqn, invals, dtype)
    if kept and name == "convert_element_type" and _floating(eqn.params["new_dtype"]):
        wide = jnp.promote_types(eqn.params["new_dtype"], _F32)  # not narrowed
        return [cast(invals[0], eqn.invars[0].aval, wide)]
    if name in TRACED_DTYPE or any(map(_holds_program, eqn.params.values())):
        return bind(eqn, as_traced(invals, eqn.invars))
    square = name == "mul" and eqn.invars[0] is eqn.invars[1]  # x * x
    floor = _F32 if name in FLOAT32 or square or kept else None
    try:
        return bind(eqn, _promote(eqn, invals, floor))
    except (TypeError, ValueError):  # an op that takes only its traced dtypes
        return bind(eqn, as_traced(invals, eqn.invars))


def _matmul(eqn: Any, invals: list, dtype: Any) -> list:
    a, b = (v.aval.dtype for v in eqn.invars[:2])
    if not (_floating(a) and _floating(b)):  # an integer (quantised) matmul
        return bind(eqn, as_traced(invals, eqn.invars))
    operands = zip(invals[:2], eqn.invars[:2], strict=True)
    invals = [cast(x, v.aval, dtype) for x, v in operands] + list(invals[2:])
    params = dict(eqn.params)
    preferred = params.get("preferred_element_type")
    if preferred is not None and np.dtype(preferred) == jnp.promote_types(a, b):
        params["preferred_element_type"] = None  # it restated the operands' dtype
    return bind(eqn, invals, params)


def _call(eqn: Any, invals: list, dtype: Any) -> list:
    def fn(*args: Any) -> list:
        return _evaluate(program(eqn), args, dtype)

    if eqn.primitive.name in ("remat2", "checkpoint"):
        p = eqn.params
        fn = jax.checkpoint(fn, prevent_cse=p["prevent_cse"], policy=p["policy"])
    return list(fn(*invals))


def _loop(eqn: Any, invals: list, dtype: Any) -> list:
    def run(closed: Any) -> Callable:
        return lambda state, *args: (state, _evaluate(closed, args, dtype))

    return loop(eqn, invals, run, ())[1]


def _cond(eqn: Any, invals: list, dtype: Any) -> list:
    def branch(closed: Any) -> Callable:  # its outputs in the traced dtypes
        return lambda *args: as_traced(_evaluate(closed, args, dtype), eqn.outvars)

    index, *operands = invals
    branches = [branch(b) for b in eqn.params["branches"]]
    return list(jax.lax.switch(index, branches, *operands))


_NESTED: dict[str, Callable[[Any, list, Any], list]] = {
    **dict.fromkeys(("jit", "pjit", "closed_call", "remat2", "checkpoint"), _call),
    "scan": _loop,
    "while": _loop,
    "cond": _cond,
}
