"""Adversarial tests: every promise, tried as a user, a bad input or a compiler.

Each test names the defect of issue 10 it covers (``test_<n>_...``); each
failed on jls 0.1.
"""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jls

F32_MAX = float(np.finfo(np.float32).max)


def _bits(tree):
    """Every leaf's bit pattern, so -0.0 != 0.0 and nan payloads count."""
    out = []
    for x in jax.tree.leaves(tree):
        x = np.asarray(x)
        inexact = jnp.issubdtype(x.dtype, jnp.inexact)  # bfloat16's kind is "V"
        out.append(x.view(f"u{x.dtype.itemsize}") if inexact else x)
    return out


def assert_bitwise_equal(a, b):
    for x, y in zip(_bits(a), _bits(b), strict=True):
        np.testing.assert_array_equal(x, y)


def _update_step(tx):
    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def _fused_step(tx):
    return jax.jit(lambda p, s, g: jls.apply_gradients(tx, g, s, p))


PATHS = {"update": _update_step, "fused": _fused_step}


# 1. The check reads exactly the values the optimizer consumes -------------


@pytest.mark.parametrize("path", ["update", "fused"])
def test_1_issue_example_fused_producer_is_skipped(path):
    a = jnp.array([1.5e29, -3.5e29])
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**30))

    @jax.jit
    def step(p, s):
        g = jax.grad(lambda q: jls.scale_loss(jnp.sum(q * a), s))(p)
        if path == "fused":
            return jls.apply_gradients(tx, g, s, p)
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    params, state = step(jnp.zeros(2), tx.init(jnp.zeros(2)))
    assert_bitwise_equal(params, jnp.zeros(2))
    assert bool(jls.metrics(state)["skipped"])


def _producers():
    """Gradients built in the same jit by ops XLA fuses into reductions."""
    return {
        "scalar_mul": lambda a, b, c: [a * c],
        "mul_add": lambda a, b, c: [a * c + b],
        "sum_of_products": lambda a, b, c: [a * c - b * c],
        "several_leaves": lambda a, b, c: [a * c, (b * c).astype(jnp.bfloat16), b],
        "f16_from_f32": lambda a, b, c: [(a * c).astype(jnp.float16), a],
        "outer": lambda a, b, c: [jnp.outer(a, b * c).ravel()],
    }


@pytest.mark.parametrize("producer", list(_producers()))
def test_1_decision_equals_truth_on_the_stored_gradients(producer):
    make = _producers()[producer]

    @jax.jit
    def run(a, b, c):
        grads = make(a, b, c)
        return grads, jls.all_finite(grads)

    rng = np.random.default_rng(0)
    mismatches = []
    for trial in range(200):
        exp = rng.uniform(25, 38.6)
        a = jnp.asarray(rng.choice([-1, 1], 4) * 10.0 ** rng.uniform(exp - 1, exp, 4))
        b = jnp.asarray(rng.choice([-1, 1], 4) * 10.0 ** rng.uniform(exp - 1, exp, 4))
        c = jnp.float32(2.0 ** rng.integers(-4, 30))
        grads, decision = run(a.astype(jnp.float32), b.astype(jnp.float32), c)
        truth = all(bool(np.all(np.isfinite(np.asarray(g)))) for g in grads)
        if bool(decision) != truth:
            mismatches.append((trial, a, b, c))
    assert not mismatches, mismatches[:3]


@pytest.mark.parametrize("path", ["update", "fused"])
def test_1_unscaled_overflow_below_scale_one_in_the_same_jit(path):
    # torch's preset goes below 1; the gradient is produced in the step.
    tx = jls.loss_scaling(optax.sgd(1.0), jls.presets.torch(init_scale=0.25))
    a = jnp.array([3.0e38, 1.0], jnp.float32)

    @jax.jit
    def step(p, s, c):
        g = jax.grad(lambda q: jls.scale_loss(jnp.sum(q * a * c), s))(p)
        if path == "fused":
            return jls.apply_gradients(tx, g, s, p)
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    # The scaled gradient, 0.25 * 2 * 3e38, is finite; unscaled it is inf.
    params, state = step(jnp.zeros(2), tx.init(jnp.zeros(2)), jnp.float32(2.0))
    assert_bitwise_equal(params, jnp.zeros(2))
    assert bool(jls.metrics(state)["skipped"])


# 2 and 3. The scale in the state is checked against the scaler -------------


def _one_step(tx, state, path, grads=None):
    params = {"w": jnp.array([1.0, -2.0])}
    grads = {"w": jnp.array([1.0, 1.0])} if grads is None else grads
    return PATHS[path](tx)(params, state, grads), params


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(
    "bad", [0.25, 0.0, -4.0, np.inf, -np.inf, np.nan, 2.0**100], ids=str
)
def test_2_a_scale_outside_the_scalers_range_is_never_used(path, bad):
    scaler = jls.dynamic_scale(2.0**4, max_scale=2.0**20)  # min_scale=1
    tx = jls.loss_scaling(optax.sgd(0.1), scaler)
    state = tx.init({"w": jnp.zeros(2)})
    # As if from a checkpoint or a user's hand: no setter checks it.
    state = state._replace(loss_scale=state.loss_scale._replace(scale=jnp.float32(bad)))
    (params, new), old = _one_step(tx, state, path)
    assert_bitwise_equal(params, old)
    m = jls.metrics(new)
    assert bool(m["skipped"]) and bool(m["nonfinite"])
    scale = float(m["loss_scale"])
    assert 1.0 <= scale <= 2.0**20, scale


def test_2_setters_refuse_concrete_bad_scales():
    state = jls.loss_scaling(optax.sgd(0.1)).init({"w": jnp.zeros(2)})
    for bad in (0.0, -1.0, np.inf, np.nan, 1e-45):
        with pytest.raises(ValueError, match="scale"):
            jls.set_loss_scale(state, bad)
        with pytest.raises(ValueError, match="scale"):
            jls.set_loss_scale(
                state, jls.dynamic_scale().init()._replace(scale=jnp.float32(bad))
            )
    with pytest.raises(ValueError, match="min_scale, max_scale"):
        jls.set_loss_scale(state, 0.25, scaler=jls.dynamic_scale())


@pytest.mark.parametrize("path", list(PATHS))
def test_2_set_then_step_under_min_scale_one_never_applies_overflow(path):
    tx = jls.loss_scaling(optax.sgd(1.0), jls.dynamic_scale(2.0**4))
    state = jls.set_loss_scale(tx.init({"w": jnp.zeros(2)}), 0.25)
    # Finite when scaled, overflowing when unscaled by 0.25.
    grads = {"w": jnp.array([3.0e38, 1.0])}
    (params, new), old = _one_step(tx, state, path, grads)
    assert_bitwise_equal(params, old)
    assert float(jls.metrics(new)["loss_scale"]) == 1.0


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("bad", [0.0, -1.0, np.inf, np.nan])
def test_2_traced_set_loss_scale_keeps_the_old_scale(path, bad):
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0**4))

    @jax.jit
    def step(params, state, grads, new_scale):
        state = jls.set_loss_scale(state, new_scale)
        if path == "fused":
            return jls.apply_gradients(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = {"w": jnp.array([1.0, -2.0])}
    grads = {"w": jnp.array([16.0, 16.0])}
    new_params, state = step(params, tx.init(params), grads, jnp.float32(bad))
    np.testing.assert_array_equal(new_params["w"], np.float32([0.9, -2.1]))
    assert float(jls.metrics(state)["loss_scale"]) == 16.0


@pytest.mark.parametrize("path", list(PATHS))
def test_3_scale_one_scalers_never_apply_a_scaled_update(path):
    params = {"w": jnp.array([1.0, -2.0])}
    sd = {
        "scale": 1024.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 10,
        "_growth_tracker": 0,
    }
    paddle_sd = jls.presets.to_state_dict(
        jls.presets.paddle(),
        jls.presets.paddle(init_loss_scaling=1024.0).init(),
        framework="paddle",
    )
    cases = {
        "no_scale_set_1024": (
            jls.no_scale(),
            jls.set_loss_scale(jls.no_scale().init(), 1024.0),
        ),
        "torch_disabled": jls.presets.from_state_dict(
            sd, enabled=False, framework="torch"
        ),
        "paddle_disabled": jls.presets.from_state_dict(
            paddle_sd, enable=False, framework="paddle"
        ),
    }
    for name, (scaler, ls_state) in cases.items():
        tx = jls.loss_scaling(optax.sgd(0.5), scaler)
        state = jls.set_loss_scale(tx.init(params), ls_state)
        step = PATHS[path](tx)
        p = params
        for _ in range(3):
            # The caller scales with the state's scale, as the README says.
            grads = jax.grad(lambda q, s=state: jls.scale_loss(jnp.sum(q["w"]), s))(p)
            p, state = step(p, state, grads)
        # Any step that was applied moved w by exactly 0.5 (1x, never 1024x).
        moved = np.asarray(params["w"] - p["w"])
        assert np.all(np.isin(moved, [0.5, 1.0, 1.5])), (name, moved)
        assert float(jls.metrics(state)["loss_scale"]) == 1.0, name


# 4. Retries are attempts, not steps --------------------------------------


def _overflowing_loss(params, x):
    # Overflows in float16 above scale 2**10: the backward pass is float16.
    return jnp.sum((params.astype(jnp.float16) * x.astype(jnp.float16)) * 64.0)


def test_4_retries_are_not_counted_as_skips():
    tx = jls.loss_scaling(
        optax.sgd(0.0), jls.dynamic_scale(2.0**14), max_consecutive_skips=2
    )
    step = jax.jit(jls.train_step(_overflowing_loss, tx, max_retries=8))
    params = jnp.ones(2)
    state = tx.init(params)
    params, state, out = step(params, state, jnp.ones(2))
    m = jls.metrics(state)
    assert not bool(out.skipped) and int(out.retries) == int(m["retries"]) > 0
    assert int(m["total_skips"]) == 0 and int(m["consecutive_skips"]) == 0
    assert int(1 - jls.metrics(state)["total_skips"]) == 1
    assert not bool(m["diverged"])
    jls.hooks.raise_if_diverged(state)  # one bad batch is not a divergence


@pytest.mark.parametrize(
    "scaler",
    [
        jls.static_scale(2.0**14),
        jls.presets.megatron(initial_scale=2.0**14, hysteresis=3),
        jls.presets.paddle(init_loss_scaling=2.0**14, decr_every_n_nan_or_inf=2),
        jls.dynamic_scale(2.0**14, min_scale=2.0**14),
    ],
    ids=["static", "hysteresis", "backoff_interval", "at_min_scale"],
)
def test_4_no_retry_that_cannot_change_the_outcome(scaler):
    tx = jls.loss_scaling(optax.sgd(0.0), scaler)
    step = jax.jit(jls.train_step(_overflowing_loss, tx, max_retries=5))
    params = jnp.ones(2)
    _, state, out = step(params, tx.init(params), jnp.ones(2))
    assert int(out.retries) == 0 and bool(out.skipped)
    assert int(jls.metrics(state)["total_skips"]) == 1


def test_4_an_out_of_range_scale_is_dropped_not_retried():
    tx = jls.loss_scaling(optax.sgd(1.0), jls.dynamic_scale(2.0**8, max_scale=2.0**12))
    step = jax.jit(jls.train_step(lambda p, x: jnp.sum(p * x), tx, max_retries=4))
    params = jnp.zeros(2)
    state = tx.init(params)
    state = state._replace(
        loss_scale=state.loss_scale._replace(scale=jnp.float32(2**20))
    )
    new, state, out = step(params, state, jnp.ones(2))
    assert bool(out.skipped) and int(out.retries) == 0
    assert_bitwise_equal(new, params)
    assert float(out.next_loss_scale) == 2.0**12


def test_4_spent_hysteresis_retries_and_counts_one_step():
    scaler = jls.presets.megatron(initial_scale=2.0**14, hysteresis=2)
    tx = jls.loss_scaling(optax.sgd(0.0), scaler)
    step = jax.jit(jls.train_step(_overflowing_loss, tx, max_retries=8))
    params = jnp.ones(2)
    state = tx.init(params)
    _, state, out = step(params, state, jnp.ones(2))  # spends the hysteresis
    assert int(out.retries) == 0 and bool(out.skipped)
    _, state, out = step(params, state, jnp.ones(2))  # now backs off each retry
    assert int(out.retries) > 0 and not bool(out.skipped)
    assert int(jls.metrics(state)["total_skips"]) == 1


# 5. Divergence is exact under vmap / scan / pmap and catchable ------------


def _diverging_tx(limit=3):
    return jls.loss_scaling(
        optax.sgd(0.1), jls.dynamic_scale(2.0**4), max_consecutive_skips=limit
    )


def test_5_no_divergence_on_finite_steps_under_vmap():
    tx = _diverging_tx()
    params = jnp.zeros((4, 2))
    states = jax.vmap(tx.init)(params)
    step = jax.jit(jax.vmap(lambda p, s, g: jls.apply_gradients(tx, g, s, p)))
    for _ in range(5):
        params, states = step(params, states, jnp.ones((4, 2)))
    jls.hooks.raise_if_diverged(states)
    assert not np.any(np.asarray(jls.metrics(states)["diverged"]))


def test_5_vmap_member_that_diverges_raises_catchable_error():
    tx = _diverging_tx()
    params = jnp.zeros((4, 2))
    states = jax.vmap(tx.init)(params)
    grads = jnp.ones((4, 2)).at[2].set(jnp.nan)  # member 2 always overflows
    step = jax.jit(jax.vmap(lambda p, s, g: jls.apply_gradients(tx, g, s, p)))
    for _ in range(3):
        params, states = step(params, states, grads)
    np.testing.assert_array_equal(
        jls.metrics(states)["diverged"], [False, False, True, False]
    )
    with pytest.raises(jls.hooks.DivergenceError, match="3 consecutive skipped steps"):
        jls.hooks.raise_if_diverged(states)


def test_5_a_breach_inside_scan_is_not_lost_by_a_later_recovery():
    tx = _diverging_tx(limit=2)
    grads = jnp.stack([jnp.full(2, jnp.nan)] * 2 + [jnp.ones(2)] * 3)

    @jax.jit
    def run(params, state):
        def body(carry, g):
            p, s = carry
            return jls.apply_gradients(tx, g, s, p), None

        return lax.scan(body, (params, state), grads)[0]

    params, state = run(jnp.zeros(2), tx.init(jnp.zeros(2)))
    assert int(jls.metrics(state)["consecutive_skips"]) == 0
    with pytest.raises(jls.hooks.DivergenceError):
        jls.hooks.raise_if_diverged(state)


def test_5_pmap_and_checkify():
    from jax.experimental import checkify

    tx = _diverging_tx(limit=1)
    n = jax.local_device_count()
    params = jnp.zeros((n, 2))
    states = jax.pmap(tx.init)(params)
    step = jax.pmap(lambda p, s, g: jls.apply_gradients(tx, g, s, p))
    params, states = step(params, states, jnp.full((n, 2), jnp.nan))
    with pytest.raises(jls.hooks.DivergenceError):
        jls.hooks.raise_if_diverged(states)

    def checked(p, s, g):
        p, s = jls.apply_gradients(tx, g, s, p)
        jls.hooks.raise_if_diverged(s)
        return p, s

    f = jax.jit(checkify.checkify(jax.vmap(checked)))
    states = jax.vmap(tx.init)(params)
    err, _ = f(params, states, jnp.ones((n, 2)))
    assert err.get() is None
    err, _ = f(params, states, jnp.full((n, 2), jnp.nan))
    assert "diverged" in err.get()


def test_5_raise_if_diverged_needs_a_limit():
    tx = jls.loss_scaling(optax.sgd(0.1), max_consecutive_skips=None)
    state = tx.init(jnp.zeros(2))
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        jls.hooks.raise_if_diverged(state)
    jls.hooks.raise_if_diverged(state, 3)


# 6. Accumulation has no false positives ----------------------------------


@pytest.mark.parametrize("k", [2, 3, 4, 8])
def test_6_accumulated_mean_near_float32_max_is_not_skipped(k):
    n = 24
    big = 0.75 * F32_MAX  # the mean gradient; any two summed overflow

    def loss_fn(p, x):  # the mean over the rows, with no overflow of its own
        return jnp.sum(p * jnp.sum(x / x.shape[0], axis=0))

    # A normal learning rate: 1e-38 is a float32 subnormal, flushed to zero
    # by some XLA versions in one program and not the other.
    tx = jls.loss_scaling(optax.sgd(1e-30), jls.static_scale(1.0))
    batch = jnp.full((n, 2), big, jnp.float32)
    params = jnp.zeros(2)
    plain = jax.jit(jls.train_step(loss_fn, tx))
    accum = jax.jit(jls.train_step(loss_fn, tx, accumulation_steps=k))
    p1, _, out1 = plain(params, tx.init(params), batch)
    p2, _, out2 = accum(params, tx.init(params), batch)
    assert not bool(out1.skipped) and not bool(out2.skipped)
    np.testing.assert_allclose(p2, p1, rtol=1e-6)
    assert np.all(np.isfinite(np.asarray(p2)))


# 7. Resetting counters: no aliasing, the scaler's restart value ----------


def test_7_reset_state_can_be_donated_and_restarts_like_the_scaler():
    scaler = jls.presets.deepspeed(initial_scale_power=8, scale_window=2)
    tx = jls.loss_scaling(optax.sgd(0.1), scaler)
    params = jnp.zeros(2)
    state = tx.init(params)
    state = jls.set_loss_scale(state, 4.0, scaler=scaler, reset_counters=True)
    leaves = jax.tree.leaves(state)
    pointers = {x.unsafe_buffer_pointer() for x in leaves}
    assert len(pointers) == len(leaves)
    step = jax.jit(
        lambda p, s, g: jls.apply_gradients(tx, g, s, p), donate_argnums=(0, 1)
    )
    scales = []
    for _ in range(4):
        params, state = step(params, state, jnp.ones(2))
        scales.append(float(jls.metrics(state)["loss_scale"]))
    # DeepSpeed: the first growth comes on the scale_window + 1 = 3rd step.
    assert scales == [4.0, 4.0, 8.0, 8.0]
    with pytest.raises(ValueError, match="reset_counters=True needs scaler"):
        jls.set_loss_scale(state, 4.0, reset_counters=True)


def test_7_no_state_made_by_jls_aliases_a_buffer():
    scaler = jls.dynamic_scale()
    states = [
        scaler.init(),
        jls.set_loss_scale(scaler.init(), 8.0),
        jls.presets.from_state_dict(
            jls.presets.to_state_dict(
                jls.presets.torch(), scaler.init(), framework="torch"
            ),
            framework="torch",
        )[1],
        jls.loss_scaling(optax.adam(1e-3)).init({"a": jnp.zeros(2)}),
    ]
    for state in states:
        leaves = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]
        pointers = {x.unsafe_buffer_pointer() for x in leaves}
        assert len(pointers) == len(leaves)


# 8. Skipped steps leave -0.0 (and everything else) bitwise unchanged -----


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.filterwarnings("ignore:every gradient is bfloat16")
def test_8_negative_zero_params_survive_a_skip(path, dtype):
    params = {"w": jnp.array([-0.0, 0.0, -1.5, jnp.inf, -jnp.inf], dtype)}
    tx = jls.loss_scaling(optax.adam(1e-3))
    state = tx.init(params)
    grads = {"w": jnp.array([1.0, jnp.nan, 1.0, 1.0, 1.0], dtype)}
    new, _ = PATHS[path](tx)(params, state, grads)
    assert_bitwise_equal(new, params)


@pytest.mark.parametrize("path", list(PATHS))
def test_8_complex_negative_zero_parts_survive_a_skip(path):
    params = {"z": jnp.array([complex(-0.0, -0.0), complex(0.0, -0.0)], jnp.complex64)}
    tx = jls.loss_scaling(optax.sgd(0.1))
    grads = {"z": jnp.array([1.0, complex(jnp.nan, 0.0)], jnp.complex64)}
    new, state = PATHS[path](tx)(params, tx.init(params), grads)
    assert bool(jls.metrics(state)["skipped"])
    assert_bitwise_equal(new, params)


def test_8_fused_skip_keeps_nan_payloads():
    # The fused path returns the parameters themselves. (On the tx.update
    # path optax.apply_updates adds -0.0: x86 quiets signalling nans and
    # XLA's bfloat16 conversion canonicalises nan payloads; see the README.)
    f32 = np.array([0x7F800001, 0x7FC00001], np.uint32).view(np.float32)
    bf16 = np.array([0x7FC1, 0x7F81], np.uint16).view(jnp.bfloat16)
    params = {"a": jnp.asarray(f32), "b": jnp.asarray(bf16)}
    tx = jls.loss_scaling(optax.sgd(0.1))
    grads = {"a": jnp.array([1.0, jnp.nan]), "b": jnp.ones(2, jnp.bfloat16)}
    new, _ = _fused_step(tx)(params, tx.init(params), grads)
    assert_bitwise_equal(new, params)


def test_8_skipped_updates_are_negative_zeros_of_the_params_dtype():
    params = {"a": jnp.zeros(2, jnp.bfloat16), "b": jnp.zeros(2)}
    tx = jls.loss_scaling(optax.sgd(0.1))
    updates, _ = jax.jit(tx.update)(
        {"a": jnp.ones(2, jnp.bfloat16), "b": jnp.full(2, jnp.nan)},
        tx.init(params),
        params,
    )
    assert updates["a"].dtype == jnp.bfloat16
    for u in jax.tree.leaves(updates):
        assert np.all(np.signbit(np.asarray(u, np.float32))) and not np.any(u)


# 9. Diagnostics agree across replicas ------------------------------------


def test_9_diagnostics_are_reduced_across_a_named_axis():
    tx = jls.loss_scaling(optax.sgd(0.1), axis_name="r", diagnostics=True)
    params = {"a": jnp.zeros((2, 3)), "b": jnp.zeros((2, 3))}
    grads = {"a": jnp.ones((2, 3)), "b": jnp.ones((2, 3)).at[1, 0].set(jnp.nan)}
    states = jax.vmap(tx.init)(params)
    step = jax.jit(
        jax.vmap(lambda p, s, g: jls.apply_gradients(tx, g, s, p), axis_name="r")
    )
    _, states = step(params, states, grads)
    flags = jls.metrics(states)["nonfinite_leaves"]
    np.testing.assert_array_equal(flags["a"], [False, False])
    np.testing.assert_array_equal(flags["b"], [True, True])  # replica 0 too
    np.testing.assert_array_equal(jls.metrics(states)["skipped"], [True, True])


def test_9_counters_follow_the_replica_reduced_decision():
    # skip_nonfinite=False, one replica's scale out of range: the decision
    # (dropped everywhere) is reduced across replicas, and so are the counts.
    scaler = jls.presets.mindspore_fixed(128.0, drop_overflow_update=False)
    tx = jls.loss_scaling(optax.sgd(0.1), scaler, axis_name="r")
    params = jnp.zeros((2, 2))
    states = jax.vmap(tx.init)(params)
    scales = jnp.array([128.0, 64.0], jnp.float32)
    states = states._replace(loss_scale=states.loss_scale._replace(scale=scales))
    step = jax.jit(
        jax.vmap(lambda p, s, g: jls.apply_gradients(tx, g, s, p), axis_name="r")
    )
    new, states = step(params, states, jnp.ones((2, 2)))
    assert_bitwise_equal(new, params)
    m = jls.metrics(states)
    np.testing.assert_array_equal(m["skipped"], [True, True])
    np.testing.assert_array_equal(m["total_skips"], [1, 1])


def test_9_replicas_agree_in_one_collective_per_reduction():
    # One all-reduce for the decision (finite and scale-in-range together)
    # and one for every leaf's diagnostic flag, whatever the number of leaves.
    tx = jls.loss_scaling(optax.sgd(0.1), axis_name="r", diagnostics=True)
    params = {f"p{i}": jnp.zeros((1, 3)) for i in range(5)}
    states = jax.pmap(tx.init)(params)
    step = jax.pmap(lambda p, s, g: jls.apply_gradients(tx, g, s, p), axis_name="r")
    text = step.lower(params, states, params).as_text()
    assert text.count("all_reduce") == 2, text.count("all_reduce")


# 10. Every dtype all_finite accepts works everywhere ----------------------


LOW_PRECISION = [
    getattr(jnp, name)
    for name in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e4m3b11fnuz",
        "float8_e3m4",
        "float8_e4m3",
        "float4_e2m1fn",
    )
    if hasattr(jnp, name)
]


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("path", list(PATHS))
def test_10_fp8_and_fp4_leaves_work_everywhere(dtype, path):
    params = {"q": jnp.array([1.0, 2.0, 0.5, -1.0], dtype), "w": jnp.ones(4)}
    state = jls.static_scale(4.0).init()
    assert jls.scale_loss(jnp.asarray(1.5, dtype), state).dtype == jnp.float32
    unscaled = jls.unscale({"q": jnp.array([4.0, -2.0], dtype)}, state)
    assert unscaled["q"].dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(unscaled["q"], np.float32), [1.0, -0.5])
    tx = jls.loss_scaling(optax.sgd(0.0), jls.static_scale(4.0))
    grads = {"q": jnp.full(4, 4.0, dtype), "w": jnp.ones(4)}
    new, s = PATHS[path](tx)(params, tx.init(params), grads)
    assert not bool(jls.metrics(s)["skipped"])
    assert_bitwise_equal(new, params)  # learning rate 0
    new, s = PATHS[path](tx)(
        params, tx.init(params), dict(grads, w=jnp.full(4, jnp.nan))
    )
    assert bool(jls.metrics(s)["skipped"])
    assert_bitwise_equal(new, params)


def test_10_e8m0_has_no_zero_and_is_refused_at_trace_time():
    # all_finite accepts it; as a gradient every zero update would be nan.
    d = jnp.float8_e8m0fnu
    assert not bool(jls.all_finite([jnp.array([1.0, jnp.nan], d)]))
    params = {"q": jnp.array([1.0, 2.0], d)}
    tx = jls.loss_scaling(optax.sgd(0.0), jls.static_scale(4.0))
    for path in PATHS.values():
        with pytest.raises(TypeError, match="float8_e8m0fnu"):
            path(tx)(params, tx.init(params), {"q": jnp.array([4.0, 4.0], d)})


# 11. Peers' own constructions; exact division under vmap ------------------


def test_11_concrete_array_scalars_are_accepted_like_numbers():
    assert jls.presets.jmp(jnp.float32(2**15)) == jls.presets.jmp(2.0**15)
    assert jls.presets.flax(scale=jnp.float32(4.0)) == jls.presets.flax(scale=4.0)
    assert jls.dynamic_scale(np.float64(8.0), growth_interval=np.int64(7)) == (
        jls.dynamic_scale(8.0, growth_interval=7)
    )
    assert jls.dynamic_scale(growth_interval=jnp.int32(5)).growth_interval == 5
    tx = jls.loss_scaling(optax.sgd(0.1), max_consecutive_skips=np.int64(3))
    jls.train_step(lambda p: jnp.sum(p), tx, max_retries=np.int64(2))
    with pytest.raises(TypeError, match="concrete"):
        jax.jit(lambda s: jls.static_scale(s))(jnp.float32(2.0))


def test_11_backoff_divisor_under_vmap_rounds_as_unbatched():
    scaler = jls.presets.tensorflow_v1(
        initial_loss_scale=1.0, multiplier=3.0, min_scale=2.0**-100
    )
    rng = np.random.default_rng(0)
    scales = jnp.asarray(rng.uniform(1, 2, 256) * 2.0 ** rng.integers(-60, 60, 256))
    scales = scales.astype(jnp.float32)
    states = jax.vmap(lambda s: scaler.init()._replace(scale=s))(scales)
    batched = jax.jit(jax.vmap(lambda s: scaler.adjust(s, jnp.asarray(False))))(states)
    expected = np.asarray(scales) / np.float32(3.0)
    np.testing.assert_array_equal(batched.scale, expected)
    one = jax.jit(lambda s: scaler.adjust(s, jnp.asarray(False)))
    for i in range(0, 256, 37):
        single = one(jax.tree.map(lambda x, i=i: x[i], states))
        assert np.asarray(single.scale) == expected[i]


# 12. Validation gaps: refused when made, naming the argument --------------


BAD_CONFIG = [
    (
        lambda: dataclasses.replace(
            jls.dynamic_scale(), backoff_factor=0.25, backoff_divisor=2.0
        ),
        "backoff_",
    ),
    (lambda: jls.dynamic_scale(growth_factor=1e39), "growth_factor"),
    (lambda: jls.dynamic_scale(growth_factor=1.00000001), "growth_factor"),
    (lambda: jls.dynamic_scale(backoff_factor=0.99999999), "backoff_factor"),
    (lambda: jls.dynamic_scale(backoff_factor=1e-50), "backoff_factor"),
    (lambda: jls.dynamic_scale(backoff_divisor=1e39), "backoff_divisor"),
    (
        lambda: jls.loss_scaling(optax.sgd(0.1), max_consecutive_skips=2**31),
        "max_consecutive_skips",
    ),
    (
        lambda: jls.train_step(lambda p: p, jls.loss_scaling(optax.sgd(1)), has_aux=2),
        "has_aux",
    ),
    (
        lambda: jls.set_loss_scale(jls.no_scale().init(), 1.0, reset_counters="no"),
        "reset_counters",
    ),
    (lambda: jls.set_loss_scale(jls.no_scale().init(), "1024"), "scale"),
    (lambda: jls.set_loss_scale(jls.no_scale().init(), True), "scale"),
    (
        lambda: jls.presets.from_state_dict(
            dict(
                jls.presets.to_state_dict(
                    jls.presets.paddle(),
                    jls.presets.paddle().init(),
                    framework="paddle",
                ),
                use_dynamic_loss_scaling="False",
            ),
            framework="paddle",
        ),
        "use_dynamic_loss_scaling",
    ),
    (
        lambda: jls.presets.from_state_dict(
            {"scale": 1024.0, "growth_tracker": 0, "hysteresis_tracker": 1.7},
            framework="megatron",
        ),
        "hysteresis_tracker",
    ),
    (lambda: jls.presets.from_state_dict(None, framework="torch"), "state_dict"),
    (lambda: jls.dynamic_scale(init_scale=10**400), "init_scale"),
    (lambda: jls.presets.torch(growth_factor=10**400), "growth_factor"),
    (lambda: jls.set_loss_scale(jls.no_scale().init(), 10**400), "scale"),
    (
        lambda: jls.presets.from_state_dict(
            {
                "scale": "512",
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": 10,
                "_growth_tracker": 0,
            },
            framework="torch",
        ),
        "scale",
    ),
    (
        lambda: jls.presets.from_state_dict(
            {"scale": True, "growth_tracker": 0, "hysteresis_tracker": 1},
            framework="megatron",
        ),
        "scale",
    ),
    (lambda: jls.presets.from_state_dict("x", framework="paddle"), "state_dict"),
]


@pytest.mark.parametrize("make, name", BAD_CONFIG)
def test_12_bad_configuration_is_refused_when_made(make, name):
    with pytest.raises((TypeError, ValueError), match=name):
        make()


@pytest.mark.parametrize("has_aux, returns", [(False, "pair"), (True, "scalar")])
def test_12_has_aux_mismatch_names_has_aux(has_aux, returns):
    def loss_fn(p):
        loss = jnp.sum(p)
        return (loss, {"x": loss}) if returns == "pair" else loss

    tx = jls.loss_scaling(optax.sgd(0.1))
    step = jls.train_step(loss_fn, tx, has_aux=has_aux)
    with pytest.raises(TypeError, match="has_aux"):
        jax.jit(step)(jnp.ones(2), tx.init(jnp.ones(2)))


# 13. Round trips keep what the peers keep ---------------------------------


def test_13_disabled_torch_and_paddle_round_trip():
    torch_off = jls.presets.torch(enabled=False)
    assert (
        jls.presets.to_state_dict(torch_off, torch_off.init(), framework="torch") == {}
    )
    scaler, state = jls.presets.from_state_dict({}, framework="torch")
    assert scaler == torch_off and float(state.scale) == 1.0
    paddle_off = jls.presets.paddle(enable=False)
    sd = jls.presets.to_state_dict(paddle_off, paddle_off.init(), framework="paddle")
    assert sd == {}
    scaler, _ = jls.presets.from_state_dict(sd, framework="paddle")
    assert scaler == paddle_off and not scaler.skip_nonfinite


# 14. skipped means dropped; nonfinite means non-finite gradients ----------


@pytest.mark.parametrize("path", list(PATHS))
def test_14_applied_nonfinite_step_is_not_reported_skipped(path):
    scaler = jls.presets.mindspore_fixed(128.0, drop_overflow_update=False)
    tx = jls.loss_scaling(optax.sgd(0.1), scaler)
    params = {"w": jnp.zeros(2)}
    new, state = PATHS[path](tx)(
        params, tx.init(params), {"w": jnp.array([1.0, jnp.inf])}
    )
    m = jls.metrics(state)
    assert bool(m["nonfinite"]) and not bool(m["skipped"])
    assert int(m["total_skips"]) == 0 and int(m["consecutive_nonfinite"]) == 1
    assert int(1 - jls.metrics(state)["total_skips"]) == 1
    assert not np.all(np.isfinite(np.asarray(new["w"])))  # applied, as configured

    step = jax.jit(
        jls.train_step(lambda p, x: jnp.sum(p * x), tx),
    )
    _, _, out = step(jnp.zeros(2), tx.init(jnp.zeros(2)), jnp.array([1.0, jnp.inf]))
    assert bool(out.nonfinite) and not bool(out.skipped)


# 15. Claims that must be true as written ---------------------------------


def _mlp(key, widths=(32, 64, 64, 10)):
    params = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        k = jax.random.fold_in(key, i)
        params.append(
            {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        )
    return params


def _mlp_loss(params, x, y):
    h = x
    for layer in params[:-1]:
        h = jax.nn.gelu(h.astype(jnp.float16) @ layer["w"].astype(jnp.float16))
        h = h.astype(jnp.float32) + layer["b"][None, :]
    logits = h @ params[-1]["w"] + params[-1]["b"][None, :]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@pytest.mark.parametrize("path", list(PATHS))
def test_15_a_finite_step_is_the_plain_step_up_to_rounding(path):
    # What the README claims, exactly: the same arithmetic as the inner
    # optimizer on the unscaled gradients, not bitwise equality with a
    # separately compiled plain step (XLA fuses and contracts differently:
    # on this MLP the fused path differs from plain by 0-1 ulp on the first
    # steps, the tx.update path by more, and any difference then grows as
    # perturbations do in training).
    key = jax.random.PRNGKey(1)
    params = _mlp(key)
    x = jax.random.normal(jax.random.fold_in(key, 99), (64, 32))
    y = jax.random.randint(jax.random.fold_in(key, 98), (64,), 0, 10)
    inner = optax.adam(1e-3)
    tx = jls.loss_scaling(optax.adam(1e-3), jls.static_scale(2.0**10))
    grads = jax.jit(jax.grad(lambda q: _mlp_loss(q, x, y) * 2.0**10))(params)
    new, _ = PATHS[path](tx)(params, tx.init(params), grads)
    u, _ = inner.update(jls.unscale(grads, tx.init(params)), inner.init(params), params)
    expected = optax.apply_updates(params, u)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params), strict=True)
    )


def test_15_multisteps_inside_adjusts_the_scale_per_micro_batch():
    # Documented: loss_scaling(MultiSteps(inner, k)) checks and adjusts per
    # micro-batch (growth_interval counts micro-batches); train_step's
    # accumulation_steps decides once per effective batch, as torch does.
    k = 4
    tx = jls.loss_scaling(
        optax.MultiSteps(optax.sgd(0.1), k), jls.dynamic_scale(2.0, growth_interval=2)
    )
    params = jnp.zeros(2)
    state = tx.init(params)
    step = _update_step(tx)
    for _ in range(k):
        params, state = step(params, state, jnp.ones(2))
    assert float(jls.metrics(state)["loss_scale"]) == 8.0  # 4 micro-batches: 2 growths
    tx2 = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(2.0, growth_interval=2))
    accum = jax.jit(
        jls.train_step(lambda p, x: jnp.sum(p * x.sum(0)), tx2, accumulation_steps=k)
    )
    p, s = jnp.zeros(2), tx2.init(jnp.zeros(2))
    for _ in range(2):
        p, s, _ = accum(p, s, jnp.ones((k, 2)))
    assert float(jls.metrics(s)["loss_scale"]) == 4.0  # 2 effective batches: 1 growth


# One trace with every new field --------------------------------------------


def test_one_trace_for_any_scale_and_counters():
    tx = _diverging_tx()
    step = chex.assert_max_traces(n=1)(lambda p, s, g: jls.apply_gradients(tx, g, s, p))
    step = jax.jit(step)
    params, state = jnp.zeros(2), tx.init(jnp.zeros(2))
    rng = np.random.default_rng(0)
    for i in range(30):
        g = jnp.asarray(rng.standard_normal(2), jnp.float32)
        if i % 4 == 0:
            g = g.at[0].set(jnp.nan)
        if i == 10:
            state = jls.set_loss_scale(state, 64.0)
        params, state = step(params, state, g)


@pytest.mark.parametrize("k", [2, 3, 8, 16])
def test_6_the_accumulation_bound_holds_at_its_limit(k):
    # The documented bound: an accumulated mean may be reported non-finite
    # only within a factor 1 + k * 2**-23 of the float32 maximum. Just below
    # it, with micro-batches that differ (so the additions round), the step
    # is applied.
    mean = np.float32(F32_MAX / (1 + k * 2.0**-23))
    n = 4 * k
    # Rows a few ulps apart (at most the bound), so that the additions round.
    rows = np.array([mean] * n, np.float32)
    for i in range(n):
        for _ in range(i % 4):
            rows[i] = np.nextafter(rows[i], np.float32(0))
    assert rows.astype(np.float64).mean() > 0.99999 * float(mean)

    def loss_fn(p, x):  # the mean over the rows
        return jnp.sum(p * jnp.sum(x / x.shape[0], axis=0))

    # A normal learning rate: 1e-38 is a float32 subnormal, flushed to zero
    # by some XLA versions in one program and not the other.
    tx = jls.loss_scaling(optax.sgd(1e-30), jls.static_scale(1.0))
    batch = jnp.asarray(np.stack([rows, rows], axis=1))
    params = jnp.zeros(2)
    accum = jax.jit(jls.train_step(loss_fn, tx, accumulation_steps=k))
    _, _, out = accum(params, tx.init(params), batch)
    assert not bool(out.skipped)


def test_consecutive_nonfinite_saturates_at_int32_max():
    top = np.iinfo(np.int32).max
    scaler = jls.dynamic_scale()
    state = scaler.init()._replace(consecutive_nonfinite=jnp.int32(top))
    state = jax.jit(scaler.adjust)(state, jnp.asarray(False))
    assert int(state.consecutive_nonfinite) == top
    state = jax.jit(scaler.adjust)(state, jnp.asarray(True))
    assert int(state.consecutive_nonfinite) == 0


def test_bool_and_integer_leaves_pass_through_unscale():
    state = jls.static_scale(8.0).init()
    tree = {"mask": jnp.array([True, False]), "n": jnp.int32(3), "w": jnp.ones(2) * 8}
    out = jax.jit(jls.unscale)(tree, state)
    assert out["mask"].dtype == jnp.bool_ and out["mask"].tolist() == [True, False]
    assert out["n"].dtype == jnp.int32 and int(out["n"]) == 3
    assert out["w"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    "bad", [2.0**20, 0.5, 1e-45, float("nan"), float("inf"), -4.0, 0.0]
)
def test_2_a_traced_scale_outside_the_range_or_subnormal_is_kept_out(bad):
    scaler = jls.dynamic_scale(2.0**8, max_scale=2.0**16)  # min_scale=1
    tx = jls.loss_scaling(optax.sgd(0.1), scaler)
    state = tx.init(jnp.zeros(2))
    new = jax.jit(lambda s, v: jls.set_loss_scale(s, v, scaler=scaler))(
        state, jnp.float32(bad)
    )
    assert float(jls.metrics(new)["loss_scale"]) == 2.0**8
    # Without a scaler the float32 normal range is the bound.
    new = jax.jit(lambda s, v: jls.set_loss_scale(s, v))(state, jnp.float32(bad))
    ok = np.isfinite(bad) and bad >= np.finfo(np.float32).tiny
    assert float(jls.metrics(new)["loss_scale"]) == (bad if ok else 2.0**8)


def test_diagnostics_refuse_gradients_of_another_structure():
    params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    tx = jls.loss_scaling(optax.sgd(0.1), diagnostics=True)
    state = tx.init(params)
    with pytest.raises(TypeError, match="must have the structure of the parameters"):
        tx.update({"a": jnp.ones(2), "b": jnp.ones(2), "c": jnp.ones(1)}, state, params)
