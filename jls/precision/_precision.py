"""`precision_report`: which dtype each matmul of a function really runs in.

Arrays a model makes itself or closes over silently promote a cast
computation back to float32; the report counts what really runs.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jls.precision._collectives import compiled_collectives
from jls.precision._interpret import is_floating as _floating
from jls.precision._interpret import is_literal, trace
from jls.precision._primitives import COLLECTIVES, FLOAT32, MATMULS

# Ops autocast would compute in float32, noted when found in float16 or bfloat16.
_NOTED = FLOAT32
_LOW = frozenset({"float16", "bfloat16"})
# Frames inside these packages are not where a user's layer is written.
_LIBRARIES = ("jax", "jaxlib", "flax", "equinox", "optax", "jls", "haiku")


class Op(NamedTuple):
    """One operation of the traced program.

    Attributes:
      kind: the primitive (``dot_general``, ``psum``), or ``softmax``.
      dtype: the dtype it computes in: its operands' common dtype.
      where: ``file:line`` of the user's layer (the innermost frame outside
        jax and the model libraries), or ``"?"``.
      scope: its name stack within its program (``jax.named_scope`` names,
        linen module paths: ``"Decoder/lm_head"``), or ``""``.
    """

    kind: str
    dtype: str
    where: str
    scope: str = ""


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """What `precision_report` found.

    Attributes:
      counts: dtype name -> how many matmuls and convolutions compute in it.
      ops: every matmul and convolution, in program order.
      info: the range-sensitive ops found in float16 or bfloat16.
      numerics: op -> dtype name -> count, for the range-sensitive ops
        (those `jls.precision.autocast` computes in float32).
      held: op -> dtype name -> count: the dtype each such result is held in.
      collectives: every collective of the program, one per dtype it sends.
    """

    counts: dict[str, int]
    ops: tuple[Op, ...]
    info: tuple[Op, ...]
    numerics: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    collectives: tuple[Op, ...] = ()
    held: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def majority(self) -> str | None:
        """The dtype most matmuls compute in (``None`` without any)."""
        return Counter(self.counts).most_common(1)[0][0] if self.counts else None

    def check(self, dtype: Any) -> None:
        """Raises unless every matmul and convolution computes in ``dtype``.

        Raises:
          ValueError: listing the ``file:line`` of every one that does not.
        """
        want = np.dtype(dtype).name
        off = [op for op in self.ops if op.dtype != want]
        if not self.ops:
            raise ValueError(f"no matmul or convolution was traced: none in {want}")
        if off:
            lines = "\n".join(f"  {op.kind} in {op.dtype} at {op.where}" for op in off)
            raise ValueError(
                f"{len(off)} of {len(self.ops)} matmuls/convolutions do not compute "
                f"in {want}:\n{lines}\nCast what they read (an array the model "
                "makes itself, a model closed over instead of passed in) to "
                f"{want}, or give the layers dtype={want}."
            )

    def __str__(self) -> str:
        rows = [f"precision report: {len(self.ops)} matmuls/convolutions"]
        rows += [f"  {d:<10}{n:>5}" for d, n in sorted(self.counts.items())]
        majority = self.majority
        off = [op for op in self.ops if op.dtype != majority]
        if off:
            rows.append(f"not in {majority}:")
            rows += [
                f"  {op.kind} {op.dtype} at {op.where} {op.scope}".rstrip()
                for op in off
            ]
        if self.numerics:
            rows.append("range-sensitive ops (softmax, exp, log, sums) by dtype:")
            rows += [
                f"  {kind:<14}{_counts(by)}"
                + (f"  held {_counts(held)}" if held != by else "")
                for kind, by in sorted(self.numerics.items())
                for held in [self.held.get(kind, by)]
            ]
        if self.info:
            rows.append("low-precision numerics (information, not errors):")
            rows += [f"  {op.kind} {op.dtype} at {op.where}" for op in self.info]
        if self.collectives:
            rows.append("collectives:")
            rows += [f"  {op.kind} {op.dtype} at {op.where}" for op in self.collectives]
        return "\n".join(rows)


def _counts(by: dict[str, int]) -> str:
    return "  ".join(f"{d} {n}" for d, n in sorted(by.items()))


def _subjaxprs(value: Any) -> Iterator[Any]:
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(getattr(value, "jaxpr", None), "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _subjaxprs(item)


def _where(eqn: Any) -> str:
    """``file:line`` of the innermost frame outside jax and the model libraries."""
    try:
        frames = eqn.source_info.traceback.frames
    except AttributeError:
        return "?"
    fallback = None
    for frame in frames:
        path = frame.file_name.replace("\\", "/")
        place = f"{os.path.basename(frame.file_name)}:{frame.line_num}"
        installed = path.partition("/site-packages/")[2].split("/")[0]
        if installed in _LIBRARIES or any(
            f"/{lib}/_src/" in path for lib in _LIBRARIES
        ):
            fallback = fallback or place
        else:
            return place
    return fallback or "?"


def _is_softmax(jaxpr: Any) -> bool:
    prims = {e.primitive.name for e in jaxpr.eqns}
    return {"reduce_max", "exp", "reduce_sum"} <= prims


_THROUGH = frozenset(
    {"sub", "broadcast_in_dim", "stop_gradient", "max", "reshape", "squeeze"}
)


def _after_reduce_max(eqn: Any, producers: dict[Any, Any], depth: int = 6) -> bool:
    """Whether ``eqn``'s input comes from a ``reduce_max`` (a softmax's exp)."""
    todo = [(v, depth) for v in eqn.invars]
    while todo:
        var, left = todo.pop()
        if is_literal(var):  # a constant (unhashable on jax 0.8)
            continue
        source = producers.get(var)
        if source is None or left == 0:
            continue
        if source.primitive.name == "reduce_max":
            return True
        if source.primitive.name in _THROUGH:
            todo.extend((v, left - 1) for v in source.invars)
    return False


class _Found(NamedTuple):
    ops: list[Op]
    info: list[Op]
    numerics: Counter
    collectives: list[Op]
    held: Counter


def _live(jaxpr: Any) -> set[int]:
    """The ids of the equations whose results are used (XLA drops the rest)."""
    used = {v for v in jaxpr.outvars if not is_literal(v)}
    alive: set[int] = set()
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in used for v in eqn.outvars):
            alive.add(id(eqn))
            used.update(v for v in eqn.invars if not is_literal(v))
    return alive


def _uses(jaxpr: Any) -> dict[Any, list]:
    """Each variable's consumers (``None`` for an output of ``jaxpr``)."""
    uses: dict[Any, list] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not is_literal(v):
                uses.setdefault(v, []).append(eqn)
    for v in jaxpr.outvars:
        if not is_literal(v):
            uses.setdefault(v, []).append(None)
    return uses


def _held(var: Any, uses: dict[Any, list]) -> str:
    """The dtype ``var`` is held in: the narrowest all its uses cast it to."""
    users = uses.get(var, [])
    if not users or any(
        e is None or e.primitive.name != "convert_element_type" for e in users
    ):
        return var.aval.dtype.name
    dtypes = [var.aval.dtype, *(e.outvars[0].aval.dtype for e in users)]
    return min(dtypes, key=lambda d: np.dtype(d).itemsize).name


def _walk(jaxpr: Any, found: _Found, in_softmax: bool = False) -> None:
    alive = _live(jaxpr)
    uses = _uses(jaxpr)
    producers: dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        for out in eqn.outvars:
            producers[out] = eqn
        name = eqn.primitive.name
        dtype = eqn.invars[0].aval.dtype.name if eqn.invars else "?"
        softmax = name == "exp" and _after_reduce_max(eqn, producers)
        live = id(eqn) in alive
        if name in MATMULS:
            # The operands' common dtype (a float16 and a float32: float32).
            operands = [v.aval.dtype for v in eqn.invars[:2]]
            dtype = np.dtype(jnp.promote_types(*operands)).name
            found.ops.append(
                Op(name, dtype, _where(eqn), str(eqn.source_info.name_stack))
            )
        elif name in COLLECTIVES:
            for sent in sorted({v.aval.dtype.name for v in eqn.invars if _floating(v)}):
                found.collectives.append(Op(name, sent, _where(eqn)))
        elif name in _NOTED and dtype in _LOW and not in_softmax and live:
            kind = "softmax" if softmax else name
            found.info.append(Op(kind, dtype, _where(eqn)))
        counted = name in FLOAT32 and live and not in_softmax
        if counted and eqn.invars and _floating(eqn.invars[0]):
            kind = "softmax" if softmax else name
            found.numerics[(kind, dtype)] += 1
            found.held[(kind, _held(eqn.outvars[0], uses))] += 1
        subs = [s for v in eqn.params.values() for s in _subjaxprs(v)]
        if name.startswith("custom_jvp") and subs and _is_softmax(subs[0]):
            # A softmax with its own derivative: counted once, as a softmax.
            if dtype in _LOW:
                found.info.append(Op("softmax", dtype, _where(eqn)))
            found.numerics[("softmax", dtype)] += 1
            found.held[("softmax", _held(eqn.outvars[0], uses))] += 1
            for sub in subs:
                _walk(sub, found, in_softmax=True)
            continue
        for sub in subs:
            _walk(sub, found, in_softmax)


def precision_report(
    fn: Callable[..., Any] | jax.stages.Lowered, *args: Any, **kwargs: Any
) -> PrecisionReport:
    """Which dtype each matmul and convolution of ``fn(*args, **kwargs)`` runs in.

    Traces ``fn`` (nothing runs) and counts its matmuls, range-sensitive ops
    and collectives by dtype. Pass the model as an argument: one closed over
    is traced as constants.

    Args:
      fn: the function to trace, or a ``Compiled``/``Lowered`` step (its
        collectives only).
      *args: its arguments; arrays are traced, other leaves passed as is.
      **kwargs: its keyword arguments, likewise.

    Returns:
      A `PrecisionReport`; ``str(report)`` is a short table.

    Example:
      >>> import jax, jax.numpy as jnp, jls
      >>> spec = "params=float32,compute=float16,output=float32"
      >>> policy = jls.precision.get_policy(spec)
      >>> w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
      >>> loss = lambda w, x: jax.nn.logsumexp(x @ w)
      >>> report = jls.precision.precision_report(policy.wrap(loss), w, x)
      >>> report.counts, report.numerics["exp"], report.numerics["reduce_sum"]
      ({'float16': 1}, {'float32': 1}, {'float32': 1})
      >>> closed = policy.cast_arguments(lambda x: x @ w)  # w closed over
      >>> jls.precision.precision_report(closed, x).counts
      {'float32': 1}
    """
    if isinstance(fn, jax.stages.Lowered):
        fn = fn.compile()
    if isinstance(fn, jax.stages.Compiled):
        if args or kwargs:
            raise TypeError(
                "precision_report(compiled): a compiled step takes no arguments"
            )
        sent = (Op(*op) for op in compiled_collectives(fn.as_text() or ""))
        return PrecisionReport(counts={}, ops=(), info=(), collectives=tuple(sent))
    found = _Found([], [], Counter(), [], Counter())
    _walk(trace(fn, args, kwargs).closed.jaxpr, found)
    numerics: dict[str, dict[str, int]] = {}
    held: dict[str, dict[str, int]] = {}
    for counts, table in ((found.numerics, numerics), (found.held, held)):
        for (kind, dtype), n in sorted(counts.items()):
            table.setdefault(kind, {})[dtype] = n
    return PrecisionReport(
        counts=dict(Counter(op.dtype for op in found.ops)),
        ops=tuple(found.ops),
        info=tuple(found.info),
        numerics=numerics,
        collectives=tuple(found.collectives),
        held=held,
    )
