"""Validators: a plain Python number or bool, or an error naming the argument."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
from jax.core import Tracer

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32
I32_MAX = int(np.iinfo(np.int32).max)


def _scalar(name: str, value: Any) -> Any:
    """Unwraps a concrete 0-d array into a numpy scalar; other values pass."""
    if isinstance(value, Tracer):
        raise TypeError(
            f"{name} must be a concrete number, not a traced value inside jit/vmap; "
            f"got {value!r:.200}"
        )
    if not isinstance(value, (numbers.Number, np.generic)) and hasattr(
        value, "__array__"
    ):  # numpy and JAX arrays, and other frameworks' tensors
        value = np.asarray(value)
        if value.shape != ():
            raise TypeError(
                f"{name} must be a scalar, got an array of shape "
                f"{value.shape}: {value!r:.200}"
            )
        return np.asarray(value)[()]
    return value


def _is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def real(name: str, value: Any) -> float:
    """A finite real number (not a bool)."""
    value = _scalar(name, value)
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond every float
        raise ValueError(f"{name} must be finite, got {value!r:.100}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return value


def to_f32(value: float) -> float:
    """``value`` rounded to float32 (inf past the float32 range), as a float."""
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(value))


def positive_f32(name: str, value: Any) -> float:
    """A positive real whose float32 rounding is a normal, finite float32."""
    value = real(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    if not F32_TINY <= to_f32(value) <= F32_MAX:
        raise ValueError(
            f"{name} must be representable as a normal float32 (between "
            f"{F32_TINY!r} and {F32_MAX!r}; XLA flushes subnormals to zero), "
            f"got {value!r}"
        )
    return value


def integer(name: str, value: Any, low: int, high: int = I32_MAX) -> int:
    """An integer (Python, numpy or a 0-d integer array) in ``[low, high]``."""
    value = _scalar(name, value)
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if not low <= value <= high:
        short = value < low and high == I32_MAX
        bounds = f">= {low}" if short else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {bounds}, got {value!r}")
    return value


def factor(name: str, value: Any, *, below_one: bool) -> float:
    """A scale factor, ``>= 1`` or in ``(0, 1]``, that stays itself in float32.

    ``1e39`` (inf) and ``0.99999999`` (rounds to 1) are refused.
    """
    value = real(name, value)
    if below_one and not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    if not below_one and value < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")
    f32 = to_f32(value)
    if not F32_TINY <= f32 <= F32_MAX:
        raise ValueError(
            f"{name} must be a normal float32 number, got {value!r} (float32: {f32!r})"
        )
    if (value == 1) != (f32 == 1):
        raise ValueError(
            f"{name} must differ from 1 in float32 if it differs from 1, got "
            f"{value!r}, which float32 rounds to 1.0 (the scale would never change)"
        )
    return value


def scale_in(name: str, value: Any, low: float, high: float) -> float:
    """A positive normal float32 scale whose float32 value is in ``[low, high]``."""
    value = positive_f32(name, value)
    if not low <= to_f32(value) <= high:
        raise ValueError(
            f"{name} must lie in the scaler's [min_scale, max_scale] = "
            f"[{low!r}, {high!r}], got {value!r}"
        )
    return value


def axis_names(name: str, value: Any) -> tuple[str, ...]:
    """``None``, a str or a non-empty tuple of str, as a tuple of str."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, tuple) and value and all(isinstance(a, str) for a in value):
        return value
    raise TypeError(f"{name} must be None, a str or a tuple of str, got {value!r}")


def flag(name: str, value: Any) -> bool:
    """A bool (Python or numpy); strings and numbers are refused."""
    value = _scalar(name, value)
    if not _is_bool(value):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def state_dict_number(name: str, value: Any) -> float:
    """A checkpoint's finite real, or an array or list of one (Paddle's tensor)."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if not isinstance(value, (numbers.Number, np.generic, str)) and hasattr(
        value, "__array__"
    ):
        array = np.asarray(value)
        if array.size == 1:
            value = array.reshape(())
    return real(name, value)
