"""The measured scaler, the gradient-norm metric and the spike rule (issue 13).

The measured rule is checked bitwise against a reference model written here
in numpy; the squares check and the norm against numpy and optax; the spike
rule against a reference of its statistics. The soak (``tests/soak.py``,
config ``measured``) runs the rule under injected faults.
"""

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

import jls
from jls._finite import SMALL_LEAF, leaves_squares

F32_MAX = np.float32(np.finfo(np.float32).max)


# The rule, against a reference model ------------------------------------------


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
        relax = finite and count >= s.growth_interval
        if not finite and self.nonfinite_run == 0:
            h = min(f32(h / f32(s.backoff_factor)), F32_MAX)
        elif relax:
            h = max(f32(h / f32(s.growth_factor)), f32(1))
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
                new = min(target, f32(self.scale * f32(s.growth_factor)))
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


# The squares check: the measurements and the finite flag -------------------------


def test_the_check_measures_each_reduction_and_the_norm():
    rng = np.random.default_rng(0)
    big = rng.normal(size=(SMALL_LEAF + 1,)).astype(np.float32) * 3
    small = [rng.normal(size=(7,)).astype(np.float32), np.ones(5, np.float16) * 2]
    leaves = [jnp.asarray(big), *(jnp.asarray(x) for x in small)]
    m = jax.jit(leaves_squares)(leaves)
    as64 = [np.asarray(x, np.float64) for x in (big, *small)]
    group = np.concatenate([x.ravel() for x in as64[1:]])  # one float32 group
    rms = max(np.sqrt(np.mean(as64[0] ** 2)), np.sqrt(np.mean(group**2)))
    np.testing.assert_allclose(float(m.magnitude), rms, rtol=1e-6)
    np.testing.assert_allclose(
        float(m.low), sum(float((x**2).sum()) for x in as64), rtol=1e-6
    )
    assert bool(m.finite)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_the_check_sees_every_nonfinite_value(bad):
    x = np.ones((SMALL_LEAF * 2,), np.float32)
    x[123] = bad
    assert not bool(jax.jit(leaves_squares)([jnp.asarray(x)]).finite)
    y = np.ones((9,), np.float16)
    y[3] = bad
    assert not bool(jax.jit(leaves_squares)([jnp.asarray(y)]).finite)


def test_a_fused_producer_that_rounds_to_inf_is_seen():
    # The stored gradient a * b is inf, though its producer is fused into the
    # check's reduction.
    @jax.jit
    def check(a, b):
        return leaves_squares([a * b]).finite

    a = jnp.ones((SMALL_LEAF * 2,), jnp.float32).at[77].set(2.0**60)
    b = jnp.ones_like(a).at[77].set(2.0**70)
    assert not bool(check(a, b))
    assert bool(check(a, jnp.ones_like(a)))


@pytest.mark.parametrize("value", [1e20, 1e30, 3e38])
def test_finite_values_whose_squares_overflow_are_finite(value):
    # The plain sum of squares overflows float32; the shrunk second pass
    # (taken only then) proves the values finite and measures them.
    x = jnp.full((4,), value, jnp.float32)
    m = jax.jit(leaves_squares)([x])
    assert bool(m.finite) and float(m.low) == np.inf
    np.testing.assert_allclose(float(m.magnitude), value, rtol=1e-6)
    want = 2 * value  # the norm of four equal values
    got = float(jls._finite.unscaled_norm(m, jnp.float32(1.0)))
    if want < float(F32_MAX):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    else:
        assert got == np.inf
    bad = x.at[2].set(jnp.inf)
    assert not bool(jax.jit(leaves_squares)([bad]).finite)


# Through loss_scaling: the norm metric, skips, one trace --------------------------


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w": jax.random.normal(k1, (64, 300)),
        "b": jnp.zeros((300,)),
        "h": jax.random.normal(k2, (300,), jnp.float32),
    }


def _grads(params, scale, rng, factor=1.0):
    return jax.tree.map(
        lambda p: (
            jnp.asarray(rng.normal(size=p.shape), p.dtype) * 1e-3 * scale * factor
        ),
        params,
    )


def test_the_norm_metric_is_optax_tree_norm_of_the_unscaled_gradients():
    params = _params()
    tx = jls.loss_scaling(
        optax.adam(1e-3), jls.dynamic_scale(2.0**10), gradient_norm=True
    )
    state = tx.init(params)
    assert float(jls.metrics(state)["gradient_norm"]) == 0.0
    grads = _grads(params, 2.0**10, np.random.default_rng(1))
    _, new = jax.jit(lambda g, s, p: jls.apply_gradients(tx, g, s, p))(
        grads, state, params
    )
    want = optax.tree.norm(jls.unscale(grads, state))
    np.testing.assert_allclose(jls.metrics(new)["gradient_norm"], want, rtol=1e-6)
    bad = dict(grads, b=grads["b"].at[3].set(jnp.nan))
    _, new = tx.update(bad, state, params)
    assert not np.isfinite(float(jls.metrics(new)["gradient_norm"]))


def test_decide_reports_the_range_and_norm():
    params = _params()
    scaling = jls.LossScaling(optax.sgd(0.1), jls.measured_scale())
    grads = _grads(params, 2.0**15, np.random.default_rng(2))
    d = scaling.decide(grads, scaling.scaler.init())
    leaves = {k: np.asarray(v, np.float64) for k, v in grads.items()}
    small = np.concatenate([leaves["b"], leaves["h"]])
    rms = max(np.sqrt(np.mean(leaves["w"] ** 2)), np.sqrt(np.mean(small**2)))
    np.testing.assert_allclose(float(d.magnitude), rms, rtol=1e-6)
    norm = np.sqrt(sum((x**2).sum() for x in leaves.values())) / 2.0**15
    np.testing.assert_allclose(float(d.norm), norm, rtol=1e-6)


@pytest.mark.parametrize("path", ["update", "fused"])
def test_the_measured_scaler_finds_its_scale_and_skips_change_nothing(path):
    params = _params()
    tx = jls.loss_scaling(
        optax.adam(1e-3),
        jls.measured_scale(2.0**10, init_scale=2.0**4),
        gradient_norm=True,
        skip_spikes=jls.SpikeRule(warmup=5),
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


def test_replicas_agree_on_the_measurements():
    params = {"w": jnp.ones((8, 4))}
    tx = jls.loss_scaling(
        optax.sgd(0.1), jls.measured_scale(), axis_name="r", gradient_norm=True
    )
    state = tx.init(params)
    grads = {"w": jnp.arange(1.0, 3.0)[:, None, None] * jnp.ones((2, 8, 4)) * 2.0**15}

    def step(g):
        return jls.metrics(tx.update(g, state, params)[1])

    m = jax.vmap(step, axis_name="r")(grads)
    assert float(m["gradient_norm"][0]) == float(m["gradient_norm"][1])
    assert float(m["loss_scale"][0]) == float(m["loss_scale"][1])


# The spike rule --------------------------------------------------------------


class RefSpikes:
    """The spike rule's statistics, in float64."""

    def __init__(self, rule):
        self.rule, self.count, self.mean, self.var = rule, 0, 0.0, 0.0

    def is_spike(self, x):
        sd = np.sqrt(self.var)
        return (
            self.count >= self.rule.warmup and x > self.mean + self.rule.threshold * sd
        )

    def feed(self, x):
        self.count += 1
        a = max(1 / self.count, 1 / self.rule.window)
        d = x - self.mean
        self.mean, self.var = self.mean + a * d, (1 - a) * (self.var + a * d * d)


@pytest.mark.parametrize("scaler", [jls.no_scale(), jls.dynamic_scale(2.0**8)])
def test_spikes_are_skipped_and_do_not_feed_the_statistics(scaler):
    rule = jls.SpikeRule(threshold=4.0, warmup=10, window=20)
    params = {"w": jnp.zeros((50,))}
    tx = jls.loss_scaling(optax.sgd(0.1), scaler, skip_spikes=rule, gradient_norm=True)
    state = tx.init(params)
    ref = RefSpikes(rule)
    rng = np.random.default_rng(4)
    update = jax.jit(tx.update)
    spikes = 0
    for i in range(80):
        factor = 30.0 if i in (15, 40, 41) else 1.0
        scale = float(jls.metrics(state)["loss_scale"])
        g = {
            "w": jnp.asarray(
                rng.normal(size=50) * (1 + 0.1 * rng.normal()), jnp.float32
            )
        }
        g = jax.tree.map(lambda x, f=factor * scale: x * f, g)
        updates, new = update(g, state, params)
        norm = float(jls.metrics(new)["gradient_norm"])
        want = ref.is_spike(norm)
        m = jls.metrics(new)
        assert bool(m["spike"]) == want, i
        assert bool(m["skipped"]) == want, i
        if want:
            spikes += 1
            chex.assert_trees_all_equal(new.inner_state, state.inner_state)
            assert new.spikes.count == state.spikes.count
        else:
            ref.feed(norm)
            np.testing.assert_allclose(float(new.spikes.norm_mean), ref.mean, rtol=1e-5)
        state = new
    assert spikes == 3 and int(jls.metrics(state)["total_spikes"]) == 3
    assert int(jls.metrics(state)["total_skips"]) == 3
    # A spike is finite: the scale does not back off for it.
    assert float(jls.metrics(state)["loss_scale"]) == scaler.init_scale


def test_watching_the_loss_needs_it_and_takes_it_from_train_step():
    rule = jls.SpikeRule(watch="loss", warmup=3, threshold=3.0)
    params = {"w": jnp.ones(3)}
    tx = jls.loss_scaling(optax.sgd(0.01), jls.no_scale(), skip_spikes=rule)
    with pytest.raises(TypeError, match="loss="):
        tx.update({"w": jnp.ones(3)}, tx.init(params), params)
    with pytest.raises(TypeError, match="loss must be a floating scalar"):
        tx.update({"w": jnp.ones(3)}, tx.init(params), params, loss=jnp.ones(2))

    def loss_fn(p, x):
        return jnp.sum(p["w"] * x) ** 2

    step = jax.jit(jls.train_step(loss_fn, tx))
    state = tx.init(params)
    for i in range(8):
        x = jnp.full(3, 100.0 if i == 6 else 1.0 + 0.01 * i)
        params, state, out = step(params, state, x)
        assert bool(out.skipped) == (i == 6), i
    assert int(jls.metrics(state)["total_spikes"]) == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"threshold": -1.0}, ValueError, "threshold"),
        ({"warmup": 1}, ValueError, "warmup"),
        ({"window": 0}, ValueError, "window"),
        ({"watch": "grads"}, ValueError, "watch"),
    ],
)
def test_spike_rule_arguments_are_checked(kwargs, error, name):
    with pytest.raises(error, match=name):
        jls.SpikeRule(**kwargs)


def test_a_state_without_the_statistics_is_refused():
    params = {"w": jnp.ones(3)}
    plain = jls.loss_scaling(optax.sgd(0.1))
    spiky = jls.loss_scaling(optax.sgd(0.1), skip_spikes=jls.SpikeRule())
    with pytest.raises(TypeError, match="spike statistics"):
        spiky.update(params, plain.init(params), params)
    normed = jls.loss_scaling(optax.sgd(0.1), gradient_norm=True)
    with pytest.raises(TypeError, match="gradient_norm"):
        normed.update(params, plain.init(params), params)


# What an adversary found (each a regression test) ----------------------------


def test_under_shard_map_and_pmap_replicas_agree():
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    env["PYTHONPATH"] = str(root)
    out = subprocess.run(
        [sys.executable, str(root / "tests" / "scripts" / "measured_shard_map.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    # A leaf replicated over the model axis counts once in the norm.
    got, want = report["norm"]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # One replica's loss spiked: both skipped, the parameters still agree.
    assert report["skipped"][-1] == [True, True]
    assert not any(any(s) for s in report["skipped"][:-1])
    assert report["params_agree"]
    # Explicitly sharded leaves (on their second axis): the squares check and
    # diagnostics work on them, real and complex (a reshape used to fail).
    explicit = report["explicit"]
    assert len(explicit) == 6
    for key, (finite, bad) in explicit.items():
        assert finite[0] is False and bad[0] is True, key
        if key.endswith("norm"):
            assert finite[1] == 1.0, key  # 16 entries of 1/4 (scale 4)
        if key.endswith("diagnostics"):
            assert finite[2] is False and bad[2] is True, key


def _loss_rule_tx(scaler=None, **kw):
    rule = jls.SpikeRule(watch="loss", warmup=3, threshold=3.0, **kw)
    return jls.loss_scaling(optax.sgd(0.01), scaler or jls.no_scale(), skip_spikes=rule)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nonfinite_loss_is_a_spike_and_feeds_nothing(bad):
    tx = _loss_rule_tx()
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for i, loss in enumerate([1.0, bad, 1.01, 0.99, 1.0, 1e3]):
        _, new = update({"w": jnp.ones(2)}, state, params, loss=jnp.float32(loss))
        spike = bool(jls.metrics(new)["spike"])
        assert spike == (i in (1, 5)), i
        assert np.isfinite(float(new.spikes.loss_mean))
        assert np.isfinite(float(new.spikes.loss_var))
        state = new


def test_a_huge_first_value_does_not_make_the_statistics_nan():
    tx = _loss_rule_tx()
    params = {"w": jnp.ones(2)}
    _, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params, loss=1e20)
    _, state = tx.update({"w": jnp.ones(2)}, state, params, loss=1.0)
    assert np.isfinite(float(state.spikes.loss_var))


def test_applied_nonfinite_steps_do_not_feed_the_norm_statistics():
    rule = jls.SpikeRule(warmup=2)
    scaler = jls.no_scale(skip_nonfinite=False)
    tx = jls.loss_scaling(optax.sgd(0.01), scaler, skip_spikes=rule)
    params = {"w": jnp.ones(2)}
    _, state = tx.update({"w": jnp.array([1.0, jnp.nan])}, tx.init(params), params)
    assert int(state.spikes.count) == 0 and float(state.spikes.norm_mean) == 0.0


def test_a_vetoed_spike_holds_the_measured_scale():
    tx = jls.loss_scaling(
        optax.sgd(0.01),
        jls.measured_scale(init_scale=2.0**10),
        skip_spikes=jls.SpikeRule(warmup=3, threshold=3.0),
    )
    params = {"w": jnp.ones(100)}
    state = tx.init(params)
    rng = np.random.default_rng(0)
    for i in range(8):
        scale = float(jls.metrics(state)["loss_scale"])
        factor = 1e4 if i == 7 else 1.0
        g = {
            "w": jnp.asarray(rng.normal(size=100) * 1e-3 * scale * factor, jnp.float32)
        }
        _, new = tx.update(g, state, params)
        if i == 7:
            assert bool(jls.metrics(new)["spike"])
            assert float(jls.metrics(new)["loss_scale"]) == scale
        state = new


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


def test_flax_train_state_takes_the_loss():
    from flax.training import train_state  # noqa: F401

    import jls.flax

    params = {"w": jnp.ones(2)}
    tx = _loss_rule_tx()
    state = jls.flax.TrainState.create(apply_fn=None, params=params, tx=tx)
    state = state.apply_gradients(grads={"w": jnp.ones(2)}, loss=jnp.float32(1.0))
    assert int(state.step) == 1


def test_framework_state_dicts_refuse_the_measured_rule():
    scaler = jls.measured_scale()
    with pytest.raises(ValueError, match="measured_scale"):
        jls.presets.to_torch_state_dict(scaler, scaler.init())


# jls 0.3 promises: powers of two whatever the configuration ----------------------


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


# jls 0.3 promises: a finite step is never reported non-finite --------------------


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


@pytest.mark.parametrize("scale", [2.0**70, 2.0**100, 2.0**126])
def test_the_gradient_norm_never_skips_a_finite_step(scale):
    # Unscaled norm 1 at a large scale: the scaled squares overflow float32.
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(scale), gradient_norm=True)
    params = {"w": jnp.zeros((4, 4))}
    grads = {"w": jnp.full((4, 4), 0.25 * scale, jnp.float32)}
    for fused in (False, True):
        state = tx.init(params)
        if fused:
            _, state = jax.jit(lambda g, s, p: jls.apply_gradients(tx, g, s, p))(
                grads, state, params
            )
        else:
            _, state = jax.jit(tx.update)(grads, state, params)
        m = jls.metrics(state)
        assert not bool(m["skipped"])
        assert float(m["gradient_norm"]) == 1.0


@pytest.mark.parametrize("value", [1e10, 1e19, 1e30, 8e37])
def test_the_gradient_norm_does_not_overflow_below_float32_max(value):
    tx = jls.loss_scaling(optax.sgd(0.0), jls.no_scale(), gradient_norm=True)
    params = {"w": jnp.zeros((4,)), "b": jnp.zeros((3,))}
    grads = {"w": jnp.full((4,), value, jnp.float32), "b": jnp.ones(3)}
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    m = jls.metrics(state)
    assert not bool(m["skipped"])
    want = np.sqrt(4 * np.float64(value) ** 2 + 3)
    np.testing.assert_allclose(float(m["gradient_norm"]), want, rtol=1e-6)


# jls 0.3 promises: the spike rule ------------------------------------------------


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_nonfinite_gradient_is_the_checks_business_not_a_spike(bad):
    # With skip_nonfinite=False such a step is applied, inf and nan alike,
    # and never counted as a spike; with the default it is skipped, not a spike.
    rule = jls.SpikeRule(warmup=2, threshold=3.0)
    params = {"w": jnp.ones(4)}
    for scaler in (jls.no_scale(skip_nonfinite=False), jls.no_scale()):
        tx = jls.loss_scaling(optax.sgd(0.0), scaler, skip_spikes=rule)
        update = jax.jit(tx.update)
        state = tx.init(params)
        for i in range(4):  # warm the statistics up
            _, state = update({"w": jnp.full(4, 1.0 + 0.01 * i)}, state, params)
        _, state = update({"w": jnp.full(4, 1.0).at[2].set(bad)}, state, params)
        m = jls.metrics(state)
        assert not bool(m["spike"]) and int(m["total_spikes"]) == 0
        assert bool(m["skipped"]) == scaler.skip_nonfinite
        assert bool(m["nonfinite"])


@pytest.mark.parametrize(
    "field, value",
    [
        ("norm_mean", np.nan),
        ("norm_var", np.inf),
        ("norm_var", -1.0),
        ("loss_mean", np.inf),
        ("count", -5),
    ],
)
def test_statistics_from_a_checkpoint_are_not_trusted(field, value):
    rule = jls.SpikeRule(warmup=3, threshold=3.0, watch="both")
    tx = jls.loss_scaling(optax.sgd(0.0), jls.no_scale(), skip_spikes=rule)
    params = {"w": jnp.ones(4)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    bad = state.spikes._replace(
        **{field: jnp.asarray(value, getattr(state.spikes, field).dtype)}
    )
    state = state._replace(spikes=bad)
    # The rule restarts: it warms up again and then catches a spike.
    spikes = []
    for i in range(8):
        g = 50.0 if i == 7 else 1.0 + 0.01 * i
        _, state = update(
            {"w": jnp.full(4, g)}, state, params, loss=jnp.float32(1.0 + 0.01 * i)
        )
        spikes.append(bool(jls.metrics(state)["spike"]))
        for x in jax.tree.leaves(state.spikes):
            assert np.all(np.isfinite(np.asarray(x, np.float64)))
    assert spikes == [False] * 7 + [True]


@pytest.mark.parametrize("threshold", [1e39, 1e-45, float("inf"), float("nan")])
def test_a_threshold_float32_cannot_hold_is_refused(threshold):
    with pytest.raises(ValueError, match="threshold"):
        jls.SpikeRule(threshold=threshold)


def test_the_rule_recovers_when_the_warm_up_saw_one_value():
    # A loss weighted 0 during warm-up: std 0, so every later larger value
    # is a spike. After `patience` of them in a row the statistics restart,
    # learn the new level, and the run goes on.
    rule = jls.SpikeRule(warmup=5, threshold=6.0, watch="loss", patience=10)
    tx = jls.loss_scaling(optax.sgd(0.0), jls.no_scale(), skip_spikes=rule)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    skipped = []
    rng = np.random.default_rng(0)
    for i in range(60):
        loss = 0.0 if i < 5 else 2.0 + 0.1 * rng.standard_normal()
        _, state = update({"w": jnp.ones(2)}, state, params, loss=jnp.float32(loss))
        skipped.append(bool(jls.metrics(state)["skipped"]))
    assert skipped[:5] == [False] * 5
    assert skipped[5:15] == [True] * 10  # the patience
    assert not any(skipped[15:])  # warm-up again, then the new normal
    assert int(jls.metrics(state)["total_spikes"]) == 10
