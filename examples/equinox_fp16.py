"""Train an equinox MLP in float16 with jls: the standard equinox loop.

Float32 master weights (the Module as created), float16 matmuls through a
jmp-style casting policy (``jls.precision.get_policy``; ``policy.wrap`` casts per op,
the loss in float32), dynamic loss scaling, and the
fused step on the whole Module: ``jls.apply_gradients`` takes the Module as
it is (its activation function and other non-array leaves pass through), so
no ``eqx.partition``/``eqx.combine`` is needed. The scale starts high on
purpose (2**24), so the first steps overflow in float16 and are skipped.

Run: ``python examples/equinox_fp16.py [--steps N] [--seed S]``.
Needs equinox (``pip install equinox``).
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jls


def make_data(seed: int, n: int = 1024, dim: int = 16):
    """A smooth regression problem (no downloads)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, dim)).astype(np.float32)
    y = np.sin(x @ rng.normal(size=(dim, 1)) / 4).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y)


def main(argv=None) -> dict:
    """Trains and returns the final loss, loss scale and skipped steps."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args(argv)

    x, y = make_data(args.seed)
    model = eqx.nn.MLP(16, 1, 64, 2, activation=jax.nn.gelu, key=jax.random.key(0))
    policy = jls.precision.get_policy("params=float32,compute=float16,output=float32")
    scaler = jls.dynamic_scale(2.0**24, growth_interval=50)
    tx = jls.loss_scaling(optax.adam(3e-3), scaler)  # the step donates: donate="all"
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @policy.wrap  # the matmuls in float16, the prediction back in float32
    def predict(model, x):
        return jax.vmap(model)(x)

    def loss_fn(model, x, y):
        return jnp.mean((predict(model, x) - y) ** 2)

    @eqx.filter_jit(donate="all")  # full batch: x, y are closed over
    def step(model, opt_state):
        def scaled(m):
            loss = loss_fn(m, x, y)
            return jls.scale_loss(loss, opt_state), loss

        grads, loss = eqx.filter_grad(scaled, has_aux=True)(model)
        model, opt_state = jls.apply_gradients(tx, grads, opt_state, model)
        return model, opt_state, loss, jls.metrics(opt_state)

    print(f"{'step':>6} {'loss':>9} {'loss_scale':>12} {'skipped':>8}")
    loss = m = None
    for i in range(1, args.steps + 1):
        model, opt_state, loss, m = step(model, opt_state)
        if i == 1 or i % max(1, args.steps // 10) == 0:
            print(
                f"{i:>6} {float(loss):>9.5f} {float(m['loss_scale']):>12.1f} "
                f"{int(m['total_skips']):>8}"
            )
    assert loss is not None and m is not None
    return {
        "final_loss": float(loss),
        "loss_scale": float(m["loss_scale"]),
        "skipped_steps": int(m["total_skips"]),
    }


if __name__ == "__main__":
    main()
