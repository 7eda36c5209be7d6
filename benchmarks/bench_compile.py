"""Trace and compile time of a train step: jls against plain optax.

For a user whose step takes minutes to compile, compile time is the most
visible cost a library adds. Each sample builds a fresh ``jax.jit`` of the
step (caches cleared), then times ``lower`` (tracing and lowering) and
``compile`` separately, in wall-clock seconds and in the process's CPU
seconds (less sensitive to other load on a shared machine). The variants
(plain Adam, jls fused, jls ``tx.update``; the steps of ``bench_step.py``)
are interleaved in shuffled order within each round, and the report gives
each variant's median times and its ratios of medians to plain.

Run: ``python benchmarks/bench_compile.py [--model lm|mlp|both] [--rounds 3]``.
Needs the ``bench`` extra (flax, jmp).
"""

from __future__ import annotations

import argparse
import random
import time

import jax
import numpy as np
from bench_step import make_problem, make_variants

VARIANTS = ("plain", "jls_fused", "jls_update")


def sample(step, opt_state, params, batch) -> tuple[float, float, float]:
    """One fresh jit of ``step``: (lower s, compile s, CPU s of both)."""
    jax.clear_caches()
    fresh = jax.jit(step.__wrapped__, donate_argnums=(0, 1))
    c0, t0 = time.process_time(), time.perf_counter()
    lowered = fresh.lower(params, opt_state, batch)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1, time.process_time() - c0


def run(name: str, rounds: int, seed: int = 0) -> dict:
    """Times every variant's trace and compile on one model."""
    loss_fn, params, batch = make_problem(name)
    variants = {
        k: v for k, v in make_variants(loss_fn, params).items() if k in VARIANTS
    }
    times = {k: {"lower": [], "compile": [], "cpu": []} for k in variants}
    order = list(variants)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for key in order:
            step, opt_state = variants[key]
            lower, compile_, cpu = sample(step, opt_state, params, batch)
            times[key]["lower"].append(lower)
            times[key]["compile"].append(compile_)
            times[key]["cpu"].append(cpu)
    med = {
        k: {part: float(np.median(v)) for part, v in parts.items()}
        for k, parts in times.items()
    }
    return {"model": name, "rounds": rounds, "median_s": med}


def report(result: dict) -> str:
    """A markdown table of one model's result."""
    med = result["median_s"]
    plain = med["plain"]
    lines = [
        f"{result['model']}: fresh jit per sample, {result['rounds']} rounds",
        "",
        "| variant | trace+lower (s) | compile (s) | wall ratio to plain "
        "| CPU ratio to plain |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key, m in med.items():
        ratio = (m["lower"] + m["compile"]) / (plain["lower"] + plain["compile"])
        cpu = m["cpu"] / plain["cpu"]
        lines.append(
            f"| {key} | {m['lower']:.2f} | {m['compile']:.2f} | {ratio:.2f} "
            f"| {cpu:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    """Runs the benchmark and prints markdown tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["lm", "mlp", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    models = ["lm", "mlp"] if args.model == "both" else [args.model]
    for m in models:
        print()
        print(report(run(m, args.rounds)))


if __name__ == "__main__":
    main()
