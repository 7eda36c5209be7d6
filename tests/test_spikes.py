"""The spike rule (`jls.hooks.SpikeRule`), against a reference of its statistics."""

# pyright: reportIndexIssue=false, reportAttributeAccessIssue=false
# pyright: reportArgumentType=false, reportOperatorIssue=false
# pyright: reportAssignmentType=false

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jls


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


def _loss_rule_tx(scaler=None, **kw):
    rule = jls.hooks.SpikeRule(watch="loss", warmup=3, threshold=3.0, **kw)
    return jls.loss_scaling(optax.sgd(0.01), scaler or jls.no_scale(), skip_spikes=rule)


@pytest.mark.parametrize("scaler", [jls.no_scale(), jls.dynamic_scale(2.0**8)])
def test_spikes_are_skipped_and_do_not_feed_the_statistics(scaler):
    rule = jls.hooks.SpikeRule(threshold=4.0, warmup=10, window=20)
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
            assert new.hooks["spikes"].count == state.hooks["spikes"].count
        else:
            ref.feed(norm)
            np.testing.assert_allclose(
                float(new.hooks["spikes"].norm_mean), ref.mean, rtol=1e-5
            )
        state = new
    assert spikes == 3 and int(jls.metrics(state)["total_spikes"]) == 3
    assert int(jls.metrics(state)["total_skips"]) == 3
    # A spike is finite: the scale does not back off for it.
    assert float(jls.metrics(state)["loss_scale"]) == scaler.init_scale


def test_watching_the_loss_needs_it_and_takes_it_from_train_step():
    rule = jls.hooks.SpikeRule(watch="loss", warmup=3, threshold=3.0)
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
        jls.hooks.SpikeRule(**kwargs)


def test_a_state_without_the_statistics_is_refused():
    params = {"w": jnp.ones(3)}
    plain = jls.loss_scaling(optax.sgd(0.1))
    spiky = jls.loss_scaling(optax.sgd(0.1), skip_spikes=jls.hooks.SpikeRule())
    with pytest.raises(TypeError, match=r"no state for the hooks \['spikes'\]"):
        spiky.update(params, plain.init(params), params)
    normed = jls.loss_scaling(optax.sgd(0.1), gradient_norm=True)
    with pytest.raises(TypeError, match="gradient_norm"):
        normed.update(params, plain.init(params), params)


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
        [
            sys.executable,
            str(root / "tests" / "integration" / "scripts" / "measured_shard_map.py"),
        ],
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


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nonfinite_loss_is_skipped_not_a_spike_and_feeds_nothing(bad):
    # A non-finite loss is the nonfinite_loss hook's business: skipped with
    # the scale held, never counted as a spike, never fed to the statistics.
    tx = _loss_rule_tx()
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for i, loss in enumerate([1.0, bad, 1.01, 0.99, 1.0, 1e3]):
        _, new = update({"w": jnp.ones(2)}, state, params, loss=jnp.float32(loss))
        m = jls.metrics(new)
        assert bool(m["spike"]) == (i == 5), i
        assert bool(m["skipped"]) == (i in (1, 5)), i
        assert bool(m["nonfinite_loss"]) == (i == 1), i
        assert np.isfinite(float(new.hooks["spikes"].loss_mean))
        assert np.isfinite(float(new.hooks["spikes"].loss_var))
        state = new


def test_a_huge_first_value_does_not_make_the_statistics_nan():
    tx = _loss_rule_tx()
    params = {"w": jnp.ones(2)}
    _, state = tx.update({"w": jnp.ones(2)}, tx.init(params), params, loss=1e20)
    _, state = tx.update({"w": jnp.ones(2)}, state, params, loss=1.0)
    assert np.isfinite(float(state.hooks["spikes"].loss_var))


def test_applied_nonfinite_steps_do_not_feed_the_norm_statistics():
    rule = jls.hooks.SpikeRule(warmup=2)
    scaler = jls.no_scale(skip_nonfinite=False)
    tx = jls.loss_scaling(optax.sgd(0.01), scaler, skip_spikes=rule)
    params = {"w": jnp.ones(2)}
    _, state = tx.update({"w": jnp.array([1.0, jnp.nan])}, tx.init(params), params)
    assert (
        int(state.hooks["spikes"].count) == 0
        and float(state.hooks["spikes"].norm_mean) == 0.0
    )


def test_a_vetoed_spike_holds_the_measured_scale():
    tx = jls.loss_scaling(
        optax.sgd(0.01),
        jls.measured_scale(init_scale=2.0**10),
        skip_spikes=jls.hooks.SpikeRule(warmup=3, threshold=3.0),
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


def test_flax_train_state_takes_the_loss():
    from flax.training import train_state  # noqa: F401

    import jls.flax

    params = {"w": jnp.ones(2)}
    tx = _loss_rule_tx()
    state = jls.flax.TrainState.create(apply_fn=None, params=params, tx=tx)
    state = state.apply_gradients(grads={"w": jnp.ones(2)}, loss=jnp.float32(1.0))
    assert int(state.step) == 1


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_nonfinite_gradient_is_the_checks_business_not_a_spike(bad):
    # With skip_nonfinite=False such a step is applied, inf and nan alike,
    # and never counted as a spike; with the default it is skipped, not a spike.
    rule = jls.hooks.SpikeRule(warmup=2, threshold=3.0)
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
    rule = jls.hooks.SpikeRule(warmup=3, threshold=3.0, watch="both")
    tx = jls.loss_scaling(optax.sgd(0.0), jls.no_scale(), skip_spikes=rule)
    params = {"w": jnp.ones(4)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    bad = state.hooks["spikes"]._replace(
        **{field: jnp.asarray(value, getattr(state.hooks["spikes"], field).dtype)}
    )
    state = state._replace(hooks={**state.hooks, "spikes": bad})
    # The rule restarts: it warms up again and then catches a spike.
    spikes = []
    for i in range(8):
        g = 50.0 if i == 7 else 1.0 + 0.01 * i
        _, state = update(
            {"w": jnp.full(4, g)}, state, params, loss=jnp.float32(1.0 + 0.01 * i)
        )
        spikes.append(bool(jls.metrics(state)["spike"]))
        for x in jax.tree.leaves(state.hooks["spikes"]):
            assert np.all(np.isfinite(np.asarray(x, np.float64)))
    assert spikes == [False] * 7 + [True]


@pytest.mark.parametrize("threshold", [1e39, 1e-45, float("inf"), float("nan")])
def test_a_threshold_float32_cannot_hold_is_refused(threshold):
    with pytest.raises(ValueError, match="threshold"):
        jls.hooks.SpikeRule(threshold=threshold)


def test_the_rule_recovers_when_the_warm_up_saw_one_value():
    # A loss weighted 0 during warm-up: std 0, so every later larger value
    # is a spike. After `patience` of them in a row the statistics restart,
    # learn the new level, and the run goes on.
    rule = jls.hooks.SpikeRule(warmup=5, threshold=6.0, watch="loss", patience=10)
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
