"""The char LM's fused step: the default check against the squares check.

``examples/char_lm.py``'s model in float16, one step compiled three ways:
plain Adam, ``jls.dynamic_scale()`` (the default check, a sum of magnitudes)
and ``jls.measured_scale()`` (the sum-of-squares check). Prints each
compiled step's temporaries and top-level fusions, copies and YNN fusions,
and with ``--time N`` N interleaved rounds of 2 steps (ratios of medians to
plain). ``--donate`` donates the parameters and state. Run:
``python benchmarks/probe_char_check.py --donate --time 20``; under
``XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=`` to compare without
XLA:CPU's YNN fusions (docs/performance.md).
"""

from __future__ import annotations

import argparse
import pathlib
import random
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jls

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from char_runs import load_char_lm  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--donate", action="store_true", help="donate the state")
    parser.add_argument("--time", type=int, default=0, help="interleaved rounds")
    args = parser.parse_args(argv)
    lm = load_char_lm()
    cfg = lm.Config()
    key = jax.random.key(0)
    params = lm.init_params(key, cfg)
    tokens = jax.random.randint(key, (cfg.batch, cfg.seq + 1), 0, 256)
    loss_fn = lm.make_loss(cfg, "f16")
    adam = optax.adam(1e-3)

    def plain(p, s, t):
        g = jax.grad(lambda p: loss_fn(p, t))(p)
        u, s = adam.update(g, s, p)
        return optax.apply_updates(p, u), s

    def make(scaler):
        tx = jls.loss_scaling(adam, scaler)

        def step(p, s, t):
            g = jax.grad(lambda p: jls.scale_loss(loss_fn(p, t), s))(p)
            return jls.apply_gradients(tx, g, s, p)

        return tx, step

    variants = {
        "plain": (adam, plain),
        "default": make(jls.dynamic_scale()),
        "squares": make(jls.measured_scale()),
    }
    compiled = {}
    for name, (tx, f) in variants.items():
        jitted = jax.jit(f, donate_argnums=(0, 1) if args.donate else ())
        c = jitted.lower(params, tx.init(params), tokens).compile()
        entry = c.as_text().split("ENTRY", 1)[1]
        fusions = len(re.findall(r"= \S+ fusion\(", entry))
        copies = len(re.findall(r"= \S+ copy\(", entry))
        print(
            f"{name:8s} temp {c.memory_analysis().temp_size_in_bytes / 1e6:.2f} MB, "
            f"fusions {fusions}, copies {copies}, "
            f"ynn fusions {entry.count('__ynn_fusion')}"
        )
        compiled[name] = (jitted, tx)
    if not args.time:
        return {}
    states = {}
    for name, (jitted, tx) in compiled.items():
        state = (jax.tree.map(jnp.copy, params), tx.init(params))
        for _ in range(3):
            state = jitted(*state, tokens)
        states[name] = jax.block_until_ready(state)
    times: dict[str, list[float]] = {n: [] for n in compiled}
    order = list(compiled)
    for _ in range(args.time):
        random.shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            for _ in range(2):
                states[name] = compiled[name][0](*states[name], tokens)
            jax.block_until_ready(states[name])
            times[name].append(time.perf_counter() - t0)
    base = float(np.median(times["plain"]))
    ratios = {n: float(np.median(t)) / base for n, t in times.items()}
    print(
        "  ".join(f"{n} {r:.3f}" for n, r in ratios.items()),
        f"(plain {base * 500:.1f} ms/step)",
    )
    return ratios


if __name__ == "__main__":
    main()
