"""Which entries `jls.hooks.Stagnation` reads at each step (`jls.hooks._blocks`)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jls.hooks._blocks import _cut, _read, read_phases


@pytest.mark.parametrize(
    "shape",
    [(8, 64, 512), (3, 3, 128, 128), (512, 8, 64), (1024, 512), (64, 4096), (8192,)],
)
def test_each_step_reads_runs_of_a_cache_line_or_more(shape):
    # A step reads 1/16 of each leaf. Entries that lie every 16th in memory
    # touch every cache line of it, and cost what reading it whole costs: a
    # flax attention block's (heads, head dim, features) kernel, cut along
    # its last axis, made the read 1.69x its Adam step on XLA:CPU. Each
    # step's entries of a leaf of 64Ki entries or more (or with room for
    # wider blocks along its cut axis) are runs of at least 16 (a line of
    # float32) in memory, and every entry is read once per cycle.
    phases = read_phases(shape, 16).ravel()  # row-major: memory order
    starts = np.flatnonzero(np.diff(phases)) + 1
    runs = np.diff(np.concatenate([[0], starts, [phases.size]]))
    assert runs.min() >= 16, (shape, runs.min())
    assert np.bincount(phases).tolist() == [phases.size // 16] * 16


@pytest.mark.parametrize("every", [2, 3, 16])
@pytest.mark.parametrize(
    "shape",
    [(8, 64, 512), (64, 4096), (32, 4, 512), (512, 8, 64), (768, 10), (2048,), (96, 6)],
)
def test_the_slice_is_the_entries_read_phases_names(shape, every):
    # `_read` (what the step slices) and `read_phases` (the numpy model the
    # tests count with) name the same entries at every phase, each once.
    cut = _cut(shape, every)
    ids = np.arange(np.prod(shape)).reshape(shape)
    phases = read_phases(shape, every)
    if cut is None:  # read whole, under a mask along the last axis
        assert (phases == np.arange(shape[-1]) % every).all()
        return
    seen = []
    for phase in range(every):
        got = np.asarray(_read(jnp.asarray(ids), jnp.int32(phase), every, cut))
        assert sorted(got.ravel().tolist()) == sorted(ids[phases == phase].tolist())
        seen.extend(got.ravel().tolist())
    assert sorted(seen) == ids.ravel().tolist()


def test_small_leaves_keep_blocks_a_mesh_reads_where_they_lie():
    # Below 64Ki entries a leaf is not cut along an earlier axis (it would
    # be gathered when sharded along that axis: an adversarial review found
    # (64, 4096) kernels, conv kernels and (64, 64) leaves gathered on 8
    # devices); a leaf with room for wider blocks along its cut axis gets
    # them, 16 rows a step.
    assert _cut((64, 64), 16) is None
    assert _cut((3, 3, 64, 64), 16) is None
    assert _cut((96, 512), 16) == (1, 1)
    assert _cut((64, 4096), 16) == (1, 16)
    assert _cut((8, 64, 512), 16) == (1, 1)  # 256Ki entries: the head dim
