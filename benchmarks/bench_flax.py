"""The flax user's train step, with and without jls: linen ``TrainState``.

A flax user steps with ``state.apply_gradients(grads=grads)``. Variants, on
the models of ``bench_step.py`` (Adam, interleaved rounds, medians and
per-round ratios as there), each without donation and with the state donated
("(donated)"):

  plain              flax's ``TrainState``, optax Adam, no loss scaling.
  jls_tx_update      flax's ``TrainState`` with ``tx=jls.loss_scaling(adam)``:
                     it calls ``tx.update`` then ``optax.apply_updates``.
  jls_flax_fused     ``jls.flax.TrainState`` (the same ``tx``): the fused path.

``jls.flax.Optimizer`` (nnx) makes the same fused call as
``jls.flax.TrainState``; ``tests/test_flax.py`` checks both step for step
against the plain ones.

Run: ``python benchmarks/bench_flax.py [--model lm|mlp|both] [--rounds 20]``.
Needs the ``bench`` extra (flax, jmp).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import optax
from bench_step import DONATED, report, run
from flax.training import train_state

import jls
import jls.flax


def make_flax_variants(loss_fn, params, modes=(False, True)):
    """Returns {name: (jitted step, initial TrainState)}, each mode's."""
    adam = optax.adam(1e-4)
    variants = {}

    def fresh(cls, tx):
        copy = jax.tree.map(jnp.copy, params)  # donated: one copy per variant
        return cls.create(apply_fn=None, params=copy, tx=tx)

    # The parameters live in the TrainState: the harness's own copy is not
    # passed to the step (returning it would pair the donated state's buffers
    # with the wrong outputs and make XLA copy them).
    def plain(_, state, batch):
        grads = jax.grad(loss_fn)(state.params, batch)
        return None, state.apply_gradients(grads=grads)

    def scaled(_, state, batch):
        def loss(q):
            return jls.scale_loss(loss_fn(q, batch), state.opt_state)

        return None, state.apply_gradients(grads=jax.grad(loss)(state.params))

    for donated in modes:
        scaler = jls.dynamic_scale(2.0**15, growth_interval=10**6)
        tx = jls.loss_scaling(adam, scaler)
        jit = functools.partial(jax.jit, donate_argnums=(1,) if donated else ())
        suffix = DONATED if donated else ""
        variants["plain" + suffix] = (jit(plain), fresh(train_state.TrainState, adam))
        variants["jls_tx_update" + suffix] = (
            jit(scaled),
            fresh(train_state.TrainState, tx),
        )
        variants["jls_flax_fused" + suffix] = (
            jit(scaled),
            fresh(jls.flax.TrainState, tx),
        )
    return variants


def main(argv=None) -> None:
    """Runs the benchmark and prints markdown tables."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model", choices=["lm", "mlp", "both"], default="both", help="which model(s)"
    )
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds")
    parser.add_argument(
        "--steps-per-sample", type=int, default=2, help="steps timed per sample"
    )
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    models = ["lm", "mlp"] if args.model == "both" else [args.model]
    for m in models:
        result = run(
            m, args.rounds, args.steps_per_sample, variants_fn=make_flax_variants
        )
        print()
        print(report(result))


if __name__ == "__main__":
    main()
