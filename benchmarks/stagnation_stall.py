"""A bfloat16 run that stalls at the end of its schedule, and what says so.

``examples/char_lm.py``'s model with bfloat16 compute and Adam under a
cosine schedule (``--lr`` decayed to ``--lr * --alpha``), the parameters and
Adam's moments kept:

- ``f32-master``: in float32 (the reference);
- ``bf16``: in bfloat16, plain: once the learning rate is small, the updates
  fall below half of a parameter's last place and are rounded away;
- ``bf16-sr``: in bfloat16, ``jls.precision.stochastic_rounding(adam)``;
- ``bf16-kahan``: in bfloat16, ``jls.precision.compensated(adam)`` (int16 buffer).

Every run is ``jls.loss_scaling(..., jls.no_scale(),
hooks=[jls.hooks.Stagnation(every=n)])`` and reports, at each tenth of the run,
the learning rate, the mean training loss over that tenth and
``jls.metrics(...)["stagnant_fraction"]`` at its end, the step at which
``jls.hooks.warn_if_stagnant`` (default threshold, 0.9) first warned, and the
held-out loss at the end. Run: ``python benchmarks/stagnation_stall.py``;
``--plot PATH`` writes the loss and fraction curves (needs matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys
import warnings

import jax
import numpy as np
import optax

import jls

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from char_runs import batch_tokens, held_out_loss, load_char_lm, split  # noqa: E402

VARIANTS = {
    "f32-master": ("float32", None),
    "bf16": ("bfloat16", None),
    "bf16-sr": ("bfloat16", "sr"),
    "bf16-kahan": ("bfloat16", "kahan"),
}


def run(name: str, args, lm, text) -> dict:
    dtype, wrap = VARIANTS[name]
    cfg = dataclasses.replace(lm.Config(), steps=args.steps, seed=args.seed)
    data, held_out = split(text)
    loss_fn = lm.make_loss(cfg, "bf16")
    params = jax.tree.map(
        lambda x: x.astype(dtype), lm.init_params(jax.random.key(args.seed), cfg)
    )
    schedule = optax.cosine_decay_schedule(args.lr, args.steps, alpha=args.alpha)
    inner = optax.adam(schedule)
    if wrap == "sr":
        inner = jls.precision.stochastic_rounding(inner, seed=args.seed)
    elif wrap == "kahan":
        inner = jls.precision.compensated(inner)
    tx = jls.loss_scaling(
        inner,
        jls.no_scale(),
        hooks=[jls.hooks.Stagnation(every=args.every)],
    )
    opt_state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        params, opt_state = jls.apply_gradients(tx, grads, opt_state, params)
        return params, opt_state, loss, jls.metrics(opt_state)["stagnant_fraction"]

    tokens_at = batch_tokens(cfg, data, args.seed)
    losses, fractions, warned = [], [], None
    for i in range(cfg.steps):
        params, opt_state, loss, fraction = step(params, opt_state, tokens_at(i))
        losses.append(float(loss))
        fractions.append(float(fraction))
        if warned is None and (i + 1) % args.every == 0:  # a cycle's end
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                jls.hooks.warn_if_stagnant(opt_state)  # threshold 0.9
            if caught:
                warned = i
    tenth = cfg.steps // 10
    return {
        "variant": name,
        "lr": [float(schedule(k * tenth + tenth - 1)) for k in range(10)],
        "loss_by_tenth": [
            float(np.mean(losses[k * tenth : (k + 1) * tenth])) for k in range(10)
        ],
        "fraction_by_tenth": [fractions[(k + 1) * tenth - 1] for k in range(10)],
        "first_warning_step": warned,
        "held_out_loss": held_out_loss(lm, cfg, params, held_out),
        "losses": losses,
        "fractions": fractions,
    }


def table(rows: list[dict]) -> str:
    names = [r["variant"] for r in rows]
    head = "| tenth | learning rate | " + " | ".join(
        f"{n} loss | {n} stagnant" for n in names
    )
    lines = [head + " |", "| ---: | ---: |" + " ---: | ---: |" * len(names)]
    for k in range(10):
        cells = [f"{k + 1}", f"{rows[0]['lr'][k]:.1e}"]
        for r in rows:
            cells += [
                f"{r['loss_by_tenth'][k]:.3f}",
                f"{r['fraction_by_tenth'][k]:.1%}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("| variant | held-out loss | warn_if_stagnant first warned at step |")
    lines.append("| --- | ---: | ---: |")
    for r in rows:
        w = "-" if r["first_warning_step"] is None else str(r["first_warning_step"])
        lines.append(f"| {r['variant']} | {r['held_out_loss']:.3f} | {w} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """The training loss's gap to the float32 master, and the fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(x):
        return np.convolve(x, np.ones(50) / 50, mode="valid")

    master = next((r for r in rows if r["variant"] == "f32-master"), rows[0])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        gap = smooth(r["losses"]) - smooth(master["losses"])
        ax1.plot(np.arange(len(gap)) + 50, gap, label=r["variant"], lw=1)
        ax2.plot(100 * np.asarray(r["fractions"]), label=r["variant"], lw=1)
    ax1.set(xlabel="step", ylabel=f"training loss - {master['variant']}'s")
    ax1.set_title("char LM, cosine schedule (means of 50 steps)")
    ax2.set(xlabel="step", ylabel="% of moving entries left unchanged")
    ax2.set_title('jls.hooks.Stagnation: metrics(...)["stagnant_fraction"]')
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=600, help="steps per run")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument(
        "--alpha", type=float, default=1e-3, help="final / peak learning rate"
    )
    parser.add_argument("--every", type=int, default=16, help="Stagnation(every=)")
    parser.add_argument("--seed", type=int, default=0, help="seed")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated variants"
    )
    parser.add_argument("--plot", default="", help="write the curves to this PNG")
    parser.add_argument("--json", default="", help="write every row here")
    args = parser.parse_args(argv)
    lm = load_char_lm()
    text = lm.load_text(lm.Config().text_bytes)
    rows = []
    for name in args.variants.split(","):
        rows.append(run(name, args, lm, text))
        r = rows[-1]
        print(
            f"{name:10s} held-out {r['held_out_loss']:.3f} last-tenth loss "
            f"{r['loss_by_tenth'][-1]:.3f} stagnant {r['fraction_by_tenth'][-1]:.1%} "
            f"first warning at {r['first_warning_step']}",
            flush=True,
        )
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps({"args": vars(args), "rows": rows})
        )
    return rows


if __name__ == "__main__":
    main()
