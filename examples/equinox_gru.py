"""An equinox GRU classifier trained in float16 with jls (after equinox's GRU example).

The model makes its own carry inside ``__call__``: in float32 it would promote
every hidden-state matmul back to float32 (``jls.precision.precision_report`` shows
it), so the carry is made in the input's dtype, which the casting policy
sets to float16 (``policy.cast_arguments``, jmp's argument casting; the
loss is computed outside, in float32). ``policy.wrap`` casts per op instead,
at each matmul, and a float32 carry is no trap there. Float32 master
weights, float16 compute, dynamic loss scaling, the fused step on the whole
Module. The task: is a noisy sine wave
rising or falling at the end of the window.

Run: ``python examples/equinox_gru.py`` (``--help`` lists the options).
Needs equinox (``pip install equinox``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jls


class GRUClassifier(eqx.Module):
    """A GRU over a sequence, then a linear head on the last hidden state."""

    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, hidden: int, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(1, hidden, key=k1)
        self.head = eqx.nn.Linear(hidden, 1, key=k2)

    def __call__(self, xs: jax.Array) -> jax.Array:
        # The carry in the input's dtype (float16 under the policy): a float32
        # jnp.zeros here would run every hidden-state matmul in float32.
        hidden = jnp.zeros(self.cell.hidden_size, xs.dtype)

        def step(h, x):
            return self.cell(x, h), None

        hidden, _ = jax.lax.scan(step, hidden, xs)
        return self.head(hidden)[0]


def make_data(seed: int, n: int, length: int) -> tuple[jax.Array, jax.Array]:
    """Noisy sine windows; the label is whether the wave rises at the end."""
    rng = np.random.default_rng(seed)
    phase = rng.uniform(0, 2 * np.pi, size=(n, 1))
    t = np.linspace(0, 2 * np.pi, length)[None, :]
    xs = np.sin(t + phase) + 0.1 * rng.normal(size=(n, length))
    ys = (np.cos(t[:, -1:] + phase) > 0).astype(np.float32)[:, 0]
    return jnp.asarray(xs[..., None], jnp.float32), jnp.asarray(ys)


def make_step(compute: str, tx: Any) -> Any:
    """The jitted train step for a compute dtype ("float16" or "float32")."""
    policy = jls.precision.get_policy(
        f"params=float32,compute={compute},output=float32"
    )

    def loss_fn(model, xs, ys):
        # The model is an argument of the wrapped function: the policy casts
        # its weights too.
        logits = policy.cast_arguments(lambda m, xs: jax.vmap(m)(xs))(model, xs)
        return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, ys))

    def step(model, opt_state, xs, ys):
        def scaled(m):
            loss = loss_fn(m, xs, ys)
            return jls.scale_loss(loss, opt_state), loss

        grads, loss = eqx.filter_grad(scaled, has_aux=True)(model)
        model, opt_state = jls.apply_gradients(tx, grads, opt_state, model)
        return model, opt_state, loss

    return step


def train(compute: str, steps: int, seed: int, hidden: int = 16) -> dict[str, Any]:
    """Trains one model; returns its final loss and jls's record."""
    xs, ys = make_data(seed, 256, 24)
    model = GRUClassifier(hidden, jax.random.key(seed))
    scaler = jls.dynamic_scale() if compute == "float16" else jls.no_scale()
    tx = jls.loss_scaling(optax.adam(1e-2), scaler)  # the step donates: donate="all"
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    train_step = make_step(compute, tx)
    # Full batch: the data are closed over, and the model and optimizer state
    # are donated (updated in place).
    step = eqx.filter_jit(lambda m, s: train_step(m, s, xs, ys), donate="all")
    losses = []
    for _ in range(steps):
        model, opt_state, loss = step(model, opt_state)
        losses.append(float(loss))
    m = jls.metrics(opt_state)
    return {
        "compute": compute,
        "final_loss": float(np.mean(losses[-10:])),
        "skipped": int(m["total_skips"]),
        "loss_scale": float(m["loss_scale"]),
    }


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Trains in float32 and in float16 with jls; prints and returns both."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=200, help="training steps")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args(argv)
    rows = [train(c, args.steps, args.seed) for c in ("float32", "float16")]
    for row in rows:
        print(
            f"{row['compute']:8}  loss {row['final_loss']:.4f}  "
            f"skipped {row['skipped']}  scale {row['loss_scale']:g}"
        )
    return rows


if __name__ == "__main__":
    main()
