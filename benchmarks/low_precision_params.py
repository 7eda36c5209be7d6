"""Parameters in bfloat16 without a float32 copy, on the char LM.

``examples/char_lm.py``'s model trained with Adam and low-precision compute,
the parameters (and Adam's moments) kept:

- ``f32-master``: in float32 (the usual mixed precision: a float32 copy);
- ``bf16``: in bfloat16, plain (small updates round away);
- ``bf16-kahan``: in bfloat16, ``jls.precision.compensated(adam)`` (a bfloat16
  compensation buffer);
- ``bf16-sr``: in bfloat16, ``jls.precision.stochastic_rounding(adam)``.

Every run is wrapped in ``jls.loss_scaling(..., jls.no_scale())``
(skip-on-nan). ``--dtype float16`` runs the same four in float16
(``f32-master``, ``f16``, ``f16-kahan``, ``f16-sr``): float16 compute with
``jls.dynamic_scale()``. ``--eps`` sets Adam's ``eps`` (optax's 1e-8 is 0
in float16). It reports, per seed, the training loss (the mean of the last
5% of steps), the held-out loss in float32, the bytes of the parameters
plus the optimizer state, the skipped steps and the first step whose loss
was not finite. Run:
``python benchmarks/low_precision_params.py --seeds 3``; ``--compiled``
prints the kernels and temporaries of each fused step instead (kernels:
the fusions of the entry computation with a single array output).
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

# variant: (parameter dtype, compute mode of char_lm, wrapper, scaler)
VARIANTS = {
    "f32-master": ("float32", "bf16", None, "none"),
    "bf16": ("bfloat16", "bf16", None, "none"),
    "bf16-kahan": ("bfloat16", "bf16", "kahan", "none"),
    "bf16-sr": ("bfloat16", "bf16", "sr", "none"),
}
# --dtype float16: float16 compute with jls's dynamic loss scale, the
# parameters and Adam's moments in float32 or float16.
VARIANTS_F16 = {
    "f32-master": ("float32", "f16", None, "dynamic"),
    "f16": ("float16", "f16", None, "dynamic"),
    "f16-kahan": ("float16", "f16", "kahan", "dynamic"),
    "f16-sr": ("float16", "f16", "sr", "dynamic"),
}


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def run(name: str, spec: tuple, seed: int, args, lm, text) -> dict:
    dtype, mode, wrap, scaler = spec
    cfg = dataclasses.replace(lm.Config(), steps=args.steps, seed=seed)
    data, held_out = split(text)
    loss_fn = lm.make_loss(cfg, mode)
    params = jax.tree.map(
        lambda x: x.astype(dtype), lm.init_params(jax.random.key(seed), cfg)
    )
    inner = optax.adam(cfg.lr, eps=args.eps)
    if wrap == "kahan":
        inner = jls.precision.compensated(inner)
    elif wrap == "sr":
        inner = jls.precision.stochastic_rounding(inner, seed=seed)
    tx = jls.loss_scaling(
        inner, jls.dynamic_scale() if scaler == "dynamic" else jls.no_scale()
    )
    opt_state = tx.init(params)
    memory = _bytes(params) + _bytes(opt_state.inner_state)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens):
        def scaled(p):
            loss = loss_fn(p, tokens)
            return jls.scale_loss(loss, opt_state), loss

        grads, loss = jax.grad(scaled, has_aux=True)(params)
        params, opt_state = jls.apply_gradients(tx, grads, opt_state, params)
        return params, opt_state, loss

    tokens_at = batch_tokens(cfg, data, seed)
    losses = []
    for i in range(cfg.steps):
        tokens = tokens_at(i)
        params, opt_state, loss = step(params, opt_state, tokens)
        losses.append(float(loss))
    tail = max(1, cfg.steps // 20)
    return {
        "variant": name,
        "seed": seed,
        "train_loss": float(np.mean(losses[-tail:])),
        "held_out_loss": held_out_loss(lm, cfg, params, held_out),
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


def table(rows: list[dict], names: list[str]) -> str:
    lines = [
        "| variant | train loss (mean, min-max over seeds) | held-out loss | "
        "params + optimizer state (MB) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for v in names:
        rs = [r for r in rows if r["variant"] == v]
        tr = [r["train_loss"] for r in rs]
        ho = [r["held_out_loss"] for r in rs]
        lines.append(
            f"| {v} | {np.mean(tr):.3f} ({min(tr):.3f}-{max(tr):.3f}) | "
            f"{np.mean(ho):.3f} ({min(ho):.3f}-{max(ho):.3f}) | "
            f"{rs[0]['bytes'] / 1e6:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..n-1")
    parser.add_argument("--steps", type=int, default=300, help="steps per run")
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
        "--compiled", action="store_true", help="only the compiled step's cost"
    )
    args = parser.parse_args(argv)
    if args.compiled:
        for name, cost in compiled_cost().items():
            print(f"{name:28s} {cost['kernels']:3d} kernels, {cost['temp_mb']:.2f} MB")
        return []
    variants = VARIANTS if args.dtype == "bfloat16" else VARIANTS_F16
    lm = load_char_lm()
    text = lm.load_text(lm.Config().text_bytes)
    rows = []
    for seed in range(args.seeds):
        for name, spec in variants.items():
            rows.append(run(name, spec, seed, args, lm, text))
            r = rows[-1]
            print(
                f"seed {seed} {name:12s} train {r['train_loss']:.3f} held-out "
                f"{r['held_out_loss']:.3f} bytes {r['bytes']} skips {r['skips']} "
                f"first non-finite loss at step {r['first_nonfinite_loss']}",
                flush=True,
            )
    print(table(rows, list(variants)))
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps({"args": vars(args), "rows": rows})
        )
    return rows


if __name__ == "__main__":
    main()
