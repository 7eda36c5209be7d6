"""Why did my step skip? A float16 residual network whose backward overflows.

A small pre-norm residual network in float16, trained with jls's dynamic
scale: the first step's forward is finite (its activations stay below 10)
but the scaled gradients overflow on the way back, so jls skips the step and
halves the scale. ``jls.precision.explain_step``, called with the state the
step ran with, names the op, its layer, its line and its pass.

    python examples/why_skip.py            # prints the report
    python examples/why_skip.py --write    # and stores it for docs/howto/why_skip.md
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import optax

import jls

F16 = jnp.float16
REPORT = pathlib.Path(__file__).parents[1] / "docs" / "howto" / "why_skip_report.txt"


def normal(key: jax.Array, shape: tuple) -> jax.Array:
    return (jax.random.normal(key, shape) / shape[0] ** 0.5).astype(F16)


def init(key: jax.Array, width: int = 32, depth: int = 4) -> dict:
    """float16 parameters: ``depth`` residual blocks and a readout."""
    k = jax.random.split(key, 2 * depth + 1)
    blocks = [
        {
            "up": normal(k[2 * i], (width, 4 * width)),
            "down": normal(k[2 * i + 1], (4 * width, width)),
        }
        for i in range(depth)
    ]
    return {"blocks": blocks, "out": normal(k[-1], (width, 1))}


def layer_norm(h: jax.Array) -> jax.Array:
    mu = jnp.mean(h, -1, keepdims=True)
    var = jnp.mean(jnp.square(h - mu), -1, keepdims=True)
    return (h - mu) * jax.lax.rsqrt(var + 1e-5)


def loss_fn(params: dict, batch: tuple) -> jax.Array:
    """Mean squared error of a pre-norm residual network, computed in float16."""
    x, y = batch
    h = x
    for i, block in enumerate(params["blocks"]):
        with jax.named_scope(f"block{i}"):
            u = jax.nn.gelu(layer_norm(h) @ block["up"])
            h = h + u @ block["down"]
    with jax.named_scope("readout"):
        pred = layer_norm(h) @ params["out"]
    return jnp.mean(jnp.square(pred.astype(jnp.float32) - y))


def explain() -> str:
    """One skipped step, and its report as text."""
    params = init(jax.random.key(0))
    x = (jax.random.normal(jax.random.key(1), (64, 32)) * 1e-3).astype(F16)
    batch = (x, jnp.ones((64, 1), jnp.float32))
    tx = jls.loss_scaling(optax.adam(1e-3))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: jls.scale_loss(loss_fn(p, batch), opt_state))(params)
        params, opt_state = jls.apply_gradients(tx, grads, opt_state, params)
        return params, opt_state, jls.metrics(opt_state)

    before = opt_state  # the state the step runs with (its scale)
    params_after, opt_state, metrics = step(params, opt_state, batch)
    assert bool(metrics["skipped"]), "the step was meant to skip"
    report = jls.precision.explain_step(loss_fn, before, params, batch)
    return str(report)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=str(__doc__).splitlines()[0])
    parser.add_argument(
        "--write", action="store_true", help=f"store the report in {REPORT}"
    )
    text = explain()
    print(text)
    if parser.parse_args().write:
        REPORT.write_text(text + "\n")
