"""`jls.LossScaleState`: fixed dtypes, no weak types, a pytree that survives jit."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import chex
import jax
import jax.numpy as jnp
import optax

import jls


def test_state_dtypes_and_no_weak_types():
    state = jls.dynamic_scale().init()
    assert isinstance(state, jls.LossScaleState)
    chex.assert_trees_all_equal_dtypes(
        state,
        jls.LossScaleState(
            jnp.float32(0), *[jnp.int32(0)] * 6, headroom=jnp.float32(1)
        ),
    )
    for leaf in state:
        assert leaf.shape == () and not leaf.weak_type
    after = jax.jit(jls.dynamic_scale().adjust)(state, jnp.asarray(False))
    chex.assert_trees_all_equal_dtypes(state, after)
    assert not any(leaf.weak_type for leaf in after)


def test_state_survives_flatten_unflatten_and_jit():
    state = jls.dynamic_scale(2.0**10).init()._replace(growth_count=jnp.int32(7))
    leaves, treedef = jax.tree.flatten(state)
    assert len(leaves) == 8
    again = jax.tree.unflatten(treedef, leaves)
    chex.assert_trees_all_equal(again, state, strict=True)
    chex.assert_trees_all_equal(jax.jit(lambda s: s)(state), state, strict=True)
    assert float(optax.tree.get(state, "scale")) == 1024.0
