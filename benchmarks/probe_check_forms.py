"""What the finite check's reduction costs on XLA:CPU, form by form, and in the step.

The default check (`jls.all_finite`) sums ``|x| * 2**-k`` per large leaf: the
shrink keeps a sum of finite values finite (no false positive, however large
they are). On XLA:CPU each of those reductions is a YNN fusion. While leaves
of one size shared one constant, XLA made it one broadcast and YNN read it as
an array beside each leaf (the "broadcasts" column); jls now gives each leaf
of a size its own power of two, and the column counts what is left. This
probe measures, on one model's gradients, the check alone in several
forms, then the train step with each of jls's two checks:

check alone (CPU time, interleaved rounds, medians; GB/s of gradient read):

  default       ``jls.all_finite``: the sum of shrunk magnitudes (exact)
  squares       ``jls._squares.leaves_squares``: the measured rule's check
                (a plain sum of squares, with a shrunk second pass inside a
                conditional when it overflows; exact)
  sqrt          ``sum(sqrt(|x|))``: exact with no constant (a finite sum of
                square roots cannot overflow), not used
  rows          ``|x|`` summed along the last axis unshrunk, then shrunk
                (no false negative; a false positive for finite values
                near the float32 maximum), not used
  abs           ``sum(|x|)`` unshrunk (the same false positives), not used
  sum           ``sum(x)``: the floor, not a check (issue 10: fooled by
                fusion, cancellation and overflow)

the step (CPU time, ratio of medians to plain Adam, not donated; with
``--compile N``, N fresh trace+compiles of each instead):

  plain         optax Adam
  default       jls's fused step, ``dynamic_scale`` (the default check)
  squares       the same with a hook that needs the norm (the squares
                check: what ``measured_scale`` uses)

Run pinned to one core, so that CPU time counts this process's work alone:
``taskset -c 1 python benchmarks/probe_check_forms.py --model lm``.
Output: ``benchmarks/results/cpu/probe_check_forms_<model>.txt``;
docs/performance.md ("The check on XLA:CPU") reads it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

import jls
from jls._finite import inexact_leaves
from jls._squares import leaves_squares
from jls.hooks._hooks import Hook

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import make_problem  # noqa: E402


class _NeedsNorm(Hook):
    """A hook that asks for the norm alone: the step's check is the squares check."""

    name = "needs_norm"
    needs_norm = True


def _each(fn):
    return lambda grads: jnp.stack([fn(x) for x in inexact_leaves(grads)]).sum()


CHECKS = {
    "default": jls.all_finite,
    "squares": lambda grads: leaves_squares(inexact_leaves(grads)).finite,
    "sqrt": _each(lambda x: jnp.sum(jnp.sqrt(jnp.abs(x)))),
    "rows": _each(lambda x: jnp.sum(jnp.sum(jnp.abs(x), axis=-1) * 2.0**-40)),
    "abs": _each(lambda x: jnp.sum(jnp.abs(x))),
    "sum": _each(jnp.sum),
}


def _rounds(fns: dict, args_of: dict, rounds: int, repeat: int) -> dict:
    """CPU seconds per call of each of ``fns``, interleaved in a shuffled order."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        for k in random.Random(r).sample(list(fns), len(fns)):
            start = time.process_time()
            for _ in range(repeat):
                out = fns[k](*args_of[k])
            jax.block_until_ready(out)
            times[k].append((time.process_time() - start) / repeat)
    return times


def _ynn_broadcasts(compiled) -> int:
    """Materialised broadcasts feeding YNN fusions run on every call.

    Counted in the program's entry computation (not inside a conditional).
    """
    text = compiled.as_text() or ""
    entry = text[text.index("\nENTRY") :] if "\nENTRY" in text else text
    return sum(
        1
        for line in entry.splitlines()
        if "ynn_fusion" in line.split("=")[0] and "%wrapped_broadcast" in line
    )


def _steps(loss_fn, params) -> dict:
    """``{name: (step, state)}``: plain Adam and jls's fused step with each check."""
    adam = optax.adam(1e-4)

    def plain(params, state, batch):
        updates, state = adam.update(jax.grad(loss_fn)(params, batch), state, params)
        return optax.apply_updates(params, updates), state

    def scaled(hooks):
        scaler = jls.dynamic_scale(growth_interval=10**6)
        tx = jls.loss_scaling(adam, scaler, hooks=hooks)

        def step(params, state, batch):
            loss = lambda p: jls.scale_loss(loss_fn(p, batch), state)  # noqa: E731
            return jls.apply_gradients(tx, jax.grad(loss)(params), state, params)

        return step, tx.init(params)

    return {
        "plain": (plain, adam.init(params)),
        "default": scaled([]),
        "squares": scaled([_NeedsNorm()]),
    }


def _compiles(steps: dict, params, batch, rounds: int) -> None:
    """Medians of ``rounds`` fresh trace+compiles of each step, interleaved."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(rounds):
        for k in random.Random(r).sample(list(steps), len(steps)):
            fn, state = steps[k]
            jax.clear_caches()
            start = time.process_time()
            jax.jit(fn).lower(params, state, batch).compile()
            times[k].append(time.process_time() - start)
    base = statistics.median(times["plain"])
    print("| step | trace+compile (s) | ratio to plain |")
    print("| --- | ---: | ---: |")
    for k, t in times.items():
        median = statistics.median(t)
        print(f"| {k} | {median:.2f} | {median / base:.2f} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="lm", choices=["lm", "mlp", "char"], help="(default: lm)"
    )
    parser.add_argument("--rounds", type=int, default=15, help="(default: 15)")
    parser.add_argument(
        "--compile",
        type=int,
        default=0,
        help="time N fresh trace+compiles of each step instead (default: 0)",
    )
    args = parser.parse_args(argv)
    loss_fn, params, batch = make_problem(args.model)[:3]
    grads = jax.jit(jax.grad(loss_fn))(params, batch)
    size = sum(x.nbytes for x in inexact_leaves(grads))
    print(f"jax {jax.__version__}, {jax.default_backend()}; process CPU time")
    print(f"{args.model}: {len(jax.tree.leaves(grads))} leaves, {size / 1e6:.1f} MB")
    print()
    steps = _steps(loss_fn, params)
    if args.compile:
        _compiles(steps, params, batch, args.compile)
        return

    compiled = {k: jax.jit(f).lower(grads).compile() for k, f in CHECKS.items()}
    times = _rounds(compiled, dict.fromkeys(compiled, (grads,)), args.rounds, 10)
    print("| check alone | ms | GB/s | broadcasts into YNN fusions |")
    print("| --- | ---: | ---: | ---: |")
    for k, t in times.items():
        ms = statistics.median(t)
        print(
            f"| {k} | {1e3 * ms:.2f} | {size / ms / 1e9:.1f} |"
            f" {_ynn_broadcasts(compiled[k])} |"
        )
    print()

    fns, args_of = {}, {}
    for k, (fn, state) in steps.items():
        fns[k] = jax.jit(fn).lower(params, state, batch).compile()
        args_of[k] = (params, state, batch)
    times = _rounds(fns, args_of, args.rounds, 2)
    base = times["plain"]
    print("| step | ms | ratio of medians | per-round ratio: median | p10-p90 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for k, t in times.items():
        ratios = sorted(a / b for a, b in zip(t, base, strict=True))
        deciles = statistics.quantiles(ratios, n=10)
        print(
            f"| {k} | {1e3 * statistics.median(t):.1f} |"
            f" {statistics.median(t) / statistics.median(base):.3f} |"
            f" {statistics.median(ratios):.3f} | {deciles[0]:.3f}-{deciles[-1]:.3f} |"
        )


if __name__ == "__main__":
    main()
