"""The measure `explain_step` takes of each value: its largest ``|x|``."""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

_F32 = np.dtype(np.float32)
# Values held to be measured together (the observer's log): at most ROW,
# fewer once they hold HOLD bytes (a large model's values are not kept), none
# on several devices (one reduction of values sharded differently gathers them).
ROW, HOLD = 32, 2**25
TOGETHER = contextvars.ContextVar("together", default=True)


def held_bytes(row: list) -> int:
    """The bytes of the values of ``(slot, value)`` pairs."""
    return sum(x.size * x.dtype.itemsize for _, x in row)


# The measures are written in lax, not jnp: each jnp function is a jit of
# its own, a function of its own in the program, and the program compiles
# several times slower.
def measures(xs: Sequence[Any]) -> list:
    """Each one's largest ``|x|``, float32 ``(1,)`` (no count of infs: slower).

    One reduction of arrays of one shape (one kernel compiles and runs faster
    than one each), a narrow float's in float32 (exact: the program is compiled
    without excess precision; float16 compiles slower on a CPU), whole (a
    sharded value is not reshaped). A finite value past float32's range
    measures float32's maximum.
    """
    wide = [lax.abs(lax.convert_element_type(x, _measured_in(x.dtype))) for x in xs]
    zeros, dims = [lax.full((), 0, w.dtype) for w in wide], tuple(range(xs[0].ndim))
    maxima = lambda a, b: [lax.max(x, y) for x, y in zip(a, b, strict=True)]  # noqa: E731
    tops = [lax.reshape(t, (1,)) for t in lax.reduce(wide, zeros, maxima, dims)]
    return [lax.convert_element_type(_clipped(t), _F32) for t in tops]


def _clipped(top: Any) -> Any:
    """A finite float64 ``top`` past float32's range as float32's maximum."""
    if top.dtype.itemsize <= 4:
        return top
    big = lax.full_like(top, np.finfo(_F32).max)
    return lax.select(lax.lt(top, lax.full_like(top, np.inf)), lax.min(top, big), top)


def _measured_in(dtype: Any) -> Any:
    """float32 for a float narrower (float16, bfloat16, fp8), else ``dtype``."""
    narrow = jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32
    return _F32 if narrow else dtype
