"""`jls.precision.scaled_state`: an optimizer's state in float16, scaled per array."""

# pyright: reportIndexIssue=false, reportAttributeAccessIssue=false
# pyright: reportArgumentType=false, reportCallIssue=false

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jls

ADAPTIVE = {
    "adam": optax.adam,
    "rmsprop": optax.rmsprop,
    "adadelta": optax.adadelta,
    "adan": optax.adan,
    "novograd": optax.novograd,
}


@pytest.mark.parametrize("name", sorted(ADAPTIVE))
def test_a_zero_gradient_float16_step_gives_no_nan(name):
    params = {"w": jnp.ones((4, 3), jnp.float16), "b": jnp.ones(3, jnp.float16)}
    zeros = jax.tree.map(jnp.zeros_like, params)
    small = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    tx = jls.precision.scaled_state(ADAPTIVE[name](1e-3))  # optax's default eps
    state = tx.init(params)
    for g in (zeros, small, zeros):
        updates, state = jax.jit(tx.update)(g, state, params)
        assert jls.all_finite(updates), (name, updates)
        assert jls.all_finite(state)
        params = optax.apply_updates(params, updates)
        assert jls.all_finite(params)


# novograd's float16 zero-gradient step is nan with optax 0.2.8 but not with
# the floor's 0.2.5: the premise is checked where it holds on every version.
@pytest.mark.parametrize("name", ["adam", "rmsprop", "adan"])
def test_without_it_the_same_float16_step_is_nan(name):
    # What the wrapper fixes (optax #1754, #1769, #1784, #1789, #1790).
    params = {"w": jnp.ones((4, 3), jnp.float16), "b": jnp.ones(3, jnp.float16)}
    tx = ADAPTIVE[name](1e-3)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
    assert not jls.all_finite(updates)


def test_the_state_is_float16_with_a_power_of_two_scale_per_array():
    params = {"w": jnp.ones((8, 4), jnp.float16), "b": jnp.ones(4, jnp.float16)}
    tx = jls.precision.scaled_state(optax.adam(1e-3))
    grads = {"w": jnp.full((8, 4), 3e-4, jnp.float16), "b": jnp.full(4, 60.0)}
    _, state = tx.update(grads, tx.init(params), params)
    adam = state.inner_state[0]
    assert adam.count.dtype == jnp.int32  # integer leaves as they are
    for leaf in (adam.mu["w"], adam.mu["b"], adam.nu["w"], adam.nu["b"]):
        assert leaf.dtype == jnp.float16
    assert len(state.scales) == 4
    for scale in state.scales:
        mantissa, _ = np.frexp(float(scale))
        assert scale.dtype == jnp.float32 and mantissa == 0.5
    # Each array's largest entry sits in [2**14, 2**15) once divided.
    stored = [adam.mu["b"], adam.mu["w"], adam.nu["b"], adam.nu["w"]]
    for leaf in stored:
        top = float(jnp.max(jnp.abs(leaf.astype(jnp.float32))))
        assert 2**14 <= top < 2**15
    # 1e-3 * (3e-4)**2 = 9e-11: 0 in float16, held here.
    assert float(state.decoded()[0].nu["w"][0, 0]) == pytest.approx(9e-11, rel=1e-3)


def test_it_follows_float32_adam():
    rng = np.random.default_rng(0)
    target = jnp.asarray(rng.normal(size=(64,)) * 0.1, jnp.float32)

    def loss(p):
        return jnp.sum((p.astype(jnp.float32) - target) ** 2) * 1e-3  # small grads

    runs = {}
    for name, tx, dtype in [
        ("float32", optax.adam(1e-2), jnp.float32),
        ("scaled", jls.precision.scaled_state(optax.adam(1e-2)), jnp.float32),
    ]:
        p = jnp.zeros(64, dtype)
        s = tx.init(p)
        step = jax.jit(
            lambda p, s, tx=tx: (lambda u, s: (optax.apply_updates(p, u), s))(
                *tx.update(jax.grad(loss)(p), s, p)
            )
        )
        for _ in range(200):
            p, s = step(p, s)
        runs[name] = np.asarray(p)
    # float16 storage: each moment to 11 bits; the paths agree closely.
    np.testing.assert_allclose(runs["scaled"], runs["float32"], atol=2e-3)
    np.testing.assert_allclose(runs["scaled"], np.asarray(target), atol=5e-3)


def _spike_grads(ratio, shape, steps=40):
    """Entries at ``ratio`` of a spike of 1 in one row at step 5 that decays."""
    rng = np.random.default_rng(0)
    g = ratio * rng.choice([-1.0, 1.0], shape) * rng.uniform(0.5, 1.5, (steps, *shape))
    spike = np.maximum(0.7 ** (np.arange(steps) - 5.0), ratio)
    g[5:, 0] = np.sign(g[5:, 0]) * spike[5:, None]
    return jnp.asarray(g, jnp.float32)


def _moves(tx, gs):
    """The sum of ``tx``'s updates per entry (Adam's do not read the parameters)."""
    p = jnp.zeros(gs.shape[1:])

    def step(carry, g):
        u, s = tx.update(g, carry[1], p)
        return (carry[0] + u, s), None

    return np.asarray(jax.lax.scan(step, (p, tx.init(p)), gs)[0][0])


@pytest.mark.parametrize("shape", [(4, 64), (64, 1)])  # a spike in a row, an entry
def test_it_follows_float32_adam_inside_one_array(shape):
    # One scale per array put an entry at 2**-20 of its array's largest
    # gradient at 2**-40 in the second moment: flushed, it moved 2x and more.
    for k in (8, 16, 20, 24):
        gs = _spike_grads(2.0**-k, shape)
        ref = _moves(optax.adam(1.0), gs)
        tx = jls.precision.scaled_state(optax.adam(1.0))
        got = _moves(tx, gs)
        np.testing.assert_allclose(got / ref, 1.0, atol=0.05, err_msg=f"2**-{k}")


def test_an_array_beyond_float16s_range_is_held_as_signed_square_roots():
    params = jnp.ones((2, 64), jnp.float16)
    tx = jls.precision.scaled_state(optax.adam(1e-3))
    g = jnp.full((2, 64), 2.0**-24, jnp.float32).at[0].set(-1.0)
    _, state = tx.update(g, tx.init(params), params)
    nu, (mu_scale, nu_scale) = state.inner_state[0].nu, state.scales
    # mu's range (2**-24) fits float16's normal range: stored as it is.
    assert float(mu_scale) > 0 and np.frexp(float(mu_scale))[0] == 0.5
    # nu's (2**-48) does not: signed square roots, flagged by a negative scale.
    assert float(nu_scale) < 0 and np.frexp(float(nu_scale))[0] == -0.5
    top = float(jnp.max(jnp.abs(nu.astype(jnp.float32))))
    assert 2**14 <= top < 2**15
    root = np.asarray(nu, np.float32) * np.float32(-nu_scale)
    decoded = state.decoded()[0]
    np.testing.assert_array_equal(decoded.nu, root * np.abs(root))  # exact
    want = optax.adam(1e-3).update(g, optax.adam(1e-3).init(g), g)[1][0]
    np.testing.assert_allclose(decoded.nu, want.nu, rtol=2**-10)  # was 0 at 2**-48
    np.testing.assert_allclose(decoded.mu, want.mu, rtol=2**-11)


def _encode_0_4(tree):
    """The storage of jls 0.4 (a2c8b71): each array as it is, its scale positive."""
    leaves, scales = [], []
    for x in jax.tree.leaves(tree):
        if np.ndim(x) == 0:
            leaves.append(x)
            continue
        _, e = np.frexp(np.max(np.abs(x)))
        scales.append(jnp.float32(2.0 ** (int(e) - 15)))
        leaves.append(jnp.asarray(x / scales[-1], jnp.float16))
    return jax.tree.unflatten(jax.tree.structure(tree), leaves), tuple(scales)


def test_a_0_4_checkpoint_restores_and_steps_as_it_did(tmp_path):
    params = {"w": jnp.ones((4, 8), jnp.float16)}
    g = {"w": jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32).reshape(4, 8)}
    adam = optax.adam(1e-3)
    wide = adam.update(g, adam.init(g), g)[1]
    old = jls.precision.ScaledState(*_encode_0_4(wide))
    tx = jls.precision.scaled_state(adam)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp_path.absolute() / "ckpt", old)
    with ocp.StandardCheckpointer() as ckptr:
        raw = ckptr.restore(tmp_path.absolute() / "ckpt")
    state = jls.upgrade_state(raw, tx.init(params))
    chex.assert_trees_all_equal(state, old)
    mu, nu = (
        {"w": m["w"].astype(jnp.float32) * s}
        for m, s in zip(old[0][0][1:], old[1], strict=True)
    )
    decoded = old.inner_state[0]._replace(mu=mu, nu=nu)
    chex.assert_trees_all_equal(state.decoded()[0], decoded)
    # The next step is 0.4's: Adam in float32 on ``stored * scale``.
    want = adam.update(g, (decoded, old.inner_state[1]), params)[0]
    chex.assert_trees_all_equal(tx.update(g, state, params)[0], want)


@pytest.mark.parametrize("fused", [False, True])
def test_a_skipped_step_leaves_the_scaled_state_unchanged(fused):
    params = {"w": jnp.ones((4, 4), jnp.float16)}
    tx = jls.loss_scaling(
        jls.precision.stochastic_rounding(jls.precision.scaled_state(optax.adam(1e-3))),
        jls.dynamic_scale(2.0**8),
    )

    def step(g, s, p):
        if fused:
            return jls.apply_gradients(tx, g, s, p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(step)
    state = tx.init(params)
    g = {"w": jnp.full((4, 4), 0.3 * 2**8, jnp.float16)}
    for _ in range(3):
        params, state = step(g, state, params)
    bad = {"w": g["w"].at[0, 0].set(jnp.inf)}
    new_params, new_state = step(bad, state, params)
    assert bool(jls.metrics(new_state)["skipped"])
    chex.assert_trees_all_equal(new_params, params)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)


def test_one_trace_and_scalar_hyperparameters_stay_float32():
    traces = []
    params = jnp.ones(16, jnp.float16)
    inner = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    tx = jls.loss_scaling(jls.precision.scaled_state(inner), jls.dynamic_scale())

    @jax.jit
    def step(g, s, p):
        traces.append(1)
        return jls.apply_gradients(tx, g, s, p)

    s = tx.init(params)
    for _ in range(4):
        params, s = step(jnp.full(16, 2.0**10, jnp.float16), s, params)
    assert len(traces) == 1
    hyper = s.inner_state.inner_state.hyperparams["learning_rate"]
    # optax stores it in the parameters' dtype; the wrapper keeps it float32.
    assert hyper.dtype == jnp.float32 and float(hyper) == float(jnp.float16(1e-3))


def test_the_state_costs_half_of_float32():
    params = {"w": jnp.ones((64, 32), jnp.float16), "b": jnp.ones(32, jnp.float16)}

    def nbytes(tree):
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))

    wide = optax.adam(1e-3, mu_dtype=jnp.float32).init(
        jax.tree.map(lambda p: p.astype(jnp.float32), params)
    )
    scaled = jls.precision.scaled_state(optax.adam(1e-3)).init(params)
    # Two float16 moments, a scale per moment array, the int32 count.
    assert nbytes(scaled) == 2 * 2 * (64 * 32 + 32) + 4 * 4 + 4
    assert nbytes(scaled) < 0.51 * nbytes(wide)


def test_a_bad_dtype_is_refused_by_name():
    for bad in ("float32", jnp.int8, None, "nonsense"):
        with pytest.raises(ValueError, match="dtype must be 'float16' or 'bfloat16'"):
            jls.precision.scaled_state(optax.adam(1e-3), dtype=bad)
    state = jls.precision.scaled_state(optax.adam(1e-3), dtype="bfloat16").init(
        jnp.ones(3)
    )
    assert state.inner_state[0].mu.dtype == jnp.bfloat16
