"""Validation, written once: each validator names the argument and the value."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jls import _validate as v


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: v.real("x", True), TypeError, "x must be a real number, got True"),
        (lambda: v.real("x", "1"), TypeError, "x must be a real number, got '1'"),
        (lambda: v.real("x", float("nan")), ValueError, "x must be finite, got nan"),
        (lambda: v.real("x", 10**400), ValueError, "x must be finite"),
        (lambda: v.real("x", np.ones(2)), TypeError, "x must be a scalar"),
        (lambda: v.positive_f32("x", -1.0), ValueError, "x must be positive"),
        (lambda: v.positive_f32("x", 1e-45), ValueError, "normal float32"),
        (lambda: v.positive_f32("x", 1e39), ValueError, "normal float32"),
        (lambda: v.integer("n", 2.0, 1), TypeError, "n must be an int, got 2.0"),
        (lambda: v.integer("n", 0, 1), ValueError, "n must be an int >= 1, got 0"),
        (lambda: v.integer("n", 9, 1, 5), ValueError, r"n must be an int in \[1, 5\]"),
        (lambda: v.factor("f", 0.99999999, below_one=True), ValueError, "rounds to 1"),
        (lambda: v.factor("f", 1e39, below_one=False), ValueError, "normal float32"),
        (
            lambda: v.factor("f", 2.0, below_one=True),
            ValueError,
            r"f must be in \(0, 1\]",
        ),
        (lambda: v.factor("f", 0.5, below_one=False), ValueError, "f must be >= 1"),
        (
            lambda: v.scale_in("s", 8.0, 1.0, 4.0),
            ValueError,
            r"\[min_scale, max_scale\]",
        ),
        (
            lambda: v.axis_names("a", ["x"]),
            TypeError,
            "a must be None, a str or a tuple",
        ),
        (lambda: v.flag("b", 1), TypeError, "b must be a bool, got 1"),
        (lambda: v.flag("b", "yes"), TypeError, "b must be a bool"),
    ],
)
def test_bad_values_are_refused_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_concrete_scalars_are_accepted_like_numbers():
    assert v.real("x", np.float32(2.5)) == 2.5
    assert v.real("x", jnp.float32(2.5)) == 2.5
    assert v.integer("n", np.int64(3), 1) == 3
    assert v.flag("b", np.bool_(True)) is True
    assert v.axis_names("a", "x") == ("x",) and v.axis_names("a", None) == ()
    assert v.state_dict_number("s", [np.float32(2.0)]) == 2.0
    assert v.state_dict_number("s", np.ones(1)) == 1.0


def test_traced_values_are_refused():
    def traced(x):
        v.real("x", x)
        return x

    with pytest.raises(TypeError, match="x must be a concrete number"):
        jax.jit(traced)(1.0)
