"""Wrote tests/data/jls_0_3_checkpoint.msgpack: a jls 0.3 state after 5 steps.

Run (``python tests/data/jls_0_3_checkpoint.py`` from the repository root) at
commit f79a7f6, the last with jls 0.3's state layout; also wrote
``jls_0_3_next_step.npz``, the step after it as 0.3 computed it. Kept to show
how the fixture was made: run on a later jls it writes that jls's layout.
"""

# pyright: reportCallIssue=false, reportArgumentType=false

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization

import jls

params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.zeros(3)}
tx = jls.loss_scaling(
    optax.adam(1e-2),
    jls.dynamic_scale(2.0**8, growth_interval=2),
    diagnostics=True,
    gradient_norm=True,
    skip_spikes=jls.SpikeRule(warmup=2),
    scale_stats=True,
)
state = tx.init(params)
rng = np.random.default_rng(0)


@jax.jit
def step(p, s, g):
    return jls.apply_gradients(tx, g, s, p, loss=jnp.float32(1.0))


def normal(x):
    return jnp.asarray(rng.normal(size=x.shape), jnp.float32) * 2.0**8


for i in range(5):
    g = jax.tree.map(normal, params)
    if i == 3:
        g["w"] = g["w"].at[0, 0].set(jnp.inf)
    params, state = step(params, state, g)
tree = serialization.to_state_dict({"params": params, "opt_state": state})
with open("tests/data/jls_0_3_checkpoint.msgpack", "wb") as f:
    f.write(serialization.msgpack_serialize(tree))
# The next step from it, as 0.3 computes it.
g = jax.tree.map(lambda x: jnp.full(x.shape, 3.0 * 2.0**8, jnp.float32), params)
after = dict(zip(("params", "opt_state"), step(params, state, g), strict=True))
flat = jax.tree_util.tree_leaves_with_path(after)
np.savez(
    "tests/data/jls_0_3_next_step.npz",
    **{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat},
)
