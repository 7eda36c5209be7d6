"""Which entries of a leaf `jls.hooks.Stagnation` reads at each step of its cycle.

Step ``k`` reads the entries whose index along the leaf's cut axis
(`cut_axis`) is ``k`` modulo ``every``; a leaf with none, under a mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

ROWS = 16
"""A cut axis holds a multiple of this many entries per step (`cut_axis`)."""


def cut_axis(shape: tuple[int, ...], every: int) -> int | None:
    """The first axis whose length is a positive multiple of ``every * ROWS``.

    ``None``: the leaf is read whole.
    """
    step = every * ROWS
    return next((a for a, n in enumerate(shape) if n and n % step == 0), None)


def read_block(x: jax.Array, phase: jax.Array, every: int, cut: int) -> jax.Array:
    """The entries of ``x`` read at ``phase``, the cut axis first."""
    n = x.shape[cut]
    split = jnp.reshape(x, (*x.shape[:cut], n // every, every, *x.shape[cut + 1 :]))
    read = lax.dynamic_index_in_dim(split, phase, axis=cut + 1, keepdims=False)
    return jnp.moveaxis(read, cut, 0)
