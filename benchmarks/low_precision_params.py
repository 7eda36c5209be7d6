"""Parameters and optimizer state in bfloat16 or float16, without a float32 copy.

``examples/char_lm.py``'s model trained with Adam and low-precision compute,
the parameters (and Adam's moments) kept:

- ``f32-master``: in float32 (the usual mixed precision: a float32 copy);
- ``bf16``: in bfloat16, plain (small updates round away);
- ``bf16-kahan``: in bfloat16, ``jls.precision.compensated(adam)`` (an int16
  compensation buffer);
- ``bf16-sr``: in bfloat16, ``jls.precision.stochastic_rounding(adam)``.

Every run is wrapped in ``jls.loss_scaling(..., jls.no_scale())``
(skip-on-nan). ``--dtype float16`` runs float16 compute with
``jls.dynamic_scale()`` and the parameters and Adam's moments in float32
(``f32-master``) or float16: plain Adam (``f16``, ``f16-kahan``,
``f16-sr``), or Adam inside ``jls.precision.scaled_state`` (``f16-state``: its
moments float16 scaled per array, Adam run in float32), with the
parameters rounded to nearest, stochastically (``-sr``) or compensated
(``-kahan``: int16 buffer, ``-kahan8``: int8). ``--model demo`` trains
``examples/demo.py``'s MLP instead, as the demo does (full batch, 1500
steps; the held-out loss is on the 360 test digits). ``--eps`` sets Adam's
``eps`` (optax's 1e-8 is 0 in float16). It reports, per seed, the training
loss (the mean of the last 5% of steps), the held-out loss in float32, the
bytes of the parameters plus the optimizer state (compensation buffers and
scales included), the skipped steps and the first step whose loss was not
finite; then a table against ``f32-master``. Run:
``python benchmarks/low_precision_params.py --seeds 3`` (``--dtype
float16``, ``--model demo``); ``--compiled`` prints the kernels and
temporaries of each fused step instead (kernels: the fusions of the entry
computation with a single array output), ``--small-steps`` each remedy's
move of a parameter at 1 under 100,000 steps of 1e-6 or 2e-6, against the
float32 master's.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from char_runs import batch_tokens, held_out_loss, load_char_lm, split  # noqa: E402

# variant: (parameter dtype, compute mode of char_lm, wrapper, scaler, state)
VARIANTS = {
    "f32-master": ("float32", "bf16", None, "none", None),
    "bf16": ("bfloat16", "bf16", None, "none", None),
    "bf16-kahan": ("bfloat16", "bf16", "kahan", "none", None),
    "bf16-sr": ("bfloat16", "bf16", "sr", "none", None),
}
# --dtype float16: float16 compute with jls's dynamic loss scale, the
# parameters and Adam's moments in float32 or float16 (``-state``: Adam
# wrapped in jls.precision.scaled_state, its moments float16 scaled per array).
VARIANTS_F16 = {
    "f32-master": ("float32", "f16", None, "dynamic", None),
    "f16": ("float16", "f16", None, "dynamic", None),
    "f16-kahan": ("float16", "f16", "kahan", "dynamic", None),
    "f16-sr": ("float16", "f16", "sr", "dynamic", None),
    "f16-state": ("float16", "f16", None, "dynamic", "scaled"),
    "f16-state-sr": ("float16", "f16", "sr", "dynamic", "scaled"),
    "f16-state-kahan": ("float16", "f16", "kahan", "dynamic", "scaled"),
    "f16-state-kahan8": ("float16", "f16", "kahan8", "dynamic", "scaled"),
}


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def char_problem(seed: int, args, mode: str, dtype: str) -> dict:
    """The char LM: its loss, parameters, batches and held-out loss."""
    lm, text = args.lm
    cfg = dataclasses.replace(lm.Config(), steps=args.steps or 300, seed=seed)
    data, held_out = split(text)
    params = jax.tree.map(
        lambda x: x.astype(dtype), lm.init_params(jax.random.key(seed), cfg)
    )
    return {
        "loss_fn": lm.make_loss(cfg, mode),
        "params": params,
        "batch_at": batch_tokens(cfg, data, seed),
        "held_out": lambda p: held_out_loss(lm, cfg, p, held_out),
        "steps": cfg.steps,
        "lr": cfg.lr,
        "scaler": lambda: jls.dynamic_scale(),
    }


def demo_problem(seed: int, args, mode: str, dtype: str) -> dict:
    """``examples/demo.py``'s MLP on the digits, full batch, as the demo runs it."""
    demo = args.demo
    config = demo.Config(seed=seed)
    x, y, x_test, y_test = (jnp.asarray(a) for a in demo.load_digits(seed))
    sizes = [x.shape[1], *[config.width] * config.depth, 10]
    params = jax.tree.map(
        lambda p: p.astype(dtype),
        demo.init_params(jax.random.key(config.seed), sizes),
    )
    compute = jnp.float16 if mode == "f16" else jnp.bfloat16
    return {
        "loss_fn": lambda p, batch: demo.loss_fn(p, *batch, compute),
        "params": params,
        "batch_at": lambda i: (x, y),
        "held_out": lambda p: float(demo.loss_fn(p, x_test, y_test, jnp.float32)),
        "steps": args.steps or config.steps,
        "lr": config.learning_rate,
        "scaler": lambda: jls.dynamic_scale(
            config.init_scale, growth_interval=config.growth_interval
        ),
    }


def run(name: str, spec: tuple, seed: int, args) -> dict:
    dtype, mode, wrap, scaler, state = spec
    make = demo_problem if args.model == "demo" else char_problem
    problem = make(seed, args, mode, dtype)
    loss_fn, params = problem["loss_fn"], problem["params"]
    inner = optax.adam(problem["lr"], eps=args.eps)
    if state == "scaled":
        inner = jls.precision.scaled_state(inner)
    if wrap == "kahan":
        inner = jls.precision.compensated(inner)
    elif wrap == "kahan8":
        inner = jls.precision.compensated(inner, buffer_dtype="int8")
    elif wrap == "sr":
        inner = jls.precision.stochastic_rounding(inner, seed=seed)
    tx = jls.loss_scaling(
        inner, problem["scaler"]() if scaler == "dynamic" else jls.no_scale()
    )
    opt_state = tx.init(params)
    memory = _bytes(params) + _bytes(opt_state.inner_state)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        def scaled(p):
            loss = loss_fn(p, batch)
            return jls.scale_loss(loss, opt_state), loss

        grads, loss = jax.grad(scaled, has_aux=True)(params)
        params, opt_state = jls.apply_gradients(tx, grads, opt_state, params)
        return params, opt_state, loss

    losses = []
    for i in range(problem["steps"]):
        params, opt_state, loss = step(params, opt_state, problem["batch_at"](i))
        losses.append(float(loss))
    tail = max(1, problem["steps"] // 20)
    return {
        "variant": name,
        "seed": seed,
        "train_loss": float(np.mean(losses[-tail:])),
        "held_out_loss": problem["held_out"](params),
        "bytes": memory,
        "losses": losses,
        "first_nonfinite_loss": next(
            (i for i, x in enumerate(losses) if not np.isfinite(x)), None
        ),
        "skips": int(jls.metrics(opt_state)["total_skips"]),
    }


def compiled_cost() -> dict:
    """Kernels and temporaries of the fused step on a 256x256 + 256 bfloat16 model."""
    import re

    params = {"w": jnp.ones((256, 256), jnp.bfloat16), "b": jnp.ones(256, jnp.bfloat16)}
    out = {}
    for name, inner in [
        ("adam", optax.adam(1e-3)),
        ("compensated(adam)", jls.precision.compensated(optax.adam(1e-3))),
        (
            "stochastic_rounding(adam)",
            jls.precision.stochastic_rounding(optax.adam(1e-3)),
        ),
    ]:
        tx = jls.loss_scaling(inner, jls.no_scale())
        step = jax.jit(lambda g, s, p, tx=tx: jls.apply_gradients(tx, g, s, p))
        compiled = step.lower(params, tx.init(params), params).compile()
        entry = compiled.as_text().split("ENTRY", 1)[1]
        out[name] = {
            "kernels": len(re.findall(r"= \S+ fusion\(", entry)),
            "temp_mb": compiled.memory_analysis().temp_size_in_bytes / 1e6,
        }
    return out


def small_steps(steps: int = 100_000) -> str:
    """Each remedy's move of a parameter at 1 under tiny steps, against float32.

    ``steps`` updates of ``size`` (either sign) by ``optax.sgd(1.0)`` on 8
    parameters at 1, in a ``lax.scan``; the mean move as a share of the
    float32 master's. Stochastic rounding's is one draw (seed 0).
    """

    def move(inner, dtype, size):
        p = jnp.full(8, 1.0, dtype)
        g = jnp.full(8, -size, jnp.float32)

        @jax.jit
        def run(p, s):
            def body(carry, _):
                p, s = carry
                u, s = inner.update(g, s, p)
                return (optax.apply_updates(p, u), s), None

            return jax.lax.scan(body, (p, s), None, length=steps)[0][0]

        out = run(p, inner.init(p))
        return float(np.mean(np.asarray(out, np.float64) - 1.0))

    remedies = {
        "plain": lambda: optax.sgd(1.0),
        "compensated (int16)": lambda: jls.precision.compensated(optax.sgd(1.0)),
        "compensated (int8)": lambda: jls.precision.compensated(
            optax.sgd(1.0), buffer_dtype="int8"
        ),
        "stochastic_rounding": lambda: jls.precision.stochastic_rounding(
            optax.sgd(1.0)
        ),
    }
    sizes = (2e-6, -2e-6, 1e-6, -1e-6)
    head = " | ".join(f"{s:+.0e} per step" for s in sizes)
    lines = [f"| dtype | remedy | {head} |", "| --- | --- |" + " ---: |" * len(sizes)]
    master = {size: move(optax.sgd(1.0), jnp.float32, size) for size in sizes}
    lines.append(
        "| float32 | master (the move) | "
        + " | ".join(f"{master[s]:+.4f}" for s in sizes)
        + " |"
    )
    for dtype in (jnp.bfloat16, jnp.float16):
        for name, make in remedies.items():
            cells = [f"{100 * move(make(), dtype, s) / master[s]:.1f}%" for s in sizes]
            lines.append(
                f"| {jnp.dtype(dtype).name} | {name} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines)


def _spread(values: list[float]) -> str:
    """The mean, and the min-max when there are several."""
    if len(values) == 1:
        return f"{values[0]:.4g}"
    return f"{np.mean(values):.4g} ({min(values):.4g}-{max(values):.4g})"


def table(rows: list[dict], names: list[str]) -> str:
    """Per variant: losses (mean, min-max over seeds), against the master, bytes."""
    master = [r["held_out_loss"] for r in rows if r["variant"] == "f32-master"]
    base = [r["bytes"] for r in rows if r["variant"] == "f32-master"]
    lines = [
        "| variant | train loss (mean, min-max over seeds) | held-out loss | "
        "held-out vs f32-master | params + optimizer state (MB) | bytes vs "
        "f32-master | skipped steps | non-finite losses |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for v in names:
        rs = [r for r in rows if r["variant"] == v]
        if not rs:
            continue
        tr = [r["train_loss"] for r in rs]
        ho = [r["held_out_loss"] for r in rs]
        vs = f"{100 * (np.mean(ho) / np.mean(master) - 1):+.1f}%" if master else "-"
        mem = f"{100 * rs[0]['bytes'] / base[0]:.0f}%" if base else "-"
        skips = "/".join(str(r["skips"]) for r in rs)
        bad = sum(r["first_nonfinite_loss"] is not None for r in rs)
        lines.append(
            f"| {v} | {_spread(tr)} | {_spread(ho)} | {vs} | "
            f"{rs[0]['bytes'] / 1e6:.2f} | {mem} | {skips} | {bad} of {len(rs)} |"
        )
    return "\n".join(lines)


def _load_demo():
    """``examples/demo.py`` (and its ``mlp``), loaded by path."""
    import importlib

    examples = str(pathlib.Path(__file__).resolve().parents[1] / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    demo = importlib.import_module("demo")
    return demo


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..n-1")
    parser.add_argument(
        "--steps", type=int, default=0, help="steps per run (0: 300, demo 1500)"
    )
    parser.add_argument("--json", default="", help="write every row here")
    parser.add_argument(
        "--eps", type=float, default=1e-8, help="Adam's eps (optax's default)"
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16"],
        default="bfloat16",
        help="low-precision dtype (float16: with jls.dynamic_scale())",
    )
    parser.add_argument(
        "--model",
        choices=["char", "demo"],
        default="char",
        help="the char LM, or examples/demo.py's MLP (needs the demo extra)",
    )
    parser.add_argument(
        "--variants", default="", help="comma-separated variants (default: all)"
    )
    parser.add_argument(
        "--compiled", action="store_true", help="only the compiled step's cost"
    )
    parser.add_argument(
        "--small-steps",
        action="store_true",
        help="only each remedy's move under 100,000 tiny steps",
    )
    args = parser.parse_args(argv)
    if args.small_steps:
        print(small_steps())
        return []
    if args.compiled:
        for name, cost in compiled_cost().items():
            print(f"{name:28s} {cost['kernels']:3d} kernels, {cost['temp_mb']:.2f} MB")
        return []
    variants = VARIANTS if args.dtype == "bfloat16" else VARIANTS_F16
    if args.variants:
        variants = {k: variants[k] for k in args.variants.split(",")}
    settings = dict(vars(args))
    if args.model == "demo":
        args.demo = _load_demo()
    else:
        lm = load_char_lm()
        args.lm = (lm, lm.load_text(lm.Config().text_bytes))
    rows = []
    for seed in range(args.seeds):
        for name, spec in variants.items():
            rows.append(run(name, spec, seed, args))
            r = rows[-1]
            print(
                f"seed {seed} {name:16s} train {r['train_loss']:.4g} held-out "
                f"{r['held_out_loss']:.4f} bytes {r['bytes']} skips {r['skips']} "
                f"first non-finite loss at step {r['first_nonfinite_loss']}",
                flush=True,
            )
    print(table(rows, list(variants)))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"args": settings, "rows": rows}))
    return rows


if __name__ == "__main__":
    main()
