"""``scale_stats=True``: underflow fraction and headroom, against numpy."""

# pyright: reportIndexIssue=false, reportAttributeAccessIssue=false
# pyright: reportArgumentType=false, reportCallIssue=false

import functools
import warnings

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
from jls._transformation import config_of


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
    with warnings.catch_warnings():
        # Scale 1 on purpose (the statistics of the gradients as they are):
        # float16 gradients there warn that they are unscaled.
        warnings.filterwarnings("ignore", "float16 gradients with a loss scale of 1")
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


def _run(scale_stats, grads_seq, donate=True):
    """Fused, jitted steps over ``grads_seq`` (donated or not); every step's results."""
    params = {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}
    tx = jls.loss_scaling(
        optax.adam(0.1), jls.dynamic_scale(2.0**4), scale_stats=scale_stats
    )
    traces = []

    @functools.partial(jax.jit, donate_argnums=(1, 2) if donate else ())
    def step(g, s, p):
        traces.append(1)
        return jls.apply_gradients(tx, g, s, p)

    state, out = tx.init(params), []
    for g in grads_seq:
        params, state = step(g, state, params)
        out.append(jax.tree.map(jnp.copy, (params, state)))  # kept: not donated
    return out, len(traces)


def _grads(n, seed=0):
    rng = np.random.default_rng(seed)
    seq = []
    for i in range(n):
        scale = 2.0 ** rng.integers(-30, 4)
        g = {
            "w": jnp.asarray(rng.standard_normal((4, 4)) * scale, jnp.float32),
            "b": jnp.asarray(rng.standard_normal(4) * scale, jnp.float32),
        }
        if i == 4:  # a non-finite step, measured or not
            g["b"] = g["b"].at[0].set(jnp.inf)
        seq.append(g)
    return seq


@pytest.mark.parametrize("donate", [True, False], ids=["donated", "undonated"])
@pytest.mark.parametrize("every", [2, 3])
def test_every_n_measures_one_step_in_n_and_holds_between(every, donate):
    # Whether the caller donates or not: there is no mode to declare.
    seq = _grads(9)
    each, _ = _run(True, seq, donate)
    sampled, traces = _run(jls.hooks.ScaleStats(every=every), seq, donate)
    assert traces == 1
    held = None
    for i, ((p1, s1), (p2, s2)) in enumerate(zip(each, sampled, strict=True)):
        # Training is unchanged, bitwise: parameters and every other state.
        chex.assert_trees_all_equal(p1, p2)
        chex.assert_trees_all_equal(s1.inner_state, s2.inner_state)
        chex.assert_trees_all_equal(s1.loss_scale, s2.loss_scale)
        got = s2.hooks["scale_stats"]
        if i % every == 0:  # measured: this step's statistics, as every=1's
            held = s1.hooks["scale_stats"][:2]
        chex.assert_trees_all_equal(tuple(got[:2]), tuple(held))
        assert int(got.phase) == (i + 1) % every


def test_every_is_checked_and_every_one_is_the_default():
    for bad in (0, -1, 2**31):
        with pytest.raises(ValueError, match="every must be an int"):
            jls.hooks.ScaleStats(every=bad)
    for bad in (1.5, True, "2"):
        with pytest.raises(TypeError, match="every must be an int"):
            jls.hooks.ScaleStats(every=bad)
    seq = _grads(3, seed=1)
    a, _ = _run(True, seq)
    b, _ = _run(jls.hooks.ScaleStats(jnp.float16, every=1), seq)
    chex.assert_trees_all_equal(a, b)


def test_every_n_is_accepted_without_donation():
    stats = jls.hooks.ScaleStats(every=4)
    for kwargs in ({"scale_stats": stats}, {"hooks": [stats]}):
        tx = jls.loss_scaling(optax.sgd(0.1), **kwargs)
        assert stats in config_of(tx).hooks


def test_every_n_agrees_across_replicas():
    # A named vmap: the measured step's collectives run inside the cond.
    params = {"w": jnp.ones(8)}
    tx = jls.loss_scaling(
        optax.sgd(0.1),
        jls.no_scale(),
        axis_name={"r": True},  # each replica's gradient its own: added
        scale_stats=jls.hooks.ScaleStats(every=2),
    )
    state = tx.init(params)
    g = jnp.stack([jnp.full(8, 1e-9), jnp.full(8, 1.0)])  # replica 0 all small

    def step(g, s):
        return tx.update({"w": g}, s, params)[1]

    batched = jax.vmap(step, in_axes=(0, None), axis_name="r", out_axes=0)
    out = batched(g, state)
    frac = out.hooks["scale_stats"].underflow_fraction
    np.testing.assert_array_equal(frac, [0.5, 0.5])  # 8 of 16, on both


def test_a_none_dtype_is_refused_as_none():
    with pytest.raises(TypeError, match="floating dtype, got None"):
        jls.hooks.ScaleStats(dtype=None)
