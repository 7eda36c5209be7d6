"""Helpers shared by several test files (moved from test_measured.py)."""

# pyright: reportIndexIssue=false, reportAttributeAccessIssue=false
# pyright: reportArgumentType=false, reportOperatorIssue=false
# pyright: reportAssignmentType=false

import jax
import jax.numpy as jnp
import numpy as np

F32_MAX = np.float32(np.finfo(np.float32).max)


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w": jax.random.normal(k1, (64, 300)),
        "b": jnp.zeros((300,)),
        "h": jax.random.normal(k2, (300,), jnp.float32),
    }


def _grads(params, scale, rng, factor=1.0):
    return jax.tree.map(
        lambda p: (
            jnp.asarray(rng.normal(size=p.shape), p.dtype) * 1e-3 * scale * factor
        ),
        params,
    )
