"""Loss spikes on the char LM: no rule, a fixed clip, skipping, clipping.

``examples/char_lm.py``'s model in float16 with ``jls.dynamic_scale()`` and
Adam, trained on the same batches four ways while a few batches carry a 100x
loss weight (an injected spike, as a corrupt batch or a data-loader bug
gives):

- ``none``: no spike handling;
- ``clip_by_global_norm``: ``optax.clip_by_global_norm(max_norm)`` inside
  ``jls.loss_scaling`` (a fixed threshold);
- ``skip``: ``jls.hooks.SpikeRule()`` (the step is dropped);
- ``clip``: ``jls.hooks.SpikeRule(action="clip")`` (the step is applied with its
  gradient norm clipped to the running ``mean + 6 std``, ZClip).

For each seed it reports the training loss (unweighted, the mean of the last
5% of steps), the held-out loss in float32 and how many steps the rule acted
on; ``--json`` writes every curve, ``--plot`` the mean curves. Run:
``python benchmarks/spike_clipping.py --seeds 3`` (about 4 minutes on 2 CPU
cores).
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

VARIANTS = ("none", "clip_by_global_norm", "skip", "clip")


def make_tx(variant: str, lr: float, max_norm: float):
    adam = optax.adam(lr)
    scaler = jls.dynamic_scale()
    if variant == "none":
        return jls.loss_scaling(adam, scaler)
    if variant == "clip_by_global_norm":
        inner = optax.chain(optax.clip_by_global_norm(max_norm), adam)
        return jls.loss_scaling(inner, scaler)
    rule = jls.hooks.SpikeRule(action=variant)
    return jls.loss_scaling(adam, scaler, skip_spikes=rule)


def run(variant: str, seed: int, spikes: list[int], args, lm, text) -> dict:
    cfg = dataclasses.replace(lm.Config(), steps=args.steps, seed=seed)
    data, held_out = split(text)
    loss_fn = lm.make_loss(cfg, "f16")
    params = lm.init_params(jax.random.key(seed), cfg)
    tx = make_tx(variant, cfg.lr, args.max_norm)
    opt_state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens, weight):
        def scaled(p):
            loss = loss_fn(p, tokens)
            return jls.scale_loss(loss * weight, opt_state), loss

        grads, loss = jax.grad(scaled, has_aux=True)(params)
        params, opt_state = jls.apply_gradients(tx, grads, opt_state, params)
        m = jls.metrics(opt_state)
        acted = m.get("spike", jnp.asarray(False))
        return params, opt_state, loss, acted, m["skipped"]

    tokens_at = batch_tokens(cfg, data, seed)
    losses, acted, skipped = [], 0, 0
    for i in range(cfg.steps):
        tokens = tokens_at(i)
        weight = jnp.float32(args.weight if i in spikes else 1.0)
        params, opt_state, loss, a, s = step(params, opt_state, tokens, weight)
        losses.append(float(loss))
        acted += bool(a)
        skipped += bool(s)
    tail = max(1, cfg.steps // 20)
    return {
        "variant": variant,
        "seed": seed,
        "train_loss": float(np.mean(losses[-tail:])),
        "held_out_loss": held_out_loss(lm, cfg, params, held_out),
        "acted": acted,
        "skipped": skipped,
        "losses": losses,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| variant | train loss (mean, min-max over seeds) | held-out loss | "
        "steps the rule acted on | skipped steps |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for v in VARIANTS:
        rs = [r for r in rows if r["variant"] == v]
        if not rs:
            continue
        tr = [r["train_loss"] for r in rs]
        ho = [r["held_out_loss"] for r in rs]
        lines.append(
            f"| {v} | {np.mean(tr):.3f} ({min(tr):.3f}-{max(tr):.3f}) | "
            f"{np.mean(ho):.3f} ({min(ho):.3f}-{max(ho):.3f}) | "
            f"{'/'.join(str(r['acted']) for r in rs)} | "
            f"{'/'.join(str(r['skipped']) for r in rs)} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], spikes: list[int], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for v in VARIANTS:
        curves = np.array([r["losses"] for r in rows if r["variant"] == v])
        if not len(curves):
            continue
        k = 10  # a 10-step moving average of the seeds' mean
        mean = np.convolve(curves.mean(0), np.ones(k) / k, mode="valid")
        ax.plot(np.arange(k - 1, curves.shape[1]), mean, label=v, lw=1.2)
    for s in spikes:
        ax.axvline(s, color="grey", lw=0.5, ls=":")
    ax.set(
        xlabel="step (dotted: batches with a 100x loss weight)",
        ylabel="training loss (10-step mean)",
        title="char LM, float16 + jls.dynamic_scale, injected spikes",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..n-1")
    parser.add_argument("--steps", type=int, default=400, help="steps per run")
    parser.add_argument(
        "--spikes", default="150,220,221,300", help="steps whose loss is weighted"
    )
    parser.add_argument("--weight", type=float, default=100.0, help="their weight")
    parser.add_argument(
        "--max-norm", type=float, default=1.0, help="clip_by_global_norm's"
    )
    parser.add_argument("--only", default="", help="run only these variants")
    parser.add_argument("--json", default="", help="write every row here")
    parser.add_argument("--plot", default="", help="write the PNG here")
    args = parser.parse_args(argv)
    spikes = [int(s) for s in args.spikes.split(",") if s]
    variants = [v for v in VARIANTS if not args.only or v in args.only.split(",")]
    lm = load_char_lm()
    text = lm.load_text(lm.Config().text_bytes)
    rows = []
    for seed in range(args.seeds):
        for v in variants:
            rows.append(run(v, seed, spikes, args, lm, text))
            r = rows[-1]
            print(
                f"seed {seed} {v:20s} train {r['train_loss']:.3f} held-out "
                f"{r['held_out_loss']:.3f} acted {r['acted']} skipped {r['skipped']}",
                flush=True,
            )
    print(table(rows))
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps({"spikes": spikes, "args": vars(args), "rows": rows})
        )
    if args.plot:
        plot(rows, spikes, pathlib.Path(args.plot))
    return rows


if __name__ == "__main__":
    main()
