"""Helpers shared by several test files (moved from test_transform.py)."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import jax
import jax.numpy as jnp
import optax

import jls


def _params(dtype=jnp.float32):
    return {
        "dense": {"w": jnp.linspace(-1, 1, 12, dtype=dtype).reshape(3, 4)},
        "bias": jnp.full((4,), 0.5, dtype),
    }


def _loss(params, x):
    h = x @ params["dense"]["w"].astype(jnp.float32)
    h = h + params["bias"].astype(jnp.float32)[None, :]
    return jnp.mean(h**2)


X = jnp.linspace(0, 1, 6, dtype=jnp.float32).reshape(2, 3)


def _scaled_grads(params, state, x=X):
    return jax.grad(lambda p: jls.scale_loss(_loss(p, x), state))(params)


def _poison(tree, bad, leaf=0, where=0):
    leaves, treedef = jax.tree.flatten(tree)
    flat = leaves[leaf].reshape(-1)
    pos = {0: 0, 1: flat.size // 2, 2: flat.size - 1}[where]
    leaves[leaf] = flat.at[pos].set(bad).reshape(leaves[leaf].shape)
    return jax.tree.unflatten(treedef, leaves)


def _update_path(tx):
    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    return step


def _fused_path(tx):
    @jax.jit
    def step(params, state, grads):
        params, state = jls.apply_gradients(tx, grads, state, params)
        return params, state, None

    return step


PATHS = {"update": _update_path, "fused": _fused_path}


def _assert_no_nan(tree):
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            assert bool(jnp.all(jnp.isfinite(leaf))), leaf
