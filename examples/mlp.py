"""The demo's model: a small MLP with float32 master weights, computed in any dtype.

Shared by ``examples/demo.py`` and ``examples/train_fp16.py``; not public
API.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax


def init_params(key: jax.Array, sizes: Sequence[int]) -> list[dict[str, jax.Array]]:
    """Float32 master weights of an MLP: LeCun-normal weights, zero biases.

    Example:
      >>> import jax
      >>> from mlp import forward, init_params, loss_fn
      >>> params = init_params(jax.random.key(0), [64, 128, 10])
      >>> [(p["w"].shape, p["w"].dtype.name) for p in params]
      [((64, 128), 'float32'), ((128, 10), 'float32')]
    """
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
        key, sub = jax.random.split(key)
        w = jax.random.normal(sub, (fan_in, fan_out)) * (1.0 / fan_in) ** 0.5
        params.append({"w": w, "b": jnp.zeros((fan_out,))})
    return params


def forward(params: Any, x: jax.Array, dtype: Any) -> jax.Array:
    """The MLP computed in ``dtype`` (weights cast from float32); float32 logits.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from mlp import forward, init_params, loss_fn
      >>> params = init_params(jax.random.key(0), [64, 32, 10])
      >>> forward(params, jnp.ones((5, 64)), jnp.float16).dtype.name
      'float32'
    """
    h = x.astype(dtype)
    for i, layer in enumerate(params):
        h = h @ layer["w"].astype(dtype) + layer["b"].astype(dtype)[None]
        if i < len(params) - 1:
            h = jax.nn.gelu(h)
    return h.astype(jnp.float32)


def loss_fn(params: Any, x: jax.Array, y: jax.Array, dtype: Any) -> jax.Array:
    """Mean softmax cross-entropy, computed in float32 from the logits.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from mlp import forward, init_params, loss_fn
      >>> params = init_params(jax.random.key(0), [64, 10])
      >>> params[0]["w"] = jnp.zeros((64, 10))  # uniform predictions
      >>> x, y = jnp.ones((4, 64)), jnp.arange(4)
      >>> round(float(loss_fn(params, x, y, jnp.float16)), 4)  # log(10)
      2.3026
    """
    logits = forward(params, x, dtype)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
