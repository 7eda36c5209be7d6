"""A part of each update, computed from the same part of its inputs.

A hook that reads one ``every``-th of each update (`jls.hooks.Stagnation`)
gives the step a *view* per leaf: a function that only selects and
rearranges entries (a reshape and a slice), so it commutes with
elementwise arithmetic: ``view(f(a, b)) == f(view(a), view(b))``. Reading
``view(u)`` beside the update ``u`` that the step applies gives ``u`` two
consumers, and XLA (which does not recompute a producer holding a
division or a square root) then holds every update in a buffer of its own:
on XLA:CPU a 27M-parameter LM's step took 1.35x as long.

`evaluate` runs the inner optimizer's update from its jaxpr, primitive by
primitive, as `jax.core.eval_jaxpr` does (the same operations, once), and
keeps each value; `Evaluation.view` then follows an update leaf back
through the elementwise operations that made it and applies them to views
of their operands: the view of Adam's update is computed from the views of
the gradient and the moments, and the full update keeps one consumer. Where
the chain meets anything else (an input, another output such as a new
moment, which the step holds anyway, a reduction, a matrix product, a
nested call, a value of another shape), it views that value as it is,
which is exact, and costs holding that value where XLA had not. Scalars
(learning rates, bias corrections, literals) enter as they are.
`read_updates` gives each reading hook its views (`Hook.update_view`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex

from jls.hooks._hooks import Hook
from jls.precision._interpret import bind

# Primitives that map entries to entries (each output entry depends only on
# the same entry of each operand, scalars broadcast): a view commutes with them.
ELEMENTWISE = frozenset(
    getattr(lax, f"{name}_p")
    for name in (
        "abs add and atan2 cbrt ceil clamp convert_element_type copy cos cosh div "
        "eq erf erf_inv erfc exp exp2 expm1 floor ge gt integer_pow is_finite "
        "le log log1p logistic lt max min mul ne neg nextafter not or pow "
        "reduce_precision rem round rsqrt select_n sign sin sinh sqrt square "
        "sub tan tanh xor"
    ).split()
    if hasattr(lax, f"{name}_p")
)


def _array(x: Any) -> bool:
    """An array the jaxpr takes as an input (numpy's too, not baked in)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) or hasattr(
        x, "__jax_array__"
    )


class Evaluation:
    """The values of one evaluation of a jaxpr, kept to compute views from."""

    def __init__(self, closed: Any, args: list[Any]):
        jaxpr = closed.jaxpr
        self.values: dict[Any, Any] = {}
        self.values.update(zip(jaxpr.constvars, closed.consts, strict=True))
        self.values.update(zip(jaxpr.invars, args, strict=True))
        self.producer: dict[Any, Any] = {}
        for eqn in jaxpr.eqns:
            outs = bind(eqn, [self.read(v) for v in eqn.invars])
            for var, out in zip(eqn.outvars, outs, strict=True):
                self.values[var] = out  # a dropped one too: never read
                self.producer[var] = eqn
        self.invars = list(jaxpr.invars) + list(jaxpr.constvars)
        self.outvars = list(jaxpr.outvars)
        self.outs = [self.read(v) for v in jaxpr.outvars]
        self.index = {id(x): k for k, x in enumerate(self.outs)}

    def read(self, var: Any) -> Any:
        """The value of ``var`` (a literal's value)."""
        if isinstance(var, jex.Literal):
            return var.val
        return self.values[var]

    def view(self, out: Any, fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
        """``fn(out)`` for an output ``out``, computed from views where it can.

        Follows ``out`` back through the elementwise equations that made
        it, down to the evaluation's inputs and its other outputs (values
        held in memory anyway: a state the step returns); ``fn`` of any
        other array, of an ``out`` this evaluation did not make, and of
        ``out`` itself where ``fn`` keeps every entry.
        """
        index = self.index.get(id(out))
        var = None if index is None else self.outvars[index]
        if var is None or isinstance(var, jex.Literal):
            return fn(out)
        shape = tuple(var.aval.shape)
        viewed = jax.eval_shape(fn, jax.ShapeDtypeStruct(shape, var.aval.dtype))
        if viewed.size == math.prod(shape):
            # Every entry: nothing to save, and the recomputation would give
            # the update's own equations more consumers (XLA then fuses them
            # otherwise, and rounded Adafactor's steps in their last place).
            return fn(out)
        ends = {
            v for v in self.outvars if not isinstance(v, jex.Literal) and v is not var
        }
        held = ends | set(self.invars)
        memo: dict[Any, Any] = {}

        def scalar(v: Any) -> Any:
            # A scalar operand: an input, an output or a reduction's result
            # as it is (held anyway); one that elementwise equations make,
            # made again from values behind a barrier, so that XLA does not
            # merge it with the original, which then keeps its consumers
            # (one more made XLA:CPU compute Adam's bias correction apart
            # from the loop it was fused into, and round it otherwise).
            if isinstance(v, jex.Literal):
                return v.val
            if v in memo:
                return memo[v]
            eqn = self.producer.get(v)
            if v in held or eqn is None:
                result = lax.optimization_barrier(self.read(v))
            elif eqn.primitive.name.startswith(("reduce_", "argm")):
                result = self.read(v)
            elif eqn.primitive in ELEMENTWISE and not eqn.params.get("sharding"):
                result = bind(eqn, [scalar(o) for o in eqn.invars])[0]
            else:
                raise _Unsafe
            memo[v] = result
            return result

        def visit(var: Any) -> Any:
            if var in memo:
                return memo[var]
            eqn = None if var in held else self.producer.get(var)
            if eqn is None:  # an input or another output: held anyway
                result = fn(self.read(var))
            elif _pushes(eqn, shape):
                operands = [
                    visit(v) if tuple(v.aval.shape) == shape else scalar(v)
                    for v in eqn.invars
                ]
                result = bind(eqn, operands)[0]
            elif _broadcasts_scalar(eqn):
                result = lax.broadcast_in_dim(scalar(eqn.invars[0]), viewed.shape, ())
            else:  # a value only the update reads: read the update instead
                raise _Unsafe
            memo[var] = result
            return result

        try:
            return visit(var)
        except _Unsafe:
            return fn(out)


class _Unsafe(Exception):
    """The view would read a value the update's own equations make and use.

    A second consumer of such a value can change how XLA compiles the
    update (and round it otherwise): the view is then taken of the update.
    """


def _pushes(eqn: Any, shape: tuple) -> bool:
    """Whether a view of ``eqn``'s output is ``eqn`` of its operands' views."""
    if eqn.primitive not in ELEMENTWISE or eqn.params.get("sharding") is not None:
        return False
    return all(tuple(v.aval.shape) in (shape, ()) for v in eqn.invars) and any(
        tuple(v.aval.shape) == shape for v in eqn.invars
    )


def _broadcasts_scalar(eqn: Any) -> bool:
    return (
        eqn.primitive is lax.broadcast_in_dim_p
        and eqn.invars[0].aval.shape == ()
        and eqn.params.get("sharding") is None
    )


def evaluate(fn: Callable[..., Any], *args: Any) -> tuple[Any, Evaluation]:
    """``fn(*args)``, evaluated so that views of its outputs can be computed.

    Returns ``fn``'s result and the `Evaluation` (its `Evaluation.view`).
    The array leaves of ``args`` are the jaxpr's inputs; any other leaf (a
    Python number, a function) is passed as it is, and so is any leaf of
    the result that is not an array.
    """
    leaves, treedef = jax.tree.flatten(args)
    arrays = [i for i, x in enumerate(leaves) if _array(x)]
    made: dict[str, Any] = {}

    def flat(*xs: Any) -> list[Any]:
        full = list(leaves)
        for i, x in zip(arrays, xs, strict=True):
            full[i] = x
        outs, made["tree"] = jax.tree.flatten(fn(*jax.tree.unflatten(treedef, full)))
        made["outs"] = outs
        made["arrays"] = [j for j, o in enumerate(outs) if _array(o)]
        return [outs[j] for j in made["arrays"]]

    closed = jax.make_jaxpr(flat)(*[leaves[i] for i in arrays])
    evaluation = Evaluation(closed, [leaves[i] for i in arrays])
    outs = list(made["outs"])
    for j, value in zip(made["arrays"], evaluation.outs, strict=True):
        outs[j] = value
    return jax.tree.unflatten(made["tree"], outs), evaluation


def read_updates(
    readers: list[Hook],
    states: dict[str, Any],
    params: Any,
    new: Any,
    updates: Any,
    view_of: Callable[[Any, Callable[[Any], Any]], Any] | None = None,
) -> dict[str, Any]:
    """Each reading hook's `Hook.read_updates`, by name, on the steps it asks.

    A hook that reads every step (``reads_updates`` is ``True``) reads
    inline; one that samples reads inside a ``lax.cond`` of its own, whose
    other branch gives zeros, so the steps between compute nothing (the
    conditional's outputs are the reads alone: no buffer of the state passes
    through it). Where a hook gives a view (`Hook.update_view`),
    ``view_of(update, view)`` computes the update's (default: ``view(update)``).
    """
    if readers and params is None:
        raise TypeError(
            f"the hooks {[h.name for h in readers]} read the updates and need the "
            "parameters: call tx.update(grads, opt_state, params)"
        )
    reads = {}
    for hook in readers:
        state = states[hook.name]
        when = hook.reads_updates(state)

        def now(hook=hook, state=state):
            viewed_new, viewed = viewed_leaves(hook, state, new, updates, view_of)
            return hook.read_updates(state, viewed_new, viewed)

        if when is True:
            reads[hook.name] = now()
        else:
            types = jax.eval_shape(now)
            zeros = lambda t=types: jax.tree.map(  # noqa: E731
                lambda s: jnp.zeros(s.shape, s.dtype), t
            )
            reads[hook.name] = jax.lax.cond(jnp.asarray(when), now, zeros)
    return reads


def viewed_leaves(
    hook: Hook,
    state: Any,
    new: Any,
    updates: Any,
    view_of: Callable[[Any, Callable[[Any], Any]], Any] | None,
) -> tuple[Any, Any]:
    """``(new, updates)``, each leaf replaced by its view where the hook gives one."""
    if type(hook).update_view is Hook.update_view:
        return new, updates
    leaves, treedef = jax.tree.flatten(new, is_leaf=lambda x: x is None)
    ups = treedef.flatten_up_to(updates)
    out_new, out_up = [], []
    for p, u in zip(leaves, ups, strict=True):
        shape = getattr(p, "shape", None)
        view = None
        if shape is not None and u is not None:
            view = hook.update_view(state, tuple(shape))
        if view is not None:
            p, u = (
                view(cast(Any, p)),
                (view_of(u, view) if view_of else view(cast(Any, u))),
            )
        out_new.append(p)
        out_up.append(u)
    return treedef.unflatten(out_new), treedef.unflatten(out_up)
