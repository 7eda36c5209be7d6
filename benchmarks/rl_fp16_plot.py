"""Plots and tabulates a run of examples/rl_fp16.py against the issue's targets.

Reads ``records.jsonl`` and ``summary.json`` from the run's folder, writes a
PNG (reward, trainer/sampler log-prob gap and loss scale against step, per
variant, the mean over seeds; float32's reward has a band from its lowest
to its highest seed; a gap of exactly 0 is drawn at 1e-9)
and prints a markdown table of each variant's figures and one of the targets
for the float16 variants that use jls (docs/rl_fp16.md):

- the trainer/sampler gap (mean absolute log-prob difference of the sampled
  tokens) at most 1/8 of bfloat16's;
- no non-finite step after the warm-up;
- at most 1% of steps skipped;
- the final reward, the mean over seeds, within float32's spread over seeds
  (its lowest to its highest seed).

Run: ``python benchmarks/rl_fp16_plot.py benchmarks/results/cpu/rl_fp16
--png docs/rl_fp16.png`` (needs matplotlib, in the demo extra).
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib

import numpy as np


def load(folders: list[pathlib.Path]):
    """The runs' per-step records grouped by variant and seed, and their summary.

    The variants of every folder after the first are named with the folder's
    name: ``bf16, no excess precision`` for ``bf16`` in ``no_excess_precision``.
    """
    runs, summary = collections.defaultdict(dict), {"runs": []}
    for i, folder in enumerate(folders):
        suffix = f", {folder.name.replace('_', ' ')}" if i else ""
        for line in (folder / "records.jsonl").read_text().splitlines():
            r = json.loads(line)
            runs[r["variant"] + suffix].setdefault(r["seed"], []).append(r)
        for run in json.loads((folder / "summary.json").read_text())["runs"]:
            summary["runs"].append(run | {"variant": run["variant"] + suffix})
    return runs, summary


def _curve(seeds: dict, key: str, smooth: int) -> tuple[np.ndarray, np.ndarray]:
    """Steps and per-seed values of ``key`` over the RL phase, a moving mean."""
    rows = [[r for r in rs if r["phase"] == "rl"] for rs in seeds.values()]
    values = np.array([[r[key] for r in rs] for rs in rows], float)
    kernel = np.ones(smooth) / smooth
    values = np.array([np.convolve(v, kernel, mode="valid") for v in values])
    steps = np.array([r["step"] for r in rows[0]])[smooth - 1 :]
    return steps, values


def plot(runs: dict, path: pathlib.Path, smooth: int) -> None:
    """Reward, gap and scale against step, one line and band per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for variant, seeds in runs.items():
        for ax, key in zip(axes[:2], ("reward", "gap_mean"), strict=True):
            steps, values = _curve(seeds, key, smooth)
            if key == "gap_mean":
                values = np.maximum(values, 1e-9)  # float32's steps of exactly 0
            (line,) = ax.plot(steps, values.mean(0), label=variant, lw=1.2)
            if variant == "f32" and key == "reward":  # the target's spread
                ax.fill_between(
                    steps, values.min(0), values.max(0), color=line.get_color(),
                    alpha=0.15, label="f32, lowest to highest seed",
                )  # fmt: skip
        scale = [[r["loss_scale"] for r in rs] for rs in seeds.values()]
        if max(max(s) for s in scale) > 1:
            axes[2].plot(np.mean(np.log2(scale), 0), label=variant, lw=1)
    n = len(next(iter(runs.values())))
    axes[0].set(xlabel="step", ylabel="mean reward", title=f"reward ({n} seeds)")
    axes[1].set(xlabel="step", ylabel="mean |logp trainer - logp sampler|")
    axes[0].set_ylim(top=1.0)
    axes[1].set(yscale="log", title="trainer/sampler log-prob gap")
    axes[2].set(xlabel="step (supervised, then RL)", ylabel="log2 loss scale")
    axes[2].set(title="loss scale (mean over seeds)")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"examples/rl_fp16.py, moving mean over {smooth} steps", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def tables(summary: dict) -> str:
    """Each variant's figures (mean over seeds), then the targets' verdicts."""
    by = collections.defaultdict(list)
    for run in summary["runs"]:
        by[run["variant"]].append(run)
    keys = ("reward", "gap_mean", "gap_max", "kl_k3", "skipped_fraction")
    mean = {
        v: {k: float(np.mean([r[k] for r in rs])) for k in keys} for v, rs in by.items()
    }
    lines = [
        "| variant | final reward (seeds) | gap mean | gap max | KL k3 | "
        "non-finite after warm-up | skipped | final scale |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for v, rs in by.items():
        m = mean[v]
        rewards = ", ".join(f"{r['reward']:.3f}" for r in rs)
        scales = ", ".join(rf"2\*\*{np.log2(r['final_scale']):.0f}" for r in rs)
        scales = scales if any(r["final_scale"] != 1 for r in rs) else "-"
        nonfinite = sum(r["nonfinite_after_warmup"] for r in rs)
        lines.append(
            f"| {v} | {m['reward']:.3f} ({rewards}) | {m['gap_mean']:.2e} | "
            f"{max(r['gap_max'] for r in rs):.2e} | {m['kl_k3']:.1e} | {nonfinite} | "
            f"{100 * m['skipped_fraction']:.1f}% | {scales} |"
        )
    if "bf16" not in by or "f32" not in by:
        return "\n".join(lines)
    low = min(r["reward"] for r in by["f32"])
    high = max(r["reward"] for r in by["f32"])
    refs = [v for v in by if v.startswith("bf16")]  # bf16, and any beside it
    lines += [
        "",
        "| variant | "
        + "".join(f"gap / {ref}'s (target <= 1/8) | " for ref in refs)
        + "non-finite after warm-up (0) | skipped (<= 1%) | final reward in "
        f"f32's spread [{low:.3f}, {high:.3f}] |",
        "| --- | " + "--- | " * len(refs) + "--- | --- | --- |",
    ]
    verdict = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    for v in (v for v in by if v.startswith("f16-jls")):
        gaps = ""
        for ref in refs:
            ratio = mean[v]["gap_mean"] / mean[ref]["gap_mean"]
            share = f"1/{1 / ratio:.0f}" if ratio < 0.5 else f"{ratio:.2f}"
            gaps += f"{share}: {verdict(ratio <= 1 / 8)} | "
        nonfinite = sum(r["nonfinite_after_warmup"] for r in by[v])
        skipped = max(r["skipped_fraction"] for r in by[v])
        inside = [low <= r["reward"] <= high for r in by[v]]
        lines.append(
            f"| {v} | {gaps}{nonfinite}: "
            f"{verdict(nonfinite == 0)} | {100 * skipped:.1f}% (worst seed): "
            f"{verdict(skipped <= 0.01)} | mean {mean[v]['reward']:.3f}: "
            f"{verdict(low <= mean[v]['reward'] <= high)} ({sum(inside)} of "
            f"{len(inside)} seeds inside) |"
        )
    return "\n".join(lines)


def main(argv=None) -> str:
    """Writes the PNG and prints the tables; returns them."""
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").partition("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "folders", type=pathlib.Path, nargs="+",
        help="the run's --out folder, then any other runs' to show beside it",
    )  # fmt: skip
    parser.add_argument(
        "--png", type=pathlib.Path, help="where to write the plot (None: no plot)"
    )
    parser.add_argument("--smooth", type=int, default=20, help="moving-mean window")
    args = parser.parse_args(argv)
    runs, summary = load(args.folders)
    if args.png:
        plot(runs, args.png, args.smooth)
        print(f"wrote {args.png}")
    text = tables(summary)
    print(text)
    return text


if __name__ == "__main__":
    main()
