"""How jls's cost grows with the work: parameter count and leaf count.

A model whose gradient costs little next to the optimizer step: each leaf
is a square matrix ``w`` and the loss is ``sum(tanh(x @ w))`` for a batch
``x`` of 8 rows, so each gradient is one thin matmul's output and Adam's
update is most of the step: the ratio to plain Adam is near the worst case
for jls's extra read of the gradients. Two sweeps: parameters from 1M to
128M in 16 leaves, and 10 to 2,000 leaves holding 8M parameters between
them. At each point, plain Adam, the fused step and ``tx.update``, each
jitted without donation and with it, are timed side by side in interleaved rounds
(medians of per-round ratios to plain in the same mode); the report adds the
trace+compile time ratio (one fresh ``jit`` each, interleaved, medians) and
the compiled temporary bytes against plain's.

Run: ``python benchmarks/bench_sweep.py [--rounds 5] [--plot sweep.png]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from bench_step import interleaved, summary

import jls

SIZES = [2**20, 2**23, 2**25, 2**27]  # 1M .. 128M parameters, 16 leaves
LEAVES = [10, 100, 1000, 2000]  # 8M parameters between them
DONATED = " (donated)"


def problem(n_params: int, n_leaves: int):
    side = max(int((n_params // n_leaves) ** 0.5), 1)
    params = {
        f"w{i}": jnp.full((side, side), 0.01, jnp.float32) for i in range(n_leaves)
    }
    x = jax.random.normal(jax.random.key(0), (8, side), jnp.float32)

    def loss_fn(params, x):
        return sum(jnp.sum(jnp.tanh(x @ w)) for w in params.values())

    return loss_fn, params, x


def steps(loss_fn, donated: bool):
    adam = optax.adam(1e-4)
    tx = jls.loss_scaling(adam, jls.dynamic_scale(2.0**15))

    def plain(carry, c):
        params, state = carry
        updates, state = adam.update(jax.grad(loss_fn)(params, c), state, params)
        return optax.apply_updates(params, updates), state

    def fused(carry, c):
        params, state = carry
        grads = jax.grad(lambda p: jls.scale_loss(loss_fn(p, c), state))(params)
        return jls.apply_gradients(tx, grads, state, params)

    def update(carry, c):
        params, state = carry
        grads = jax.grad(lambda p: jls.scale_loss(loss_fn(p, c), state))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return {
        "plain": (plain, adam.init),
        "jls_fused": (fused, tx.init),
        "jls_update": (update, tx.init),
    }


def point(n_params: int, n_leaves: int, rounds: int, compiles: int = 1) -> dict:
    loss_fn, params, coef = problem(n_params, n_leaves)
    variants, temp = {}, {}
    for donated in (False, True):
        suffix = DONATED if donated else ""
        for key, (fn, init) in steps(loss_fn, donated).items():
            carry = (jax.tree.map(jnp.copy, params), init(params))
            variants[key + suffix] = (fn, carry, (0,) if donated else ())
    compile_s = {key: [] for key in variants}
    for _ in range(compiles):  # compile times, interleaved
        for key, (fn, carry, donate) in variants.items():
            t0 = time.perf_counter()
            compiled = jax.jit(fn, donate_argnums=donate).lower(carry, coef).compile()
            compile_s[key].append(time.perf_counter() - t0)
            memory = compiled.memory_analysis()
            temp[key] = memory.temp_size_in_bytes if memory is not None else 0
    timed = {
        key: (jax.jit(fn, donate_argnums=donate), carry)
        for key, (fn, carry, donate) in variants.items()
    }
    times = interleaved(timed, coef, rounds)
    base = lambda k: "plain" + DONATED if k.endswith(DONATED) else "plain"  # noqa: E731
    rows = summary(times, base)
    for key, row in rows.items():
        row["compile_ratio"] = float(
            np.median(compile_s[key]) / np.median(compile_s[base(key)])
        )
        row["temp_mb"] = temp[key] / 1e6
        row["plain_temp_mb"] = temp[base(key)] / 1e6
    return {"params": n_params, "leaves": n_leaves, "variants": rows}


def report(results: list[dict]) -> str:
    lines = [
        "| params | leaves | variant | step ratio (p10-p90) | compile ratio | "
        "temp MB (plain's) |",
        "| ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in results:
        for key, v in r["variants"].items():
            if key.startswith("plain"):
                continue
            lines.append(
                f"| {r['params'] / 2**20:.0f}M | {r['leaves']} | {key} | "
                f"{v['ratio_median']:.3f} ({v['ratio_p10']:.2f}-{v['ratio_p90']:.2f})"
                f" | {v['compile_ratio']:.2f} | {v['temp_mb']:.1f} "
                f"({v['plain_temp_mb']:.1f}) |"
            )
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    sweeps = [
        ([r for r in results if r["leaves"] == 16], "params", "parameters (M)"),
        (
            [r for r in results if r["params"] == 2**23],
            "leaves",
            "leaves (8M params)",
        ),
    ]
    for ax, (rows, field, label) in zip(axes, sweeps, strict=True):
        rows = sorted(rows, key=lambda r, field=field: r[field])
        xs = [r[field] / (2**20 if field == "params" else 1) for r in rows]
        for key in rows[0]["variants"] if rows else []:
            if key.startswith("plain"):
                continue
            ys = [r["variants"][key]["ratio_median"] for r in rows]
            ax.plot(xs, ys, marker="o", label=key)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel(label)
    axes[0].set_ylabel("step time / plain Adam (same donation)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"jls step cost, {jax.devices()[0].device_kind}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> list[dict]:
    """Runs both sweeps; prints a markdown table, writes JSON and a plot."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument(
        "--max-params",
        type=int,
        default=2**27,
        help="largest parameter count of the size sweep",
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--plot", help="write a PNG plot to this file")
    parser.add_argument(
        "--replot", help="only plot this JSON output of an earlier run (to --plot)"
    )
    args = parser.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            results = json.load(f)
        plot(results, args.plot or "sweep.png")
        return results
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"{platform.processor() or platform.machine()}"
    )
    points = [(n, 16) for n in SIZES if n <= args.max_params]
    points += [(2**23, k) for k in LEAVES]
    results = []
    for n, k in points:
        results.append(point(n, k, args.rounds))
        print("\n".join(report(results[-1:]).splitlines()[2:]), flush=True)
    print()
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    main()
