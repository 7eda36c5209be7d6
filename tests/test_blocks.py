"""Which entries `jls.hooks.Stagnation` reads at each step (`jls.hooks._blocks`)."""

import jax.numpy as jnp
import numpy as np
import pytest
from blocks_model import read_phases

from jls.hooks._blocks import cut_axis, read_block


@pytest.mark.parametrize(
    ("shape", "every", "axis"),
    [
        ((1024, 512), 16, 0),  # the first axis, whole rows a step
        ((512, 768), 16, 0),
        ((768, 10), 16, 0),  # 768 = 3 * 256
        ((64, 4096), 16, 1),  # 64 rows: 4 a step, too few for 8 devices
        ((8, 64, 512), 16, 2),  # (heads, head dim, features)
        ((3, 3, 256, 256), 16, 2),  # a conv kernel, along C_in
        ((2048,), 16, 0),
        ((3, 3, 128, 128), 16, None),  # no axis of 256: read whole
        ((64, 64), 16, None),
        ((7, 3), 16, None),
        ((0, 512), 16, 1),  # an empty axis is not cut
        ((), 16, None),
        ((64, 64), 2, 0),  # 64 = 2 * 16 * 2
        ((96, 6), 3, 0),
        ((96, 6), 16, None),
    ],
)
def test_a_leaf_is_cut_along_its_first_axis_of_whole_rows_a_step(shape, every, axis):
    # The first axis whose length is a multiple of every * 16: a step reads a
    # multiple of 16 of its indices, so a shard along it over up to 16
    # devices holds whole runs of `every` and reads its own entries.
    assert cut_axis(shape, every) == axis


@pytest.mark.parametrize("every", [2, 3, 16])
@pytest.mark.parametrize(
    "shape",
    [(8, 64, 512), (64, 4096), (32, 4, 512), (512, 8, 64), (768, 10), (2048,), (96, 6)],
)
def test_the_slice_is_the_entries_read_phases_names(shape, every):
    # `read_block` (what the step slices) and `read_phases` (the numpy model the
    # tests count with) name the same entries at every phase, and each
    # entry once per cycle.
    cut = cut_axis(shape, every)
    ids = np.arange(np.prod(shape)).reshape(shape)
    phases = read_phases(shape, every)
    if cut is None:  # read whole, under a mask along the last axis
        assert (phases == np.arange(shape[-1]) % every).all()
        return
    seen = []
    for phase in range(every):
        got = np.asarray(read_block(jnp.asarray(ids), jnp.int32(phase), every, cut))
        # The cut axis first: never the leading 1 of a leaf read whole.
        assert got.shape[0] == shape[cut] // every >= 16
        assert sorted(got.ravel().tolist()) == sorted(ids[phases == phase].tolist())
        seen.extend(got.ravel().tolist())
    assert sorted(seen) == ids.ravel().tolist()


def test_a_scalar_is_read_whole_at_the_first_phase():
    assert read_phases((), 16).tolist() == [0]
