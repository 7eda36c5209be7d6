"""What ``scale_stats=True`` costs: the fused step with it against without it.

``jls.loss_scaling(..., scale_stats=True)`` records ``underflow_fraction`` and
``headroom_bits`` each step. This times the fused float16 step
(``jls.apply_gradients``, ``jls.dynamic_scale()``) with and without it, and
plain Adam, on the models of ``bench_step.py``, donated and not, in
interleaved rounds; ratios are to the fused step without the statistics in
the same donation mode. ``jls_fused_scale_stats_every<n>`` measures one
step in ``n`` (``jls.hooks.ScaleStats(every=n)``, donated only: jls refuses it
without donation), with ``n`` the steps timed per sample, so that every
sample holds exactly one measured step. Run:
``python benchmarks/bench_scale_stats.py --model all --rounds 15``;
``--isolated`` times the check and the statistics' reductions on their own.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import optax

import jls

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_step  # noqa: E402

DONATED = bench_step.DONATED


def variants(loss_fn, params, every: int):
    adam = optax.adam(1e-4)
    scaler = jls.dynamic_scale(2.0**15, growth_interval=10**6)
    out = {}
    for donated in (False, True):
        jit = functools.partial(jax.jit, donate_argnums=(0, 1) if donated else ())
        suffix = DONATED if donated else ""

        def plain(params, state, batch):
            grads = jax.grad(loss_fn)(params, batch)
            updates, state = adam.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        out["plain" + suffix] = (jit(plain), adam.init(params))
        configs = [("jls_fused", False), ("jls_fused_scale_stats", True)]
        if donated:  # sampling needs a donating step (refused without)
            configs.append(
                (
                    f"jls_fused_scale_stats_every{every}",
                    jls.hooks.ScaleStats(every=every),
                )
            )
        for name, stats in configs:
            tx = jls.loss_scaling(adam, scaler, scale_stats=stats)

            def fused(params, state, batch, tx=tx):
                grads = jax.grad(lambda p: jls.scale_loss(loss_fn(p, batch), state))(
                    params
                )
                return jls.apply_gradients(tx, grads, state, params)

            out[name + suffix] = (jit(fused), tx.init(params))
    return out


def base(key: str) -> str:
    return "jls_fused" + DONATED if key.endswith(DONATED) else "jls_fused"


def run(model: str, rounds: int, steps_per_sample: int) -> dict:
    loss_fn, params, batch = bench_step.make_problem(model)
    made = variants(loss_fn, params, every=steps_per_sample)
    facts = {
        key: bench_step.compiled_stats(step, params, state, batch)
        for key, (step, state) in made.items()
    }
    timed = {
        key: (bench_step._pairwise(step), (jax.tree.map(jnp.copy, params), state))
        for key, (step, state) in made.items()
    }
    times = bench_step.interleaved(timed, batch, rounds, steps_per_sample)
    rows = bench_step.summary(times, base)
    n = sum(x.size for x in jax.tree.leaves(params))
    return {
        "model": model,
        "params": int(n),
        "leaves": len(jax.tree.leaves(params)),
        "rounds": rounds,
        "steps_per_sample": steps_per_sample,
        "variants": {k: {**v, **facts[k]} for k, v in rows.items()},
    }


def isolated(rounds: int) -> dict:
    """The check alone, the check and the statistics, and one reduction for both.

    On gradient-shaped float32 arrays (the 27M LM's big leaves, 470 MB): how
    much the statistics' reduction costs against the check's own, and what
    one variadic reduction computing the check's sum, the maximum and the
    count together would cost instead (a design not taken).
    """
    import random
    import time

    import numpy as np
    from jax import lax

    from jls._finite import leaves_finite
    from jls.hooks._scale_stats import _reduce

    shapes = [(8192, 1024)] * 4 + [(1024, 1024)] * 16 + [(1024, 4096)] * 16
    key = jax.random.key(0)
    tree = [
        jax.random.normal(jax.random.fold_in(key, i), s) for i, s in enumerate(shapes)
    ]
    tiny = np.float32(np.finfo(np.float16).tiny)

    def with_stats(t):
        out = [leaves_finite(t)]
        for x in t:
            a = jnp.abs(x)
            out.extend(_reduce(a, (a < tiny).astype(jnp.int32)))
        return out

    def one_reduction(t):
        out = []
        for x in t:
            a = jnp.abs(x)
            k = jnp.float32(2.0 ** -((x.size - 1).bit_length() + 8))

            def body(p, q):
                return p[0] + q[0], jnp.maximum(p[1], q[1]), p[2] + q[2]

            small = (a < tiny).astype(jnp.int32)
            init = (jnp.float32(0), jnp.float32(0), jnp.int32(0))
            out.extend(lax.reduce((a * k, a, small), init, body, (0, 1)))
        return out

    fns = {
        "check": jax.jit(leaves_finite),
        "check + statistics (scale_stats)": jax.jit(with_stats),
        "one variadic reduction for both": jax.jit(one_reduction),
    }
    for f in fns.values():
        jax.block_until_ready(f(tree))
    times: dict[str, list[float]] = {n: [] for n in fns}
    order = list(fns)
    for _ in range(rounds):
        random.shuffle(order)
        for n in order:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[n](tree))
            times[n].append(time.perf_counter() - t0)
    base = float(np.median(times["check"]))
    return {n: float(np.median(t)) / base for n, t in times.items()}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model", choices=["lm", "mlp", "char", "all"], default="char", help="model"
    )
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=2, help="steps per sample")
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument(
        "--isolated", action="store_true", help="time the reductions alone instead"
    )
    args = parser.parse_args(argv)
    if args.isolated:
        for name, ratio in isolated(args.rounds).items():
            print(f"{name:36s} {ratio:.2f}x the check's time")
        return []
    models = ["lm", "mlp", "char"] if args.model == "all" else [args.model]
    results = []
    for m in models:
        result = run(m, args.rounds, args.steps)
        results.append(result)
        text = bench_step.report(result)
        print(text.replace("ratios to plain Adam", "ratios to jls_fused"), flush=True)
        print()
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
