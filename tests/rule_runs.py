"""Helpers shared by several test files (moved from test_scaler.py)."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import jax
import jax.numpy as jnp


def _run(scaler, finite, state=None):
    adjust = jax.jit(scaler.adjust)
    state = scaler.init() if state is None else state
    out = []
    for f in finite:
        state = adjust(state, jnp.asarray(f))
        out.append(state)
    return out
