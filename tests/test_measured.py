"""The measured rule (`jls.measured_scale`), against a reference model in numpy."""

# pyright: reportIndexIssue=false, reportAttributeAccessIssue=false
# pyright: reportArgumentType=false, reportOperatorIssue=false
# pyright: reportAssignmentType=false

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from measured_grads import F32_MAX, _grads, _params

import jls
from jls._finite import SMALL_LEAF


@dataclasses.dataclass
class RefMeasured:
    """The measured rule, one step at a time, in numpy float32."""

    scaler: jls.LossScaler
    scale: np.float32 = np.float32(0)
    headroom: np.float32 = np.float32(1)
    count: int = 0
    nonfinite_run: int = 0

    def __post_init__(self):
        self.scale = np.float32(self.scaler.init_scale)

    def step(self, finite: bool, magnitude: float) -> None:
        f32, s = np.float32, self.scaler
        lo, hi = f32(s.min_scale), f32(s.max_scale)
        finite = finite and lo <= self.scale <= hi
        h = self.headroom if self.headroom >= 1 else f32(1)
        count = self.count + 1
        relax = finite and count >= s.history
        if not finite and self.nonfinite_run == 0:
            h = min(f32(h / f32(s.backoff_factor)), F32_MAX)
        elif relax:
            h = max(f32(h / f32(s.max_growth)), f32(1))
        self.count = count if finite and not relax else 0
        self.nonfinite_run = 0 if finite else self.nonfinite_run + 1
        self.headroom = h
        with np.errstate(all="ignore"):
            if finite:
                m = f32(magnitude)
                wanted = f32(
                    f32(self.scale * f32(f32(s.compute_max / s.margin) / m)) / h
                )
                if np.isfinite(wanted) and wanted > 0:
                    _, e = np.frexp(wanted)
                    target = f32(np.ldexp(f32(1), int(e) - 1))
                else:
                    target = hi if wanted > 0 else f32(0)
                new = min(target, f32(self.scale * f32(s.max_growth)))
            else:
                new = max(f32(self.scale * f32(s.backoff_factor)), lo)
        self.scale = min(new, hi) if new >= lo else lo


steps = st.lists(st.tuples(st.booleans(), st.floats(-40, 20)), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(
    steps=steps,
    history=st.integers(1, 5),
    margin=st.sampled_from([1.0, 2.0**4, 2.0**10]),
)
def test_the_rule_matches_the_reference_bitwise(steps, history, margin):
    scaler = jls.measured_scale(
        margin, history=history, min_scale=2.0**-8, max_scale=2.0**40
    )
    ref = RefMeasured(scaler)
    state = scaler.init()
    adjust = jax.jit(scaler.adjust)
    for finite, log2m in steps:
        m = np.float32(2.0**log2m * 1.37)
        state = adjust(state, jnp.asarray(finite), magnitude=jnp.float32(m))
        ref.step(finite, m)
        assert state.scale.item() == ref.scale, (finite, m)
        assert state.headroom.item() == ref.headroom
        assert int(state.growth_count) == ref.count
        assert int(state.consecutive_nonfinite) == ref.nonfinite_run


def test_scales_are_powers_of_two_and_stay_in_range():
    scaler = jls.measured_scale(min_scale=2.0**-4, max_scale=2.0**30)
    state = scaler.init()
    rng = np.random.default_rng(0)
    for _ in range(300):
        m = jnp.float32(10.0 ** rng.uniform(-30, 30))
        if rng.uniform() < 0.05:
            m = jnp.float32(rng.choice([0.0, np.inf, np.nan]))
        state = scaler.adjust(state, jnp.asarray(rng.uniform() < 0.9), magnitude=m)
        scale = float(state.scale)
        assert 2.0**-4 <= scale <= 2.0**30
        assert np.frexp(scale)[0] == 0.5, scale


def test_all_zero_gradients_grow_by_at_most_max_growth():
    scaler = jls.measured_scale(init_scale=2.0**4, max_growth=4.0)
    state = scaler.adjust(scaler.init(), True, magnitude=jnp.float32(0))
    assert float(state.scale) == 2.0**6


def test_a_sudden_jump_is_followed_down_without_a_skip():
    scaler = jls.measured_scale(2.0**10, init_scale=2.0**20)
    state = scaler.init()
    # Scaled RMS 2**10 at 2**20: the target keeps it 2**10 below 65504.
    state = scaler.adjust(state, True, magnitude=jnp.float32(2.0**10))
    assert float(state.scale) == 2.0**15
    assert int(state.consecutive_skips) == 0


def test_an_overflow_backs_off_and_adds_headroom_once_per_run():
    scaler = jls.measured_scale(init_scale=2.0**12, history=2)
    state = scaler.init()
    for _ in range(3):
        state = scaler.adjust(state, False)
    assert float(state.scale) == 2.0**9 and float(state.headroom) == 2.0
    one = jnp.float32(1e-3)
    state = scaler.adjust(state, True, magnitude=one)
    assert float(state.headroom) == 2.0
    state = scaler.adjust(state, True, magnitude=one)
    assert float(state.headroom) == 1.0  # `history` finite steps: relaxed


@pytest.mark.parametrize("bad", [np.nan, 0.0, -4.0, 0.5])
def test_a_headroom_from_a_checkpoint_is_not_trusted(bad):
    scaler = jls.measured_scale(init_scale=2.0**10)
    state = scaler.init()._replace(headroom=jnp.float32(bad))
    state = scaler.adjust(state, True, magnitude=jnp.float32(2.0**4))
    assert float(state.headroom) == 1.0
    assert np.isfinite(float(state.scale)) and float(state.scale) >= 1


def test_without_a_measurement_a_finite_step_holds_the_scale():
    scaler = jls.measured_scale(init_scale=2.0**10)
    assert float(scaler.adjust(scaler.init(), True).scale) == 2.0**10


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"margin": 0.5}, ValueError, "margin"),
        ({"margin": "big"}, TypeError, "margin"),
        ({"history": 0}, ValueError, "history"),
        ({"max_growth": 0.5}, ValueError, "max_growth"),
        ({"backoff_factor": 2.0}, ValueError, "backoff_factor"),
        ({"dtype": jnp.int32}, TypeError, "dtype"),
        ({"init_scale": 0.0}, ValueError, "init_scale"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, error, name):
    with pytest.raises(error, match=name):
        jls.measured_scale(**kwargs)


def test_the_dtype_sets_the_target():
    assert jls.measured_scale().compute_max == 65504.0
    e5m2 = jls.measured_scale(dtype=jnp.float8_e5m2)
    assert e5m2.compute_max == float(jnp.finfo(jnp.float8_e5m2).max)


@pytest.mark.parametrize("path", ["update", "fused"])
def test_the_measured_scaler_finds_its_scale_and_skips_change_nothing(path):
    params = _params()
    tx = jls.loss_scaling(
        optax.adam(1e-3),
        jls.measured_scale(2.0**10, init_scale=2.0**4),
        gradient_norm=True,
        skip_spikes=jls.hooks.SpikeRule(warmup=5),
    )
    traces = []

    @jax.jit
    def step(params, state, grads):
        traces.append(1)
        if path == "fused":
            return jls.apply_gradients(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    rng = np.random.default_rng(3)
    for i in range(30):
        scale = float(jls.metrics(state)["loss_scale"])
        grads = _grads(params, scale, rng)
        if i == 20:
            grads = dict(grads, w=grads["w"].at[0, 0].set(jnp.inf))
        new_params, new_state = step(params, state, grads)
        if i == 20:
            chex.assert_trees_all_equal(new_params, params)
            chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
            assert float(jls.metrics(new_state)["loss_scale"]) == scale / 2
        params, state = new_params, new_state
    assert len(traces) == 1
    # Gradients of RMS 1e-3: the scale settles where the scaled RMS is at most
    # 65504 / 2**10 (with one overflow's extra headroom of 2).
    scale = float(jls.metrics(state)["loss_scale"])
    assert 2.0**14 <= scale <= 2.0**16, scale
    assert int(jls.metrics(state)["total_skips"]) == 1


def test_the_scale_stays_a_power_of_two_under_any_max_scale():
    scaler = jls.measured_scale(init_scale=512.0, max_scale=1000.0)
    state = scaler.init()
    for _ in range(3):
        state = scaler.adjust(state, True, magnitude=jnp.float32(0))
    assert float(state.scale) == 512.0
    big = jls.measured_scale(init_scale=2.0**126, max_scale=float(F32_MAX))
    state = big.adjust(big.init(), True, magnitude=jnp.float32(0))
    assert float(state.scale) == 2.0**127
    default = jls.measured_scale(init_scale=2.0**126)  # max_scale=2**126
    state = default.adjust(default.init(), True, magnitude=jnp.float32(0))
    assert float(state.scale) == 2.0**126


@pytest.mark.parametrize("bad", [np.inf, 2.0**80])
def test_an_infinite_or_absurd_headroom_is_repaired(bad):
    scaler = jls.measured_scale(init_scale=2.0**10)
    state = scaler.init()._replace(headroom=jnp.float32(bad))
    state = scaler.adjust(state, True, magnitude=jnp.float32(1e-3))
    assert float(state.headroom) == 1.0 and float(state.scale) == 2.0**11


def test_retries_add_headroom_once():
    tx = jls.loss_scaling(optax.sgd(0.1), jls.measured_scale(init_scale=2.0**14))

    def loss_fn(p, x):
        return jnp.sum(p["w"] * x).astype(jnp.float16) * jnp.float16(100.0)

    step = jls.train_step(loss_fn, tx, max_retries=4)
    params = {"w": jnp.ones(4)}
    _, state, out = jax.jit(step)(params, tx.init(params), jnp.ones(4))
    assert int(out.retries) > 1
    assert float(jls.loss_scale_state(state).headroom) == 2.0


def test_framework_state_dicts_refuse_the_measured_rule():
    scaler = jls.measured_scale()
    with pytest.raises(ValueError, match="measured_scale"):
        jls.presets.to_state_dict(scaler, scaler.init(), framework="torch")


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"backoff_factor": 0.75}, "backoff_factor"),
        ({"max_growth": 3.0}, "max_growth"),
        ({"init_scale": 1000.0}, "init_scale"),
        ({"min_scale": 3.0}, "min_scale"),
    ],
)
def test_configurations_that_leave_the_powers_of_two_are_refused(kwargs, name):
    value = next(iter(kwargs.values()))
    with pytest.raises(ValueError, match=rf"{name} must be a power of two.*{value}"):
        jls.measured_scale(**kwargs)


def test_a_scale_set_by_hand_is_a_power_of_two_or_refused():
    scaler = jls.measured_scale()
    tx = jls.loss_scaling(optax.sgd(1.0), scaler)
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"scale must be a power of two.*1000"):
        jls.set_loss_scale(state, 1000.0, scaler=scaler)
    # Traced, it cannot be refused: the old scale stays.
    kept = jax.jit(lambda s, v: jls.set_loss_scale(s, v, scaler=scaler))(state, 1e3)
    assert float(jls.metrics(kept)["loss_scale"]) == 2.0**15
    # Without the scaler (or from a checkpoint) it reaches the state: the step
    # at it is never applied (its unscaling would not be exact), and every
    # later scale is a power of two.
    state = jls.set_loss_scale(state, 1000.0)
    update = jax.jit(tx.update)
    updates, state = update({"w": jnp.full(3, 1000.0)}, state, params)
    assert bool(jls.metrics(state)["skipped"])
    np.testing.assert_array_equal(updates["w"], np.zeros(3))
    for _ in range(20):
        scale = float(jls.metrics(state)["loss_scale"])
        assert np.frexp(scale)[0] == 0.5, scale
        _, state = update({"w": jnp.full(3, scale)}, state, params)
        assert not bool(jls.metrics(state)["skipped"])


@settings(max_examples=40, deadline=None)
@given(
    start=st.floats(1.0, 2.0**60),
    headroom=st.floats(0.0, 2.0**70),
    steps=steps,
)
def test_scales_and_headroom_from_any_state_become_powers_of_two(
    start, headroom, steps
):
    scaler = jls.measured_scale(2.0**4, history=3)
    state = scaler.init()._replace(
        scale=jnp.float32(start), headroom=jnp.float32(headroom)
    )
    adjust = jax.jit(scaler.adjust)
    for finite, log2m in steps:
        m = jnp.float32(2.0**log2m * 1.37)
        state = adjust(state, jnp.asarray(finite), magnitude=m)
        assert np.frexp(state.scale.item())[0] == 0.5, state
        assert np.frexp(state.headroom.item())[0] == 0.5, state


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from([jnp.float16, jnp.bfloat16, jnp.float32]),
    sizes=st.lists(
        st.sampled_from([1, 7, 300, SMALL_LEAF + 3]), min_size=1, max_size=4
    ),
    log2_magnitude=st.integers(-24, 12),
    seed=st.integers(0, 2**16),
)
def test_the_measured_scaler_never_skips_a_finite_step(
    dtype, sizes, log2_magnitude, seed
):
    # The scaled gradients are the true ones times the scale, rounded to the
    # compute dtype (as a backward pass in that dtype makes them): whenever
    # they are finite, the step must be applied, whatever scale the rule
    # has driven them to.
    rng = np.random.default_rng(seed)
    true = [
        (rng.standard_normal(n) * 2.0**log2_magnitude).astype(np.float32) for n in sizes
    ]
    scaler = jls.measured_scale(dtype=dtype)
    tx = jls.loss_scaling(optax.sgd(0.0), scaler)
    params = [jnp.zeros(n) for n in sizes]
    state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(40):
        scale = np.float32(jls.metrics(state)["loss_scale"])
        with np.errstate(over="ignore"):
            scaled = [jnp.asarray((t * scale).astype(np.float32), dtype) for t in true]
        finite = all(bool(jnp.all(jnp.isfinite(g))) for g in scaled)
        _, state = update(scaled, state, params)
        assert bool(jls.metrics(state)["skipped"]) == (not finite), scale
