"""A flax nnx model with BatchNorm and Dropout trained in float16 with jls.

The nnx way (after flax's nnx examples): float16 compute comes from the
layers' own ``dtype=jnp.float16, param_dtype=jnp.float32`` (float32 master
weights; BatchNorm keeps its running statistics in float32), not from a
casting policy, which would run a cast copy and lose the forward pass's
state updates. ``jls.flax.Optimizer`` applies the fused step, counts applied
steps, and writes the BatchNorm statistics back on a skipped step (an
overflowing forward pass wrote inf into them). Dropout draws a new mask on
every call from the model's ``nnx.Rngs``.

Run: ``python examples/nnx_batchnorm.py`` (``--help`` lists the options).
Needs flax (``pip install -e ".[flax]"``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jls
import jls.flax


class Net(nnx.Module):
    """Linear, BatchNorm, ReLU, Dropout, Linear; compute in ``dtype``."""

    def __init__(self, dtype: Any, *, rngs: nnx.Rngs):
        kw = {"dtype": dtype, "param_dtype": jnp.float32}
        self.a = nnx.Linear(8, 64, rngs=rngs, **kw)
        self.bn = nnx.BatchNorm(64, rngs=rngs, **kw)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.b = nnx.Linear(64, 1, rngs=rngs, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.drop(nnx.relu(self.bn(self.a(x))))
        return self.b(h)[:, 0].astype(jnp.float32)  # the loss in float32


def make_data(seed: int, n: int = 512) -> tuple[jax.Array, jax.Array]:
    """A smooth regression problem (no downloads)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = np.tanh(x @ rng.normal(size=(8,)) / 2).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y)


def loss_fn(model: Net, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


@nnx.jit
def train_step(model: Net, optimizer: jls.flax.Optimizer, x, y) -> jax.Array:
    def scaled(m):
        loss = loss_fn(m, x, y)
        return jls.scale_loss(loss, optimizer.opt_state), loss

    grads, loss = nnx.grad(scaled, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss


def build(dtype: Any, seed: int) -> tuple[Net, jls.flax.Optimizer]:
    """The model and its optimizer (float16: dynamic scale; float32: none)."""
    model = Net(dtype, rngs=nnx.Rngs(params=seed, dropout=seed + 1))
    scaler = jls.dynamic_scale() if dtype == jnp.float16 else jls.no_scale()
    tx = jls.loss_scaling(optax.adam(3e-3), scaler)
    return model, jls.flax.Optimizer(model, tx, wrt=nnx.Param)


def train(dtype: Any, steps: int, seed: int) -> dict[str, Any]:
    """Trains one model in ``dtype``; returns its losses and jls's record."""
    x, y = make_data(seed)
    model, optimizer = build(dtype, seed)
    losses = [float(train_step(model, optimizer, x, y)) for _ in range(steps)]
    model.eval()  # running statistics, no dropout
    m = jls.metrics(optimizer.opt_state)
    return {
        "compute": jnp.dtype(dtype).name,
        "train_loss": float(np.mean(losses[-10:])),
        "eval_loss": float(loss_fn(model, x, y)),
        "skipped": int(m["total_skips"]),
        "steps_applied": int(optimizer.step[...]),
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
    rows = [train(d, args.steps, args.seed) for d in (jnp.float32, jnp.float16)]
    for row in rows:
        print(
            f"{row['compute']:8}  train loss {row['train_loss']:.4f}  "
            f"eval loss {row['eval_loss']:.4f}  skipped {row['skipped']}"
        )
    return rows


if __name__ == "__main__":
    main()
