"""Helpers shared by several test files (moved from test_workflows.py)."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import jax.numpy as jnp

W = {"a": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.full((3,), 0.1)}


X = jnp.linspace(0.0, 1.0, 8).reshape(4, 2)


def loss_fn(params, x):
    h = x @ params["a"] + params["b"][None, :]
    return jnp.mean(h**2)
