"""How closely `jls.precision.scaled_state(optax.adam)` follows float32 Adam.

One array whose entries see gradients ``ratio`` times the largest: a spike
of 1 in one part of the array at step 5 that then decays by 0.7 a step
(never below ``ratio``), every other entry ``ratio`` times a random factor
in [0.5, 1.5] of a fixed sign. Three layouts: a spike in one row of a
(16, 64) matrix (``row``), in one entry of a 64-vector (``entry``), and
``row`` with its last row at 2**-26 (``row+tiny``: the moments are held as
signed square roots whatever the ratio, the precision of that form).
Each entry's move is the sum of Adam's updates over ``--steps`` steps
(the updates do not depend on the parameters); the table gives, per ratio,
the worst entry's move over float32 Adam's (the one furthest from 1) and
the state's bytes per moment entry, the scales included (the step count
left out); ``--rounds`` times one update of a 1024 x 1024 array against
float32 Adam's, by the process's CPU time (its median). Run: ``taskset -c 1
python benchmarks/bench_scaled_state.py --steps 100 300 500 1000 --rounds 100``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jls


def grads(ratio: float, layout: str, steps: int, seed: int = 0) -> np.ndarray:
    """The gradients of every step, float32, shape ``(steps, *shape)``."""
    rng = np.random.default_rng(seed)
    shape = (64,) if layout == "entry" else (16, 64)
    sign = rng.choice([-1.0, 1.0], size=shape)
    g = ratio * sign * rng.uniform(0.5, 1.5, size=(steps, *shape))
    spike = np.maximum(0.7 ** (np.arange(steps) - 5.0), ratio)[:, None]
    hit = g[:, :1] if layout == "entry" else g[:, 0]
    hit[5:] = np.sign(hit[5:]) * spike[5:]
    if layout == "row+tiny":
        g[:, -1] = np.sign(g[:, -1]) * 2.0**-26
    return g.astype(np.float32)


def moves(tx: optax.GradientTransformation, gs: np.ndarray) -> tuple[np.ndarray, Any]:
    """The sum of ``tx``'s updates over the steps, per entry, and the state."""
    params = jnp.zeros(gs.shape[1:], jnp.float32)

    def step(carry, g):
        total, state = carry
        u, state = tx.update(g, state, params)
        return (total + u, state), None

    init = (jnp.zeros_like(params), tx.init(params))
    (total, state), _ = jax.jit(lambda g: jax.lax.scan(step, init, g))(gs)
    return np.asarray(total), state


def bytes_per_entry(state: jls.precision.ScaledState) -> float:
    """The moments' bytes and their scales over the moments' entries."""
    moments = [x for x in jax.tree.leaves(state.inner_state) if np.ndim(x) >= 1]
    nbytes = sum(x.nbytes for x in moments) + sum(s.nbytes for s in state.scales)
    return nbytes / sum(x.size for x in moments)


def table(steps: int) -> None:
    """Print the worst move ratio per layout and ratio over ``steps`` steps."""
    print(f"\n{steps} steps\n")
    print("| layout | gradient ratio | worst move / float32 Adam's | bytes per entry |")
    print("| --- | --- | ---: | ---: |")
    worst_all = 0.0
    for layout in ("row", "entry", "row+tiny"):
        for k in range(8, 25, 2):
            gs = grads(2.0**-k, layout, steps)
            ref, _ = moves(optax.adam(1.0), gs)
            got, state = moves(jls.precision.scaled_state(optax.adam(1.0)), gs)
            ratios = (got / ref).ravel()
            worst = ratios[np.argmax(np.abs(ratios - 1))]
            worst_all = max(worst_all, abs(worst - 1))
            size = bytes_per_entry(state)
            print(f"| {layout} | 2**-{k} | {worst:.4f} | {size:.4f} |")
    print(f"\nworst deviation over all, {steps} steps: {worst_all:.2%}")


def timing(rounds: int) -> None:
    """Print the median CPU time of one jitted update of a 1024 x 1024 array."""
    print("\n| optimizer | gradient ratio | update of 1M entries (CPU ms) |")
    print("| --- | --- | ---: |")
    for name, tx, k in [
        ("scaled_state(optax.adam)", jls.precision.scaled_state(optax.adam(1e-3)), 8),
        ("scaled_state(optax.adam)", jls.precision.scaled_state(optax.adam(1e-3)), 24),
        ("optax.adam, float32 state", optax.adam(1e-3), 8),
    ]:
        g = jnp.asarray(np.tile(grads(2.0**-k, "row", 1)[0], (64, 16)))
        step = jax.jit(lambda g, s, tx=tx: tx.update(g, s, g))
        state = step(g, tx.init(g))[1]
        for _ in range(rounds):  # warm up (the first run of a process is slow)
            jax.block_until_ready(step(g, state))
        times = []
        for _ in range(rounds):
            start = time.process_time()
            jax.block_until_ready(step(g, state))
            times.append(1e3 * (time.process_time() - start))
        print(f"| {name} | 2**-{k} | {np.median(times):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--steps", type=int, nargs="+", default=[100], help="steps per table"
    )
    parser.add_argument(
        "--rounds", type=int, default=0, help="time the update (0: do not)"
    )
    args = parser.parse_args()
    steps = " ".join(map(str, args.steps))
    print(
        f"# taskset -c 1 python benchmarks/bench_scaled_state.py --steps {steps}"
        f" --rounds {args.rounds}"
        f" ({os.cpu_count()}-core {platform.machine()} CPU,"
        f" XLA:{jax.devices()[0].platform.upper()}, jax {jax.__version__},"
        f" optax {optax.__version__}, {time.strftime('%Y-%m-%d', time.gmtime())})"
    )
    for n in args.steps:
        table(n)
    if args.rounds:
        timing(args.rounds)


if __name__ == "__main__":
    main()
