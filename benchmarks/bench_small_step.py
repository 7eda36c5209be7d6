"""The fixed cost of a small step: jls on flax's FSDP toy MLP, 2 x 4 mesh.

The model is the MLP of flax's pjit guide (``DotReluDot`` blocks: a dense
layer, a relu, a second dense layer back to the input width), float16
parameters sharded over both axes of a ("data", "model") mesh of 8 devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8`` on a CPU), the batch
over "data", under ``jax.jit`` with ``NamedSharding`` (the partitioner
inserts the collectives). A step takes 1-4 ms on a CPU: the part of it that
does not grow with the model is what this measures.

Variants (Adam, each undonated and with ``donate_argnums=(0, 1)``,
"(donated)"):
  plain            optax on the float16 gradients, no scaling: plain float16
                   training, the floor.
  jls_off          ``jls.loss_scaling(adam, jls.no_scale(skip_nonfinite=False))``
                   via ``tx.update``: the off switch.
  jls_update       ``jls.loss_scaling(adam)`` (the default dynamic scale)
                   via ``tx.update``.
  jls_train_step   the same transformation through ``jls.train_step``.
  apply_if_finite  ``optax.apply_if_finite(adam)`` with a static scale: the
                   peer's idiom.
  plain_scalars    plain carrying as many more replicated scalars, passed
                   through, as jls's state does: what carrying them costs.
  plain_checked    plain that also returns whether its gradients are all
                   finite (one more scalar): what the check costs.

They run side by side in one process in interleaved rounds (each round times
a few steps of every variant, in a shuffled order) by the process's CPU time
(all its threads: the measure to read on a shared machine) and by wall time;
the report gives each variant's median per step, the ratio of medians to
plain in the same donation mode, the median and 10th-90th percentile of the
per-round ratio, and what each compiled step holds (instructions, fusions,
scalar parameters and outputs, collectives): ``compiled_counts``.

Run: ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python
benchmarks/bench_small_step.py [--widths 32 4096] [--rounds 15] [--steps 4]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import re
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jls

DONATED = " (donated)"
LAYERS, FEATURES, BATCH = 4, 32, 8


def make_problem(width: int):
    """Returns (loss_fn, params, batch, mesh) of the toy MLP at ``width``."""
    devices = np.asarray(jax.devices()[:8]).reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("data", "model"))

    def put(x, *spec):
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    keys = jax.random.split(jax.random.key(0), 2 * LAYERS + 2)
    init = jax.nn.initializers.xavier_normal()
    params = {}
    for i in range(LAYERS):
        w1 = init(keys[2 * i], (FEATURES, width), jnp.float16)
        w2 = init(keys[2 * i + 1], (width, FEATURES), jnp.float16)
        params[f"block{i}"] = {
            "w1": put(w1, "data", "model"),
            "w2": put(w2, "model", "data"),
        }
    x = put(jax.random.normal(keys[-2], (BATCH, FEATURES), jnp.float16), "data")
    y = put(jax.random.normal(keys[-1], (BATCH, FEATURES), jnp.float16), "data")

    def loss_fn(params, x, y):
        for i in range(LAYERS):
            p = params[f"block{i}"]
            h = jax.nn.relu(x @ p["w1"])
            h = jax.lax.with_sharding_constraint(
                h, NamedSharding(mesh, P("data", "model"))
            )
            x = jax.lax.with_sharding_constraint(
                h @ p["w2"], NamedSharding(mesh, P("data"))
            )
        return jnp.mean(jnp.square(x.astype(jnp.float32) - y))

    return loss_fn, params, (x, y), mesh


def _steps(loss_fn):
    """``{name: (step(params, state, batch) -> (params, state), tx)}``."""
    adam = optax.adam(1e-4)

    def via_update(tx, scaled):
        def step(params, state, batch):
            def loss(p):
                value = loss_fn(p, *batch)
                return jls.scale_loss(value, state) if scaled else value

            grads = jax.grad(loss)(params)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        return step

    off = jls.loss_scaling(adam, jls.no_scale(skip_nonfinite=False))
    default = jls.loss_scaling(adam)
    train = jls.train_step(loss_fn, default)
    guarded = optax.apply_if_finite(adam, max_consecutive_errors=10**6)
    scale = jnp.float16(2.0**10)

    def apply_if_finite(params, state, batch):
        grads = jax.grad(lambda p: loss_fn(p, *batch) * scale)(params)
        grads = jax.tree.map(lambda g: g / scale.astype(g.dtype), grads)
        updates, state = guarded.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def plain_checked(params, state, batch):
        grads = jax.grad(loss_fn)(params, *batch)
        finite = jnp.all(
            jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)])
        )
        updates, inner = adam.update(grads, state[0], params)
        return optax.apply_updates(params, updates), (inner, finite)

    def carried(params, state, batch):
        params, inner = via_update(adam, False)(params, state[0], batch)
        return params, (inner, state[1])

    extra = len(jax.tree.leaves(default.init({}))) - len(jax.tree.leaves(adam.init({})))
    return {
        "plain": (via_update(adam, False), adam),
        "plain_scalars": (carried, _Paired(adam, [jnp.int32(0)] * extra)),
        "plain_checked": (plain_checked, _Paired(adam, jnp.asarray(True))),
        "jls_off": (via_update(off, False), off),
        "jls_update": (via_update(default, True), default),
        "jls_train_step": (lambda p, s, b: train(p, s, *b)[:2], default),
        "apply_if_finite": (apply_if_finite, guarded),
    }


class _Paired:
    """``init``: the inner optimizer's state paired with ``extra``."""

    def __init__(self, inner, extra):
        self.inner, self.extra = inner, extra

    def init(self, params):
        return self.inner.init(params), self.extra


def make_variants(loss_fn, params, modes=(False, True)):
    """``{name: (jitted step, initial state)}``, each donation mode."""
    variants = {}
    for donated in modes:
        jit = functools.partial(jax.jit, donate_argnums=(0, 1) if donated else ())
        for name, (fn, tx) in _steps(loss_fn).items():
            state = jax.jit(tx.init)(params)
            variants[name + (DONATED if donated else "")] = (jit(fn), state)
    return variants


def compiled_counts(step, params, state, batch) -> dict:
    """What one device's compiled step holds: the fixed cost, counted.

    ``ops``: the entry computation's instructions but its parameters (each a
    thunk XLA:CPU runs, a kernel a GPU launches, or free: a tuple element),
    ``fusions`` and ``copies`` among them, ``params`` and ``scalar_params``
    (of shape ``()``): the buffers passed in, ``scalar_outputs``,
    ``collectives`` (all-reduces, all-gathers, reduce-scatters).
    """
    text = step.lower(params, state, batch).compile().as_text()
    entry = text[text.index("\nENTRY ") :]
    body = entry[: entry.index("\n}")].splitlines()[1:]
    outs = entry.splitlines()[1].split("->")[-1]
    return {
        "ops": sum(" parameter(" not in line for line in body),
        "fusions": sum(" fusion(" in line for line in body),
        "params": sum(" parameter(" in line for line in body),
        "scalar_params": sum(
            re.search(r"= \w+\[\] parameter\(", line) is not None for line in body
        ),
        "scalar_outputs": len(re.findall(r"\w+\[\]", outs)),
        "collectives": sum(
            re.search(r" (all-reduce|all-gather|reduce-scatter)(-start)?\(", line)
            is not None
            for line in body
        ),
        "copies": sum(" copy(" in line for line in body),
    }


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def interleaved(variants, params, batch, rounds, steps, seed=0) -> dict:
    """Per-sample seconds per step, ``{clock: {variant: [...]}}``."""
    carry = {}
    for key, (step, state) in variants.items():
        fresh = jax.tree.map(jnp.copy, params)
        c = step(*step(fresh, state, batch), batch)  # compile, warm up
        carry[key] = jax.block_until_ready(c)
    times = {c: {k: [] for k in variants} for c in CLOCKS}
    order = list(variants)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for key in order:
            step, c = variants[key][0], carry[key]
            t0 = {n: f() for n, f in CLOCKS.items()}
            for _ in range(steps):
                c = step(*c, batch)
            jax.block_until_ready(c)
            for n, f in CLOCKS.items():
                times[n][key].append((f() - t0[n]) / steps)
            carry[key] = c
    return times


def summary(ts: dict) -> dict:
    """Median ms and ratios to the plain variant of the same donation mode."""
    out = {}
    for key, t in ts.items():
        base = np.asarray(ts["plain" + (DONATED if key.endswith(DONATED) else "")])
        r = np.asarray(t) / base
        out[key] = {
            "ms": float(np.median(t) * 1e3),
            "ratio": float(np.median(t) / np.median(base)),
            "per_round": float(np.median(r)),
            "p10": float(np.percentile(r, 10)),
            "p90": float(np.percentile(r, 90)),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--widths",
        type=int,
        nargs="+",
        default=[32, 4096],
        help="the MLP's hidden widths",
    )
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=4, help="steps per sample")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if len(jax.devices()) < 8:
        sys.exit("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    warnings.simplefilter("ignore")  # the off switch warns on float16 gradients
    print(
        f"# jax {jax.__version__}, {jax.default_backend()}, {platform.machine()}, "
        f"{os.cpu_count()} cores; rounds={args.rounds} steps={args.steps}"
    )
    results = {}
    for width in args.widths:
        loss_fn, params, batch, _ = make_problem(width)
        n = sum(x.size for x in jax.tree.leaves(params))
        variants = make_variants(loss_fn, params)
        counts = {
            k: compiled_counts(s, params, st, batch) for k, (s, st) in variants.items()
        }
        times = interleaved(variants, params, batch, args.rounds, args.steps)
        results[width] = {"counts": counts, **{c: summary(t) for c, t in times.items()}}
        print(
            f"\n## width {width}: {n} float16 parameters in "
            f"{len(jax.tree.leaves(params))} arrays"
        )
        print(
            f"{'variant':28s} {'cpu ms':>7s} {'ratio':>6s} {'rounds p10-p90':>17s}"
            f" {'wall ms':>8s} {'ratio':>6s}  ops fus copy scal_in coll"
        )
        for key in variants:
            c, w, k = (
                results[width]["cpu"][key],
                results[width]["wall"][key],
                counts[key],
            )
            print(
                f"{key:28s} {c['ms']:7.3f} {c['ratio']:6.3f} {c['per_round']:5.3f}"
                f" ({c['p10']:.2f}-{c['p90']:.2f}) {w['ms']:8.3f} {w['ratio']:6.3f}"
                f"  {k['ops']:3d} {k['fusions']:3d} {k['copies']:4d}"
                f" {k['scalar_params']:7d} {k['collectives']:4d}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
