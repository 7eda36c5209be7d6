"""The one place jls reads and re-runs jaxprs: what its interpreters share.

Autocast, the report and the explainer only say what they do differently.
Reading a program needs ``jax.extend``, imported here only (when
``jls.precision``'s tools are first reached), so a change to it breaks those
and not loss scaling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.extend import source_info_util


def is_array(x: Any) -> bool:
    """Whether a leaf of the arguments is traced (an array) or passed as it is."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


class Traced(NamedTuple):
    """A function traced once: its program, the arguments' arrays, ``rebuild``.

    ``rebuild(outs)`` puts the program's outputs among the result's other leaves.
    """

    closed: Any
    arrays: list
    rebuild: Callable[[Any], Any]


def trace(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Traced:
    """``fn(*args, **kwargs)`` traced: its array leaves traced, the rest static."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    traced = [is_array(x) for x in leaves]
    returned: list[Any] = []

    def flat(*arrays: Any) -> list:
        it = iter(arrays)
        full = [next(it) if t else x for x, t in zip(leaves, traced, strict=True)]
        a, k = jax.tree.unflatten(treedef, full)
        out_leaves, out_def = jax.tree.flatten(fn(*a, **k))
        out_arrays = [isinstance(x, jax.Array) for x in out_leaves]
        static = [None if t else x for x, t in zip(out_leaves, out_arrays, strict=True)]
        returned.append((static, out_def, out_arrays))
        return [x for x, t in zip(out_leaves, out_arrays, strict=True) if t]

    arrays = [jnp.asarray(x) for x, t in zip(leaves, traced, strict=True) if t]
    closed = jax.make_jaxpr(flat)(*arrays)
    static, out_def, out_arrays = returned[0]

    def rebuild(outs: Any) -> Any:
        it = iter(outs)
        full = [next(it) if t else x for x, t in zip(static, out_arrays, strict=True)]
        return jax.tree.unflatten(out_def, full)

    return Traced(closed, arrays, rebuild)


def is_floating(v: Any) -> bool:
    """Whether an equation's variable is a floating array (not a token)."""
    dtype = getattr(v.aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def dtype_of(value: Any, aval: Any) -> np.dtype:
    """The dtype ``value`` has now (a Python scalar: the one it was traced as)."""
    return np.dtype(getattr(value, "dtype", aval.dtype))


def cast(value: Any, aval: Any, dtype: Any) -> Any:
    """``value`` in ``dtype`` (unchanged if it is: a literal is bound as it is)."""
    if dtype_of(value, aval) == dtype:
        return value
    return jax.lax.convert_element_type(value, dtype)


def as_traced(values: Sequence[Any], variables: Sequence[Any]) -> list:
    """``values`` cast back to the floating dtypes ``variables`` were traced in."""
    return [
        cast(x, v.aval, v.aval.dtype) if is_floating(v) else x
        for x, v in zip(values, variables, strict=True)
    ]


def is_literal(v: Any) -> bool:
    """Whether an equation's operand is a constant inlined into the program."""
    return isinstance(v, jcore.Literal)


def read(v: Any, env: dict) -> Any:
    """An operand's value: a literal's own, a variable's from ``env``."""
    return v.val if isinstance(v, jcore.Literal) else env[v]


def is_program(value: Any) -> bool:
    """Whether an equation's parameter is a program (a ``Jaxpr``, closed or not)."""
    return isinstance(value, (jcore.Jaxpr, jcore.ClosedJaxpr))


def as_closed(jaxpr: Any) -> Any:
    """An open ``Jaxpr`` (a ``checkpoint``'s) as a ``ClosedJaxpr`` of no constants."""
    return jcore.ClosedJaxpr(jaxpr, ())


def program(eqn: Any) -> Any:
    """The program a call (``jit``, ``closed_call``, ``checkpoint``...) runs, closed."""
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    return inner if isinstance(inner, jcore.ClosedJaxpr) else as_closed(inner)


def interpret(closed: Any, args: Sequence[Any], step: Callable) -> list:
    """``closed`` run on ``args``, each equation's outputs ``step(eqn, invals)``.

    Each value is dropped after its last use, as jax's own evaluation does.
    """
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    last = {
        v: i for i, e in enumerate(jaxpr.eqns) for v in e.invars if not is_literal(v)
    }
    kept = {v for v in jaxpr.outvars if not is_literal(v)}
    for i, eqn in enumerate(jaxpr.eqns):
        env.update(
            zip(eqn.outvars, step(eqn, [read(v, env) for v in eqn.invars]), strict=True)
        )
        for v in eqn.invars:
            if not is_literal(v) and last.get(v) == i and v not in kept:
                env.pop(v, None)
    return [read(v, env) for v in jaxpr.outvars]


@contextlib.contextmanager
def located(eqn: Any) -> Iterator[None]:
    """Binds inside this get ``eqn``'s source line and name stack."""
    info = eqn.source_info
    names = source_info_util.current_name_stack() + info.name_stack
    with source_info_util.user_context(info.traceback, name_stack=names):
        yield


def bind(eqn: Any, invals: Any, params: dict | None = None) -> list:
    """One equation bound again on ``invals`` (with ``params``, else its own).

    As jax's own evaluation does, through ``get_bind_params``.
    """
    bound = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    # jax 0.8 returns (subfuns, params); later jax, the params alone.
    subfuns, bound = bound if isinstance(bound, tuple) else ((), bound)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *invals, **bound)
    return list(out) if eqn.primitive.multiple_results else [out]


def loop(eqn: Any, invals: list, run: Callable, state: Any) -> tuple[Any, list]:
    """A ``scan`` or ``while`` run again, its carry kept in its traced dtypes.

    ``run(closed)`` is a program as ``fn(state, *args) -> (state, outs)``;
    ``state`` goes through the iterations and comes back with the outputs.
    """
    p, scan = eqn.params, eqn.primitive.name == "scan"
    nc = p["num_consts"] if scan else p["cond_nconsts"] + p["body_nconsts"]
    nk = p["num_carry"] if scan else len(invals) - nc
    consts = invals[0 if scan else p["cond_nconsts"] : nc]
    keep, body = eqn.invars[nc : nc + nk], run(p["jaxpr" if scan else "body_jaxpr"])

    def step(carry: tuple, x: Sequence = ()) -> tuple:
        new, outs = body(carry[0], *consts, *carry[1], *x)
        return (new, as_traced(outs[:nk], keep)), outs[nk:]

    init = (state, as_traced(invals[nc : nc + nk], keep))
    if scan:
        options = {k: p[k] for k in ("length", "reverse", "unroll")}
        (state, carry), ys = jax.lax.scan(step, init, invals[nc + nk :], **options)
        return state, [*carry, *ys]
    cond, cond_consts = run(p["cond_jaxpr"]), invals[: p["cond_nconsts"]]

    def go_on(carry: tuple) -> Any:
        return cond(carry[0], *cond_consts, *carry[1])[1][0]

    state, carry = jax.lax.while_loop(go_on, lambda c: step(c)[0], init)
    return state, list(carry)
