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

import jls


def test_diagnostics_name_the_bad_leaves():
    tx = jls.loss_scaling(optax.adam(1e-2), diagnostics=True)
    params = {
        "enc": {"w": jnp.ones((2, 2))},
        "dec": {"w": jnp.ones(3), "b": jnp.ones(1)},
    }
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    step = jax.jit(lambda g, s, p: jls.apply_gradients(tx, g, s, p))
    _, state = step(grads, state, params)
    assert jls.hooks.nonfinite_paths(state) == []
    bad = {
        "enc": {"w": grads["enc"]["w"].at[0, 1].set(jnp.nan)},
        "dec": dict(grads["dec"], b=jnp.array([jnp.inf])),
    }
    _, state = step(bad, state, params)
    assert jls.hooks.nonfinite_paths(state) == ["['dec']['b']", "['enc']['w']"]
    flags = jls.metrics(state)["nonfinite_leaves"]
    assert bool(flags["enc"]["w"]) and not bool(flags["dec"]["w"])
    chex.assert_trees_all_equal(jls.metrics(state)["nonfinite_leaves"], flags)
    _, state = step(grads, state, params)
    assert jls.hooks.nonfinite_paths(state) == []
    with pytest.raises(ValueError, match="diagnostics=True"):
        jls.hooks.nonfinite_paths(jls.loss_scaling(optax.sgd(1.0)).init(params))


def test_diagnostics_cost_nothing_on_the_finite_path():
    params = {f"l{i}": jnp.ones((128, 128)) for i in range(4)}
    grads = jax.tree.map(jnp.ones_like, params)

    def temp_bytes(diagnostics):
        tx = jls.loss_scaling(optax.adam(1e-3), diagnostics=diagnostics)
        fn = jax.jit(
            lambda g, s, p: jls.apply_gradients(tx, g, s, p), donate_argnums=(1, 2)
        )
        stats = fn.lower(grads, tx.init(params), params).compile().memory_analysis()
        assert stats is not None
        return stats.temp_size_in_bytes

    assert temp_bytes(True) <= temp_bytes(False) + 1024
