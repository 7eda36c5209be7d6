"""The measure of a value: its largest |x|, in float32, exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jls.precision._measure import measures

F32_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize(
    "dtype",
    [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float32],
)
def test_each_value_measures_its_largest_magnitude_in_its_own_dtype(dtype):
    xs = [jnp.array(v, dtype) for v in ([-3.0, 2.0], [0.5, -0.25], [7.0, 448.0])]
    tops = jax.jit(measures)(xs)
    expected = [float(jnp.max(jnp.abs(x.astype(jnp.float32)))) for x in xs]
    assert [float(t[0]) for t in tops] == expected
    assert all(t.dtype == jnp.float32 and t.shape == (1,) for t in tops)


def test_inf_and_nan_survive_and_a_complex_value_measures_its_modulus():
    xs = [jnp.array([1.0, -jnp.inf]), jnp.array([jnp.nan, 1.0])]
    inf, nan = (float(t[0]) for t in jax.jit(measures)(xs))
    assert inf == np.inf and np.isnan(nan)
    (z,) = measures([jnp.array([3 + 4j, 1j], jnp.complex64)])
    assert float(z[0]) == 5.0


def test_a_finite_float64_past_float32s_range_measures_float32s_maximum():
    with jax.enable_x64(True):
        xs = [jnp.array([1e300, 1.0]), jnp.array([-jnp.inf]), jnp.array([jnp.nan])]
        big, inf, nan = (float(jax.jit(measures)([x])[0][0]) for x in xs)
    assert big == F32_MAX and inf == np.inf and np.isnan(nan)
