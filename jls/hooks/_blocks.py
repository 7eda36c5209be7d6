"""Which entries of a leaf `jls.hooks.Stagnation` reads at each step of its cycle.

A step reads one ``every``-th of each leaf: every ``every``-th block of
consecutive entries along one axis (`_cut` picks the axis and the block,
`read_phases` says in numpy at which step each entry is read, `_read`
takes the slice). The layout decides what the read costs (runs of
consecutive entries, not entries strided over every cache line) and
whether a sharded leaf is read where it lies.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BLOCK = 16
"""The most entries per block (one 64-byte line of float32): see `read_phases`."""


ROWS = 16
"""Rows (of ``every`` blocks) an axis must hold to be cut: see `_block`."""


def _block(n: int, every: int) -> int | None:
    """Entries per block along an axis of ``n`` entries, ``every`` blocks a row.

    An axis is cut only into a multiple of `ROWS` rows, so that an axis
    sharded over a power of two up to 16 devices (or any count dividing
    the rows) holds whole rows on each, and each step's slice is read
    where it lies, with no gather. The block is the largest power of two up
    to `BLOCK` leaving a multiple of 64 rows (consecutive entries read
    together, and up to 64 devices), else 1; ``None`` when even that
    leaves no multiple of `ROWS`.
    """
    if n % (every * ROWS):
        return None
    block = 1
    while block < BLOCK and n % (every * block * 2 * 64) == 0:
        block *= 2
    return block


def read_phases(shape: tuple[int, ...], every: int) -> np.ndarray:
    """The step of the cycle (0 to ``every - 1``) at which each entry is read.

    Along the axis `_cut` picks, its blocks take the phases in turn; with
    no such axis (a small leaf), the entries of the last axis do, one by
    one, and the leaf is read whole, under a mask. (numpy; what `_read`
    computes with a slice.)
    """
    shape = shape or (1,)
    cut = _cut(shape, every)
    if cut is None:
        axis, index = len(shape) - 1, np.arange(shape[-1]) % every
    else:
        axis, block = cut
        index = np.arange(shape[axis]) // block % every
    view = [1] * len(shape)
    view[axis] = -1
    return np.broadcast_to(index.reshape(view), shape)


STRIDED = 1 << 16
"""Entries from which a leaf is cut along an earlier axis rather than in
strided blocks along its last (`_cut`): below it, reading the strided
blocks costs little (a leaf of 256 KB of float32)."""


def _cut(shape: tuple[int, ...], every: int) -> tuple[int, int] | None:
    """``(axis, entries per block)`` a leaf is cut in, or ``None`` (read whole).

    The first axis `_block` cuts: each step's slice holds a multiple of
    `ROWS` rows, so that a shard along it over up to 16 devices holds whole
    cycles, and no axis is gathered for the read. Its blocks are widened
    to `BLOCK` consecutive entries where the axis has room for that
    (a (64, 4096) kernel: 16 rows of 16 entries a step): blocks of a few
    entries along the last axis lie every ``every``-th in memory, the read
    touches every cache line of the leaf, and it cost what reading it whole
    costs (1.69x the Adam step of (8, 64, 512) kernels on XLA:CPU). Where
    the axis has no room, a leaf of `STRIDED` entries or more is cut in
    whole rows along an earlier axis of at least two rows a step (``n`` a
    multiple of ``2 * every``: a slice of one row would look like a leaf
    read whole, whose leading axis of 1 `Stagnation.read_updates` masks),
    each row at least `BLOCK` entries: the head dim of a (heads, head dim,
    features) kernel. A shard along that axis then holds whole cycles only
    where the device count divides ``n // every``; the other axes can be
    sharded any way.
    """
    shape = shape or (1,)
    first = next(
        (axis for axis, n in enumerate(shape) if _block(n, every) is not None), None
    )
    if first is not None:
        n, rest = shape[first], math.prod(shape[first + 1 :])
        block = _block(n, every) or 1
        wide = 1
        while wide * rest < BLOCK and wide < BLOCK:
            wide *= 2
        if block * rest >= BLOCK:
            return first, block
        if n % (every * wide * ROWS) == 0:
            return first, wide
        if math.prod(shape) < STRIDED:
            return first, block
    elif math.prod(shape) < STRIDED:
        return None
    for axis, n in enumerate(shape[:-1]):
        if n % (2 * every) == 0 and math.prod(shape[axis + 1 :]) >= BLOCK:
            return axis, 1
    return None if first is None else (first, _block(shape[first], every) or 1)


def _read(
    x: jax.Array, phase: jax.Array, every: int, cut: tuple[int, int]
) -> jax.Array:
    """The entries of ``x`` read at ``phase`` (`read_phases`), the cut axis first.

    A dynamic slice of every ``every``-th block along the cut axis (no
    other axis is touched, and the cut one holds whole rows per shard: a
    leaf sharded along any axis is read where it lies, within `_cut`'s
    limit).
    """
    axis, block = cut
    n = x.shape[axis]
    split = x.shape[:axis] + (n // (every * block), every, block)
    y = jnp.reshape(x, split + x.shape[axis + 1 :])
    read = lax.dynamic_index_in_dim(y, phase, axis=axis + 1, keepdims=False)
    return jnp.moveaxis(read, axis, 0)
