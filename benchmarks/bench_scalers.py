"""Which scaler wastes fewest steps and loses least gradient: the evidence.

Trains three float16 cases with each scaler, side by side in one process:

  demo    the demo's 6-layer MLP on scikit-learn's digits, full batch, Adam
          (``python examples/demo.py``'s f16-jls run, with another scaler).
  lm      ``examples/char_lm.py``'s character-level transformer LM at its
          default size.
  stress  the demo's MLP with its loss multiplied by a factor that drifts
          down by 2**20 over 60% of the run and back up by 2**8 over the
          next 30%, then jumps up by 2**10 at once: gradients whose range
          moves over 30 powers of two, and a sudden jump.

Scalers: ``dynamic_scale()`` (default interval 2000), ``dynamic_scale``
with interval 50 (the demo's tuning), the torch preset, and
``measured_scale()`` at its default (``--margins`` adds others).

Per run: skipped steps (in all, after the warm-up, and after the stress
case's jump), the underflow fraction (as the demo defines it: gradient
entries nonzero in float32 and exactly zero in the run's own float16
gradients, averaged over measurements once per chunk), the final loss (the
unscaled float32 loss on the training data) and the final scale.

``--timing`` also measures the step time on the LM (fused path, interleaved
rounds, medians and 10th-90th percentiles of per-round ratios): the measured
scaler and the gradient-norm metric against the fused dynamic step, and the
norm as ``optax.tree.norm`` computed in the same step, for comparison.

Run: ``python benchmarks/bench_scalers.py [--cases demo,lm,stress]
[--margins 10,12] [--timing] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import platform
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jls

# The demo's model and data (examples/demo.py, examples/mlp.py).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import demo  # noqa: E402
import mlp  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from char_runs import load_char_lm  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
WARMUP = 100  # steps before skips count against a scaler


@dataclasses.dataclass
class Case:
    """A float16 training problem.

    ``loss(params, batch, dtype)`` is the unscaled float32 loss with the
    model run in ``dtype``; ``batches`` holds every step's batch stacked on
    a leading axis; ``reference(step)`` is the batch underflow is measured on
    after that step (and the final loss after the last).
    """

    name: str
    params: Any
    loss: Callable[..., jax.Array]
    batches: tuple[np.ndarray, ...]
    reference: Callable[[int], tuple[np.ndarray, ...]]
    steps: int
    lr: float
    jump: int | None = None  # the step of a sudden jump in the gradients


def demo_case(steps: int = 1500) -> Case:
    x, y, _, _ = demo.load_digits(0)
    params = mlp.init_params(jax.random.key(0), [x.shape[1], *[128] * 6, 10])
    batches = (
        np.broadcast_to(x, (steps, *x.shape)),
        np.broadcast_to(y, (steps, *y.shape)),
    )
    return Case(
        "demo",
        params,
        lambda p, b, dtype: mlp.loss_fn(p, b[0], b[1], dtype),
        batches,
        lambda step: (x, y),
        steps,
        5e-3,
    )


def stress_factor(steps: int) -> tuple[np.ndarray, int]:
    """log2 of the loss factor per step: -20 over 60%, +8 over 30%, then +10."""
    down, up = int(steps * 0.6), int(steps * 0.3)
    jump = down + up
    log2 = np.concatenate(
        [
            np.linspace(0, -20, down, endpoint=False),
            np.linspace(-20, -12, up, endpoint=False),
            np.full(steps - jump, -2.0),
        ]
    )
    return log2.astype(np.float32), jump


def stress_case(steps: int = 1500) -> Case:
    x, y, _, _ = demo.load_digits(0)
    params = mlp.init_params(jax.random.key(0), [x.shape[1], *[128] * 6, 10])
    log2, jump = stress_factor(steps)
    batches = (
        np.broadcast_to(x, (steps, *x.shape)),
        np.broadcast_to(y, (steps, *y.shape)),
        log2,
    )

    def loss(p, b, dtype):
        factor = jnp.exp2(jnp.asarray(b[2], jnp.float32)) if len(b) > 2 else 1.0
        return mlp.loss_fn(p, b[0], b[1], dtype) * factor

    # Measured at the step's own factor: the gradients the run sees.
    return Case(
        "stress",
        params,
        loss,
        batches,
        lambda step: (x, y, log2[step]),
        steps,
        5e-3,
        jump,
    )


def lm_case(steps: int | None = None) -> Case:
    lm = load_char_lm()
    cfg = lm.Config() if steps is None else lm.Config(steps=steps)
    data = lm.load_text(cfg.text_bytes)
    rng = np.random.default_rng(cfg.seed)
    starts = rng.integers(0, len(data) - cfg.seq - 1, (cfg.steps, cfg.batch))
    tokens = data[starts[:, :, None] + np.arange(cfg.seq + 1)].astype(np.int32)
    losses = {dtype: lm.make_loss(cfg, mode) for mode, dtype in lm.MODES.items()}

    def loss(p, b, dtype):
        return losses[jnp.dtype(dtype).name](p, b[0])

    return Case(
        "lm",
        lm.init_params(jax.random.key(cfg.seed), cfg),
        loss,
        (tokens,),
        lambda step: (tokens[0],),
        cfg.steps,
        cfg.lr,
    )


def train(case: Case, scaler: jls.LossScaler, *, chunk: int = 25) -> dict:
    """One float16 run of ``case`` with ``scaler``; the row and the trajectory."""
    tx = jls.loss_scaling(optax.adam(case.lr), scaler)
    step = jls.train_step(lambda p, *b: case.loss(p, b, jnp.float16), tx)
    params = jax.tree.map(jnp.copy, case.params)  # the runs donate theirs
    opt_state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def run_chunk(params, opt_state, batches, reference):
        def one(carry, batch):
            params, opt_state, out = step(*carry, *batch)
            return (params, opt_state), (out.loss_scale, out.skipped)

        (params, opt_state), records = jax.lax.scan(one, (params, opt_state), batches)
        # Underflow: the run's own float16 gradients at the next scale.
        grads = jax.grad(
            lambda p: jls.scale_loss(case.loss(p, reference, jnp.float16), opt_state)
        )(params)
        exact = jax.grad(lambda p: case.loss(p, reference, jnp.float32))(params)
        return params, opt_state, records, demo.underflow_fraction(grads, exact)

    scales, skipped, underflow = [], [], []
    for start in range(0, case.steps, chunk):
        batches = tuple(jnp.asarray(b[start : start + chunk]) for b in case.batches)
        last = min(start + chunk, case.steps) - 1
        reference = tuple(jnp.asarray(a) for a in case.reference(last))
        params, opt_state, (scale, skip), frac = run_chunk(
            params, opt_state, batches, reference
        )
        scales.extend(np.asarray(scale).tolist())
        skipped.extend(np.asarray(skip).tolist())
        underflow.append(float(frac))
    final = float(
        jax.jit(case.loss, static_argnums=2)(params, case.reference(0)[:2], jnp.float32)
    )
    after = [i for i, s in enumerate(skipped) if s and i >= WARMUP]
    row = {
        "case": case.name,
        "skipped": int(sum(skipped)),
        "skipped_after_warmup": len(after),
        "per_1000_after_warmup": 1000 * len(after) / max(1, case.steps - WARMUP),
        "underflow": float(np.mean(underflow)),
        "final_loss": final,
        "final_scale": scales[-1],
    }
    if case.jump is not None:
        row["skipped_after_jump"] = sum(1 for i in after if i >= case.jump)
    return {"row": row, "scales": scales, "skipped": skipped}


def scalers(margins: list[int]) -> dict[str, jls.LossScaler]:
    out = {
        "dynamic": jls.dynamic_scale(),
        "dynamic-50": jls.dynamic_scale(growth_interval=50),
        "torch": jls.presets.torch(),
        "measured": jls.measured_scale(),
    }
    for k in margins:
        out[f"measured-2**{k}"] = jls.measured_scale(margin=2.0**k)
    return out


def timing(rounds: int) -> dict:
    """Step time on the LM: the new features against the fused dynamic step."""
    case = lm_case(steps=8)
    tokens = jnp.asarray(case.batches[0][0])

    def make(scaler, **kw):
        tx = jls.loss_scaling(optax.adam(case.lr), scaler, **kw)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, opt_state, tokens):
            grads = jax.grad(
                lambda p: jls.scale_loss(
                    case.loss(p, (tokens,), jnp.float16), opt_state
                )
            )(params)
            params, opt_state = jls.apply_gradients(tx, grads, opt_state, params)
            return params, opt_state, 0.0

        return tx, step

    variants = {
        "fused_dynamic": make(jls.dynamic_scale()),
        "measured": make(jls.measured_scale()),
        "gradient_norm": make(jls.dynamic_scale(), gradient_norm=True),
    }
    # optax.tree.norm in the same step: its own pass over the gradients.
    tx = jls.loss_scaling(optax.adam(case.lr), jls.dynamic_scale())

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def with_optax_norm(params, opt_state, tokens):
        grads = jax.grad(
            lambda p: jls.scale_loss(case.loss(p, (tokens,), jnp.float16), opt_state)
        )(params)
        norm = optax.tree.norm(jls.unscale(grads, opt_state))
        params, opt_state = jls.apply_gradients(tx, grads, opt_state, params)
        return params, opt_state, norm

    variants["optax.tree.norm"] = (tx, with_optax_norm)
    # Plain Adam, no loss scaling: the floor.
    adam = optax.adam(case.lr)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def plain(params, opt_state, tokens):
        grads = jax.grad(lambda p: case.loss(p, (tokens,), jnp.float16))(params)
        updates, opt_state = adam.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, 0.0

    variants["plain_adam"] = (adam, plain)
    states = {}
    for name, (tx, step) in variants.items():
        params = jax.tree.map(jnp.copy, case.params)
        state = (params, tx.init(params))
        for _ in range(3):  # compile and warm up
            *state, extra = step(*state, tokens)
        jax.block_until_ready(state)
        states[name] = state
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for _ in range(rounds):
        random.shuffle(order)
        for name in order:
            step = variants[name][1]
            state = states[name]
            start = time.perf_counter()
            *state, extra = step(*state, tokens)
            jax.block_until_ready(state)
            times[name].append(time.perf_counter() - start)
            states[name] = state
    base = np.array(times["fused_dynamic"])
    out = {}
    for name, t in times.items():
        ratios = np.array(t) / base
        out[name] = {
            "median_s": float(np.median(t)),
            "ratio": float(np.median(t) / np.median(base)),
            "ratio_p10": float(np.percentile(ratios, 10)),
            "ratio_p90": float(np.percentile(ratios, 90)),
        }
    return out


def format_rows(rows: list[dict]) -> str:
    lines = [
        "| case | scaler | skipped | after warm-up (per 1000) | after jump "
        "| underflow | final loss | final scale |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        jump = r.get("skipped_after_jump")
        lines.append(
            f"| {r['case']} | {r['scaler']} | {r['skipped']} | "
            f"{r['skipped_after_warmup']} ({r['per_1000_after_warmup']:.1f}) | "
            f"{'-' if jump is None else jump} | {100 * r['underflow']:.1f}% | "
            f"{r['final_loss']:.4g} | 2**{np.log2(r['final_scale']):.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--cases", default="demo,lm,stress", help="comma-separated cases to run"
    )
    parser.add_argument("--steps", type=int, default=1500, help="demo and stress")
    parser.add_argument("--margins", default="", help="extra measured margins (log2)")
    parser.add_argument("--only", default="", help="run only these scalers")
    parser.add_argument("--timing", action="store_true")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds")
    parser.add_argument(
        "--json", default=None, help="also write the results to this file"
    )
    args = parser.parse_args(argv)
    margins = [int(k) for k in args.margins.split(",") if k]
    chosen = scalers(margins)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    makers = {"demo": demo_case, "stress": stress_case, "lm": lambda steps: lm_case()}
    result: dict[str, Any] = {
        "machine": f"{platform.machine()}, jax {jax.__version__}",
        "rows": [],
        "trajectories": {},
    }
    for name in [c for c in args.cases.split(",") if c]:
        case = makers[name](args.steps)
        for label, scaler in chosen.items():
            start = time.perf_counter()
            run = train(case, scaler)
            row = {
                "scaler": label,
                **run["row"],
                "seconds": time.perf_counter() - start,
            }
            result["rows"].append(row)
            result["trajectories"][f"{name}/{label}"] = run["scales"]
            print(format_rows([row]).splitlines()[-1], flush=True)
    if result["rows"]:
        print(format_rows(result["rows"]))
    if args.timing:
        result["timing"] = timing(args.rounds)
        for name, t in result["timing"].items():
            print(
                f"{name:20s} {1e3 * t['median_s']:8.1f} ms  {t['ratio']:.3f}x "
                f"(per-round p10-p90 {t['ratio_p10']:.3f}-{t['ratio_p90']:.3f})"
            )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
