"""How to skip a step: the structures a skipping train step can take, measured.

Every variant is the same Adam train step with the same check
(``jls.all_finite`` of the gradients); they differ only in how a step whose
gradients are not finite leaves the parameters and optimizer state as they
were. Each runs jitted twice, with the state donated and without, side by
side in one process (interleaved rounds, medians, per-round ratios to plain
Adam in the same mode), and the report adds the compiled program's
temporary bytes and copy instructions.

Variants:
  plain        optax.adam, no check (the floor).
  cond_pass    ``lax.cond(finite, update, lambda: (params, state))``: the
               skip branch returns its operands (jls 0.2's structure).
  cond_fresh   the same conditional, its skip branch writing fresh arrays
               (a select on a runtime flag that XLA cannot fold).
  select       no conditional: the update is computed and
               ``jnp.where(finite, new, old)`` picks per leaf (flax's idiom).

What XLA does with them (jax 0.10.2, XLA:CPU; the same passes run on GPU):
a conditional's output is one buffer for both branches, and it can share
the operand's buffer only when a branch returns the operand itself. So
``cond_pass`` is free when the state is donated and, without donation, makes
XLA copy every parameter and moment before the conditional (the read-only
arguments cannot become the outputs); ``cond_fresh`` is free without
donation and copies every output into the donated buffers with it. Any
conditional also keeps the gradients in a temporary buffer of their own
(operands of a conditional cannot share its outputs' buffers, as the plain
step's gradients share the new moments'). ``select`` fuses into the
update's loops and has no conditional.

Run: ``python benchmarks/bench_skip.py [--model lm|mlp|both] [--rounds 20]``.
"""

from __future__ import annotations

import argparse
import platform

import jax
import jax.numpy as jnp
import optax
from bench_step import compiled_stats, report, run
from jax import lax

import jls


def make_skip_variants(loss_fn, params, modes=(False, True)):
    """Returns {name: (jitted step, initial opt_state)}, each mode's."""
    adam = optax.adam(1e-4)

    def update(params, state, grads):
        updates, state = adam.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def plain(params, state, batch):
        return update(params, state, jax.grad(loss_fn)(params, batch))

    def cond_pass(params, state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        return lax.cond(
            jls.all_finite(grads),
            lambda ops: update(*ops),
            lambda ops: (ops[0], ops[1]),
            (params, state, grads),
        )

    def cond_fresh(params, state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        finite = jls.all_finite(grads)

        def skipped(ops):
            keep = ops[3]
            return jax.tree.map(
                lambda x: lax.select(
                    jnp.broadcast_to(keep, x.shape), x, jnp.zeros_like(x)
                ),
                (ops[0], ops[1]),
            )

        return lax.cond(
            finite,
            lambda ops: update(*ops[:3]),
            skipped,
            (params, state, grads, ~finite),
        )

    def select(params, state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        finite = jls.all_finite(grads)
        new = update(params, state, grads)
        return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, (params, state))

    variants = {}
    for donated in modes:
        jit = jax.jit if not donated else lambda f: jax.jit(f, donate_argnums=(0, 1))
        suffix = " (donated)" if donated else ""
        for f in (plain, cond_pass, cond_fresh, select):
            variants[f.__name__ + suffix] = (jit(f), adam.init(params))
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
    print(
        f"jax {jax.__version__}, optax {optax.__version__}, "
        f"{jax.devices()[0].device_kind}, {platform.processor() or platform.machine()}"
    )
    for model in ["lm", "mlp"] if args.model == "both" else [args.model]:
        result = run(
            model,
            args.rounds,
            args.steps_per_sample,
            variants_fn=make_skip_variants,
            stats=compiled_stats,
        )
        print()
        print(report(result))


if __name__ == "__main__":
    main()
