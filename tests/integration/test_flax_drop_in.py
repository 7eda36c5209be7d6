"""The seeds' workflows, the JAX way.

One-call step, retries, accumulation, divergence errors, setting the scale,
per-leaf diagnostics, and flax integration.
"""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import chex
import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from step_model import W, X, loss_fn

import jls


class Model(nnx.Module):
    """A one-layer nnx model."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(2, 3, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


def test_nnx_optimizer_skips_and_its_step_counts_calls():
    model = Model(nnx.Rngs(0))
    tx = jls.loss_scaling(optax.adam(1e-2), jls.dynamic_scale(2.0**8))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        def loss(m):
            return jls.scale_loss(jnp.mean(m(x) ** 2), optimizer.opt_state)

        grads = nnx.grad(loss)(model)
        optimizer.update(model, grads)

    step(model, optimizer, X)
    kernel = np.asarray(model.lin.kernel[...])
    step(model, optimizer, X.at[0, 0].set(jnp.nan))
    np.testing.assert_array_equal(model.lin.kernel[...], kernel)
    m = jls.metrics(optimizer.opt_state)
    assert bool(m["skipped"]) and float(m["loss_scale"]) == 128.0
    # nnx counts every call; the inner Adam count (which drives schedules)
    # does not advance on a skipped step; step - total_skips reconciles them.
    assert int(optimizer.step[...]) == 2
    assert (
        int(optimizer.step[...] - jls.metrics(optimizer.opt_state)["total_skips"]) == 1
    )
    adam_count = optax.tree.get(optimizer.opt_state, "count")
    assert (
        int(adam_count[...] if hasattr(adam_count, "__getitem__") else adam_count) == 1
    )


def test_linen_train_state_with_jls():
    params = {"params": W}
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**8))
    ts = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)

    @jax.jit
    def step(ts, x):
        grads = jax.grad(
            lambda p: jls.scale_loss(loss_fn(p["params"], x), ts.opt_state)
        )(ts.params)
        return ts.apply_gradients(grads=grads)

    ts = step(ts, X)
    before = ts.params
    ts = step(ts, X.at[0, 0].set(jnp.nan))
    chex.assert_trees_all_equal(ts.params, before)
    assert (
        int(ts.step) == 2
        and int(ts.step - jls.metrics(ts.opt_state)["total_skips"]) == 1
    )
    assert bool(jls.metrics(ts.opt_state)["skipped"])
