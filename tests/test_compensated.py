"""Low-precision parameters: `compensated` and `stochastic_rounding`."""

# pyright: reportIndexIssue=false, reportAttributeAccessIssue=false
# pyright: reportArgumentType=false, reportOperatorIssue=false
# pyright: reportCallIssue=false

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

NARROW = [jnp.bfloat16, jnp.float16]


def _given():
    return optax.sgd(-1.0)  # update == gradient


def _spacing(x, dtype):
    """numpy: the spacing of ``dtype`` just above ``|x|`` (float64)."""
    info = ml_dtypes.finfo(dtype) if dtype == jnp.bfloat16 else np.finfo(dtype)
    x = np.abs(np.asarray(x, np.float64))
    _, e = np.frexp(x)
    top = np.where(x == 0, info.minexp, np.maximum(e - 1, info.minexp))
    return np.exp2(np.maximum(top - info.nmant, -126).astype(np.float64))


@given(
    dtype=st.sampled_from([jnp.bfloat16, jnp.float16, jnp.float32]),
    gap=st.integers(0, 40),
    bits=st.sampled_from([8, 16]),
    seed=st.integers(0, 2**16),
)
def test_apply_updates_lands_exactly_on_the_compensated_value(dtype, gap, bits, seed):
    # p in [1, 2) * 2**e; the update 2**-gap times smaller, either sign; a
    # compensation already in the buffer (a count of 2**-bits of p's
    # spacing). Reference: numpy, float64 sums of float32 values.
    rng = np.random.default_rng(seed)
    p = (rng.uniform(1, 2, 64) * 2.0 ** rng.integers(-8, 8, 64)).astype(dtype)
    u = (p.astype(np.float32) * rng.uniform(-1, 1, 64) * 2.0**-gap).astype(np.float32)
    top = 2 ** (bits - 1) - 1
    k = rng.integers(-top, top + 1, 64).astype(f"int{bits}")
    tx = jls.precision.compensated(_given(), buffer_dtype=f"int{bits}")
    state = tx.init(jnp.asarray(p))._replace(compensation=jnp.asarray(k))
    step, state = jax.jit(tx.update)(jnp.asarray(u), state, jnp.asarray(p))
    new = optax.apply_updates(jnp.asarray(p), step)
    c = k.astype(np.float64) * 2.0**-bits * _spacing(p, dtype)
    y = (u.astype(np.float64) + c).astype(np.float32)  # the sum float32 holds
    want = (p.astype(np.float32) + y).astype(dtype)

    def units_of(new):
        lost = y.astype(np.float64) - (new.astype(np.float64) - p.astype(np.float64))
        return np.round(lost / _spacing(new, dtype) * 2.0**bits)

    # A parameter that stayed, its lost part past the buffer's largest count
    # (the half): one place toward it.
    carry = (np.abs(units_of(want)) > top) & (want == p)
    toward = np.where(units_of(want) > 0, np.inf, -np.inf).astype(dtype)
    want = np.where(carry, np.nextafter(want, toward), want).astype(dtype)
    np.testing.assert_array_equal(np.asarray(new), want)
    assert new.dtype == dtype
    units = np.clip(units_of(want), -top, top)
    np.testing.assert_array_equal(np.asarray(state.compensation), units)
    assert state.compensation.dtype == np.dtype(f"int{bits}")


def _move(tx, dtype, size, steps):
    """The mean move of 8 parameters at 1 after ``steps`` updates of ``size``."""
    p = jnp.full(8, 1.0, dtype)
    g = jnp.full(8, -size, jnp.float32)  # sgd(1.0): the update is size

    @jax.jit
    def run(p, s):
        def body(carry, _):
            p, s = carry
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        return jax.lax.scan(body, (p, s), None, length=steps)[0][0]

    return float(np.mean(np.asarray(run(p, tx.init(p)), np.float64) - 1.0))


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("size", [2e-6, 1e-6, -2e-6, -1e-6])
def test_kahan_recovers_the_float32_move_at_steps_far_below_the_last_place(dtype, size):
    # |p| = 1: bfloat16's last place is 2**-7 (2**-8 below 1), 4000 times
    # these steps. A buffer in the parameter's dtype recovered 0% in
    # bfloat16 (it could not add them to itself). 100,000 steps: the move
    # (0.1 to 0.2) is 25 or more of the final parameter's half-spacings.
    steps = 100_000
    master = _move(optax.sgd(1.0), jnp.float32, size, steps)
    kahan = _move(jls.precision.compensated(optax.sgd(1.0)), dtype, size, steps)
    plain = _move(optax.sgd(1.0), dtype, size, steps)
    assert plain == 0.0  # every step rounded away
    assert 0.95 <= kahan / master <= 1.05, (kahan, master)


@pytest.mark.parametrize(("dtype", "bits"), [(jnp.bfloat16, 16), (jnp.float16, 8)])
def test_a_full_buffer_carries_the_half_over(dtype, bits):
    # The buffer's largest count is one unit short of half a place: a step
    # of 0.6 units on a full buffer still moves the parameter a place (it
    # used to stay, the buffer clipped, every later step of that size lost).
    top = 2 ** (bits - 1) - 1
    p = jnp.ones(4, dtype)
    spacing = float(jnp.finfo(dtype).eps)  # the spacing above 1
    tx = jls.precision.compensated(optax.sgd(-1.0), buffer_dtype=f"int{bits}")
    state = tx.init(p)._replace(compensation=jnp.full(4, top, f"int{bits}"))
    u = jnp.full(4, 0.6 * spacing * 2.0**-bits, jnp.float32)
    step, state = tx.update(u, state, p)
    new = optax.apply_updates(p, step)
    assert new.tolist() == [1.0 + spacing] * 4
    # What is left, half a place less a little, is kept (of the other sign).
    assert state.compensation.tolist() == [-top] * 4


def test_the_buffer_costs_what_its_dtype_says():
    params = {"w": jnp.ones((3, 5), jnp.bfloat16), "n": jnp.arange(2)}
    for buffer_dtype, itemsize in (("int16", 2), ("int8", 1), (jnp.int8, 1)):
        state = jls.precision.compensated(
            optax.sgd(1.0), buffer_dtype=buffer_dtype
        ).init(params)
        assert state.compensation["w"].dtype.itemsize == itemsize
        assert state.compensation["w"].shape == (3, 5)
        assert state.compensation["n"] is None
    for bad in ("float16", jnp.int32, None):
        with pytest.raises(ValueError, match="buffer_dtype must be 'int16' or 'int8'"):
            jls.precision.compensated(optax.sgd(1.0), buffer_dtype=bad)


@pytest.mark.parametrize("dtype", NARROW)
def test_a_jls_0_3_buffer_or_another_width_is_carried_over(dtype):
    # jls 0.3 kept the lost part itself, in the parameter's dtype; a state
    # restored from its checkpoint (or one made with the other buffer_dtype)
    # must continue with that part as a count, never read its bits as one.
    p = jnp.asarray([1.0, -3.0, 0.5, 1.0], dtype)
    part = np.asarray([0.25, -0.375, 0.125, 0.0])  # of each spacing
    spacing = _spacing(p, dtype)
    tx16 = jls.precision.compensated(_given())
    tx8 = jls.precision.compensated(_given(), buffer_dtype="int8")
    zero = jnp.zeros(4, dtype)
    want = (part * 2**16).astype(np.int16)
    old = tx16.init(p)._replace(compensation=jnp.asarray(part * spacing, dtype))
    counts8 = tx8.init(p)._replace(compensation=jnp.asarray(part * 2**8, jnp.int8))
    for tx, state in ((tx16, old), (tx16, counts8)):
        step, after = jax.jit(tx.update)(zero, state, p)
        assert after.compensation.dtype == jnp.int16
        np.testing.assert_array_equal(after.compensation, want)
        np.testing.assert_array_equal(step, np.zeros(4))
    step, after = tx8.update(zero, old, p)
    assert after.compensation.dtype == jnp.int8
    np.testing.assert_array_equal(after.compensation, (part * 2**8).astype(np.int8))


@pytest.mark.parametrize("dtype", NARROW)
def test_small_updates_accumulate_instead_of_vanishing(dtype):
    p0 = jnp.full(8, 1.0, dtype)
    lr, steps = 1e-4, 500  # each update far below half of 1's last place
    exact = 1.0 - lr * steps
    results = {}
    for name, tx in [
        ("plain", optax.sgd(lr)),
        ("kahan", jls.precision.compensated(optax.sgd(lr))),
        ("sr", jls.precision.stochastic_rounding(optax.sgd(lr))),
    ]:
        p, s = p0, tx.init(p0)
        update = jax.jit(tx.update)
        for _ in range(steps):
            u, s = update(jnp.ones(8, dtype), s, p)
            p = optax.apply_updates(p, u)
        results[name] = np.asarray(p, np.float64)
    ulp = float(jnp.finfo(dtype).eps)  # the spacing just below 1 is eps / 2
    assert np.all(results["plain"] == 1.0)  # every update rounded away
    assert np.all(np.abs(results["kahan"] - exact) <= ulp / 2)
    # Stochastic rounding is unbiased: the mean of 8 walks is close.
    assert abs(results["sr"].mean() - exact) < 4 * ulp


@pytest.mark.parametrize(
    "wrap", [jls.precision.compensated, jls.precision.stochastic_rounding]
)
@pytest.mark.parametrize("fused", [False, True])
def test_a_skipped_step_leaves_the_buffer_and_count_unchanged(wrap, fused):
    params = {"w": jnp.full((4, 4), 1.0, jnp.bfloat16), "b": jnp.ones(4, jnp.float32)}
    tx = jls.loss_scaling(wrap(optax.adam(1e-3)), jls.dynamic_scale(2.0**8))

    def step(g, s, p):
        if fused:
            return jls.apply_gradients(tx, g, s, p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(step)
    state = tx.init(params)
    g = jax.tree.map(lambda x: jnp.full(x.shape, 0.3 * 2**8, x.dtype), params)
    for _ in range(3):
        params, state = step(g, state, params)
    bad = {"w": g["w"].at[0, 0].set(jnp.inf), "b": g["b"]}
    new_params, new_state = step(bad, state, params)
    assert bool(jls.metrics(new_state)["skipped"])
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)


def test_the_fused_path_matches_tx_update():
    params = {"w": jnp.full((8, 8), 1.0, jnp.bfloat16), "b": jnp.ones(8, jnp.float16)}
    rng = np.random.default_rng(0)
    grads = [
        jax.tree.map(
            lambda x: jnp.asarray(rng.normal(size=x.shape) * 2**8, x.dtype), params
        )
        for _ in range(5)
    ]
    out = {}
    for fused in (False, True):
        tx = jls.loss_scaling(
            jls.precision.compensated(optax.sgd(1e-3)), jls.static_scale(2**8)
        )
        p, s = params, tx.init(params)
        fused_step = jax.jit(lambda g, s, p, tx=tx: jls.apply_gradients(tx, g, s, p))
        for g in grads:
            if fused:
                p, s = fused_step(g, s, p)
            else:
                u, s = jax.jit(tx.update)(g, s, p)
                p = optax.apply_updates(p, u)
        out[fused] = (p, s.inner_state)
    chex.assert_trees_all_equal(out[False], out[True])


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    x = jnp.asarray(np.linspace(1.0, 2.0, 101, dtype=np.float32)[1:-1])
    keys = jax.random.split(jax.random.key(0), 4000)
    rounded = jls.precision._compensated.round_stochastically
    draws = jax.vmap(lambda k: rounded(x, jnp.bfloat16, k))(keys)
    # The neighbours, from the bits: bfloat16 is float32's top 16 bits.
    bits = np.asarray(x).view(np.uint32) & np.uint32(0xFFFF0000)
    lo = bits.view(np.float32).astype(ml_dtypes.bfloat16)  # x > 0: toward 0
    hi = (bits + np.uint32(0x10000)).view(np.float32).astype(ml_dtypes.bfloat16)
    d = np.asarray(draws)
    assert np.all((d == lo) | (d == hi))
    mean = d.astype(np.float64).mean(0)
    spacing = hi.astype(np.float64) - lo.astype(np.float64)
    # The mean of 4000 draws is within 4 standard errors of x.
    assert np.all(np.abs(mean - np.asarray(x, np.float64)) <= 4 * spacing / 2 / 63)
    # A value bfloat16 holds is kept; inf and nan pass through.
    exact = jnp.asarray([1.0, 1.5, -3.0, np.inf, -np.inf, np.nan], jnp.float32)
    got = jls.precision._compensated.round_stochastically(exact, jnp.bfloat16, keys[0])
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(exact))


def test_stochastic_rounding_is_reproducible_and_keyed():
    params = jnp.full(256, 1.0, jnp.bfloat16)
    g = jnp.full(256, 1.0, jnp.bfloat16)

    def run(tx, **kw):
        s = tx.init(params)
        p = params
        for _ in range(3):
            u, s = jax.jit(tx.update)(g, s, p, **kw)
            p = optax.apply_updates(p, u)
        return p

    a = run(jls.precision.stochastic_rounding(optax.sgd(1e-3)))
    b = run(jls.precision.stochastic_rounding(optax.sgd(1e-3)))
    c = run(jls.precision.stochastic_rounding(optax.sgd(1e-3), seed=1))
    d = run(jls.precision.stochastic_rounding(optax.sgd(1e-3)), key=jax.random.key(7))
    chex.assert_trees_all_equal(a, b)
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    assert not np.array_equal(np.asarray(a), np.asarray(d))


def test_float32_parameters_are_updated_as_the_inner_says():
    params = {"w": jnp.ones(4, jnp.float32)}
    tx = jls.precision.stochastic_rounding(optax.sgd(0.1))
    u, _ = tx.update({"w": jnp.full(4, 0.3)}, tx.init(params), params)
    sgd = optax.sgd(0.1)
    want, _ = sgd.update({"w": jnp.full(4, 0.3)}, sgd.init(params), params)
    chex.assert_trees_all_equal(u, want)


def test_one_trace_per_step():
    traces = []
    params = jnp.ones(16, jnp.bfloat16)
    inner = jls.precision.stochastic_rounding(
        jls.precision.compensated(optax.adam(1e-3))
    )
    tx = jls.loss_scaling(inner, jls.no_scale())

    @jax.jit
    def step(g, s, p):
        traces.append(1)
        return jls.apply_gradients(tx, g, s, p)

    s = tx.init(params)
    for _ in range(5):
        params, s = step(jnp.ones(16, jnp.bfloat16), s, params)
    assert len(traces) == 1


@pytest.mark.parametrize(
    "wrap", [jls.precision.compensated, jls.precision.stochastic_rounding]
)
def test_the_parameters_are_required(wrap):
    tx = wrap(optax.sgd(0.1))
    params = jnp.ones(2, jnp.bfloat16)
    with pytest.raises(TypeError, match="needs the parameters"):
        tx.update(params, tx.init(params))


def test_a_finite_run_saturates_instead_of_overflowing():
    # Kahan's buffer would push 65504 + 16 to inf in float16 and then make
    # the buffer -inf and everything nan; plain rounding stays at 65504.
    tx = jls.precision.compensated(optax.sgd(1.0))
    p = jnp.asarray([65504.0], jnp.float16)
    s = tx.init(p)
    for _ in range(5):
        u, s = tx.update(jnp.asarray([-8.0], jnp.float16), s, p)
        p = optax.apply_updates(p, u)
        assert np.isfinite(np.asarray(p, np.float32)).all()
        assert np.isfinite(np.asarray(s.compensation, np.float32)).all()
    assert float(p[0]) == 65504.0


@pytest.mark.parametrize(
    ("dtype", "x", "want"),
    [
        (
            jnp.float16,
            [-65530.0, -70000.0, 65530.0, 70000.0],
            [-65504, -65504, 65504, 65504],
        ),
        (jnp.bfloat16, [-3.4e38, 3.4e38], [-3.3895314e38, 3.3895314e38]),
    ],
)
def test_stochastic_rounding_saturates_on_both_sides(dtype, x, want):
    rounded = jls.precision._compensated.round_stochastically
    for seed in range(4):
        got = rounded(jnp.asarray(x, jnp.float32), dtype, jax.random.key(seed))
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-7)


@pytest.mark.parametrize(
    "wrap", [jls.precision.compensated, jls.precision.stochastic_rounding]
)
def test_fp8_parameters_are_refused_and_python_floats_work(wrap):
    p = jnp.asarray([1.0, 2.0], jnp.float8_e4m3fn)
    tx = wrap(optax.sgd(0.5))
    with pytest.raises(TypeError, match="fp8 parameter"):
        tx.update(p, tx.init(p), p)
    params = {"a": 1.0, "w": jnp.ones(2, jnp.bfloat16)}
    u, _ = tx.update({"a": 1.0, "w": jnp.ones(2)}, tx.init(params), params)
    new = optax.apply_updates(params, u)
    assert float(new["a"]) == 0.5
