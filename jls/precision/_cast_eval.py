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
    as_closed,
    bind,
    is_literal,
    is_program,
    located,
    read,
)
from jls.precision._primitives import CAST, FLOAT32

_F32 = np.dtype(np.float32)
# The keep rule, the name stack a nested program runs under (its own is relative).
_KEEP: contextvars.ContextVar = contextvars.ContextVar("keep", default=(None, ""))


def evaluate(closed: Any, args: Sequence, dtype: np.dtype, keep: Any = None) -> list:
    """``closed`` run on ``args``, autocast to ``dtype``, ``keep``'s ops in float32."""
    token = _KEEP.set((keep, ""))
    try:
        return _eval(closed.jaxpr, closed.consts, args, dtype)
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


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], dtype: Any) -> list:
    env: dict[Any, Any] = {}
    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    # The narrowest floating width (bytes) each value was computed from.
    narrowest = {v: _width(v, x) for v, x in env.items()}
    # Drop each value after its last use, as jax's own evaluation does.
    last = {
        v: i for i, e in enumerate(jaxpr.eqns) for v in e.invars if not is_literal(v)
    }
    outputs = {v for v in jaxpr.outvars if not is_literal(v)}
    for i, eqn in enumerate(jaxpr.eqns):
        invals = [read(v, env) for v in eqn.invars]
        seen = min(
            [
                _width(v, x) if is_literal(v) else narrowest[v]
                for v, x in zip(eqn.invars, invals, strict=True)
            ],
            default=_WIDEST,
        )
        if _casts_back(eqn, invals, seen):
            outs = invals  # held in the wider dtype it was computed in
        else:
            with located(eqn), _kept(eqn) as kept:
                outs = _apply(eqn, invals, _F32 if kept else dtype, kept)
        env.update(zip(eqn.outvars, outs, strict=True))
        for v, x in zip(eqn.outvars, outs, strict=True):
            narrowest[v] = min(seen, _width(v, x))
        for v in eqn.invars:
            if not is_literal(v) and last.get(v) == i and v not in outputs:
                env.pop(v, None)
    return [read(v, env) for v in jaxpr.outvars]


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
    to, now = np.dtype(eqn.params["new_dtype"]), _dtype(invals[0], eqn.invars[0].aval)
    return _floating(to) and _floating(now) and seen <= to.itemsize < now.itemsize


def _is_weak(v: Any) -> bool:
    return is_literal(v) or v.aval.weak_type


def _floating(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _dtype(value: Any, aval: Any) -> np.dtype:
    """The dtype ``value`` has now (a Python scalar: the one it was traced as)."""
    return np.dtype(getattr(value, "dtype", aval.dtype))


def _cast(value: Any, aval: Any, dtype: Any) -> Any:
    if _dtype(value, aval) == dtype:  # unchanged (a literal is bound as it is)
        return value
    return jax.lax.convert_element_type(value, dtype)


def _as_traced(eqn: Any, invals: Sequence[Any]) -> list:
    """The operands cast back to the dtypes the program traced them in."""
    return [
        _cast(x, v.aval, v.aval.dtype) if _floating(v.aval.dtype) else x
        for v, x in zip(eqn.invars, invals, strict=True)
    ]


def _promote(eqn: Any, invals: list, floor: np.dtype | None = None) -> list:
    """Operands traced in one dtype brought to one dtype again (the widest)."""
    groups: dict[np.dtype, list[int]] = {}
    for i, v in enumerate(eqn.invars):
        if _floating(v.aval.dtype):
            groups.setdefault(np.dtype(v.aval.dtype), []).append(i)
    out = list(invals)
    for members in groups.values():
        now = [_dtype(out[i], eqn.invars[i].aval) for i in members]
        # A literal is a scalar the program inlined (``h * 2.0``): weak.
        weak = [_is_weak(eqn.invars[i]) for i in members]
        strong = [d for d, w in zip(now, weak, strict=True) if not w]
        target = jnp.result_type(*(strong or now))
        if floor is not None:
            target = jnp.promote_types(target, floor)
        for i in members:
            out[i] = _cast(out[i], eqn.invars[i].aval, target)
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
        return [_cast(invals[0], eqn.invars[0].aval, wide)]
    if any(_holds_program(v) for v in eqn.params.values()):
        return bind(eqn, _as_traced(eqn, invals))
    square = name == "mul" and eqn.invars[0] is eqn.invars[1]  # x * x
    floor = _F32 if name in FLOAT32 or square or kept else None
    try:
        return bind(eqn, _promote(eqn, invals, floor))
    except (TypeError, ValueError):  # an op that takes only its traced dtypes
        return bind(eqn, _as_traced(eqn, invals))


def _matmul(eqn: Any, invals: list, dtype: Any) -> list:
    a, b = (v.aval.dtype for v in eqn.invars[:2])
    if not (_floating(a) and _floating(b)):  # an integer (quantised) matmul
        return bind(eqn, _as_traced(eqn, invals))
    operands = zip(invals[:2], eqn.invars[:2], strict=True)
    invals = [_cast(x, v.aval, dtype) for x, v in operands] + list(invals[2:])
    params = dict(eqn.params)
    preferred = params.get("preferred_element_type")
    if preferred is not None and np.dtype(preferred) == jnp.promote_types(a, b):
        params["preferred_element_type"] = None  # it restated the operands' dtype
    return bind(eqn, invals, params)


def _run(closed: Any, dtype: Any, keep: Sequence[Any] | None = None) -> Callable:
    """``closed`` as a function, its outputs cast to ``keep``'s dtypes if given."""

    def fn(*args: Any) -> list:
        outs = _eval(closed.jaxpr, closed.consts, args, dtype)
        if keep is None:
            return outs
        return [
            _cast(x, v.aval, v.aval.dtype) if _floating(v.aval.dtype) else x
            for x, v in zip(outs, keep, strict=True)
        ]

    return fn


def _jit(eqn: Any, invals: list, dtype: Any) -> list:
    return _run(eqn.params["jaxpr"], dtype)(*invals)


def _checkpoint(eqn: Any, invals: list, dtype: Any) -> list:
    p = eqn.params
    fn = jax.checkpoint(
        _run(as_closed(p["jaxpr"]), dtype),
        prevent_cse=p["prevent_cse"],
        policy=p["policy"],
    )
    return list(fn(*invals))


def _scan(eqn: Any, invals: list, dtype: Any) -> list:
    p = eqn.params
    n_consts, n_carry = p["num_consts"], p["num_carry"]
    consts, init, xs = (
        invals[:n_consts],
        invals[n_consts : n_consts + n_carry],
        invals[n_consts + n_carry :],
    )
    carry_vars = eqn.invars[n_consts : n_consts + n_carry]
    init = [
        _cast(x, v.aval, v.aval.dtype) for x, v in zip(init, carry_vars, strict=True)
    ]
    inner = _run(p["jaxpr"], dtype)

    def body(carry: list, x: list) -> tuple[list, list]:
        outs = inner(*consts, *carry, *x)
        kept = [
            _cast(c, v.aval, v.aval.dtype)
            for c, v in zip(outs[:n_carry], carry_vars, strict=True)
        ]
        return kept, outs[n_carry:]

    carry, ys = jax.lax.scan(
        body, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    return [*carry, *ys]


def _while(eqn: Any, invals: list, dtype: Any) -> list:
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
    carry_vars = eqn.invars[nc + nb :]
    init = [
        _cast(x, v.aval, v.aval.dtype) for x, v in zip(init, carry_vars, strict=True)
    ]
    cond, body = _run(p["cond_jaxpr"], dtype), _run(p["body_jaxpr"], dtype, carry_vars)
    return list(
        jax.lax.while_loop(
            lambda c: cond(*cconsts, *c)[0], lambda c: body(*bconsts, *c), init
        )
    )


def _cond(eqn: Any, invals: list, dtype: Any) -> list:
    index, *operands = invals
    branches = [_run(b, dtype, eqn.outvars) for b in eqn.params["branches"]]
    return list(jax.lax.switch(index, branches, *operands))


_NESTED: dict[str, Callable[[Any, list, Any], list]] = {
    "jit": _jit,
    "pjit": _jit,
    "closed_call": lambda eqn, invals, dtype: _run(eqn.params["call_jaxpr"], dtype)(
        *invals
    ),
    "remat2": _checkpoint,
    "checkpoint": _checkpoint,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
}
