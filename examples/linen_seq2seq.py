"""A flax linen LSTM encoder-decoder trained in float16 with jls (after flax's seq2seq).

The task: reverse a sequence of digits. Both LSTMs run under ``nn.scan``
with ``dtype=jnp.float16, param_dtype=jnp.float32``. Three things would
silently promote the computation back to float32, and each is made in the
compute dtype here (``jls.precision.precision_report`` shows the difference): the
LSTM's initial carry (linen's ``initialize_carry`` makes it in
``param_dtype``), the one-hot inputs (``jax.nn.one_hot`` makes float32),
and the teacher-forced decoder inputs. ``jls.flax.TrainState`` applies the
fused step.

Run: ``python examples/linen_seq2seq.py`` (``--help`` lists the options).
Needs flax (``pip install -e ".[flax]"``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jls
import jls.flax

VOCAB = 11  # the digits and a start token
START = 10


class LSTM(nn.Module):
    """An LSTM over the leading axis of ``xs``, from ``carry``."""

    features: int
    dtype: Any

    @nn.compact
    def __call__(self, carry: Any, xs: jax.Array) -> tuple[Any, jax.Array]:
        cell = nn.scan(
            nn.OptimizedLSTMCell,
            variable_broadcast="params",
            split_rngs={"params": False},
            in_axes=1,
            out_axes=1,
        )(self.features, dtype=self.dtype, param_dtype=jnp.float32)
        return cell(carry, xs)


class Seq2Seq(nn.Module):
    """Encode the digits, decode them reversed (teacher forcing)."""

    features: int = 64
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        batch = tokens.shape[0]
        # The carry in the compute dtype (initialize_carry would make it in
        # param_dtype, float32, and promote every recurrent matmul).
        zeros = jnp.zeros((batch, self.features), self.dtype)
        carry, _ = LSTM(self.features, self.dtype, name="encoder")(
            (zeros, zeros), jax.nn.one_hot(tokens, VOCAB, dtype=self.dtype)
        )
        previous = jnp.concatenate(
            [jnp.full((batch, 1), START), targets[:, :-1]], axis=1
        )
        _, hs = LSTM(self.features, self.dtype, name="decoder")(
            carry, jax.nn.one_hot(previous, VOCAB, dtype=self.dtype)
        )
        logits = nn.Dense(VOCAB, dtype=self.dtype, param_dtype=jnp.float32)(hs)
        return logits.astype(jnp.float32)  # the loss in float32


def make_data(seed: int, n: int, length: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 10, size=(n, length))
    return jnp.asarray(tokens), jnp.asarray(tokens[:, ::-1].copy())


def loss_fn(params: Any, apply_fn: Any, tokens: jax.Array, targets: jax.Array):
    logits = apply_fn({"params": params}, tokens, targets)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == targets)
    return jnp.mean(loss), accuracy


@jax.jit
def train_step(state: jls.flax.TrainState, tokens, targets):
    def scaled(params):
        loss, accuracy = loss_fn(params, state.apply_fn, tokens, targets)
        return jls.scale_loss(loss, state.opt_state), (loss, accuracy)

    grads, (loss, accuracy) = jax.grad(scaled, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), loss, accuracy


def build(dtype: Any, seed: int, length: int = 6) -> jls.flax.TrainState:
    model = Seq2Seq(dtype=dtype)
    tokens, targets = make_data(seed, 2, length)
    params = model.init(jax.random.key(seed), tokens, targets)["params"]
    scaler = jls.dynamic_scale() if dtype == jnp.float16 else jls.no_scale()
    tx = jls.loss_scaling(optax.adam(1e-2), scaler)
    return jls.flax.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def train(dtype: Any, steps: int, seed: int) -> dict[str, Any]:
    """Trains one model in ``dtype``; returns its loss, accuracy and record."""
    tokens, targets = make_data(seed, 128, 6)
    state = build(dtype, seed)
    losses, accuracy = [], 0.0
    for _ in range(steps):
        state, loss, accuracy = train_step(state, tokens, targets)
        losses.append(float(loss))
    m = jls.metrics(state.opt_state)
    return {
        "compute": jnp.dtype(dtype).name,
        "final_loss": float(np.mean(losses[-10:])),
        "accuracy": float(accuracy),
        "skipped": int(m["total_skips"]),
        "steps_applied": int(state.step),
    }


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Trains in float32 and in float16 with jls; prints and returns both."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args(argv)
    rows = [train(d, args.steps, args.seed) for d in (jnp.float32, jnp.float16)]
    for row in rows:
        print(
            f"{row['compute']:8}  loss {row['final_loss']:.4f}  "
            f"accuracy {row['accuracy']:.3f}  skipped {row['skipped']}"
        )
    return rows


if __name__ == "__main__":
    main()
