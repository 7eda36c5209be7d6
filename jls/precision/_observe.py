"""The interpreter behind `explain_step`: every op of a program, observed.

`observe` binds each equation of a closed jaxpr again (under the caller's
``jit``) and reduces every floating value an op makes to a few numbers
(`_K`): its largest finite ``|x|``, how many of its entries are not finite,
the same of what went in, how many nonzero operands it flushed to zero, and
whether it made a non-finite value from finite operands. Nested ``jit``,
``custom_jvp``/``custom_vjp``, ``checkpoint``, ``scan``, ``while_loop`` and
``cond`` programs are observed inside: a loop's ops at every iteration (the
figures over all iterations, with the first iteration that made a
non-finite value), a ``cond``'s in the branch taken. Any other op with a
program (``shard_map``, ``pmap``) is observed as one op.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jls.precision._interpret import as_closed, bind, is_literal, read

# An op's row: its value's largest finite |x| and count of inf and nan, its
# operands' (same), the nonzero operands it flushed to zero, and whether it
# made a non-finite value from finite operands (0; in a loop, the outermost
# loop's first iteration that did; else inf).
_K = 6
_NEVER = np.float32(np.inf)
# The name scope around the backward pass: what tells it from the forward.
BACKWARD = "jls_backward"
# An op that only moves values: a non-finite constant it takes (a mask's
# -inf) is not made by it.
MOVES = frozenset(
    {"select_n", "broadcast_in_dim", "pad", "concatenate", "max", "min", "reshape"}
    | {"convert_element_type", "copy", "dynamic_update_slice", "scatter", "squeeze"}
)
# Ops whose zero from nonzero operands is an underflow (an exp to zero is not).
_FLUSH = frozenset({"mul", "div", "convert_element_type", "integer_pow", "square"})
_WRAPPER = re.compile(
    r"^(?:transpose|jvp|vmap|pmap|remat|checkpoint|jit|pjit)\((.*)\)$"
)
_LIBRARIES = ("flax", "equinox", "optax", "haiku", "jax", "jaxlib")
_JLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class Site(NamedTuple):
    """An observed op: its pass, primitive, line, layer, dtype and operands."""

    pass_: str
    primitive: str
    where: str
    layer: str
    dtype: str
    inputs: str
    in_loop: int | None  # its outermost enclosing loop, if any


class _Ctx(NamedTuple):
    names: str  # the enclosing equations' name stacks
    loop: int | None


def _floating(v: Any) -> bool:
    dtype = getattr(v.aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _source(names: str, eqn: Any) -> tuple[str, str]:
    """``file:line`` and the layer: the calls from the loss down, then the names.

    The line is the innermost of the user's own frames (else of a model
    library's). The calls are the user's frames (and the model library's
    where there is no name stack: flax nnx); the name stack names flax linen
    and equinox modules and ``jax.named_scope`` s.
    """
    parts = []
    for part in names.split("/"):
        while (m := _WRAPPER.match(part)) is not None:
            part = m.group(1)
        if part and part != BACKWARD:
            parts.append(part)
    calls, where, fallback = [], None, None
    for frame in getattr(eqn.source_info.traceback, "frames", ()):
        if frame.file_name.startswith(_JLS):
            break  # explain_step's own frames: the loss function is above
        tail = frame.file_name.replace("\\", "/").rpartition("/site-packages/")[2]
        library = tail.split("/")[0] in _LIBRARIES
        place = f"{os.path.basename(frame.file_name)}:{frame.line_num}"
        if tail.split("/")[0] in ("jax", "jaxlib") or "/jax/_src/" in tail:
            continue
        fallback = fallback or place
        where = where or (None if library else place)
        if not (parts and library) and frame.function_name[0] != "<":
            calls.append(frame.function_name.removesuffix(".__call__"))
    out: list[str] = []
    for part in [*reversed(calls), *parts]:
        part = part.replace(".<locals>.", "/")
        if not out or out[-1] != part:
            out.append(part)
    return where or fallback or "jls.scale_loss", "/".join(out)


def _measure(x: Any) -> Any:
    """``[largest finite |x|, count of inf and nan]``, as float32."""
    x = jnp.abs(jnp.asarray(x))
    finite = x <= jnp.finfo(x.dtype).max  # False for inf and nan
    top = jnp.max(jnp.where(finite, x, 0), initial=0).astype(jnp.float32)
    return jnp.stack([top, jnp.sum(~finite, dtype=jnp.float32)])


def _stats(eqn: Any, invals: list, outs: list, measured: Callable) -> Any:
    """An op's row: its value's and operands' measures, flushes, whether it made."""
    name = eqn.primitive.name
    out = [
        measured(v, x) for v, x in zip(eqn.outvars, outs, strict=True) if _floating(v)
    ]
    ins = [
        measured(v, x)
        for v, x in zip(eqn.invars, invals, strict=True)
        if _floating(v) and (name in MOVES or not is_literal(v))
    ]
    zero = jnp.zeros(2, jnp.float32)
    out_max, out_bad = jnp.max(jnp.stack(out), 0)[0], jnp.sum(jnp.stack(out), 0)[1]
    in_max, in_bad = (
        (jnp.max(jnp.stack(ins), 0)[0], jnp.sum(jnp.stack(ins), 0)[1]) if ins else zero
    )
    flushed = zero[0]
    shape = np.shape(outs[0])
    if name in _FLUSH and all(np.shape(x) in ((), shape) for x in invals):
        nonzero = [jnp.broadcast_to(jnp.asarray(x) != 0, shape) for x in invals]
        lost = (outs[0] == 0) & jnp.all(jnp.stack(nonzero), 0)
        flushed = jnp.sum(lost, dtype=jnp.float32)
    made = jnp.where((out_bad > 0) & (in_bad == 0), 0.0, _NEVER)
    return jnp.stack([out_max, out_bad, in_max, in_bad, flushed, made])


_IDLE = np.array([0, 0, 0, 0, 0, np.inf], np.float32)
_SUM = np.array([0, 1, 0, 1, 1, 0], bool)
_MIN = np.array([0, 0, 0, 0, 0, 1], bool)
_Recs = list  # of (tuple of Site, stats [n, _K])


def _site(eqn: Any, ctx: _Ctx) -> Site:
    names = f"{ctx.names}/{eqn.source_info.name_stack}"
    where, layer = _source(names, eqn)
    dtype = next(v.aval.dtype.name for v in eqn.outvars if _floating(v))
    ins = ", ".join(v.aval.str_short() for v in eqn.invars if _floating(v))
    pass_ = "backward" if BACKWARD in names.split("/") else "forward"
    return Site(pass_, eqn.primitive.name, where, layer, dtype, ins, ctx.loop)


def _eval(closed: Any, args: Sequence[Any], ctx: _Ctx, recs: _Recs) -> list:
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    seen: dict[Any, Any] = {}  # each value measured once, however often read

    def measured(v: Any, x: Any) -> Any:
        if is_literal(v):
            return _measure(x)
        if v not in seen:
            seen[v] = _measure(x)
        return seen[v]

    for eqn in jaxpr.eqns:
        invals = [read(v, env) for v in eqn.invars]
        nested = _NESTED.get(eqn.primitive.name)
        if nested is not None:
            names = f"{ctx.names}/{eqn.source_info.name_stack}"
            outs = nested(eqn, invals, ctx._replace(names=names), recs)
        else:
            outs = bind(eqn, invals)
            if any(_floating(v) for v in eqn.outvars):
                recs.append(
                    ((_site(eqn, ctx),), _stats(eqn, invals, outs, measured)[None])
                )
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v, env) for v in jaxpr.outvars]


def _run(closed: Any, args: Sequence[Any], ctx: _Ctx) -> tuple[list, list, Any]:
    recs: _Recs = []
    outs = _eval(closed, args, ctx, recs)
    blocks = [b for _, b in recs] or [jnp.zeros((0, _K), jnp.float32)]
    return outs, [s for block, _ in recs for s in block], jnp.concatenate(blocks)


def _traced(closed: Any, ctx: _Ctx) -> tuple[Callable, list, int]:
    """``closed`` as ``fn(*args) -> (outs, rows)``, its sites, and their count."""
    sites: list = []

    def fn(*args: Any) -> tuple[list, Any]:
        outs, sites[:], rows = _run(closed, args, ctx)
        return outs, rows

    specs = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars
    ]
    return fn, sites, jax.eval_shape(lambda *a: fn(*a)[1], *specs).shape[0]


def _call(key: str) -> Callable:
    def call(eqn: Any, invals: list, ctx: _Ctx, recs: _Recs) -> list:
        closed = eqn.params[key]
        if "name" in eqn.params:  # a jit's function name
            ctx = ctx._replace(names=f"{ctx.names}/{eqn.params['name']}")
        return _eval(
            closed if hasattr(closed, "consts") else as_closed(closed),
            invals,
            ctx,
            recs,
        )

    return call


def _combine(acc: Any, new: Any, i: Any) -> Any:
    new = new.at[:, 5].set(jnp.where(new[:, 5] < _NEVER, i, _NEVER))
    return jnp.where(
        _SUM[None],
        acc + new,
        jnp.where(_MIN[None], jnp.minimum(acc, new), jnp.maximum(acc, new)),
    )


def _loop_ctx(ctx: _Ctx) -> _Ctx:
    return ctx if ctx.loop is not None else ctx._replace(loop=next(_LOOPS))


def _scan(eqn: Any, invals: list, ctx: _Ctx, recs: _Recs) -> list:
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
    fn, sites, n = _traced(p["jaxpr"], _loop_ctx(ctx))

    def body(carry: tuple, x: list) -> tuple:
        c, acc, i = carry
        outs, stats = fn(*consts, *c, *x)
        return (outs[:nk], _combine(acc, stats, i), i + 1), outs[nk:]

    start = (list(init), jnp.tile(_IDLE, (n, 1)), jnp.float32(0))
    (carry, acc, _), ys = jax.lax.scan(
        body,
        start,
        list(xs),
        length=p["length"],
        reverse=p["reverse"],
        unroll=p["unroll"],
    )
    recs.append((tuple(sites), acc))
    return [*carry, *ys]


def _while(eqn: Any, invals: list, ctx: _Ctx, recs: _Recs) -> list:
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:nc], invals[nc : nc + nb], invals[nc + nb :]
    fn, sites, n = _traced(p["body_jaxpr"], _loop_ctx(ctx))

    def cond(carry: tuple) -> Any:
        return _eval(p["cond_jaxpr"], [*cconsts, *carry[0]], ctx, [])[0]

    def body(carry: tuple) -> tuple:
        c, acc, i = carry
        outs, stats = fn(*bconsts, *c)
        return outs, _combine(acc, stats, i), i + 1

    start = (list(init), jnp.tile(_IDLE, (n, 1)), jnp.float32(0))
    carry, acc, _ = jax.lax.while_loop(cond, body, start)
    recs.append((tuple(sites), acc))
    return list(carry)


def _cond(eqn: Any, invals: list, ctx: _Ctx, recs: _Recs) -> list:
    index, *operands = invals
    traced = [_traced(b, ctx) for b in eqn.params["branches"]]
    sizes = [n for _, _, n in traced]
    starts = np.cumsum([0, *sizes])

    def branch(k: int) -> Callable:
        def run(*args: Any) -> tuple:
            outs, stats = traced[k][0](*args)
            full = jnp.tile(_IDLE, (int(starts[-1]), 1))
            return outs, jax.lax.dynamic_update_slice(full, stats, (int(starts[k]), 0))

        return run

    outs, stats = jax.lax.switch(
        index, [branch(k) for k in range(len(traced))], *operands
    )
    recs.append((tuple(s for _, sites, _ in traced for s in sites), stats))
    return list(outs)


_LOOPS = itertools.count()
_JLS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))).replace("\\", "/") + "/"
)
_NESTED: dict[str, Callable[[Any, list, _Ctx, _Recs], list]] = {
    "jit": _call("jaxpr"),
    "pjit": _call("jaxpr"),
    "closed_call": _call("call_jaxpr"),
    "core_call": _call("call_jaxpr"),
    "custom_jvp_call": _call("call_jaxpr"),
    "custom_vjp_call": _call("call_jaxpr"),
    "remat2": _call("jaxpr"),
    "checkpoint": _call("jaxpr"),
    "scan": _scan,
    "while": _while,
    "cond": _cond,
}


def observe(closed: Any, args: Sequence[Any]) -> tuple[list, list, Any]:
    """``closed`` run on ``args``: its outputs, its ops' `Site` s, their rows.

    The rows are an array ``[len(sites), _K]``. Ops under the name scope
    `BACKWARD` are the backward pass's.
    """
    return _run(closed, args, _Ctx("", None))
