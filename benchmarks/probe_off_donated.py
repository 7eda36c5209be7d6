"""Probe: does the off switch's cost under donation depend on ``donated=``?

``bench_step.py``'s ``jls_off`` variant, passed ``donated=`` like jls's other
variants, against the same off switch left at ``donated=False``, both jitted
with and without ``donate_argnums``, beside plain Adam and jls's fused step.

Run: ``python benchmarks/probe_off_donated.py {lm,mlp,char}``. Output on one
NVIDIA H200 in ``benchmarks/results/h200/off_*.txt``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax

import jls

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_step  # noqa: E402

_steps = bench_step._steps


def _with_flagless_off(loss_fn, params, adam, donated):
    steps = _steps(loss_fn, params, adam, donated)
    off = jls.loss_scaling(adam, jls.no_scale(skip_nonfinite=False))

    def jls_off_flagless(params, state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        return jls.apply_gradients(off, grads, state, params)

    steps["jls_off_flagless"] = (jls_off_flagless, off.init(params))
    return steps


def main(argv=None) -> None:
    """Runs bench_step's interleaved rounds on the four variants."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("model", choices=["lm", "mlp", "char"], help="model")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    args = parser.parse_args(argv)
    bench_step._steps = _with_flagless_off
    bench_step.main(
        ["--model", args.model, "--rounds", str(args.rounds), "--steps-per-sample", "5"]
        + ["--variants", "jls_fused", "jls_off", "jls_off_flagless"]
    )


if __name__ == "__main__":
    main()
