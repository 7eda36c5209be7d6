"""``scale_stats=True``: underflow fraction and headroom, against numpy."""

# pyright: reportIndexIssue=false, reportAttributeAccessIssue=false
# pyright: reportArgumentType=false, reportCallIssue=false

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jls


def _reference(grads, dtype):
    """(fraction below dtype's smallest normal, log2(dtype max / max |g|))."""
    info = ml_dtypes.finfo(dtype) if dtype == jnp.bfloat16 else np.finfo(dtype)
    flat = np.concatenate(
        [np.abs(np.asarray(g, np.float64)).ravel() for g in jax.tree.leaves(grads)]
    )
    tiny = float(np.float32(info.tiny))
    fraction = np.mean(flat.astype(np.float32) < np.float32(tiny))
    top = np.float32(flat.max())
    headroom = np.inf if top == 0 else np.log2(np.float32(info.max)) - np.log2(top)
    return fraction, headroom


@given(
    magnitude=st.integers(-30, 10),
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=4),
    leaf=st.sampled_from([jnp.float32, jnp.float16, jnp.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_the_statistics_match_numpy(magnitude, sizes, leaf, seed):
    rng = np.random.default_rng(seed)
    grads = {
        f"g{i}": jnp.asarray(
            rng.standard_normal(n) * 2.0 ** rng.integers(magnitude - 12, magnitude),
            leaf,
        )
        for i, n in enumerate(sizes)
    }
    params = jax.tree.map(jnp.zeros_like, grads)
    tx = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(1.0), scale_stats=True)
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    m = jls.metrics(state)
    fraction, headroom = _reference(grads, np.float16)
    np.testing.assert_allclose(float(m["underflow_fraction"]), fraction, rtol=1e-6)
    if np.isfinite(headroom):
        np.testing.assert_allclose(float(m["headroom_bits"]), headroom, rtol=1e-5)
    else:  # every gradient 0: infinite headroom
        assert float(m["headroom_bits"]) == np.inf


def test_a_larger_scale_lifts_gradients_out_of_underflow():
    # The same gradients at scales 1 and 2**16: the scaled ones underflow
    # float16 less, and the headroom is 16 bits smaller.
    rng = np.random.default_rng(0)
    unscaled = {"w": jnp.asarray(rng.standard_normal(1000) * 1e-6, jnp.float32)}
    params = jax.tree.map(jnp.zeros_like, unscaled)
    out = {}
    for scale in (1.0, 2.0**16):
        tx = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(scale), scale_stats=True)
        grads = jax.tree.map(lambda g, s=scale: g * s, unscaled)
        _, state = tx.update(grads, tx.init(params), params)
        out[scale] = jls.metrics(state)
    assert float(out[1.0]["underflow_fraction"]) > 0.9
    assert float(out[2.0**16]["underflow_fraction"]) < 0.01
    np.testing.assert_allclose(
        float(out[1.0]["headroom_bits"]) - float(out[2.0**16]["headroom_bits"]),
        16.0,
        rtol=1e-6,
    )


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_nonfinite_step_has_no_headroom_and_no_nan(bad):
    params = {"w": jnp.zeros(8)}
    tx = jls.loss_scaling(optax.adam(0.1), jls.dynamic_scale(2.0**4), scale_stats=True)
    state = tx.init(params)
    g = jnp.ones(8).at[2].set(bad)
    _, new = tx.update({"w": g}, state, params)
    m = jls.metrics(new)
    assert bool(m["skipped"])
    assert float(m["headroom_bits"]) == -np.inf
    assert np.isfinite(float(m["underflow_fraction"]))
    chex.assert_trees_all_equal(new.inner_state, state.inner_state)


def test_the_dtype_can_be_chosen_and_is_checked():
    params = {"w": jnp.zeros(4)}
    tx = jls.loss_scaling(optax.sgd(0.1), jls.no_scale(), scale_stats=jnp.bfloat16)
    g = {"w": jnp.asarray([1e-39, 1.0, 2.0, 4.0], jnp.float32)}
    _, state = tx.update(g, tx.init(params), params)
    m = jls.metrics(state)
    assert float(m["underflow_fraction"]) == 0.25  # 1e-39 < bfloat16's tiny
    np.testing.assert_allclose(
        float(m["headroom_bits"]),
        np.log2(np.float32(ml_dtypes.finfo(jnp.bfloat16).max)) - 2,
        rtol=1e-6,
    )
    for bad in ("int32", 3, "nope"):
        with pytest.raises(TypeError, match="scale_stats must be True or a floating"):
            jls.loss_scaling(optax.sgd(0.1), scale_stats=bad)


def test_one_trace_and_the_fused_path_agree():
    traces = []
    params = {"w": jnp.zeros((8, 8)), "b": jnp.zeros(8)}
    tx = jls.loss_scaling(optax.adam(0.1), scale_stats=True)

    @jax.jit
    def fused(g, s, p):
        traces.append(1)
        return jls.apply_gradients(tx, g, s, p)

    rng = np.random.default_rng(1)
    s_fused = s_update = tx.init(params)
    p_fused = p_update = params
    for _ in range(4):
        g = jax.tree.map(
            lambda x: jnp.asarray(rng.standard_normal(x.shape) * 2.0**10, x.dtype),
            params,
        )
        p_fused, s_fused = fused(g, s_fused, p_fused)
        _, s_update = jax.jit(tx.update)(g, s_update, p_update)
        chex.assert_trees_all_equal(
            s_fused.hooks["scale_stats"], s_update.hooks["scale_stats"]
        )
    assert len(traces) == 1


def test_wide_or_zeroless_dtypes_are_refused():
    for bad in ("float64", jnp.float8_e8m0fnu):
        with pytest.raises(TypeError, match="at most 32 bits that holds zero"):
            jls.loss_scaling(optax.sgd(0.1), scale_stats=bad)


def test_a_complex_gradient_near_the_maximum_keeps_its_headroom():
    # |3e38 + 3e38j| overflows float32; its larger component does not: the
    # step is finite, and so is its headroom against bfloat16.
    g = {"z": jnp.asarray([3e38 + 3e38j, 1.0], jnp.complex64)}
    p = {"z": jnp.zeros(2, jnp.complex64)}
    tx = jls.loss_scaling(optax.sgd(0.0), jls.no_scale(), scale_stats=jnp.bfloat16)
    _, s = tx.update(g, tx.init(p), p)
    m = jls.metrics(s)
    top = float(ml_dtypes.finfo(jnp.bfloat16).max)
    np.testing.assert_allclose(
        float(m["headroom_bits"]), np.log2(top) - np.log2(3e38), rtol=1e-5
    )
