"""Trace and compile time of a train step: jls against plain optax.

For a user whose step takes minutes to compile, compile time is the most
visible cost a library adds. Each sample builds a fresh ``jax.jit`` of the
step (caches cleared), then times ``lower`` (tracing and lowering) and
``compile`` separately, in wall-clock seconds and in the process's CPU
seconds (less sensitive to other load on a shared machine). The variants
(plain Adam, jls fused, jls ``tx.update``; the steps of ``bench_step.py``)
are interleaved in shuffled order within each round, and the report gives
each variant's median times and its ratios of medians to plain.

With ``--parts`` it also times plain Adam with each piece of jls's step added
on its own, built from public pieces, to show where the time goes:

  plain_checked   plain Adam that also returns ``jls.all_finite(grads)``: the
                  check.
  plain_in_cond   plain Adam's update inside a ``lax.cond`` on a runtime flag
                  whose other branch returns ``-0.0`` updates and the state,
                  applied outside, as ``tx.update`` is: the conditional.
  plain_unscaled  ``plain_in_cond`` with the gradients multiplied by a runtime
                  ``1 / scale`` inside the branch: the unscaling.
  plain_all_three ``plain_unscaled`` whose flag is also ``jls.all_finite``: the
                  three together, without the rest of jls (scale rule, state).
  jls_update_two_factors  ``tx.update`` with a scaler whose ``max_scale``
                  is the float32 maximum: the exact two-factor unscale
                  (``(g * a) * b``) that only such scalers (the presets of
                  peers without a cap) compile; the default, capped at
                  2**126, unscales with one factor.

Run: ``python benchmarks/bench_compile.py [--model lm|mlp|both] [--rounds 3]
[--parts] [--peers]``. Needs the ``bench`` extra (flax, jmp).
"""

from __future__ import annotations

import argparse
import random
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from bench_step import make_problem, make_variants

import jls

VARIANTS = ("plain", "jls_fused", "jls_update")
# --peers: the peers' idioms of bench_step.py (flax's is the same select per
# leaf that jls compiles; jmp's state cannot be lowered from ``lower``'s
# argument descriptions, so it is left out).
PEERS = ("apply_if_finite", "flax_dynamic_scale")
DONATED = " (donated)"


def sample(
    step, opt_state, params, batch, donated: bool = False
) -> tuple[float, float, float]:
    """One fresh jit of ``step``: (lower s, compile s, CPU s of both)."""
    jax.clear_caches()
    fresh = jax.jit(step.__wrapped__, donate_argnums=(0, 1) if donated else ())
    c0, t0 = time.process_time(), time.perf_counter()
    lowered = fresh.lower(params, opt_state, batch)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1, time.process_time() - c0


def make_parts(loss_fn, params) -> dict:
    """Plain Adam with one piece of jls's step each (see the module notes)."""
    adam = optax.adam(1e-4)
    state = adam.init(params)

    @jax.jit
    def plain_checked(params, state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, state = adam.update(grads, state, params)
        return optax.apply_updates(params, updates), state, jls.all_finite(grads)

    def in_cond(unscale, check=False):
        @jax.jit
        def step(params, state, batch):
            grads = jax.grad(loss_fn)(params, batch)
            flag = state[0].count < 2**30  # known only at run time
            if check:
                flag = flag & jls.all_finite(grads)
            inverse = 1 / (state[0].count.astype(jnp.float32) + 1)

            def taken(operands):
                grads, state, params = operands
                if unscale:
                    grads = jax.tree.map(lambda g: g * inverse, grads)
                return adam.update(grads, state, params)

            def skipped(operands):
                grads, state, _ = operands
                return jax.tree.map(lambda g: jnp.full_like(g, -0.0), grads), state

            updates, state = jax.lax.cond(flag, taken, skipped, (grads, state, params))
            return optax.apply_updates(params, updates), state

        return step

    # The exact two-factor unscale, which only scalers whose max_scale passes
    # 2**126 (the presets of peers without a cap) compile.
    two = jls.dynamic_scale(
        2.0**15, growth_interval=10**6, max_scale=float(jnp.finfo(jnp.float32).max)
    )
    tx = jls.loss_scaling(adam, two)

    @jax.jit
    def two_factors(params, state, batch):
        grads = jax.grad(lambda p: jls.scale_loss(loss_fn(p, batch), state))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return {
        "jls_update_two_factors": (two_factors, tx.init(params)),
        "plain_checked": (plain_checked, state),
        "plain_in_cond": (in_cond(False), state),
        "plain_unscaled": (in_cond(True), state),
        "plain_all_three": (in_cond(True, check=True), state),
    }


def run(
    name: str, rounds: int, seed: int = 0, parts: bool = False, peers: bool = False
) -> dict:
    """Times every variant's trace and compile on one model."""
    loss_fn, params, batch = make_problem(name)
    wanted = VARIANTS + (PEERS if peers else ())
    variants = {
        k: v
        for k, v in make_variants(loss_fn, params).items()
        if k.removesuffix(DONATED) in wanted
    }
    if parts:
        variants.update(make_parts(loss_fn, params))
    times = {k: {"lower": [], "compile": [], "cpu": []} for k in variants}
    order = list(variants)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for key in order:
            step, opt_state = variants[key]
            donated = key.endswith(DONATED)
            lower, compile_, cpu = sample(step, opt_state, params, batch, donated)
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
    lines = [
        f"{result['model']}: fresh jit per sample, {result['rounds']} rounds; "
        "ratios to plain Adam with the same donation",
        "",
        "| variant | trace+lower (s) | compile (s) | wall ratio to plain "
        "| CPU ratio to plain |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key, m in med.items():
        plain = med["plain" + DONATED if key.endswith(DONATED) else "plain"]
        ratio = (m["lower"] + m["compile"]) / (plain["lower"] + plain["compile"])
        cpu = m["cpu"] / plain["cpu"]
        lines.append(
            f"| {key} | {m['lower']:.2f} | {m['compile']:.2f} | {ratio:.2f} "
            f"| {cpu:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    """Runs the benchmark and prints markdown tables."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model", choices=["lm", "mlp", "both"], default="both", help="which model(s)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument(
        "--parts", action="store_true", help="also time jls's pieces one by one"
    )
    parser.add_argument(
        "--peers", action="store_true", help="also the peers' idioms (bench_step)"
    )
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    models = ["lm", "mlp"] if args.model == "both" else [args.model]
    for m in models:
        print()
        print(report(run(m, args.rounds, parts=args.parts, peers=args.peers)))


if __name__ == "__main__":
    main()
