"""Helpers shared by several test files (moved from test_workflows.py)."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import jax
import jax.numpy as jnp

W = {"a": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.full((3,), 0.1)}


X = jnp.linspace(0.0, 1.0, 8).reshape(4, 2)


def loss_fn(params, x):
    h = x @ params["a"] + params["b"][None, :]
    return jnp.mean(h**2)


@jax.custom_vjp
def overflow_where(h, bad):
    """``h``; in the backward pass, inf gradients where ``bad`` (a scalar)."""
    return h


def _forward(h, bad):
    return h, bad


def _backward(bad, g):
    return jnp.where(bad, jnp.inf, g), None


overflow_where.defvjp(_forward, _backward)


def overflowing_loss(params, x, bad):
    """`loss_fn`, whose gradients overflow where ``bad``: the loss stays finite.

    As a float16 backward pass overflows at too high a scale: the step is
    non-finite, and the scale must back off (a non-finite loss would hold it).
    ``bad`` has one entry per row of ``x``.
    """
    h = x @ params["a"] + params["b"][None, :]
    h = overflow_where(h, jnp.any(bad))
    return jnp.mean(h**2)
