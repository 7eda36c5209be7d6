"""`precision_report`: which dtype each matmul of a function really runs in.

A casting policy casts arguments only. Arrays a model makes itself (a
float32 ``jnp.zeros`` carry, an LSTM carry in ``param_dtype``, a float32
``one_hot``) and a model closed over instead of passed in silently promote
the computation back to float32, and the loss looks normal. The report
traces the function (nothing is executed: ``jax.make_jaxpr``), walks every
nested program (``jit``, ``scan``, ``while``, ``cond``, ``remat``,
``custom_jvp``/``custom_vjp``; ``vmap`` is already applied in the trace),
and counts the ``dot_general`` and convolution operations by the dtype they
compute in, with the source line of each. Arguments may be whole models:
an equinox or flax ``nnx`` Module (its arrays are traced, everything else is
closed over).
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

_MATMULS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot"})
# Low-precision numerics worth knowing about (information, not errors).
_NOTED = frozenset(
    {
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "cumsum",
        "cumlogsumexp",
        "exp",
        "exp2",
        "log",
        "log1p",
        "logistic",
    }
)
_LOW = frozenset({"float16", "bfloat16"})
# Frames inside these packages are not where a user's layer is written.
_LIBRARIES = ("jax", "jaxlib", "flax", "equinox", "optax", "jls", "haiku")


class Op(NamedTuple):
    """One operation of the traced program.

    Attributes:
      kind: the primitive (``dot_general``, ``conv_general_dilated``), or
        ``softmax`` for a softmax found by its pattern.
      dtype: the dtype it computes in: its operands' common dtype (for a
        matmul of a float16 and a float32 operand, float32).
      where: ``file:line`` of the innermost frame outside jax and the model
        libraries (the user's layer), or ``"?"``.
    """

    kind: str
    dtype: str
    where: str


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
    """What `precision_report` found.

    Attributes:
      counts: dtype name -> how many matmuls and convolutions compute in it.
      ops: every matmul and convolution, in program order.
      info: low-precision reductions, ``exp``/``log``/``logistic`` and
        softmaxes (float16 or bfloat16): information, not errors.
    """

    counts: dict[str, int]
    ops: tuple[Op, ...]
    info: tuple[Op, ...]

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
            rows += [f"  {op.kind} {op.dtype} at {op.where}" for op in off]
        if self.info:
            rows.append("low-precision numerics (information, not errors):")
            rows += [f"  {op.kind} {op.dtype} at {op.where}" for op in self.info]
        return "\n".join(rows)


def _is_traceable(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _trace(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The closed jaxpr of ``fn(*args, **kwargs)``, arrays traced, rest static."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    mask = [_is_traceable(x) for x in leaves]

    def flat(*arrays: Any) -> Any:
        it = iter(arrays)
        full = [next(it) if m else x for x, m in zip(leaves, mask, strict=True)]
        a, k = jax.tree.unflatten(treedef, full)
        # Only the arrays of the result (a whole model may come back).
        return [x for x in jax.tree.leaves(fn(*a, **k)) if isinstance(x, jax.Array)]

    return jax.make_jaxpr(flat)(*[x for x, m in zip(leaves, mask, strict=True) if m])


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
        parts = frame.file_name.replace("\\", "/").split("/")
        place = f"{os.path.basename(frame.file_name)}:{frame.line_num}"
        if "site-packages" in parts:
            inside = parts[
                parts.index("site-packages") + 1 : parts.index("site-packages") + 2
            ]
            if inside and inside[0] in _LIBRARIES:
                fallback = fallback or place
                continue
        elif any(f"/{lib}/_src/" in frame.file_name for lib in _LIBRARIES):
            fallback = fallback or place
            continue
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
        source = producers.get(var)
        if source is None or left == 0:
            continue
        if source.primitive.name == "reduce_max":
            return True
        if source.primitive.name in _THROUGH:
            todo.extend((v, left - 1) for v in source.invars)
    return False


def _walk(jaxpr: Any, ops: list[Op], info: list[Op]) -> None:
    producers: dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        for out in eqn.outvars:
            producers[out] = eqn
        name = eqn.primitive.name
        dtype = eqn.invars[0].aval.dtype.name if eqn.invars else "?"
        if name in _MATMULS:
            # The operands' common dtype: jnp feeds dot_general a float16 and
            # a float32 operand as they are, and it computes in float32.
            operands = [v.aval.dtype for v in eqn.invars[:2]]
            dtype = np.dtype(jnp.promote_types(*operands)).name
            ops.append(Op(name, dtype, _where(eqn)))
        elif name in _NOTED and dtype in _LOW:
            softmax = name == "exp" and _after_reduce_max(eqn, producers)
            info.append(Op("softmax" if softmax else name, dtype, _where(eqn)))
        subs = [s for v in eqn.params.values() for s in _subjaxprs(v)]
        if name.startswith("custom_jvp") and subs and _is_softmax(subs[0]):
            if dtype in _LOW:
                info.append(Op("softmax", dtype, _where(eqn)))
            for sub in subs:  # its matmuls count; its exp/sums are the softmax
                _walk(sub, ops, [])
            continue
        for sub in subs:
            _walk(sub, ops, info)


def precision_report(
    fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> PrecisionReport:
    """Which dtype each matmul and convolution of ``fn(*args, **kwargs)`` runs in.

    Traces ``fn`` (nothing is executed) through every nested program and
    through equinox and flax ``nnx`` Modules passed as arguments, and counts
    its ``dot_general`` and convolution operations by the dtype they compute
    in. Pass the model as an argument: a model closed over is traced as
    constants, and so is reported in whatever dtype it holds.

    Args:
      fn: the function to trace: a forward pass, a loss, a whole train step.
      *args: its arguments; arrays are traced, other leaves (functions,
        numbers, a Module's static fields) are passed as they are.
      **kwargs: its keyword arguments, likewise.

    Returns:
      A `PrecisionReport`: ``.counts`` by dtype name, ``str(report)`` a short
      table with the ``file:line`` of every op not in the majority dtype,
      ``.check(dtype)`` raising unless every op computes in ``dtype``.

    Example:
      >>> import jax.numpy as jnp, jls
      >>> policy = jls.get_policy("params=float32,compute=float16,output=float32")
      >>> w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
      >>> jls.precision_report(policy.wrap(lambda w, x: x @ w), w, x).counts
      {'float16': 1}
      >>> closed = policy.wrap(lambda x: x @ w)  # w closed over: stays float32
      >>> jls.precision_report(closed, x).counts
      {'float32': 1}
    """
    jaxpr = _trace(fn, args, kwargs)
    ops: list[Op] = []
    info: list[Op] = []
    _walk(jaxpr.jaxpr, ops, info)
    counts = dict(Counter(op.dtype for op in ops))
    return PrecisionReport(counts=counts, ops=tuple(ops), info=tuple(info))
