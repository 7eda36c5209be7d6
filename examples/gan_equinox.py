"""A float16 GAN in equinox whose BatchNorm survives a nan batch.

Two jls optimizers (the generator's and the discriminator's) and state
outside both: the discriminator's ``eqx.nn.BatchNorm`` keeps its running
statistics in an ``eqx.nn.State`` that the step threads itself. With
``mode="ema"`` BatchNorm normalises by those running statistics in training
too, so the one nan batch injected at ``--nan-step`` (a corrupt record, say)
writes nan into them in the forward pass, before jls sees the gradients.
Both optimizers skip that step, correctly; but without
``jls.keep_if_skipped`` the nan statistics stay, every later forward pass is
nan, and every later step of both models is skipped, with no error; as the
steps pass their loss (``loss=``), `jls.metrics` warns from the 8th non-finite
loss in a row (``--no-keep`` shows it). With it, the statistics are kept as they were on
the skipped step, and training goes on.

Each loss is scaled with its own optimizer's state (jls warns, at trace time,
when a step scales with the other's). The matmuls run in float16, the
BatchNorm statistics and the losses in float32; float32 master weights.

Run: ``python examples/gan_equinox.py [--steps N] [--nan-step K] [--no-keep]``.
Needs equinox (``pip install equinox``).
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import jls

F16 = jnp.float16


def half(module):
    """``module`` with its floating arrays in float16 (the compute copy)."""
    return jax.tree.map(
        lambda a: a.astype(F16) if eqx.is_inexact_array(a) else a, module
    )


class Discriminator(eqx.Module):
    """Linear, BatchNorm (statistics in float32), leaky ReLU, Linear."""

    first: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    last: eqx.nn.Linear

    def __init__(self, width: int, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.first = eqx.nn.Linear(2, width, key=k1)
        self.norm = eqx.nn.BatchNorm(width, "batch", mode="ema", momentum=0.9)
        self.last = eqx.nn.Linear(width, 1, key=k2)

    def __call__(self, x, state):
        h = half(self.first)(x.astype(F16)).astype(jnp.float32)
        h, state = self.norm(h, state)
        logit = half(self.last)(jax.nn.leaky_relu(h).astype(F16))
        return logit[0].astype(jnp.float32), state


def discriminate(disc, x, state):
    """Logits of a batch, and the BatchNorm state it wrote."""
    batched = jax.vmap(disc, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    return batched(x, state)


def generate(gen, z):
    return jax.vmap(half(gen))(z.astype(F16)).astype(jnp.float32)


def real_batch(key, n):
    """Points on a ring of 8 Gaussians (no downloads)."""
    k1, k2 = jax.random.split(key)
    angle = jax.random.randint(k1, (n,), 0, 8) * (2 * jnp.pi / 8)
    centers = jnp.stack([jnp.cos(angle), jnp.sin(angle)], axis=1) * 2.0
    return centers + 0.05 * jax.random.normal(k2, (n, 2))


def bce(logits, label):
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, label))


def make_step(tx_g, tx_d, keep: bool):
    """One training step of both models (D, then G)."""

    @eqx.filter_jit
    def step(gen, disc, state, opt_g, opt_d, real, z):
        def d_loss(disc):
            fake = jax.lax.stop_gradient(generate(gen, z))
            logits_real, new = discriminate(disc, real, state)
            logits_fake, new = discriminate(disc, fake, new)
            loss = bce(logits_real, 1.0) + bce(logits_fake, 0.0)
            return jls.scale_loss(loss, opt_d), (loss, new)  # D's own state

        grads, (loss_d, new) = eqx.filter_grad(d_loss, has_aux=True)(disc)
        disc, opt_d = jls.apply_gradients(tx_d, grads, opt_d, disc, loss=loss_d)

        def g_loss(gen):
            logits, after = discriminate(disc, generate(gen, z), new)
            loss = bce(logits, 1.0)
            return jls.scale_loss(loss, opt_g), (loss, after)  # G's own state

        grads, (loss_g, new) = eqx.filter_grad(g_loss, has_aux=True)(gen)
        gen, opt_g = jls.apply_gradients(tx_g, grads, opt_g, gen, loss=loss_g)
        if keep:  # the one call: the statistics as they were if a step skipped
            new = jls.keep_if_skipped(new, state, opt_d, opt_g)
        skipped = jls.metrics(opt_d)["skipped"] | jls.metrics(opt_g)["skipped"]
        return gen, disc, new, opt_g, opt_d, loss_d, loss_g, skipped

    return step


def main(argv=None) -> dict:
    """Trains and returns the skipped steps and the statistics' state."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument(
        "--nan-step", type=int, default=50, help="the step whose batch holds a nan"
    )
    parser.add_argument(
        "--no-keep",
        action="store_true",
        help="leave out jls.keep_if_skipped: the nan statistics stay",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args(argv)

    kg, kd, data = jax.random.split(jax.random.key(args.seed), 3)
    gen = eqx.nn.MLP(4, 2, 32, 2, activation=jax.nn.relu, key=kg)
    disc, state = eqx.nn.make_with_state(Discriminator)(32, kd)
    tx_g = jls.loss_scaling(optax.adam(1e-3, b1=0.5), jls.measured_scale())
    tx_d = jls.loss_scaling(optax.adam(1e-3, b1=0.5), jls.measured_scale())
    opt_g = tx_g.init(eqx.filter(gen, eqx.is_inexact_array))
    opt_d = tx_d.init(eqx.filter(disc, eqx.is_inexact_array))
    step = make_step(tx_g, tx_d, keep=not args.no_keep)

    print(f"{'step':>5} {'loss D':>8} {'loss G':>8} {'skipped':>8}")
    skipped_after = 0
    loss_d = loss_g = jnp.float32(jnp.nan)
    for i in range(1, args.steps + 1):
        k_real, k_z = jax.random.split(jax.random.fold_in(data, i))
        real = real_batch(k_real, 64)
        if i == args.nan_step:
            real = real.at[0, 0].set(jnp.nan)  # one corrupt record
        z = jax.random.normal(k_z, (64, 4))
        gen, disc, state, opt_g, opt_d, loss_d, loss_g, skipped = step(
            gen, disc, state, opt_g, opt_d, real, z
        )
        if i > args.nan_step:
            skipped_after += int(skipped)
        if i == 1 or i == args.nan_step or i % max(1, args.steps // 6) == 0:
            losses = f"{float(loss_d):>8.4f} {float(loss_g):>8.4f}"
            print(f"{i:>5} {losses} {bool(skipped)!s:>8}")
    finite = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state))
    summary = {
        "skips_d": int(jls.metrics(opt_d)["total_skips"]),
        "skips_g": int(jls.metrics(opt_g)["total_skips"]),
        "skipped_after_nan": skipped_after,
        "steps_after_nan": args.steps - args.nan_step,
        "statistics_finite": finite,
        "final_loss_d": float(loss_d),
        "final_loss_g": float(loss_g),
    }
    print(
        f"steps skipped after the nan batch: {skipped_after} of "
        f"{summary['steps_after_nan']}; BatchNorm statistics finite: {finite}"
    )
    return summary


if __name__ == "__main__":
    main()
