"""The skip: how a step leaves the state as it was, in two forms.

`selected` (the default): the update is computed and each leaf of the new
state is ``lax.select(applied, new, old)``, which XLA fuses into the
update's own loops. `guarded` (``loss_scaling(..., donated=True)``): one
``lax.cond`` whose skip branch returns its operands. Both are exact (a
select picks bits, it does not mask with ``0 * x``, which is nan for an inf
``x``), so a skipped step leaves every leaf bitwise as it was, and neither
lets a nan reach a state.

Why two (``benchmarks/bench_skip.py``; the numbers are in
``docs/performance.md``): a conditional's output is one buffer for both
branches, and XLA lets it share the operand's buffer only when a branch
returns the operand itself. So the conditional is free when the caller
donates the state (``donate_argnums``: the skip branch passes the donated
buffers through, the applying branch updates them in place), and without
donation it makes XLA copy every parameter and moment before the
conditional, every step, because read-only arguments cannot become outputs;
its operands (the gradients) also cannot share the outputs' buffers, which
keeps a gradient-sized temporary alive. The select has neither cost without
donation, and with donation XLA:CPU copies the moments, which the select's
fusions read after the update overwrote them. Neither form is best in both
modes, and a traced function cannot see whether its caller donates, so the
caller says so.

In `guarded`, the applying branch comes first (putting the skip branch
first made XLA copy every parameter and moment), and it is traced once, by
``lax.cond`` itself: it records its output types while it is traced, and the
skip branch builds the same from them (tracing the update ahead of the
conditional, with ``jax.eval_shape`` or ``jax.make_jaxpr``, cost about what
tracing the inner optimizer costs; the skip branch falls back to
``jax.eval_shape`` should a jax ever trace it first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jls._compat import varying_of, weakly_typed


def zero(dtype: Any) -> Any:
    """The zero update of ``dtype``: ``-0.0`` for floats, 0 for others.

    ``p + (-0.0)`` is ``p`` bitwise for every float ``p``, ``-0.0`` included
    (``-0.0 + 0.0`` is ``+0.0``).
    """
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return complex(-0.0, -0.0)  # both parts: -0.0 + 0.0 is +0.0
    return -0.0 if jnp.issubdtype(dtype, jnp.inexact) else 0


def zeros_like(shapes: Any, *likes: Any) -> Any:
    """Zero updates of ``shapes``, laid out as the updates are.

    ``shapes``: the updates themselves (then each zero is a ``full_like`` of
    its update: the same sharding and varying axes), or their types; then
    each zero is built from the first leaf of ``likes`` (trees of the same
    structure: the gradients, the parameters) with the same shape, sharding
    and varying axes, so it has the updates' layout under explicit sharding
    and ``shard_map``. (``optax.tree.zeros_like`` makes ``+0.0``.)
    """
    leaves, treedef = jax.tree.flatten(shapes)
    candidates = [
        jax.tree.leaves(like) for like in likes if jax.tree.structure(like) == treedef
    ]

    def zero_of(i: int, s: Any) -> Any:
        if isinstance(s, jax.Array):
            return jnp.full_like(s, zero(s.dtype))
        same_shape = [
            c[i] for c in candidates if getattr(c[i], "shape", None) == s.shape
        ]
        for x in same_shape:
            t = jax.typeof(x)
            if getattr(t, "sharding", None) == getattr(s, "sharding", None) and (
                varying_of(t) == varying_of(s)
            ):
                return jnp.full_like(x, zero(s.dtype), dtype=s.dtype)
        if same_shape:
            return jnp.full_like(same_shape[0], zero(s.dtype), dtype=s.dtype)
        return jnp.full(s.shape, zero(s.dtype), s.dtype)

    return treedef.unflatten([zero_of(i, s) for i, s in enumerate(leaves)])


def cast_like(tree: Any, like: Any) -> Any:
    """Casts ``tree``'s leaves to the dtypes of ``like``'s (shape structs).

    Not ``optax.tree.cast_like``: that casts every leaf, and ``astype`` makes
    a weakly typed leaf strong, so a skipped step would change the state's
    types and retrace the step once.
    """
    return jax.tree.map(
        lambda x, s: x if x is None or x.dtype == s.dtype else x.astype(s.dtype),
        tree,
        like,
    )


def guarded(
    apply: jax.Array,
    step: Callable[[Any], Any],
    skip: Callable[[Any, Any], Any],
    operands: Any,
    after: Callable[[bool], Any],
) -> tuple[Any, Any]:
    """``(step(operands), after(True))`` if ``apply``, else the skip's.

    ``skip(operands, shapes)`` gets ``step``'s output types (`selected`
    gives it the outputs themselves). ``after(taken)``
    is evaluated inside each branch with ``taken`` a Python constant (the
    scale rule: there the decision is a constant, so it folds to a few
    scalar ops instead of reading the step's flags, which XLA would
    recompute in each fusion that reads them). For callers that donate the
    state; see the module notes.
    """
    if isinstance(step, Reading):
        return guarded_reading(apply, step, skip, operands, after)
    shapes: list[Any] = []  # step's output types, once it is traced

    def taken(ops):
        new = step(ops)
        shapes.append(jax.tree.map(jax.typeof, new))
        return new, after(True)

    def skipped(ops):
        out = shapes[-1] if shapes else jax.eval_shape(step, ops)
        return skip(ops, out), after(False)

    return lax.cond(apply, taken, skipped, operands)


def selected(
    apply: jax.Array,
    step: Callable[[Any], Any],
    skip: Callable[[Any, Any], Any],
    operands: Any,
    after: Callable[[Any], Any],
) -> tuple[Any, Any]:
    """`guarded`'s result, without a conditional: each leaf selected.

    ``after(apply)`` gets the traced decision. A `Reading` step reads
    inside one ``lax.cond`` on ``step.now`` (both branches update).
    """
    if isinstance(step, Reading):
        new = lax.cond(step.now, step.read, step.plain, operands)
    else:
        new = step(operands)
    old = skip(operands, new)  # the values: the skip's zeros take their layout
    out = jax.tree.map(lambda n, o: select(apply, n, o), new, old)
    return out, after(apply)


def select(apply: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``apply`` (a scalar), else ``old``, bitwise.

    The result has ``new``'s dtype, weakly typed if ``old`` is (as
    ``lax.cond`` joins them), so a weakly typed state keeps its types and the
    step is traced once. Floats narrower than float32 are selected as their
    bits: XLA:CPU computes them in float32, and a select it widens that way
    would canonicalise a nan's payload.
    """
    new = jnp.asarray(new)
    old = jnp.asarray(old)
    weak = jax.typeof(old).weak_type and old.dtype == new.dtype
    if old.dtype != new.dtype:
        old = old.astype(new.dtype)
    narrow = jnp.issubdtype(new.dtype, jnp.floating) and jnp.finfo(new.dtype).bits < 32
    if narrow:
        bits = _UINT[jnp.finfo(new.dtype).bits]
        chosen = lax.select(
            apply,
            lax.bitcast_convert_type(new, bits),
            lax.bitcast_convert_type(old, bits),
        )
        chosen = lax.bitcast_convert_type(chosen, new.dtype)
    else:
        chosen = lax.select(apply, new, old)
    if weak and not jax.typeof(chosen).weak_type:
        chosen = weakly_typed(chosen)
    return chosen


_UINT = {4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16}


class Reading(NamedTuple):
    """An applying step that may also read its updates (made by `reading`).

    Attributes:
      plain: ``ops -> (out, zero reads)``: the step, reading nothing.
      read: ``ops -> (out, reads)``: the step and the hooks' reads.
      now: a scalar bool: this step reads (a hook samples it).
      again: ``(ops, out) -> (ops, carry)``: the operands of the reading
        step once the plain one has run (``out``: the state it left), and
        what its pass-through needs besides (the updates, or ``None``).
      passed: ``(ops, carry) -> out``: the reading step's pass-through.
    """

    plain: Callable[[Any], Any]
    read: Callable[[Any], Any]
    now: jax.Array
    again: Callable[[Any, Any], Any]
    passed: Callable[[Any, Any], Any]


def reading(
    hooks: Any,
    states: dict[str, Any],
    step: Callable[[Any], Any],
    skip: Callable[[Any, Any], Any],
    fused: bool,
) -> tuple[Any, Callable[[Any, Any], Any]]:
    """``step`` and ``skip`` with what the hooks read of the applied updates.

    ``step(ops)`` returns ``(out, params, updates)`` (``ops``: the gradients,
    the inner state and the parameters; ``out``: the new parameters on the
    fused path, else the updates, with the inner state). The step returned
    gives ``(out, reads)``, ``reads`` each reading hook's
    `jls.hooks.Hook.read_updates` by name, and the skip ``(its out, zero reads)``.
    A hook reads on the steps its `jls.hooks.Hook.reads_updates` says: always (a
    Python ``True``: read inline), or on a traced condition: then the step
    is a `Reading`, which `guarded` runs as two conditionals in a row (the
    plain update, then the reading one, each with a pass-through branch: a
    conditional nested in the applying branch, or a three-way switch, makes
    XLA copy every parameter and moment) and `selected` as one.
    """
    when = {h.name: h.reads_updates(states[h.name]) for h in hooks}
    readers = [h for h in hooks if when[h.name] is not None]

    def read(ops: Any) -> Any:
        out, params, updates = step(ops)
        if not readers:
            return out, {}
        if params is None:
            raise TypeError(
                f"the hooks {[h.name for h in readers]} read the updates and need "
                "the parameters: call tx.update(grads, opt_state, params)"
            )
        new = optax.apply_updates(params, updates)  # on the fused path: out
        return out, {
            h.name: h.read_updates(states[h.name], new, updates) for h in readers
        }

    def skipped(ops: Any, out: Any) -> Any:
        return skip(ops, out[0]), jax.tree.map(_zeros, out[1])

    if all(when[h.name] is True for h in readers):  # none, or always: inline
        return read, skipped
    now = jnp.any(jnp.stack([jnp.asarray(when[h.name]) for h in readers]))
    shapes: list[Any] = []  # the reads' types, once the reading step is traced

    def traced(ops: Any) -> Any:
        out, reads = read(ops)
        shapes.append(jax.tree.map(jax.typeof, reads))
        return out, reads

    def plain(ops: Any) -> Any:
        types = shapes[-1] if shapes else jax.eval_shape(read, ops)[1]
        return step(ops)[0], jax.tree.map(_zeros, types)

    def again(ops: Any, out: Any) -> Any:
        grads, _, params = ops
        if fused:  # out: the new parameters and inner state
            return (grads, out[1], out[0]), None
        return (grads, out[1], params), out[0]  # out: the updates and state

    def passed(ops: Any, updates: Any) -> Any:
        return (ops[2], ops[1]) if fused else (updates, ops[1])

    return Reading(plain, traced, now, again, passed), skipped


def _zeros(t: Any) -> jax.Array:
    return jnp.zeros(t.shape, t.dtype)


def guarded_reading(
    apply: jax.Array,
    step: Reading,
    skip: Callable[[Any, Any], Any],
    operands: Any,
    after: Callable[[Any], Any],
) -> tuple[Any, Any]:
    """`guarded` for a `Reading` step: the plain update, then the reading one.

    Each is a conditional with a pass-through branch, so the state is
    updated in place by whichever applies; the scale rule gets the traced
    decision.
    """
    (out, _), _ = guarded(apply & ~step.now, step.plain, skip, operands, _nothing)
    shapes: list[Any] = []

    def taken(second: Any) -> Any:
        new = step.read(second[0])
        shapes.append(jax.tree.map(jax.typeof, new[1]))
        return new

    def passed(second: Any) -> Any:
        types = shapes[-1] if shapes else jax.eval_shape(taken, second)[1]
        return step.passed(*second), jax.tree.map(_zeros, types)

    second = step.again(operands, out)
    return lax.cond(apply & step.now, taken, passed, second), after(apply)


def _nothing(taken: Any) -> tuple[()]:
    del taken
    return ()
