"""The seeds' workflows, the JAX way.

One-call step, retries, accumulation, divergence errors, setting the scale,
per-leaf diagnostics, and flax integration.
"""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from step_model import W, X, overflowing_loss

import jls


def test_set_loss_scale():
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**8))
    params, state = W, tx.init(W)
    params, state, _ = jax.jit(jls.train_step(overflowing_loss, tx))(
        params, state, X, jnp.ones(4, bool)
    )
    new = jls.set_loss_scale(state, 4096.0)
    assert float(jls.metrics(new)["loss_scale"]) == 4096.0
    assert int(jls.metrics(new)["total_skips"]) == 1  # counters kept
    scaler = jls.dynamic_scale(2.0**8)
    reset = jls.set_loss_scale(state, 4096.0, scaler=scaler, reset_counters=True)
    assert int(jls.metrics(reset)["total_skips"]) == 0
    chex.assert_trees_all_equal(new.inner_state, state.inner_state)
    # Inside jit, with a traced scale.
    halved = jax.jit(lambda s: jls.set_loss_scale(s, jls.metrics(s)["loss_scale"] / 2))(
        state
    )
    assert float(jls.metrics(halved)["loss_scale"]) == 64.0
    for bad in (0.0, -1.0, float("inf"), 1e-45):
        with pytest.raises(
            ValueError, match="scale must be (positive|represent|finite)"
        ):
            jls.set_loss_scale(state, bad)
