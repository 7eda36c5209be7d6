"""What ``jls.hooks.Stagnation`` costs: the fused step with it against without it.

``jls.loss_scaling(..., hooks=[jls.hooks.Stagnation(every=n)])`` reads, on
each applied step, one n-th of each parameter's entries beside the update
(every entry once per n steps; no conditional). This times the fused step
(``jls.apply_gradients``, Adam, ``jls.dynamic_scale()``) with and without
the hook, and plain Adam, on the models of ``bench_step.py``, donated and
not, in interleaved rounds; ratios are to the fused step without the hook
in the same donation mode. ``every16`` is the default; ``every1`` reads
every entry on every step. ``--params bfloat16`` casts the parameters (and
so Adam's moments) to bfloat16, the case the hook is for. Run:
``python benchmarks/bench_stagnation.py --model all --rounds 15``.
``--clock cpu`` times each sample by the process's CPU time instead: pinned
to one core (``taskset -c 1 python benchmarks/bench_stagnation.py --clock
cpu ...``) it counts this process's work alone, which on a shared machine
resolves differences of a few percent that wall clock does not.

The read's own cost is a few milliseconds in a step of hundreds, below the
spread of the step's per-round ratios; it is also timed where it can be
resolved, in the optimizer's update alone (``jls.apply_gradients`` on fixed
gradients, the same interleaved rounds): the difference it makes there,
in milliseconds, and that difference over the full step's median (the
read's share of the step, "read / step").
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jls

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_step  # noqa: E402

DONATED = bench_step.DONATED


def _modes():
    """Adam, the scaler, and per donation mode ``(donated, jit, key suffix)``."""
    adam = optax.adam(1e-4)
    scaler = jls.dynamic_scale(2.0**15, growth_interval=10**6)
    modes = [
        (
            donated,
            functools.partial(jax.jit, donate_argnums=(0, 1) if donated else ()),
            DONATED if donated else "",
        )
        for donated in (False, True)
    ]
    return adam, scaler, modes


def variants(loss_fn, params, every: int):
    adam, scaler, modes = _modes()
    out = {}
    for _donated, jit, suffix in modes:

        def plain(params, state, batch):
            grads = jax.grad(loss_fn)(params, batch)
            updates, state = adam.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        out["plain" + suffix] = (jit(plain), adam.init(params))
        configs = [
            ("jls_fused", ()),
            (f"jls_fused_stagnation_every{every}", (jls.hooks.Stagnation(every),)),
            ("jls_fused_stagnation_every1", (jls.hooks.Stagnation(1),)),
        ]
        for name, hooks in configs:
            tx = jls.loss_scaling(adam, scaler, hooks=hooks)

            def fused(params, state, batch, tx=tx):
                grads = jax.grad(lambda p: jls.scale_loss(loss_fn(p, batch), state))(
                    params
                )
                return jls.apply_gradients(tx, grads, state, params)

            out[name + suffix] = (jit(fused), tx.init(params))
    return out


def update_alone(params, every: int):
    """``jls.apply_gradients`` on fixed gradients, with and without the hook."""
    adam, scaler, modes = _modes()
    out = {}
    for _donated, jit, suffix in modes:
        for name, hooks in (
            ("jls_fused", ()),
            (f"jls_fused_stagnation_every{every}", (jls.hooks.Stagnation(every),)),
        ):
            tx = jls.loss_scaling(adam, scaler, hooks=hooks)

            def update(params, state, grads, tx=tx):
                return jls.apply_gradients(tx, grads, state, params)

            out[name + suffix] = (jit(update), tx.init(params))
    return out


def read_share(times: dict, steps: dict, every: int) -> dict:
    """Per donation: the update alone's medians, the read's ms and share of the step."""
    out = {}
    for suffix in ("", DONATED):
        plain = np.asarray(times["jls_fused" + suffix])
        read = np.asarray(times[f"jls_fused_stagnation_every{every}" + suffix])
        without, with_hook = float(np.median(plain)), float(np.median(read))
        ratio = read / plain
        step = steps["jls_fused" + suffix]["median_ms"]
        out["jls_fused" + suffix] = {
            "update_ms": without * 1e3,
            "update_with_read_ms": with_hook * 1e3,
            "update_ratio_median": float(np.median(ratio)),
            "update_ratio_p10": float(np.percentile(ratio, 10)),
            "update_ratio_p90": float(np.percentile(ratio, 90)),
            "read_ms": (with_hook - without) * 1e3,
            "read_share_of_step": (with_hook - without) * 1e3 / step,
        }
    return out


def base(key: str) -> str:
    return "jls_fused" + DONATED if key.endswith(DONATED) else "jls_fused"


def run(model: str, rounds: int, steps_per_sample: int, dtype: str) -> dict:
    loss_fn, params, batch = bench_step.make_problem(model)
    params = jax.tree.map(lambda x: x.astype(dtype), params)
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
    grads = jax.tree.map(lambda x: jnp.full_like(x, 2.0**-10), params)
    alone = {
        key: (bench_step._pairwise(step), (jax.tree.map(jnp.copy, params), state))
        for key, (step, state) in update_alone(params, steps_per_sample).items()
    }
    alone_times = bench_step.interleaved(alone, grads, rounds, steps_per_sample)
    n = sum(x.size for x in jax.tree.leaves(params))
    return {
        "model": f"{model} ({dtype} parameters)",
        "params": int(n),
        "leaves": len(jax.tree.leaves(params)),
        "rounds": rounds,
        "steps_per_sample": steps_per_sample,
        "variants": {k: {**v, **facts[k]} for k, v in rows.items()},
        "read": read_share(alone_times, rows, steps_per_sample),
    }


def read_report(result: dict) -> str:
    """A markdown table of the read's cost, timed in the update alone."""
    lines = [
        "The read alone: the optimizer's update (jls.apply_gradients on fixed "
        "gradients) without / with the hook, in the same rounds",
        "",
        "| donated | update (ms) | update with the read (ms) | per-round ratio: "
        "median | p10-p90 | read (ms) | read / step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, v in result["read"].items():
        lines.append(
            f"| {'yes' if key.endswith(DONATED) else 'no'} | {v['update_ms']:.1f} | "
            f"{v['update_with_read_ms']:.1f} | {v['update_ratio_median']:.3f} | "
            f"{v['update_ratio_p10']:.3f}-{v['update_ratio_p90']:.3f} | "
            f"{v['read_ms']:.2f} | {100 * v['read_share_of_step']:.2f}% |"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model", choices=["lm", "mlp", "char", "all"], default="char", help="model"
    )
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument(
        "--steps", type=int, default=16, help="steps per sample (and every)"
    )
    parser.add_argument(
        "--params", choices=["float32", "bfloat16"], default="float32", help="dtype"
    )
    bench_step.add_clock_option(parser)
    parser.add_argument("--json", default="", help="write the results here")
    args = parser.parse_args(argv)
    bench_step.use_clock(args.clock)
    print(f"jax {jax.__version__}, {jax.default_backend()}; clock: {args.clock}")
    print()
    models = ["lm", "mlp", "char"] if args.model == "all" else [args.model]
    results = []
    for m in models:
        result = run(m, args.rounds, args.steps, args.params)
        results.append(result)
        text = bench_step.report(result)
        print(text.replace("ratios to plain Adam", "ratios to jls_fused"))
        print()
        print(read_report(result), flush=True)
        print()
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
