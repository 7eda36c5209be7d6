"""What a step's scalar bookkeeping costs XLA:CPU to compile, and one way out.

A jls step updates a dozen scalars (the scale, its counters, the hooks'
records, the inner step count). XLA makes each one in a fusion of its own,
and XLA:CPU compiles each fusion as a function of its own. This probe
compiles ``n`` independent scalar updates (a select each) two ways, fresh
each time, interleaved, medians of ``--rounds``:

  apart     as written: one fusion per scalar (what XLA makes of jls's step)
  together  routed through one variadic ``lax.reduce`` over two copies of
            each (``max(x, x)`` is ``x``): one fusion with every scalar as
            an output

jls 0.4 tried ``together`` inside the step (commit 751abff, reverted by
fe5e4b8): on the 3.7M MLP the fused step's compile went from 1.52x to
1.43x plain Adam's CPU time, but the variadic reduce's ``vmap`` rule batches
every operand once one is batched (a replica-agreed scale became batched
beside a per-replica hook record, and ``out_axes=None`` for it raised), an
fp8 scalar without infinity became nan through the reduce's initial value,
and the reduce has no derivative. The figures and the reasons are in
docs/performance.md ("Trace and compile time").

Run: ``python benchmarks/probe_scalar_kernels.py [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax


def apart(xs: list, ok: jax.Array) -> list:
    return [jnp.where(ok, x + i, x * 2) for i, x in enumerate(xs)]


def _largest(a, b):
    return [jnp.maximum(x, y) for x, y in zip(a, b, strict=True)]


def together(xs: list, ok: jax.Array) -> list:
    made = apart(xs, ok)
    twice = [lax.broadcast(v, (2,)) for v in made]
    lowest = [jnp.asarray(jnp.iinfo(v.dtype).min, v.dtype) for v in made]
    return list(lax.reduce(twice, lowest, _largest, (0,)))


def sample(fn, n: int) -> tuple[float, int]:
    """One fresh compile of ``fn`` on ``n`` int32 scalars: (seconds, fusions)."""
    jax.clear_caches()
    xs = [jnp.int32(i) for i in range(n)]
    lowered = jax.jit(fn).lower(xs, jnp.bool_(True))
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    text = compiled.as_text() or ""
    return seconds, text.count(" fusion(")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=5, help="fresh compiles per form (default: 5)"
    )
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.default_backend()}; wall-clock compile")
    print()
    print("| scalars | form | fusions | compile (ms) |")
    print("| ---: | --- | ---: | ---: |")
    for n in (4, 16):
        times: dict[str, list[float]] = {"apart": [], "together": []}
        fusions = {}
        for _ in range(args.rounds):
            for name, fn in (("apart", apart), ("together", together)):
                seconds, fusions[name] = sample(fn, n)
                times[name].append(seconds)
        for name in times:
            ms = 1e3 * statistics.median(times[name])
            print(f"| {n} | {name} | {fusions[name]} | {ms:.0f} |")


if __name__ == "__main__":
    main()
