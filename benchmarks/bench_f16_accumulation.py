"""A float16 accumulation client: why the measured scale's step cost follows its value.

The client: a small MLP whose parameters and compute are float16, trained
with SGD through ``jls.train_step(..., accumulation_steps=4)`` under a plain
``jax.jit`` (no donation). Variants, side by side in one process
(interleaved rounds, medians, per-round ratios to ``unscaled``):

  unscaled       the same accumulation loop written by hand, no loss scaling.
  no_scale       ``jls.no_scale()``: jls's step at scale 1.
  static_2**k    ``jls.static_scale(2**k)`` (``--exponents``).
  dynamic        ``jls.dynamic_scale()`` (starts at 2**15).
  measured       ``jls.measured_scale()``.

Each variant is warmed up for ``--warmup`` steps first (the measured rule
moves its scale there), and the report gives the scale it ran at, whether
its steps were skipped, and two facts about the float16 numbers its backward
pass produced at that scale, from one micro-batch: the fraction of gradient
elements (of the parameters and of every layer's pre-activation) that are
float16 subnormals, and the fraction that are inf or nan.

``--micro`` adds the minimal reproducers: a float16 matmul and an
elementwise chain on XLA:CPU, with inputs scaled so that they are normal,
subnormal, zero, inf or nan in float16.

Run: ``python benchmarks/bench_f16_accumulation.py [--rounds 15] [--micro]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jls

F16 = jnp.float16
TINY = float(jnp.finfo(F16).tiny)


def init(key, sizes):
    """float16 weights (LeCun normal) and zero biases."""
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
        key, sub = jax.random.split(key)
        w = jax.random.normal(sub, (fan_in, fan_out)) * fan_in**-0.5
        params.append({"w": w.astype(F16), "b": jnp.zeros((fan_out,), F16)})
    return params


def forward(params, x, taps=None):
    """float16 compute, float32 logits; ``taps`` (zeros) join each pre-activation."""
    h = x.astype(F16)
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        if taps is not None:
            h = h + taps[i]
        if i < len(params) - 1:
            h = jax.nn.gelu(h)
    return h.astype(jnp.float32)


def loss_fn(params, x, y, taps=None):
    logits = forward(params, x, taps)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def problem(width, depth, batch):
    key = jax.random.key(0)
    sizes = [256] + [width] * depth + [10]
    params = init(key, sizes)
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (batch, 256))
    y = jax.random.randint(ky, (batch,), 0, 10)
    return params, (x, y)


def with_scale(state, value):
    """``state`` with its loss scale set to ``value`` (same executable)."""
    loss_scale = state.loss_scale._replace(scale=jnp.float32(value))
    return state._replace(loss_scale=loss_scale)


def make_variants(params, k, lr, exponents, sweep=()):
    """``{name: (jitted step(params, state, x, y), state)}``.

    ``sweep``: exponents at which the dynamic and the measured steps are
    also run from a state whose scale is ``2**e``: the same executable as
    their own row, only the scale's value differs.
    """
    sgd = optax.sgd(lr)
    variants = {}

    def unscaled(params, state, x, y):
        def micro(acc, b):
            g = jax.grad(loss_fn)(params, *b)
            return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, g), None

        cut = lambda a: a.reshape(k, a.shape[0] // k, *a.shape[1:])  # noqa: E731
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        total, _ = lax.scan(micro, zeros, (cut(x), cut(y)))
        grads = jax.tree.map(lambda t, p: (t / k).astype(p.dtype), total, params)
        updates, state = sgd.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    variants["unscaled"] = (jax.jit(unscaled), sgd.init(params))
    scalers = {"no_scale": jls.no_scale()}
    for e in exponents:
        scalers[f"static_2**{e}"] = jls.static_scale(2.0**e)
    scalers["dynamic"] = jls.dynamic_scale()
    scalers["measured"] = jls.measured_scale()
    for name, scaler in scalers.items():
        tx = jls.loss_scaling(sgd, scaler)
        step = jls.train_step(loss_fn, tx, accumulation_steps=k)

        def dropped_out(params, state, x, y, step=step):
            params, state, _ = step(params, state, x, y)
            return params, state

        variants[name] = (jax.jit(dropped_out), tx.init(params))
    for name in ("dynamic", "measured"):
        step, state = variants[name]
        for e in sweep:
            variants[f"{name}@2**{e}"] = (step, with_scale(state, 2.0**e))
    return variants


@functools.partial(jax.jit, static_argnames="k")
def number_facts(params, scale, x, y, k):
    """Subnormal and non-finite fractions of one micro-batch's float16 gradients."""
    x, y = x[: x.shape[0] // k], y[: y.shape[0] // k]
    taps = [jnp.zeros((x.shape[0], p["b"].shape[0]), F16) for p in params]
    scaled = lambda p, t: loss_fn(p, x, y, t) * scale  # noqa: E731
    grads = jax.grad(scaled, argnums=(0, 1))(params, taps)
    leaves = [g.ravel() for g in jax.tree.leaves(grads)]
    flat = jnp.concatenate(leaves)
    mag = jnp.abs(flat.astype(jnp.float32))
    sub = jnp.mean((mag > 0) & (mag < TINY))
    bad = jnp.mean(~jnp.isfinite(flat))
    return sub, bad


def scale_of(state):
    inner = getattr(state, "loss_scale", None)
    return None if inner is None else float(inner.scale)


def skips_of(state):
    metrics = jls.metrics(state) if hasattr(state, "loss_scale") else {}
    return int(metrics.get("skipped_steps", metrics.get("skips", 0)) or 0)


def timed(variants, params, batch, rounds, warmup, seed=0, clock=time.perf_counter):
    """Warm each variant up, then interleaved rounds: {name: [s per step]}.

    A swept variant (its name has ``@``) is not warmed up: it runs from the
    scale it was given.
    """
    state = {}
    for name, (step, opt_state) in variants.items():
        carry = (params, opt_state)
        for _ in range(warmup if "@" not in name else 1):
            carry = step(*carry, *batch)
        state[name] = jax.block_until_ready(
            carry if "@" not in name else (params, opt_state)
        )
    times = {n: [] for n in variants}
    order = list(variants)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            t0 = clock()
            carry = variants[name][0](*state[name], *batch)
            jax.block_until_ready(carry)
            times[name].append(clock() - t0)
            # each sample starts from the warmed-up state: the same numbers
    return times, state


def micro(rounds=15):
    """Minimal reproducers: one float16 matmul and one elementwise chain."""
    key = jax.random.key(1)
    a = jax.random.normal(key, (256, 512))
    b = jax.random.normal(jax.random.key(2), (512, 512)) * 512**-0.5
    dot = jax.jit(lambda a, b: a @ b)
    chain = jax.jit(lambda a: jax.nn.gelu(a) * a + a)
    cases = {
        "normal": 1.0,
        "subnormal": 2.0**-20,
        "zero": 0.0,
        "inf": float("inf"),
        "nan": float("nan"),
    }
    rows = {}
    for name, s in cases.items():
        x = (a * s).astype(F16) if s == s else jnp.full(a.shape, jnp.nan, F16)
        w = b.astype(F16)
        args = {"dot": (x, w), "dot_both": (x, (b * (s if s == s else 1)).astype(F16))}
        fns = {"dot": dot, "dot_both": dot}
        t = {}
        for f, fn in fns.items():
            jax.block_until_ready(fn(*args[f]))
            ts = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args[f]))
                ts.append(time.perf_counter() - t0)
            t[f] = float(np.median(ts) * 1e3)
        jax.block_until_ready(chain(x))
        ts = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            jax.block_until_ready(chain(x))
            ts.append(time.perf_counter() - t0)
        t["elementwise"] = float(np.median(ts) * 1e3)
        rows[name] = t
        cells = f"{t['dot']:.2f} | {t['dot_both']:.2f} | {t['elementwise']:.3f}"
        print(f"| {name} | {cells} |")
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=30, help="steps before timing")
    parser.add_argument("--width", type=int, default=512, help="hidden width")
    parser.add_argument("--depth", type=int, default=3, help="hidden layers")
    parser.add_argument("--batch", type=int, default=256, help="batch size")
    parser.add_argument(
        "--accumulation", type=int, default=4, help="micro-batches per step"
    )
    parser.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    parser.add_argument(
        "--exponents",
        type=int,
        nargs="*",
        default=[0, 8, 15, 20, 24],
        help="static scales 2**e timed",
    )
    parser.add_argument(
        "--sweep",
        type=int,
        nargs="*",
        default=[],
        help="also run the dynamic and measured executables at scale 2**e",
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall or process CPU time",
    )
    parser.add_argument("--micro", action="store_true")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    print(
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"{platform.processor() or platform.machine()}"
    )
    params, batch = problem(args.width, args.depth, args.batch)
    variants = make_variants(
        params, args.accumulation, args.lr, args.exponents, args.sweep
    )
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"clock: {args.clock}; cores seen: {len(os.sched_getaffinity(0))}")
    times, state = timed(variants, params, batch, args.rounds, args.warmup, clock=clock)
    base = np.asarray(times["unscaled"])
    print(
        f"\nfloat16 MLP 256-{args.width}x{args.depth}-10, batch {args.batch} in "
        f"{args.accumulation} micro-batches, SGD, plain jit; {args.rounds} rounds "
        f"after {args.warmup} warm-up steps; ratios to unscaled\n"
    )
    print(
        "| variant | scale | median step (ms) | ratio of medians | per-round ratio: "
        "median | p10-p90 | grads subnormal | grads inf/nan |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = {}
    for name, ts in times.items():
        ts = np.asarray(ts)
        ratio = ts / base
        scale = scale_of(state[name][1])
        sub, bad = number_facts(state[name][0], scale or 1.0, *batch, args.accumulation)
        rows[name] = {
            "scale": scale,
            "median_ms": float(np.median(ts) * 1e3),
            "ratio_of_medians": float(np.median(ts) / np.median(base)),
            "ratio_median": float(np.median(ratio)),
            "ratio_p10": float(np.percentile(ratio, 10)),
            "ratio_p90": float(np.percentile(ratio, 90)),
            "subnormal": float(sub),
            "nonfinite": float(bad),
        }
        r = rows[name]
        s = "-" if scale is None else f"2**{np.log2(scale):.0f}"
        print(
            f"| {name} | {s} | {r['median_ms']:.2f} | {r['ratio_of_medians']:.3f} | "
            f"{r['ratio_median']:.3f} | {r['ratio_p10']:.3f}-{r['ratio_p90']:.3f} | "
            f"{r['subnormal']:.3f} | {r['nonfinite']:.3f} |"
        )
    out = {"rows": rows}
    if args.micro:
        print(
            "\nfloat16 on XLA:CPU, median ms: matmul 256x512 @ 512x512 (inputs as "
            "named; dot_both: both operands), elementwise gelu chain on 256x512\n"
        )
        print("| inputs | dot | dot_both | elementwise |")
        print("| --- | ---: | ---: | ---: |")
        out["micro"] = micro(args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
