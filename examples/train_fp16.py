"""Train a small MLP in float16 with jls dynamic loss scaling.

Float32 master weights, float16 compute, Adam, the fused jls step, all inside
one jitted, donated train step. The scale starts high on purpose (2**24, far
above what float16 gradients can hold), so the first steps overflow, are
skipped, and the scale backs off until the gradients fit; from then on it
grows back every ``--growth-interval`` finite steps.

Run: ``python examples/train_fp16.py [--steps N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from mlp import forward, init_params, loss_fn  # the demo's model, shared

import jls


def make_data(seed: int, n: int = 2048, dim: int = 32, classes: int = 4):
    """A synthetic classification problem (no downloads)."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(classes, dim)) * 0.35
    labels = rng.integers(0, classes, size=n)
    x = centers[labels] + rng.normal(size=(n, dim))
    return jnp.asarray(x, jnp.float32), jnp.asarray(labels, jnp.int32)


def main(argv=None) -> dict:
    """Trains and prints the loss, loss scale and skipped steps."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=600, help="training steps")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--batch", type=int, default=128, help="batch size")
    parser.add_argument(
        "--growth-interval", type=int, default=100, help="jls growth_interval"
    )
    args = parser.parse_args(argv)

    x, y = make_data(args.seed)
    params = init_params(jax.random.key(args.seed), (32, 256, 256, 4))
    scaler = jls.dynamic_scale(2.0**24, growth_interval=args.growth_interval)
    tx = jls.loss_scaling(optax.adam(1e-3), scaler)
    opt_state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, xb, yb):
        def scaled_loss(p):
            loss = loss_fn(p, xb, yb, jnp.float16)
            return jls.scale_loss(loss, opt_state), loss

        grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
        params, opt_state = jls.apply_gradients(tx, grads, opt_state, params)
        return params, opt_state, loss, jls.metrics(opt_state)

    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    print(f"{'step':>6} {'loss':>8} {'loss_scale':>12} {'skipped':>8}")
    loss = m = None
    for step in range(1, args.steps + 1):
        idx = rng.integers(0, x.shape[0], size=args.batch)
        params, opt_state, loss, m = train_step(params, opt_state, x[idx], y[idx])
        if step == 1 or step % max(1, args.steps // 10) == 0 or step == args.steps:
            print(
                f"{step:>6} {float(loss):>8.4f} {float(m['loss_scale']):>12.1f} "
                f"{int(m['total_skips']):>8}"
            )
    assert loss is not None and m is not None
    accuracy = float(jnp.mean(jnp.argmax(forward(params, x, jnp.float16), -1) == y))
    summary = {
        "final_loss": float(loss),
        "accuracy": accuracy,
        "loss_scale": float(m["loss_scale"]),
        "skipped_steps": int(m["total_skips"]),
        "seconds": time.perf_counter() - start,
    }
    print(
        f"accuracy {accuracy:.3f}; final loss scale {summary['loss_scale']:.0f}; "
        f"skipped steps {summary['skipped_steps']}; {summary['seconds']:.1f}s"
    )
    return summary


if __name__ == "__main__":
    main()
