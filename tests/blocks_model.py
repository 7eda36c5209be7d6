"""A numpy model of which entries a hook reads at each step of its cycle."""

import numpy as np

from jls.hooks._blocks import cut_axis


def read_phases(shape: tuple[int, ...], every: int) -> np.ndarray:
    """The step of the cycle at which each entry is read (numpy, a model)."""
    shape = shape or (1,)
    cut = cut_axis(shape, every)
    axis = len(shape) - 1 if cut is None else cut
    view = [1] * len(shape)
    view[axis] = -1
    return np.broadcast_to((np.arange(shape[axis]) % every).reshape(view), shape)
