"""What casting per op costs: ``policy.wrap`` (autocast) against argument casting.

One float32 loss, converted to float16 three ways, in the same jitted train
step (``jls.loss_scaling(optax.adam, jls.dynamic_scale())`` and
``jls.apply_gradients``):

  float32         the loss as written: no casting (the reference).
  cast_arguments  ``policy.cast_arguments(loss)``: jmp's argument casting;
                  every op inside runs in float16, the loss's too.
  autocast        ``policy.wrap(loss)``: matmuls in float16, softmax, exp,
                  log, sums and the loss in float32, the rest as their
                  operands (float32 after a float32 bias).

Models: ``demo``, the demo's MLP (``examples/mlp.py``: 64-128x6-10, full
batch of 1437 examples, as ``examples/demo.py`` trains it; random data of
the digits' shape) and ``char``, ``examples/char_lm.py``'s transformer at
its default size (batch 16 of 64 bytes).

Measured side by side in one process: the step time (interleaved rounds, the
variants in a shuffled order each round, a few steps per sample; medians and
the ratio of medians to ``cast_arguments``), and the trace+lower and compile
time of a fresh ``jax.jit`` per sample (caches cleared; wall-clock and the
process's CPU seconds; medians). Each variant's logged loss is compared with
the float32 loss of the parameters it reached.

Run: ``python benchmarks/bench_autocast.py [--model demo|char|both]
[--rounds 7] [--steps 5] [--compiles 3]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from char_runs import ROOT, load_char_lm

import jls

VARIANTS = ("float32", "cast_arguments", "autocast")
POLICY = jls.precision.get_policy("params=float32,compute=float16,output=float32")


def _load_mlp():
    spec = importlib.util.spec_from_file_location("mlp", ROOT / "examples" / "mlp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_problem(name: str):
    """(float32 loss(params, batch), params, batch) of the model ``name``."""
    key = jax.random.key(0)
    if name == "demo":
        mlp = _load_mlp()
        params = mlp.init_params(key, [64, *[128] * 6, 10])
        x = jax.random.uniform(jax.random.key(1), (1437, 64))
        y = jax.random.randint(jax.random.key(2), (1437,), 0, 10)

        def loss(params, batch):
            return mlp.loss_fn(params, batch[0], batch[1], jnp.float32)

        return loss, params, (x, y)
    lm = load_char_lm()
    cfg = lm.Config()
    params = lm.init_params(key, cfg)
    tokens = jax.random.randint(jax.random.key(1), (cfg.batch, cfg.seq + 1), 0, 256)

    def loss(params, tokens):
        logits = lm.forward(params, tokens[:, :-1], cfg.heads)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, tokens[:, 1:]
        ).mean()

    return loss, params, tokens


def make_step(loss):
    """The optimizer and the (unjitted) train step of ``loss``."""
    tx = jls.loss_scaling(optax.adam(1e-3), jls.dynamic_scale())

    def step(params, opt_state, batch):
        def scaled(p):
            value = loss(p, batch)
            return jls.scale_loss(value, opt_state), value

        grads, value = jax.grad(scaled, has_aux=True)(params)
        params, opt_state = jls.apply_gradients(tx, grads, opt_state, params)
        return params, opt_state, value

    return tx, step


def compile_sample(step, params, opt_state, batch) -> tuple[float, float, float]:
    """A fresh jit of ``step``: (trace+lower s, compile s, CPU s of both)."""
    jax.clear_caches()
    c0, t0 = time.process_time(), time.perf_counter()
    lowered = jax.jit(step).lower(params, opt_state, batch)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1, time.process_time() - c0


def run(name: str, rounds: int, steps: int, compiles: int) -> str:
    loss, params, batch = make_problem(name)
    losses = {
        "float32": loss,
        "cast_arguments": POLICY.cast_arguments(loss),
        "autocast": POLICY.wrap(loss),
    }
    made = {v: make_step(losses[v]) for v in VARIANTS}
    jitted = {v: jax.jit(made[v][1]) for v in VARIANTS}
    carry = {v: (params, made[v][0].init(params)) for v in VARIANTS}
    for v in VARIANTS:  # compile and warm up
        p, s, _ = jitted[v](*carry[v], batch)
        carry[v] = jax.block_until_ready((p, s))
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    order = list(VARIANTS)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for v in order:
            p, s = carry[v]
            t0 = time.perf_counter()
            for _ in range(steps):
                p, s, _ = jitted[v](p, s, batch)
            jax.block_until_ready((p, s))
            times[v].append((time.perf_counter() - t0) / steps)
            carry[v] = (p, s)
    builds: dict[str, list[tuple[float, float, float]]] = {v: [] for v in VARIANTS}
    for _ in range(compiles):
        rng.shuffle(order)
        for v in order:
            builds[v].append(compile_sample(made[v][1], *carry[v], batch))
    exact = jax.jit(loss)
    base = statistics.median(times["cast_arguments"])
    rows = [
        f"{name}: {rounds} rounds of {steps} steps, {compiles} fresh jits; "
        "ratios to cast_arguments",
        "",
        "| variant | step (ms) | ratio | trace+lower (s) | compile (s) "
        "| CPU (s) | logged loss vs float32 loss |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v in VARIANTS:
        step_ms = statistics.median(times[v]) * 1e3
        lower, build, cpu = (
            statistics.median(b[i] for b in builds[v]) for i in range(3)
        )
        p = carry[v][0]
        logged, want = float(jax.jit(losses[v])(p, batch)), float(exact(p, batch))
        rows.append(
            f"| {v} | {step_ms:.2f} | {step_ms / (base * 1e3):.2f} | {lower:.2f} "
            f"| {build:.2f} | {cpu:.2f} | {100 * (logged - want) / want:+.2f}% |"
        )
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        choices=("demo", "char", "both"),
        default="both",
        help="which model to time",
    )
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds")
    parser.add_argument("--steps", type=int, default=5, help="steps per sample")
    parser.add_argument("--compiles", type=int, default=3, help="fresh jits each")
    args = parser.parse_args(argv)
    names = ("demo", "char") if args.model == "both" else (args.model,)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    for name in names:
        print(run(name, args.rounds, args.steps, args.compiles), "\n", flush=True)


if __name__ == "__main__":
    main()
