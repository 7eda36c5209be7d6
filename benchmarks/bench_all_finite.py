"""The all-finite check against the memory-bandwidth floor.

The floor is ``jnp.sum`` over the same bytes (one read of every element, the
least any check can do). Compared side by side in one process, interleaved
rounds, medians and the 10th-90th percentile of the per-round ratio
``floor_time / check_time`` (1.0 = at the floor, higher = faster). Also timed:
the idioms people copy (``jnp.isfinite(x).all()`` per leaf, as in optax and
jmp) and the alternatives jls's design rejected (``sum(x * 0)``).

Run: ``python benchmarks/bench_all_finite.py [--rounds 30] [--mib 100]``.
"""

from __future__ import annotations

import argparse
import random
import time

import jax
import jax.numpy as jnp
import numpy as np

import jls

F32 = jnp.float32


def variants():
    """The checks to time, by name: functions of a list of arrays."""
    return {
        "floor_sum": lambda t: sum(jnp.sum(x, dtype=F32) for x in t),
        "jls.all_finite": jls.all_finite,
        "isfinite_all": lambda t: jnp.all(
            jnp.stack([jnp.isfinite(x).all() for x in t])
        ),
        "sum_times_zero": lambda t: jnp.isfinite(
            sum(jnp.sum(x.astype(F32) * 0) for x in t)
        ),
    }


def run(n_leaves: int, dtype, total_bytes: int, rounds: int, seed: int = 0):
    """Times every variant on ``n_leaves`` arrays of ``total_bytes`` in all."""
    itemsize = jnp.dtype(dtype).itemsize
    n = total_bytes // itemsize // n_leaves
    rng = np.random.default_rng(seed)
    tree = [
        jnp.asarray(rng.standard_normal(n, np.float32)).astype(dtype)
        for _ in range(n_leaves)
    ]
    fns = {k: jax.jit(f) for k, f in variants().items()}
    for f in fns.values():
        jax.block_until_ready(f(tree))
    times = {k: [] for k in fns}
    order = list(fns)
    shuffle = random.Random(seed).shuffle
    for _ in range(rounds):
        shuffle(order)
        for k in order:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[k](tree))
            times[k].append(time.perf_counter() - t0)
    floor = np.asarray(times["floor_sum"])
    out = {}
    for k, ts in times.items():
        ratio = floor / np.asarray(ts)
        out[k] = (
            float(np.median(ts) * 1e3),
            float(np.median(ratio)),
            float(np.percentile(ratio, 10)),
            float(np.percentile(ratio, 90)),
        )
    return out


def main(argv=None) -> None:
    """Prints a markdown table."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds")
    parser.add_argument("--mib", type=int, default=100, help="bytes per tree")
    args = parser.parse_args(argv)
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"{args.mib} MiB per tree, {args.rounds} interleaved rounds"
    )
    print(
        "\n| dtype | leaves | variant | median (ms) | floor/variant (median) "
        "| p10-p90 |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        for n_leaves in (10, 1000):
            res = run(n_leaves, dtype, args.mib * 2**20, args.rounds)
            for k, (ms, med, p10, p90) in res.items():
                print(
                    f"| {jnp.dtype(dtype).name} | {n_leaves} | {k} | {ms:.2f} | "
                    f"{med:.2f} | {p10:.2f}-{p90:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
