"""Which entries of a leaf `jls.hooks.Stagnation` reads at each step of its cycle.

One rule: a leaf is cut along its first axis whose length is a multiple of
``every * ROWS``, and step ``k`` of the cycle reads the entries whose index
along that axis is ``k`` modulo ``every``; a leaf with no such axis is read
whole, under a mask that keeps the entries whose index along its last axis
is ``k`` modulo ``every``. Either way each entry is read once per cycle
(`read_phases` says when, in numpy; `read_block` takes the cut leaf's slice).

The cut reads whole runs of ``every`` consecutive indices along one axis,
and touches no other: a leaf sharded along any other axis is read where it
lies, and one sharded along the cut axis over a device count that divides
`ROWS` (any power of two up to 16) holds whole runs, so no shard needs
another's entries. A masked leaf is read where it lies however it is
sharded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ROWS = 16
"""A cut axis holds a multiple of this many entries per step (`cut_axis`)."""


def cut_axis(shape: tuple[int, ...], every: int) -> int | None:
    """The axis a leaf of ``shape`` is cut along, or ``None`` (read whole).

    The first axis whose length is a positive multiple of ``every * ROWS``:
    a step reads a multiple of `ROWS` indices of it, so a shard along it
    over up to `ROWS` devices holds whole runs of ``every`` (see the module).
    """
    step = every * ROWS
    return next((a for a, n in enumerate(shape) if n and n % step == 0), None)


def read_phases(shape: tuple[int, ...], every: int) -> np.ndarray:
    """The step of the cycle (0 to ``every - 1``) at which each entry is read.

    Its index modulo ``every`` along the axis `cut_axis` picks, or along the last
    axis of a leaf read whole (a scalar is a leaf of shape ``(1,)``). numpy:
    the model of what `read_block` slices and what the mask keeps.
    """
    shape = shape or (1,)
    cut = cut_axis(shape, every)
    axis = len(shape) - 1 if cut is None else cut
    view = [1] * len(shape)
    view[axis] = -1
    return np.broadcast_to((np.arange(shape[axis]) % every).reshape(view), shape)


def read_block(x: jax.Array, phase: jax.Array, every: int, cut: int) -> jax.Array:
    """The entries of ``x`` read at ``phase`` (`read_phases`), the cut axis first.

    The cut axis is split into ``(n // every, every)`` and one index of the
    second taken: a reshape and a dynamic slice, no other axis touched. The
    cut axis comes first, so that the slice's leading axis (``n // every``,
    at least `ROWS`) is never the 1 of a leaf read whole.
    """
    n = x.shape[cut]
    split = jnp.reshape(x, (*x.shape[:cut], n // every, every, *x.shape[cut + 1 :]))
    read = lax.dynamic_index_in_dim(split, phase, axis=cut + 1, keepdims=False)
    return jnp.moveaxis(read, cut, 0)
