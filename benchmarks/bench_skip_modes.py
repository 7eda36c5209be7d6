"""One skip for both donation modes: candidate skip forms, measured in both.

jls's skip is `select` (`jls._cond.select_tree`): the inner update runs
unconditionally and each new leaf is selected against its old one (jmp's
and flax's form). It is what XLA compiles without copies on a GPU; on
XLA:CPU a donated step copies every moment (the select's fusions read the
old moments after the update overwrote them in place). This script keeps
the other forms measured against it, as a record: it swaps the library's
``jls._core.finish`` for `finish_with` (the step built around a form
``form(apply, step, skip, operands, after)``) while the step is traced, and
runs each form in both modes beside plain Adam: jitted without donation, and
with ``donate_argnums=(0, 1)`` ("(donated)"). For `guarded`, "(donated)" is
the mode it was made for.

Forms:
  select     jls's skip, the library unchanged: ``select_tree(apply, new,
             old)`` over the step's results after the update.
  guarded    one ``lax.cond`` whose skip branch passes the state through:
             free with donation, copies every parameter and moment without.
  barrier    ``select``, the state selected after an
             ``optimization_barrier`` on (selected outputs, old state):
             XLA:CPU removes the barrier before copy insertion
             (``cse_barrier_expander``), so it compiles as ``select``.
  ordered    ``select``, the state's selects waiting for the outputs: the
             decision they read is ``apply & (popcount(bits(x)) <= width)``
             of one element ``x`` of each output leaf (always ``apply``; XLA
             cannot fold it). XLA can then no longer fuse the new moments
             into both readers (the path through the outputs), so it
             materialises them.
  dual       ``ordered``, the new state taken from a second instance of the
             update whose operands pass an ``optimization_barrier`` (so CSE
             keeps the two apart): the outputs' fusions read the old state,
             then the state's fusions read and overwrite it in place.
  dual_once  ``dual`` with the update traced once: a nested ``jax.jit`` of
             it, called twice (the second call reuses the trace).
  substituted  the update traced once (``jax.make_jaxpr``, ``jax.extend``)
             and evaluated equation by equation; each new state leaf is
             selected against its old value as soon as an equation makes it,
             and the later equations (the parameters', the updates') read the
             selected leaf. XLA then sees plain Adam's structure in both
             modes, with no copies on XLA:CPU either; it re-runs the user's
             program on ``jax.extend`` (no compatibility promise), so it is
             no default.

The proxies: compiled temporaries, the entry computation's copies, and
XLA's cost analysis of the bytes the program accesses (deterministic).
``--check`` first verifies every form on the MLP: a step with a nan
gradient leaves the parameters and the state bitwise unchanged, and a
finite step gives the bits of the first form.

Run: ``python benchmarks/bench_skip_modes.py [--model lm|mlp|char|all]
[--rounds 10] [--forms ...] [--paths fused update] [--proxies] [--compile N]
[--clock cpu]``. On the shared 2-core machine the step times were taken as
``taskset -c 1 python benchmarks/bench_skip_modes.py --clock cpu ...``: one
core (XLA then compiles single-threaded programs) and the process's CPU
time per sample, which leaves out the time other processes hold the core.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import pathlib
import platform
import random
import re
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend import core as jcore
from jax.extend import source_info_util

import jls
from jls import _cond, _core
from jls._decision import vetoes
from jls._scaling import reciprocals, unscale_leaf
from jls.hooks._hooks import LossScalingState

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_step  # noqa: E402

_UINT = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


def after_outputs(apply: jax.Array, tree) -> jax.Array:
    """``apply``, computed from one element of each leaf of ``tree``.

    ``popcount(bits) <= 32`` is always true, and XLA does not fold it, so
    whatever reads the result runs after every leaf of ``tree`` is written.
    The elements are stacked and reduced once: one scalar for every reader
    (a chain of ``&`` was fused into each reader, 101 operands each on the
    LM, and compiled for minutes).
    """
    firsts = []
    for leaf in jax.tree.leaves(tree):
        leaf = jnp.asarray(leaf)
        if leaf.size == 0:
            continue
        x = lax.slice(leaf, (0,) * leaf.ndim, (1,) * leaf.ndim).reshape(())
        if jnp.issubdtype(x.dtype, jnp.complexfloating):
            x = jnp.real(x)
        if x.dtype == jnp.bool_:
            x = x.astype(jnp.uint8)
        if not jnp.issubdtype(x.dtype, jnp.integer):
            x = lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize * 8])
        firsts.append(x.astype(jnp.uint32))
    if not firsts:
        return apply
    return apply & jnp.all(lax.population_count(jnp.stack(firsts)) <= 32)


def guarded(
    apply: jax.Array,
    step: Callable[[Any], Any],
    skip: Callable[[Any, Any], Any],
    operands: Any,
    after: Callable[[bool], Any],
) -> tuple[Any, Any]:
    """``(step(operands), after(True))`` if ``apply``, else the skip's.

    ``skip(operands, shapes)`` gets ``step``'s output types (the other
    forms give it the outputs themselves). ``after(taken)`` is evaluated inside
    each branch with ``taken`` a constant (the scale rule then folds to a
    few scalar ops).
    """
    shapes: list[Any] = []  # step's output types, once it is traced

    def taken(ops):
        new = step(ops)
        shapes.append(jax.tree.map(jax.typeof, new))
        return new, after(jnp.asarray(True))

    def skipped(ops):
        out = shapes[-1] if shapes else jax.eval_shape(step, ops)
        return skip(ops, out), after(jnp.asarray(False))

    return lax.cond(apply, taken, skipped, operands)


def _select(apply, new, old):
    return _cond.select_tree(apply, new, old)


def barrier(apply, step, skip, operands, after):
    """``select``, the state selected after an optimization barrier."""
    new = step(operands)
    (new_out, new_state), (old_out, old_state) = new, skip(operands, new)
    out = _select(apply, new_out, old_out)
    out, old_state = lax.optimization_barrier((out, old_state))
    return (out, _select(apply, new_state, old_state)), after(apply)


def ordered(apply, step, skip, operands, after):
    """``select``, the state's selects ordered after the outputs."""
    new = step(operands)
    (new_out, new_state), (old_out, old_state) = new, skip(operands, new)
    out = _select(apply, new_out, old_out)
    state = _select(after_outputs(apply, out), new_state, old_state)
    return (out, state), after(apply)


def dual(apply, step, skip, operands, after):
    """The outputs from one instance of the update, the state from another."""
    new = step(operands)
    (new_out, _), (old_out, old_state) = new, skip(operands, new)
    out = _select(apply, new_out, old_out)
    _, new_state = step(lax.optimization_barrier(operands))
    state = _select(after_outputs(apply, out), new_state, old_state)
    return (out, state), after(apply)


def dual_once(apply, step, skip, operands, after):
    """`dual`, the update traced once: a nested ``jit`` called twice."""
    once = jax.jit(step)  # the second call reuses the first's trace
    new = once(operands)
    (new_out, _), (old_out, old_state) = new, skip(operands, new)
    out = _select(apply, new_out, old_out)
    _, new_state = once(lax.optimization_barrier(operands))
    state = _select(after_outputs(apply, out), new_state, old_state)
    return (out, state), after(apply)


def substituted(apply, step, skip, operands, after):
    """``(step(operands), after(apply))`` if ``apply``, else the skip's.

    The update traced once (``jax.make_jaxpr``) and its program run again
    equation by equation; as soon as an equation makes a result (an output
    or a state leaf), that result is selected against its old value, and
    every later equation reads the selected one. Only the array leaves of
    ``operands`` are the program's inputs.
    """
    leaves, tree = jax.tree.flatten(operands)
    arrays = [_is_array(x) for x in leaves]
    values = [x for x, a in zip(leaves, arrays, strict=True) if a]

    def program(values):
        given = iter(values)
        rebuilt = [next(given) if a else x for x, a in zip(leaves, arrays, strict=True)]
        return step(jax.tree.unflatten(tree, rebuilt))

    closed, shapes = jax.make_jaxpr(program, return_shape=True)(values)
    jaxpr = closed.jaxpr
    old_out, old_state = skip(operands, shapes)
    n_out = len(jax.tree.leaves(shapes[0]))
    old_leaves = jax.tree.leaves(old_out) + jax.tree.leaves(old_state)
    made = {e for eqn in jaxpr.eqns for e in eqn.outvars}
    kept = {}  # a result an equation makes -> its old value
    for v, old in zip(jaxpr.outvars, old_leaves, strict=True):
        if isinstance(v, jcore.Var) and v in made:
            kept.setdefault(v, old)
    env, raw = {}, {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    env.update(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, values, strict=True))
    for eqn in jaxpr.eqns:
        info = eqn.source_info
        names = source_info_util.current_name_stack() + info.name_stack
        with source_info_util.user_context(info.traceback, name_stack=names):
            outs = _bind(eqn, [read(v) for v in eqn.invars])
        for v, x in zip(eqn.outvars, outs, strict=True):
            if v in kept:  # typed as traced, so later equations bind as they did
                raw[v] = x
                x = _typed_as(_cond.select(apply, x, kept[v]), x)
            env[v] = x

    def result(v, old):
        if isinstance(v, jcore.Literal):
            return _cond.select(apply, v.val, old)
        if v in raw and old is kept[v]:  # typed as `select` types it
            x, old = env[v], jnp.asarray(old)
            weak = jax.typeof(old).weak_type and old.dtype == x.dtype
            return _typed_as(x, old if weak else lax.convert_element_type(x, x.dtype))
        return _cond.select(apply, raw.get(v, env[v]), old)

    leaves = [result(v, o) for v, o in zip(jaxpr.outvars, old_leaves, strict=True)]
    out = jax.tree.unflatten(jax.tree.structure(shapes[0]), leaves[:n_out])
    state = jax.tree.unflatten(jax.tree.structure(shapes[1]), leaves[n_out:])
    return (out, state), after(apply)


def _is_array(x):
    """Whether ``x`` can be an input of a traced program."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def _typed_as(x, like):
    """``x``, weakly typed as ``like`` (of ``x``'s dtype) is or not."""
    weak = jax.typeof(like).weak_type
    if jax.typeof(x).weak_type == weak:
        return x
    return (
        lax.cond(True, lambda: x, lambda: like)
        if weak
        else lax.convert_element_type(x, x.dtype)
    )


def _bind(eqn, invals):
    """One equation of a jaxpr bound again on ``invals``: its outputs, a list."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    subfuns, bound = bound if isinstance(bound, tuple) else ((), bound)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *invals, **bound)
    return list(out) if eqn.primitive.multiple_results else [out]


FORMS = {
    "select": None,  # the library's own step
    "guarded": guarded,
    "barrier": barrier,
    "ordered": ordered,
    "dual": dual,
    "dual_once": dual_once,
    "substituted": substituted,
}


def finish_with(form):
    """`jls._core.finish`, its skip made by ``form`` (the forms' signature).

    The library's pieces (the vetoes, the scale rule, the hooks' records)
    around ``form(apply, taken, skipped, operands, after)``. No hook may read
    the updates.
    """

    def finish(config, grads, prepared, params, decision, *, fused, retries=None):
        state, loss, args = prepared
        assert not config.off and decision is not None
        info = _core.step_info(config, grads, state, decision, loss)
        vetoed, held = vetoes(config, state.hooks, info, decision.apply)
        apply = decision.apply
        for v in vetoed.values():
            apply = apply & ~v
        factors = {}  # computed once, before the skip
        if not config.scaler.is_identity:
            two = config.scaler.two_factor
            factors = reciprocals(state.loss_scale.scale, grads, two_factor=two)

        def taken(operands):
            grads, inner_state, params = operands
            grads = jax.tree.map(lambda g: unscale_leaf(g, factors), grads)
            updates, inner_state = config.inner.update(
                grads, inner_state, params, **args
            )
            out = optax.apply_updates(params, updates) if fused else updates
            return out, inner_state

        def skipped(operands, shapes):
            grads, inner_state, params = operands
            out, inner = shapes
            if fused:
                return _cast_like((params, inner_state), (out, inner))
            zeros = _cond.zeros_like(out, grads, params)
            return zeros, _cast_like(inner_state, inner)

        def after(applied):
            old = state.loss_scale
            return _core.adjusted(config, old, decision, applied, vetoed, held, retries)

        operands = (grads, state.inner_state, params)
        (out, inner_state), loss_scale = form(apply, taken, skipped, operands, after)
        hooks = _core.recorded(config, state.hooks, info, apply, loss_scale, {}, vetoed)
        return out, LossScalingState(loss_scale, inner_state, hooks)

    return finish


def _cast_like(tree, like):
    """``tree``'s leaves in the dtypes of ``like``'s, weak types kept."""
    return jax.tree.map(
        lambda x, s: x if x is None or x.dtype == s.dtype else x.astype(s.dtype),
        tree,
        like,
    )


@contextlib.contextmanager
def using(form: str):
    """While tracing: jls's skip is ``FORMS[form]`` (``select``: the library's)."""
    if FORMS[form] is None:
        yield
        return
    saved = _core.finish
    _core.finish = finish_with(FORMS[form])
    try:
        yield
    finally:
        _core.finish = saved


def _jls_steps(loss_fn, params, forms, paths):
    adam = optax.adam(1e-4)
    scaler = jls.dynamic_scale(2.0**15, growth_interval=10**6)
    tx = jls.loss_scaling(adam, scaler)
    steps = {}

    def plain(params, state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, state = adam.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    steps["plain"] = (plain, adam.init(params))

    def make(form, path):
        def step(params, state, batch):
            with using(form):
                scaled = lambda p: jls.scale_loss(loss_fn(p, batch), state)  # noqa: E731
                grads = jax.grad(scaled)(params)
                if path == "fused":
                    return jls.apply_gradients(tx, grads, state, params)
                updates, state2 = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state2

        return step

    for path in paths:
        for form in forms:
            steps[f"{path}:{form}"] = (make(form, path), tx.init(params))
    return steps


def make_variants(loss_fn, params, forms, paths, modes=(False, True)):
    """``{name: (jitted step, state)}``; "(donated)" rows donate, undeclared."""
    variants = {}
    for donated in modes:
        jit = functools.partial(jax.jit, donate_argnums=(0, 1) if donated else ())
        suffix = bench_step.DONATED if donated else ""
        for key, (fn, state) in _jls_steps(loss_fn, params, forms, paths).items():
            variants[key + suffix] = (jit(fn), state)
    return variants


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "u16": 2}


def proxies(step, params, opt_state, batch) -> dict:
    """Compiled temporaries, bytes accessed, and the entry's copies (count, MB).

    Bytes accessed is XLA's own cost analysis of the compiled program: the
    bytes every instruction reads and writes, a deterministic proxy for a
    memory-bound step.
    """
    compiled = step.lower(params, opt_state, batch).compile()
    entry = compiled.as_text().split("ENTRY", 1)[1]
    count, size = 0, 0
    for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\]\{[^}]*\} copy\(", entry):
        count += 1
        size += _BYTES.get(dtype, 4) * int(
            np.prod([int(d) for d in dims.split(",") if d])
        )
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "temp_mb": compiled.memory_analysis().temp_size_in_bytes / 1e6,
        "copies": count,
        "copy_mb": size / 1e6,
        "bytes_mb": float(cost.get("bytes accessed", 0.0)) / 1e6,
    }


def check(forms, paths) -> None:
    """Every form: a nan step changes nothing; a finite step, the first form's bits."""
    loss_fn, params, (x, y) = bench_step.make_problem("mlp")
    bad = (x.at[0, 0].set(jnp.nan), y)
    steps = _jls_steps(loss_fn, params, forms, paths)
    for path in paths:
        ref = None
        for form in forms:
            step, state = steps[f"{path}:{form}"]
            fn = jax.jit(step)
            p1, s1 = fn(params, state, (x, y))
            p2, s2 = fn(p1, s1, bad)
            assert jax.tree.all(
                jax.tree.map(
                    lambda a, b: np.asarray(a).tobytes() == np.asarray(b).tobytes(),
                    (p1, s1.inner_state),
                    (p2, s2.inner_state),
                )
            ), f"{path}:{form}: a skipped step changed the state"
            if ref is None:
                ref = (p1, s1.inner_state)
            same = jax.tree.all(
                jax.tree.map(
                    lambda a, b: np.asarray(a).tobytes() == np.asarray(b).tobytes(),
                    ref,
                    (p1, s1.inner_state),
                )
            )
            print(
                f"check {path}:{form}: skipped step unchanged; finite step bits "
                f"{'equal to' if same else 'DIFFER from'} {path}:{forms[0]}'s"
            )


def compile_times(model, forms, paths, rounds, seed=0) -> dict:
    """`bench_compile.py`'s fresh-jit samples of every variant, interleaved."""
    import bench_compile

    loss_fn, params, batch = bench_step.make_problem(model)
    variants = make_variants(loss_fn, params, forms, paths)
    times = {k: {"lower": [], "compile": [], "cpu": []} for k in variants}
    order = list(variants)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for key in order:
            step, opt_state = variants[key]
            donated = key.endswith(bench_step.DONATED)
            sample = bench_compile.sample(step, opt_state, params, batch, donated)
            for part, t in zip(("lower", "compile", "cpu"), sample, strict=True):
                times[key][part].append(t)
    med = {
        k: {part: float(np.median(v)) for part, v in parts.items()}
        for k, parts in times.items()
    }
    result = {"model": model, "rounds": rounds, "median_s": med}
    print()
    print(bench_compile.report(result))
    return result


def report(result: dict) -> str:
    """`bench_step.report`'s table, with the copied megabytes."""
    lines = bench_step.report(result).splitlines()
    lines[2] += " copied MB | bytes accessed MB |"
    lines[3] += " ---: | ---: |"
    for i, v in enumerate(result["variants"].values()):
        lines[4 + i] += f" {v['copy_mb']:.1f} | {v['bytes_mb']:.0f} |"
    return "\n".join(lines)


def main(argv=None) -> None:
    """Runs the benchmark and prints markdown tables (and JSON with --json)."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model", choices=["lm", "mlp", "char", "all"], default="all", help="model"
    )
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--steps-per-sample", type=int, default=2, help="steps")
    parser.add_argument(
        "--forms", nargs="*", default=list(FORMS), choices=list(FORMS), help="forms"
    )
    parser.add_argument(
        "--paths", nargs="*", default=["fused", "update"], help="jls paths"
    )
    parser.add_argument("--proxies", action="store_true", help="no timing")
    parser.add_argument(
        "--compile", type=int, default=0, help="time trace+compile instead, N rounds"
    )
    parser.add_argument("--check", action="store_true", help="verify the forms first")
    parser.add_argument("--seed", type=int, default=0, help="the rounds' order")
    bench_step.add_clock_option(parser)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    print(
        f"jax {jax.__version__}, optax {optax.__version__}, "
        f"{jax.devices()[0].device_kind}, {platform.processor() or platform.machine()}"
    )
    bench_step.use_clock(args.clock)
    print(f"clock: {args.clock}; cores seen: {len(os.sched_getaffinity(0))}")
    if args.check:
        check(args.forms, args.paths)
    models = ["lm", "mlp", "char"] if args.model == "all" else [args.model]
    results = []
    for model in models:
        make = functools.partial(make_variants, forms=args.forms, paths=args.paths)
        if args.compile:
            results.append(
                compile_times(model, args.forms, args.paths, args.compile, args.seed)
            )
            continue
        if args.proxies:
            loss_fn, params, batch = bench_step.make_problem(model)
            print(f"\n{model}: temp MB / entry copies / copied MB / bytes accessed MB")
            rows = {}
            for key, (step, state) in make(loss_fn, params).items():
                rows[key] = proxies(step, params, state, batch)
                r = rows[key]
                cells = (
                    f"{r['temp_mb']:.1f} | {r['copies']} | {r['copy_mb']:.1f} | "
                    f"{r['bytes_mb']:.0f}"
                )
                print(f"| {key} | {cells} |")
            results.append({"model": model, "variants": rows})
            continue
        result = bench_step.run(
            model,
            args.rounds,
            args.steps_per_sample,
            seed=args.seed,
            variants_fn=make,
            stats=proxies,
        )
        results.append(result)
        print()
        print(report(result))
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
