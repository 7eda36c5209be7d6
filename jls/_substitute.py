"""The skip in one form for both donation modes: each result kept where it is made.

jls 0.3 had two forms, each compiled well in one donation mode only:
``lax.select`` per leaf after the update (XLA:CPU copies every moment when
the caller donates: the select's fusions read the old moments after the
update overwrote them in place) and one ``lax.cond`` (without donation XLA
copies every parameter and moment before it). `substituted` is the form the
default step uses, whatever the caller's jit does.

The update is traced once (``jax.make_jaxpr``) and its program run again
equation by equation. As soon as an equation makes a leaf of the new inner
state, that leaf is selected against its old value (``lax.select`` on the
bits, `jls._cond.select`), and every later equation (the parameters', the
updates') reads the selected leaf. XLA then sees plain Adam's structure in
both modes: each moment made once (in place when the state is donated), the
parameters computed from the moments it wrote, and nothing read after it is
overwritten.

Exact: where the step applies, each selected leaf is the new one bitwise,
so every later equation computes what it computed before; where it does
not, every result is its old value (the old parameters and state, or zero
updates), whatever the later equations computed from them.
Nested programs (a ``jit``, a ``lax.cond``, a ``custom_jvp`` in the inner
optimizer) are bound as they were traced; a state leaf one of them makes is
selected where it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.extend import source_info_util

from jls._cond import retyped, select
from jls.precision._interpret import bind


def substituted(
    apply: jax.Array,
    step: Callable[[Any], Any],
    skip: Callable[[Any, Any], Any],
    operands: Any,
    after: Callable[[Any], Any],
) -> tuple[Any, Any]:
    """``(step(operands), after(apply))`` if ``apply``, else the skip's.

    The signature of jls 0.3's two forms (kept as candidates in
    ``benchmarks/bench_skip_modes.py``): ``step``
    returns ``(outputs, state)``; ``skip(operands, new)`` gives the values a
    skipped step returns, laid out as ``new``; ``after`` gets the traced
    decision.
    """
    # Only the array leaves are the program's inputs: a function or other
    # static leaf (an unfiltered equinox model's activation) is closed over.
    leaves, tree = jax.tree.flatten(operands)
    arrays = [_is_array(x) for x in leaves]
    values = [x for x, a in zip(leaves, arrays, strict=True) if a]

    def program(values: list[Any]) -> Any:
        given = iter(values)
        rebuilt = [next(given) if a else x for x, a in zip(leaves, arrays, strict=True)]
        return step(jax.tree.unflatten(tree, rebuilt))

    closed, shapes = jax.make_jaxpr(program, return_shape=True)(values)
    jaxpr = closed.jaxpr
    old_out, old_state = skip(operands, shapes)
    n_out = len(jax.tree.leaves(shapes[0]))
    # Every result (the outputs and the state) is selected where it is made:
    # a later equation (a hook's read of the new parameters) then reads the
    # selected value, and nothing reads a result beside its in-place update.
    old_leaves = jax.tree.leaves(old_out) + jax.tree.leaves(old_state)
    made = {e for eqn in jaxpr.eqns for e in eqn.outvars}
    kept: dict[Any, Any] = {}  # a result an equation makes -> its old value
    for v, old in zip(jaxpr.outvars, old_leaves, strict=True):
        if isinstance(v, jcore.Var) and v in made:
            kept.setdefault(v, old)

    env: dict[Any, Any] = {}
    raw: dict[Any, Any] = {}  # the state leaves as the update made them

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    env.update(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, values, strict=True))
    for eqn in jaxpr.eqns:
        info = eqn.source_info
        names = source_info_util.current_name_stack() + info.name_stack
        with source_info_util.user_context(info.traceback, name_stack=names):
            outs = bind(eqn, [read(v) for v in eqn.invars])
        for v, x in zip(eqn.outvars, outs, strict=True):
            if v in kept:  # typed as traced, so later equations bind as they did
                raw[v] = x
                x = select(apply, x, kept[v], weak=jax.typeof(x).weak_type)
            env[v] = x

    # The selected leaf, typed as the old one (as `select` types it); selected
    # anew where one variable of the program is two results whose old values
    # may differ, or where no equation made it (an input passed through).
    def result(v: Any, old: Any) -> Any:
        if isinstance(v, jcore.Literal):
            return select(apply, v.val, old)
        if v in raw and old is kept[v]:
            return _typed_as_old(env[v], old)
        return select(apply, raw.get(v, env[v]), old)

    leaves = [result(v, o) for v, o in zip(jaxpr.outvars, old_leaves, strict=True)]
    out = jax.tree.unflatten(jax.tree.structure(shapes[0]), leaves[:n_out])
    state = jax.tree.unflatten(jax.tree.structure(shapes[1]), leaves[n_out:])
    return (out, state), after(apply)


def _is_array(x: Any) -> bool:
    """Whether ``x`` can be an input of a traced program."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def _typed_as_old(x: jax.Array, old: Any) -> jax.Array:
    """``x`` weakly typed as ``select(apply, x, old)`` would be."""
    old = jax.numpy.asarray(old)
    return retyped(x, jax.typeof(old).weak_type and old.dtype == x.dtype)
