"""`explain_step`: where a step overflowed, its op, line, layer and pass.

The forward and backward (``jax.vjp``, the pullback under the name scope
`BACKWARD`) are observed under one ``jit``; nothing runs unless called.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import sysconfig
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jls._loss_scaling import metrics
from jls.precision._interpret import is_array, is_program, trace
from jls.precision._observe import BACKWARD, MOVES, Record, observe, tops

_keystr = jax.tree_util.keystr
# Primitives that place a program on several devices.
_SHARDING = frozenset({"sharding_constraint", "shard_map", "device_put", "xla_pmap"})
# The explanation runs once: its compilation is its cost, and on XLA:CPU
# the backend's optimisation is most of that (benchmarks/bench_explain.py),
# unless a loop runs long (a while, a scan of more than _LONG steps).
_QUICK, _LONG = {"cpu": {"xla_backend_optimization_level": 0}}, 5000
# Values as their dtype holds them: no op computed in a wider type unrounded.
_EXACT = {"xla_allow_excess_precision": False}

_WRAPPER = re.compile(r"^(?:transpose|jvp|vmap|pmap|remat|checkpoint|pjit)\((.*)\)$")
_LIBRARIES = ("flax", "equinox", "optax", "haiku", "jax", "jaxlib")
_JLS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Python's own modules (contextlib's frames, which older jax keeps) are no place.
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


class Op(NamedTuple):
    """One op's values, as the explanation saw them.

    Attributes:
      pass_: ``"forward"`` or ``"backward"``.
      primitive: the jax primitive (``exp``, ``dot_general``...).
      where: ``file:line`` of the user's code that made it.
      layer: the name stack and calls from the loss down (``loss > Block``).
      dtype: the dtype of its value.
      inputs: the shapes and dtypes of its floating operands.
      in_max: the operands' largest ``|x|`` (inf or nan if an entry is).
      out_max: the same of its value.
      flushed: for a cast, the nonzero values it turned into zero.
      iteration: in a loop, the iteration it first made a non-finite value.
    """

    pass_: str
    primitive: str
    where: str
    layer: str
    dtype: str
    inputs: str
    in_max: float
    out_max: float
    flushed: int = 0
    iteration: int | None = None

    @property
    def headroom(self) -> float:
        """``dtype max / largest |value|``: how far its value is from overflow."""
        return (
            float(jnp.finfo(self.dtype).max) / self.out_max
            if self.out_max
            else math.inf
        )

    def __str__(self) -> str:
        loop = "" if self.iteration is None else f" (loop iteration {self.iteration})"
        return (
            f"{self.pass_} {self.primitive} -> {self.dtype} at {self.where}{loop}\n"
            f"  layer: {self.layer or '?'}\n"
            f"  in:  {self.inputs}: max|x| {self.in_max:.4g}\n"
            f"  out: max|x| {self.out_max:.4g}"
        )


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What `explain_step` found; ``str(report)`` is a short text report.

    Attributes:
      scale: the loss scale the step ran with.
      loss: the unscaled loss.
      grads_finite: whether every scaled gradient was finite.
      nonfinite_args: the paths of argument leaves already not finite.
      first: the first op to make inf or nan from finite operands, or ``None``.
      least_headroom: the ops nearest their dtype's maximum, nearest first.
      first_flush: the first cast that flushed nonzero values to zero.
    """

    scale: float
    loss: float
    grads_finite: bool
    nonfinite_args: tuple[str, ...]
    first: Op | None
    least_headroom: tuple[Op, ...]
    first_flush: Op | None = None

    def __str__(self) -> str:
        ok = "finite" if self.grads_finite else "NOT finite (the step is skipped)"
        rows = [
            f"step at loss scale {self.scale:g}: loss {self.loss:.6g}, gradients {ok}"
        ]
        if self.nonfinite_args:
            rows.append("non-finite before any op, in the arguments:")
            rows += [f"  {p}" for p in self.nonfinite_args]
        if self.first is not None:
            rows += ["first op to overflow (inf/nan from finite operands):"]
            rows += ["  " + r for r in str(self.first).splitlines()]
        elif not self.nonfinite_args:
            rows.append("no op overflowed")
        if self.first_flush is not None:
            f = self.first_flush
            rows.append(
                f"first underflow: {f.pass_} {f.primitive} -> {f.dtype} at "
                f"{f.where} flushed {f.flushed} nonzero values to zero"
            )
        rows.append(
            "least headroom (dtype max / max|value|; backward grows with scale):"
        )
        rows += [
            f"  {op.headroom:>9.3g}x  {op.pass_:<8} {op.primitive:<20} {op.dtype:<8} "
            f"{op.where}  {op.layer}"
            for op in self.least_headroom
        ]
        return "\n".join(rows)

    def _repr_markdown_(self) -> str:
        return f"```text\n{self}\n```"


def _scale_of(state: Any) -> np.float32:
    """The scale a state holds (`jls.metrics`' ``loss_scale``), or a number's."""
    if isinstance(state, (int, float, np.generic, np.ndarray, jax.Array)):
        return np.float32(state)
    return np.float32(np.ravel(metrics(state)["loss_scale"])[0])


def _step(loss_fn: Callable, nums: set, has_aux: bool) -> Callable:
    """``(scale, *args, **kwargs) -> (loss, gradients)``, the backward named."""

    def step(scale: Any, *args: Any, **kwargs: Any) -> tuple:
        flat, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
        leaves = [x for _, x in flat]
        diff = [
            i
            for i, (p, x) in enumerate(flat)
            if p[0].idx == 0 and p[1].idx in nums and _floating(x)
        ]

        def scaled(d: list) -> tuple:
            for i, x in zip(diff, d, strict=True):
                leaves[i] = x
            a, k = jax.tree.unflatten(treedef, leaves)
            loss = jnp.asarray(loss_fn(*a, **k)[0] if has_aux else loss_fn(*a, **k))
            wide = jnp.promote_types(loss.dtype, jnp.float32)  # as jls.scale_loss
            return loss.astype(wide) * scale.astype(wide), loss

        out, pullback, loss = jax.vjp(scaled, [leaves[i] for i in diff], has_aux=True)
        with jax.named_scope(BACKWARD):
            return loss, pullback(jnp.ones((), out.dtype))[0]

    return step


def _eqns(jaxpr: Any) -> list:
    """The equations of a program (closed or not) and of the programs inside it."""
    eqns = []
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        eqns.append(eqn)
        for value in eqn.params.values():
            for p in value if isinstance(value, tuple) else (value,):
                eqns += _eqns(p) if is_program(p) else []
    return eqns


def _options(eqns: list) -> dict:
    """The explanation's compiler options: quick to compile, unless a loop runs long."""
    long = any(
        e.primitive.name == "while"
        or e.primitive.name == "scan"
        and e.params["length"] > _LONG
        for e in eqns
    )
    return {**_EXACT, **({} if long else _QUICK.get(jax.default_backend(), {}))}


def _floating(x: Any) -> bool:
    return is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)


def explain_step(
    loss_fn: Callable[..., Any],
    opt_state: Any,
    *args: Any,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    top: int = 5,
    **kwargs: Any,
) -> StepReport:
    """Runs a step's forward and backward again and says where it overflowed.

    Every op of the scaled forward and backward is checked under one ``jit``;
    the cost is paid here only. See docs/howto/why_skip.md.

    Args:
      loss_fn: the unscaled loss, as the step differentiates it.
      opt_state: the state the step ran with (before the back-off), or a scale.
      *args: the step's arguments.
      argnums: which arguments the gradients are taken of.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      top: how many ops the least-headroom table lists.
      **kwargs: keyword arguments of ``loss_fn``.

    Returns:
      A ``StepReport``: the first op that overflowed, and those nearest.

    Example:
      >>> import jax.numpy as jnp, jls
      >>> loss = lambda w, x: jnp.sum(jnp.exp(x * w))
      >>> w, x = jnp.ones(3, jnp.float16), jnp.array([1.0, 5.0, 12.0], jnp.float16)
      >>> report = jls.precision.explain_step(loss, 1.0, w, x)
      >>> report.first.pass_, report.first.primitive, report.first.dtype
      ('forward', 'exp', 'float16')
    """
    nums = {argnums} if isinstance(argnums, int) else set(argnums)
    scale = _scale_of(opt_state)
    traced = trace(_step(loss_fn, nums, has_aux), (scale, *args), kwargs)
    sites: list = []
    devices = {d for x in traced.arrays for d in x.sharding.device_set}
    eqns = _eqns(traced.closed)
    together = len(devices) == 1 and not {e.primitive.name for e in eqns} & _SHARDING

    @functools.partial(jax.jit, compiler_options=_options(eqns))
    def run(arrays: list) -> tuple:
        (loss, *grads), sites[:], record = observe(traced.closed, arrays, together)
        # Measured as the ops are: jnp.isfinite's reductions compile slower.
        found = [*grads, *(x for x in arrays if _floating(x))]
        return loss, record, tops(found, together)

    loss, record, measured = jax.device_get(run(traced.arrays))
    n = len(measured) - sum(map(_floating, traced.arrays))  # the gradients'
    ok, args_ok = np.isfinite(measured[:n]).all(), iter(np.isfinite(measured[n:]))
    finite = [next(args_ok) if _floating(x) else True for x in traced.arrays]
    flat = jax.tree_util.tree_flatten_with_path(((scale, *args), kwargs))[0]
    paths = [p for p, x in flat if is_array(x)]
    bad = tuple(
        f"args[{p[1].idx - 1}]{_keystr(p[2:])}"
        if p[0].idx == 0
        else f"kwargs{_keystr(p[1:])}"
        for p, f in zip(paths, finite, strict=True)
        if not f
    )
    return _report(sites, record, (float(scale), float(loss), bool(ok), bad), top)


def _source(names: str, info: Any) -> tuple[str, str]:
    """``file:line`` of the innermost user frame and the layer, ``names in calls``."""
    parts = []
    for part in names.split("/"):
        while (m := _WRAPPER.match(part)) is not None:
            part = m.group(1)
        if part not in ("", BACKWARD, *parts[-1:]):
            parts.append(part)
    calls, where, fallback = [], None, None
    for frame in getattr(info.traceback, "frames", ()):
        if frame.file_name.startswith(_JLS):
            break  # explain_step's own frames: the loss function is above
        tail = frame.file_name.replace("\\", "/").rpartition("/site-packages/")[2]
        library = tail.split("/")[0] in _LIBRARIES
        place = f"{os.path.basename(frame.file_name)}:{frame.line_num}"
        if tail.split("/")[0] in ("jax", "jaxlib") or "/jax/_src/" in tail:
            continue
        if frame.file_name.startswith(_STDLIB) and "-packages" not in frame.file_name:
            continue
        fallback = fallback or place
        where = where or (None if library else place)
        if not (parts and library) and frame.function_name[0] != "<":
            calls.append(frame.function_name.removesuffix(".__call__"))
    chain = [c.replace(".<locals>.", ".") for c in reversed(calls)]
    layer = " in ".join(p for p in ("/".join(parts), " > ".join(chain)) if p)
    return where or fallback or "jls.scale_loss", layer


def _report(sites: list, record: Record, head: tuple, top: int) -> StepReport:
    """The first op to make a non-finite value, the first flush, least headroom."""
    ops, keys, starts = [], [], {}
    for k, s in enumerate(sites):
        out_max = float(np.max(record.top[list(s.outs)]))
        in_max = float(np.max(record.top[list(s.ins)], initial=0.0))
        flushed = 0 if s.flush is None else int(record.flush[s.flush])
        made = not math.isfinite(out_max) and math.isfinite(in_max)
        if s.made is not None:  # in a loop: the iteration it first made one
            made = bool(record.made[s.made] < np.inf)
        it = int(record.made[s.made]) if made and s.made is not None else None
        where, layer = _source(s.names, s.source)
        op = (s.pass_, s.primitive, where, layer, s.dtype, s.inputs, in_max, out_max)
        ops.append(Op(*op, flushed, it))
        start = starts.setdefault(s.in_loop, k) if s.in_loop is not None else k
        if made:  # a loop's ops are ordered by iteration, then as written
            keys.append((start, it or 0, k))
    first = ops[min(keys)[2]] if keys else None
    flush = next((op for op in ops if op.flushed), None)
    near: dict = {}
    for op in sorted(ops, key=lambda op: op.headroom):
        moves = op.primitive in MOVES and op.primitive != "convert_element_type"
        if 0 < op.out_max < math.inf and not moves:
            near.setdefault((op.pass_, op.where, op.primitive), op)
    scale, loss, ok, bad = head
    return StepReport(scale, loss, ok, bad, first, tuple(near.values())[:top], flush)
