"""What the layout of `jls.hooks.Stagnation`'s blocks costs: rows or strided entries.

At the default cycle of 16 a step reads one block in 16 of each leaf. Cut
along the last axis, a block of one entry lies every 16th in memory, so
the read touches every cache line of the leaf and costs what reading it
whole costs. Since 5956d4e such blocks are widened to 16 entries where the
axis has room (a (64, 4096) kernel), and a leaf of 64Ki entries or more
whose axis has none (an attention kernel of shape (heads, head dim,
features), a (128, 512) matrix) is cut in whole rows along an earlier
axis instead (`jls.hooks._blocks._cut`).

This times the optimizer's update alone (``jls.apply_gradients``, Adam,
fixed gradients, donated) on a tree of leaves of one shape, and on the
27M LM's parameters (`bench_step.make_problem`), three ways,
in interleaved rounds, each sample by the process's CPU time:

  none      without the hook
  rows      with ``Stagnation()``, cut as the package cuts (`_cut`)
  last      with ``Stagnation()``, cut along the first axis `_block` cuts,
            the last one here (the rule before 5956d4e; patched in)

Run: ``taskset -c 1 python benchmarks/probe_stagnation_layout.py``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jls
from jls.hooks import _blocks, _stagnation

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_step  # noqa: E402

PRESENT = _blocks._cut


def last_cut(shape: tuple[int, ...], every: int) -> tuple[int, int] | None:
    """The rule before 5956d4e: the first axis `_block` cuts, its blocks."""
    for axis, n in enumerate(shape or (1,)):
        block = _blocks._block(n, every)
        if block is not None:
            return axis, block
    return None


def compiled(params, rule):
    """The donated update step, traced (and so cut) under ``rule``."""
    _stagnation._cut = rule
    try:
        hooks = () if rule is None else (jls.hooks.Stagnation(),)
        tx = jls.loss_scaling(
            optax.adam(1e-4),
            jls.dynamic_scale(2.0**15, growth_interval=10**6),
            donated=True,
            hooks=hooks,
        )
        step = jax.jit(
            lambda p, s, g: jls.apply_gradients(tx, g, s, p), donate_argnums=(0, 1)
        )
        state = tx.init(params)
        grads = jax.tree.map(lambda x: jnp.full_like(x, 2.0**-10), params)
        step = step.lower(params, state, grads).compile()
        carry = (jax.tree.map(jnp.copy, params), state)
        return step, carry, grads
    finally:
        _stagnation._cut = PRESENT


def run(params, rounds: int, steps: int) -> dict:
    ways = {"none": None, "rows": PRESENT, "last": last_cut}
    made: dict[str, list[Any]] = {
        name: list(compiled(params, rule)) for name, rule in ways.items()
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, (step, carry, grads) in made.items():
            t0 = time.process_time()
            for _ in range(steps):
                carry = step(*carry, grads)
            jax.block_until_ready(carry)
            times[name].append((time.process_time() - t0) / steps)
            made[name][1] = carry
    base = np.asarray(times["none"])
    return {
        name: (float(np.median(t) * 1e3), float(np.median(np.asarray(t) / base)))
        for name, t in times.items()
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=5, help="steps per sample")
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.default_backend()}; clock: cpu")
    print()
    print("| leaves | (axis, block): rows / last | none (ms) | rows | last |")
    print("| --- | --- | ---: | ---: | ---: |")
    shapes = (((8, 64, 512), 16), ((128, 512), 64), ((64, 4096), 16), ((512, 8192), 1))
    for shape, count in shapes:
        params = {f"w{i}": jnp.full(shape, 1.0 + i) for i in range(count)}
        got = run(params, args.rounds, args.steps)
        axes = f"{PRESENT(shape, 16)} / {last_cut(shape, 16)}"
        print(
            f"| {count} x {shape} | {axes} | {got['none'][0]:.2f} | "
            f"{got['rows'][1]:.3f}x | {got['last'][1]:.3f}x |",
            flush=True,
        )
    # The 27M LM of bench_step.py, every leaf (six (8, 64, 512) among 101).
    _, params, _ = bench_step.make_problem("lm")
    got = run(params, args.rounds, args.steps)
    print(
        f"| the 27M LM's 101 leaves | | {got['none'][0]:.2f} | "
        f"{got['rows'][1]:.3f}x | {got['last'][1]:.3f}x |",
        flush=True,
    )


if __name__ == "__main__":
    main()
