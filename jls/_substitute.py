"""The skip in one form for both donation modes: each state leaf kept where it is made.

`jls._cond` has two forms, each compiled well in one donation mode only:
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
not, the state is the old state and the outputs (the parameters, or the
updates) are selected away too (the old parameters, or zero updates).
Nested programs (a ``jit``, a ``lax.cond``, a ``custom_jvp`` in the inner
optimizer) are bound as they were traced; a state leaf one of them makes is
selected where it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jcore
from jax.extend import source_info_util

from jls._compat import bind
from jls._cond import retyped, select


def substituted(
    apply: jax.Array,
    step: Callable[[Any], Any],
    skip: Callable[[Any, Any], Any],
    operands: Any,
    after: Callable[[Any], Any],
) -> tuple[Any, Any]:
    """``(step(operands), after(apply))`` if ``apply``, else the skip's.

    The signature of `jls._cond.selected` and `jls._cond.guarded`: ``step``
    returns ``(outputs, state)``; ``skip(operands, new)`` gives the values a
    skipped step returns, laid out as ``new``; ``after`` gets the traced
    decision.
    """
    closed, shapes = jax.make_jaxpr(step, return_shape=True)(operands)
    jaxpr = closed.jaxpr
    old_out, old_state = skip(operands, shapes)
    n_out = len(jax.tree.leaves(shapes[0]))
    state_vars = jaxpr.outvars[n_out:]
    old_leaves = jax.tree.leaves(old_state)
    made = {e for eqn in jaxpr.eqns for e in eqn.outvars}
    kept: dict[Any, Any] = {}  # a state leaf an equation makes -> its old value
    for v, old in zip(state_vars, old_leaves, strict=True):
        if v in made:
            kept.setdefault(v, old)

    env: dict[Any, Any] = {}
    raw: dict[Any, Any] = {}  # the state leaves as the update made them

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    env.update(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, jax.tree.leaves(operands), strict=True))
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

    leaves = [read(v) for v in jaxpr.outvars[:n_out]]
    new_out = jax.tree.unflatten(jax.tree.structure(shapes[0]), leaves)
    out = jax.tree.map(lambda n, o: select(apply, n, o), new_out, old_out)
    # The selected leaf, typed as the old one (as `select` types it); selected
    # anew where one variable of the program is two state leaves whose old
    # values may differ.
    state = [
        _typed_as_old(env[v], old)
        if v in raw and old is kept[v]
        else select(apply, raw[v] if v in raw else read(v), old)
        for v, old in zip(state_vars, old_leaves, strict=True)
    ]
    state = jax.tree.unflatten(jax.tree.structure(shapes[1]), state)
    return (out, state), after(apply)


def _typed_as_old(x: jax.Array, old: Any) -> jax.Array:
    """``x`` weakly typed as ``select(apply, x, old)`` would be."""
    old = jax.numpy.asarray(old)
    return retyped(x, jax.typeof(old).weak_type and old.dtype == x.dtype)
