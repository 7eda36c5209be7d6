"""The interpreter behind `explain_step`: every floating value an op makes, measured.

`observe` binds each equation again and measures each value once (its largest
``|x|``); nested calls, loops (every iteration) and ``cond`` (the branch taken)
are observed inside, any other op with a program (``shard_map``) as one op.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jls.precision import _measure
from jls.precision._interpret import (
    bind,
    interpret,
    is_floating,
    is_literal,
    loop,
    program,
)
from jls.precision._measure import TOGETHER, held_bytes, measures

_F32 = np.dtype(np.float32)
_NEVER = np.float32(np.inf)
_ZEROS, _NEVERS, _EMPTY = np.zeros(1, _F32), np.full(1, np.inf, _F32), np.zeros(0, _F32)
_TRUE, _BIG = np.ones(1, bool), np.finfo(_F32).max
_IDLE = (0, 0, np.inf)  # a record's entries where nothing was observed
# The name scope around the backward pass: what tells it from the forward.
BACKWARD = "jls_backward"
# An op that only moves values: a non-finite constant it takes (a mask's
# -inf) is not made by it.
MOVES = frozenset(
    {"select_n", "broadcast_in_dim", "pad", "concatenate", "max", "min", "reshape"}
    | {"convert_element_type", "copy", "dynamic_update_slice", "scatter", "squeeze"}
    | {"transpose", "slice", "dynamic_slice", "gather", "rev"}
)
# Ops whose value has its operand's largest |x|, as a widening cast's (`_cast`):
# not observed (their value is measured as their operand's).
_SAME = {"reshape", "broadcast_in_dim", "transpose", "squeeze", "copy", "neg"}


class Site(NamedTuple):
    """An observed op: what the report shows, and its entries in a `Record`."""

    pass_: str
    primitive: str
    source: Any  # its source_info: the line and the layer
    names: str  # its name stack and its enclosing equations'
    dtype: str
    inputs: str
    in_loop: int | None  # its outermost enclosing loop, if any
    outs: tuple[int, ...]  # its value's entries in `Record.top`
    ins: tuple[int, ...]  # its operands'
    flush: int | None  # its entry in `Record.flush` (a cast's)
    made: int | None  # its entry in `Record.made` (in a loop)


class Record(NamedTuple):
    """What a run measured, float32 vectors (a loop's: up to its first overflow)."""

    top: Any  # each value's largest |x|: inf or nan if an entry is
    flush: Any  # a cast's nonzero operands flushed to zero
    made: Any  # the first iteration a loop's op made a non-finite value, else inf


def _shift(s: Site, by: Sequence[int]) -> Site:
    """``s`` with its entries moved ``by`` (the top, flush and made offsets)."""
    return s._replace(
        outs=tuple(i + by[0] for i in s.outs),
        ins=tuple(i + by[0] for i in s.ins),
        flush=None if s.flush is None else s.flush + by[1],
        made=None if s.made is None else s.made + by[2],
    )


class _Log:
    """The sites and the measures of one program's run, as they are made."""

    def __init__(self, names: str, loop: int | None) -> None:
        # The enclosing equations' name stacks, the outermost enclosing loop.
        self.names, self.loop, self.sites = names, loop, []
        self.parts: tuple[list, ...] = ([], [], [])
        self.sizes = [0, 0, 0]
        self.made: list[tuple] = []  # a loop's ops: (entry, outs, ins), flags to come
        self.row: list[tuple[int, Any]] = []  # values held, with their slots

    def add(self, k: int, part: Any) -> int:
        self.parts[k].append(part)
        self.sizes[k] += part.shape[0]
        return self.sizes[k] - part.shape[0]

    def measure(self, x: Any) -> int:
        """``x``'s entry in the record's ``top``."""
        x, i = jnp.asarray(x), self.add(0, _ZEROS)  # a placeholder, until measured
        if held_bytes(self.row) + x.size * x.dtype.itemsize > _measure.HOLD:
            self._settle()
        self.row.append((len(self.parts[0]) - 1, x))
        if (
            not TOGETHER.get()
            or len(self.row) == _measure.ROW
            or held_bytes(self.row) >= _measure.HOLD
        ):
            self._settle()
        return i

    def _settle(self) -> None:
        """Measures the values held: one reduction for those of one aval."""
        for aval in dict.fromkeys(x.aval for _, x in self.row):
            same = [(k, x) for k, x in self.row if x.aval == aval]
            slots, xs = zip(*same, strict=True)
            for slot, top in zip(slots, measures(xs), strict=True):
                self.parts[0][slot] = top
        self.row = []

    def merge(self, sites: list, record: Record) -> None:
        self._settle()
        self.sites += [_shift(s, self.sizes) for s in sites]
        for k, part in enumerate(record):
            self.add(k, part)

    def record(self) -> Record:
        self._settle()
        top = lax.concatenate(self.parts[0], 0) if self.parts[0] else _EMPTY
        if self.made:  # some value not finite, every operand finite
            fin = lax.concatenate([lax.le(top, lax.full_like(top, _BIG)), _TRUE], 0)
            slots, outs, ins = zip(*self.made, strict=True)
            outs_ok, ins_ok = (_all_of(fin, ix, len(top)) for ix in (outs, ins))
            made = lax.select(
                ins_ok & ~outs_ok, *(np.full(len(slots), v, _F32) for v in (0, np.inf))
            )
            for k, slot in enumerate(slots):
                self.parts[2][slot] = lax.slice(made, (k,), (k + 1,))
        rest = (lax.concatenate(p, 0) if p else _EMPTY for p in self.parts[1:])
        return Record(top, *rest)


def _all_of(flags: Any, rows: Sequence[tuple], pad: int) -> Any:
    """Whether each row's ``flags`` are all true (``flags[pad]`` is true)."""
    width = max(map(len, rows), default=0)
    ix = np.array([list(r) + [pad] * (width - len(r)) for r in rows], np.int32)
    return jnp.all(flags[ix.reshape(len(rows), width)], axis=1)


def _cast(eqn: Any) -> tuple[bool, bool]:
    """Whether a cast keeps every value; whether it can flush a nonzero to zero.

    (The only zero called an underflow: an exp's is none; products compile slower.)
    """
    a, b = (v.aval.dtype for v in (eqn.invars[0], eqn.outvars[0]))
    if not (jnp.issubdtype(a, jnp.floating) and jnp.issubdtype(b, jnp.floating)):
        return False, False
    a, b = jnp.finfo(a), jnp.finfo(b)
    widens = b.nmant >= a.nmant and b.maxexp >= a.maxexp and b.minexp <= a.minexp
    return widens, float(b.smallest_subnormal) > float(a.smallest_subnormal)


def _flushed(x: Any, out: Any) -> Any:
    """How many entries of a cast's ``out`` are zero where its operand ``x`` is not."""
    x = jnp.asarray(x)
    lost = lax.bitwise_and(
        lax.eq(out, lax.full_like(out, 0)), lax.ne(x, lax.full_like(x, 0))
    )
    lost = lax.convert_element_type(lost, _F32)
    return lax.reshape(lax.reduce_sum(lost, tuple(range(out.ndim))), (1,))


def _observe_op(eqn: Any, invals: list, outs: list, log: _Log, index: Callable) -> None:
    """``eqn``'s site, its measures (and in a loop, whether it made a non-finite)."""
    name = eqn.primitive.name
    pairs = zip(eqn.outvars, outs, strict=True)
    out_ix = tuple(index(v, x) for v, x in pairs if is_floating(v))
    pairs = zip(eqn.invars, invals, strict=True)
    in_ix = tuple(
        index(v, x)
        for v, x in pairs
        if is_floating(v) and (name in MOVES or not is_literal(v))
    )
    flush = made = None
    if name == "convert_element_type" and _cast(eqn)[1]:
        flush = log.add(1, _flushed(invals[0], outs[0]))
    if log.loop is not None:  # its flag: whether it made a non-finite value
        made = log.add(2, _NEVERS)  # a placeholder, until `_Log.record`
        log.made.append((len(log.parts[2]) - 1, out_ix, in_ix))
    names = f"{log.names}/{eqn.source_info.name_stack}"
    dtype = next(v.aval.dtype.name for v in eqn.outvars if is_floating(v))
    ins = ", ".join(v.aval.str_short() for v in eqn.invars if is_floating(v))
    pass_ = "backward" if BACKWARD in names.split("/") else "forward"
    site = (pass_, name, eqn.source_info, names, dtype, ins, log.loop)
    log.sites.append(Site(*site, out_ix, in_ix, flush, made))


def _eval(closed: Any, args: Sequence[Any], log: _Log) -> list:
    seen: dict[Any, int] = {}  # each value measured once, however often read
    alias: dict[Any, Any] = {}  # a value only moved: the one it was moved from

    def index(v: Any, x: Any) -> int:
        if not is_literal(v):
            v, x = alias.get(v, (v, x))
            if v in seen:
                return seen[v]
        i = log.measure(x)
        if not is_literal(v):
            seen[v] = i
        return i

    def step(eqn: Any, invals: list) -> list:
        name = eqn.primitive.name
        if name in _NESTED:
            names = f"{log.names}/{eqn.source_info.name_stack}"
            return _NESTED[name](eqn, invals, _Log(names, log.loop), log)
        outs = bind(eqn, invals)
        cast = name == "convert_element_type" and _cast(eqn)[0]
        if (name in _SAME or cast) and not is_literal(eqn.invars[0]):
            source = eqn.invars[0]
            alias[eqn.outvars[0]] = alias.get(source, (source, invals[0]))
        elif any(is_floating(v) for v in eqn.outvars):
            _observe_op(eqn, invals, outs, log, index)
        return outs

    return interpret(closed, args, step)


def _traced(closed: Any, names: str, loop: Any) -> tuple[Callable, list, list]:
    """``closed`` as ``fn(*args) -> (outs, record)``, its sites, its record's sizes."""
    sites: list = []

    def fn(*args: Any) -> tuple[list, Record]:
        log = _Log(names, loop)
        outs = _eval(closed, args, log)
        sites[:] = log.sites
        return outs, log.record()

    specs = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars
    ]
    return fn, sites, [r.shape[0] for r in jax.eval_shape(lambda *a: fn(*a)[1], *specs)]


def _call(eqn: Any, invals: list, inner: _Log, log: _Log) -> list:
    name = eqn.params.get("name", "")  # a jit's function name
    inner.names += f"/{name}"
    outs = _eval(program(eqn), invals, inner)
    log.merge(inner.sites, inner.record())
    return outs


def _idle(sizes: Sequence[int]) -> Record:
    """A record of nothing observed: what a loop starts from, a branch not taken."""
    return Record(*(jnp.full(n, v, _F32) for n, v in zip(sizes, _IDLE, strict=True)))


def _combine(state: tuple, new: Record) -> tuple:
    """A loop's record after one more iteration: frozen after its first overflow."""
    acc, i = state
    made = jnp.minimum(acc.made, jnp.where(new.made < _NEVER, i, _NEVER))
    done = jnp.min(acc.made, initial=_NEVER) < _NEVER
    top = jnp.where(done, acc.top, jnp.maximum(acc.top, new.top))
    return Record(top, jnp.where(done, acc.flush, acc.flush + new.flush), made), i + 1


def _loop(eqn: Any, invals: list, inner: _Log, log: _Log) -> list:
    """A ``scan`` or ``while``, its body's record carried over the iterations."""
    body = eqn.params["jaxpr" if eqn.primitive.name == "scan" else "body_jaxpr"]
    fn, sites, n = _traced(body, inner.names, inner.loop or next(_LOOPS))

    def run(closed: Any) -> Callable:
        def step(state: tuple, *args: Any) -> tuple:
            if closed is not body:  # a while's condition: not observed
                return state, _eval(closed, args, _Log(inner.names, inner.loop))
            outs, record = fn(*args)
            return _combine(state, record), outs

        return step

    (acc, _), outs = loop(eqn, invals, run, (_idle(n), jnp.float32(0)))
    log.merge(sites, acc)
    return outs


def _cond(eqn: Any, invals: list, inner: _Log, log: _Log) -> list:
    index, *operands = invals
    traced = [_traced(b, inner.names, inner.loop) for b in eqn.params["branches"]]
    sizes = np.array([n for _, _, n in traced])
    starts = np.cumsum(sizes, 0) - sizes

    def branch(k: int) -> Callable:
        def run(*args: Any) -> tuple:  # its record among the others' idle ones
            outs, record = traced[k][0](*args)
            before, after = _idle(starts[k]), _idle(sizes.sum(0) - starts[k] - sizes[k])
            parts = zip(before, record, after, strict=True)
            return outs, Record(*(lax.concatenate(list(p), 0) for p in parts))

        return run

    outs, record = jax.lax.switch(
        index, [branch(k) for k in range(len(traced))], *operands
    )
    sites = [_shift(s, starts[k]) for k, (_, ss, _) in enumerate(traced) for s in ss]
    log.merge(sites, record)
    return list(outs)


_LOOPS = itertools.count()
_CALLS = ("jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint")
_NESTED: dict[str, Callable[[Any, list, _Log, _Log], list]] = {
    **dict.fromkeys((*_CALLS, "custom_jvp_call", "custom_vjp_call"), _call),
    "scan": _loop,
    "while": _loop,
    "cond": _cond,
}


def observe(
    closed: Any, args: Sequence[Any], together: bool = True
) -> tuple[list, list, Record]:
    """``closed`` run on ``args``: its outputs, its ops' `Site` s, their `Record`.

    ``together``: values may be measured together (the program runs on one device).
    """
    log, token = _Log("", None), TOGETHER.set(together)
    try:
        outs = _eval(closed, args, log)
        return outs, log.sites, log.record()
    finally:
        TOGETHER.reset(token)


def tops(xs: Sequence[Any], together: bool = True) -> Any:
    """Each one's largest ``|x|`` (inf or nan if an entry is), a float32 vector."""
    log, token = _Log("", None), TOGETHER.set(together)
    try:
        for x in xs:
            log.measure(x)
        return log.record().top
    finally:
        TOGETHER.reset(token)
