"""Clipping spikes (`jls.hooks.SpikeRule(action="clip")`), against a reference.

A clipped spike is applied with its unscaled gradients multiplied by
``limit / norm`` (``limit = mean + threshold * std`` of the statistics
before the step), and the statistics are fed ``limit``. Everything that is
not a spike is bitwise what the step does without the rule.
"""

# pyright: reportIndexIssue=false, reportAttributeAccessIssue=false
# pyright: reportArgumentType=false, reportOperatorIssue=false
# pyright: reportCallIssue=false

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jls


class RefClip:
    """ZClip's statistics in float64: what a clipped step feeds them."""

    def __init__(self, rule):
        self.rule, self.count, self.mean, self.var = rule, 0, 0.0, 0.0

    def limit(self):
        return self.mean + self.rule.threshold * np.sqrt(self.var)

    def step(self, norm):
        """The factor this step's gradients get; feeds the statistics."""
        limit = self.limit()
        spike = self.count >= self.rule.warmup and norm > limit
        factor = limit / norm if spike else 1.0
        fed = limit if spike else norm
        self.count += 1
        a = max(1 / self.count, 1 / self.rule.window)
        d = fed - self.mean
        self.mean, self.var = self.mean + a * d, (1 - a) * (self.var + a * d * d)
        return spike, factor, limit


RULE = jls.hooks.SpikeRule(threshold=3.0, warmup=5, window=20, action="clip")


def _grads(rng, factor):
    return {
        "w": jnp.asarray(rng.normal(size=(8, 16)) * factor, jnp.float32),
        "b": jnp.asarray(rng.normal(size=16) * factor, jnp.float32),
    }


@pytest.mark.parametrize("scaler", [jls.no_scale(), jls.dynamic_scale(2.0**10)])
def test_spikes_are_applied_clipped_and_feed_the_limit(scaler):
    params = {"w": jnp.zeros((8, 16)), "b": jnp.zeros(16)}
    tx = jls.loss_scaling(optax.sgd(1.0), scaler, skip_spikes=RULE, gradient_norm=True)
    state = tx.init(params)
    ref = RefClip(RULE)
    rng = np.random.default_rng(0)
    update = jax.jit(tx.update)
    clipped = 0
    for i in range(60):
        factor = 50.0 if i in (12, 30, 31, 45) else 1.0
        g = _grads(rng, factor)
        scale = jls.metrics(state)["loss_scale"]
        updates, new = update(jax.tree.map(lambda x, s=scale: x * s, g), state, params)
        m = jls.metrics(new)
        norm = float(m["gradient_norm"])  # the unclipped norm
        np.testing.assert_allclose(norm, float(optax.tree.norm(g)), rtol=1e-6)
        spike, want, limit = ref.step(norm)
        assert bool(m["spike"]) == spike, i
        assert not bool(m["skipped"]), i  # a clipped spike is applied
        clipped += spike
        # sgd(1.0): the update is minus the clipped gradient.
        for k in g:
            np.testing.assert_allclose(
                np.asarray(updates[k]), -np.asarray(g[k]) * want, rtol=2e-6, atol=0
            )
        if spike:  # clipped to the limit: its norm is the limit
            np.testing.assert_allclose(
                float(optax.tree.norm(updates)), limit, rtol=1e-5
            )
        np.testing.assert_allclose(
            float(new.hooks["spikes"].norm_mean), ref.mean, rtol=1e-5
        )
        np.testing.assert_allclose(
            float(new.hooks["spikes"].norm_var), ref.var, rtol=1e-4
        )
        state = new
    assert clipped == 4 and int(jls.metrics(state)["total_spikes"]) == 4
    assert int(jls.metrics(state)["total_skips"]) == 0
    assert float(jls.metrics(state)["loss_scale"]) == scaler.init_scale


def _run(tx, grads_seq, params, *, fused):
    state = tx.init(params)
    if fused:
        step = jax.jit(lambda g, s, p: jls.apply_gradients(tx, g, s, p))
    else:

        def step(g, s, p):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        step = jax.jit(step)
    out = []
    for g in grads_seq:
        params, state = step(g, state, params)
        out.append((params, state.inner_state, state.loss_scale))
    return out


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("init_scale", [1.0, 2.0**10, 2.0**70])
def test_without_spikes_clipping_changes_no_bit(fused, init_scale):
    # Against the skipping rule: the same check (the sum of squares, which
    # measures the norm), so the same compiled step but the factor. float16
    # gradients at a dynamic scale unscale exactly, and a factor of 1 (folded
    # into the scalar reciprocal) must keep them so; 2**70 takes the
    # two-factor unscaling. Under no_scale there is no unscaling to fold it
    # into: the multiplication by 1 changes how XLA contracts Adam's
    # arithmetic into FMAs, so the moments may differ in the last bit (the
    # README says so); the values are checked to float32 rounding.
    rng = np.random.default_rng(1)
    if init_scale == 1:
        scaler = jls.no_scale()
        w = lambda: jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)  # noqa: E731
    else:
        scaler = jls.dynamic_scale(init_scale, growth_interval=3)
        w = lambda: jnp.asarray(  # noqa: E731
            rng.normal(size=(4, 8)) * min(init_scale, 2.0**10), jnp.float16
        )
    seq = [
        {"w": w(), "b": jnp.asarray(rng.normal(size=8) * init_scale, jnp.float32)}
        for _ in range(10)
    ]
    params = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), seq[0])
    adam = optax.adam(1e-2)
    skip = jls.hooks.SpikeRule(threshold=3.0, warmup=5, window=20, action="skip")
    want = _run(
        jls.loss_scaling(adam, scaler, skip_spikes=skip), seq, params, fused=fused
    )
    got = _run(
        jls.loss_scaling(adam, scaler, skip_spikes=RULE), seq, params, fused=fused
    )
    if init_scale == 1:
        chex.assert_trees_all_close(got, want, rtol=1e-6, atol=0)
    else:
        chex.assert_trees_all_equal(got, want)


@pytest.mark.parametrize(
    ("scale", "clipped"), [(2.0**100, True), (2.0**126, False), (2.0**127, False)]
)
def test_a_spike_float32_cannot_clip_is_skipped(scale, clipped):
    # limit / norm / scale below the smallest normal float32 would flush the
    # unscaled gradients to zero: such a spike is skipped (and counted),
    # never applied as a zero step. At 2**100 the factor 1e-3 is carried.
    rule = jls.hooks.SpikeRule(threshold=1.0, warmup=2, window=4, action="clip")
    tx = jls.loss_scaling(optax.sgd(1.0), jls.static_scale(scale), skip_spikes=rule)
    params = {"w": jnp.zeros(4, jnp.float32)}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(3):
        _, state = update({"w": jnp.full(4, 1e-3 * scale)}, state, params)
    updates, new = update({"w": jnp.full(4, 1.0 * scale)}, state, params)
    m = jls.metrics(new)
    assert bool(m["spike"]) and int(m["total_spikes"]) == 1
    assert bool(m["skipped"]) == (not clipped)
    if clipped:  # three norms of 2e-3: std 0, limit 2e-3
        np.testing.assert_allclose(float(optax.tree.norm(updates)), 2e-3, rtol=1e-5)
    else:
        chex.assert_trees_all_equal(new.inner_state, state.inner_state)
        assert int(new.hooks["spikes"].count) == int(state.hooks["spikes"].count)


@pytest.mark.parametrize("action", ["skip", "clip"])
def test_finite_gradients_whose_norm_overflows_are_a_spike(action):
    # Every gradient is finite (the check applies the step) but the norm is
    # past the float32 maximum: a spike, skipped either way (float32 cannot
    # clip it), never applied as it is.
    rule = jls.hooks.SpikeRule(threshold=3.0, warmup=3, window=10, action=action)
    tx = jls.loss_scaling(optax.sgd(2.0), jls.no_scale(), skip_spikes=rule)
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    for i in range(5):
        _, state = tx.update({"w": jnp.ones(2) * (1 + 0.01 * i)}, state, params)
    updates, new = tx.update({"w": jnp.full(2, 3e38, jnp.float32)}, state, params)
    m = jls.metrics(new)
    assert bool(m["spike"]) and bool(m["skipped"])
    assert np.all(np.isfinite(np.asarray(optax.apply_updates(params, updates)["w"])))


def test_a_negative_mean_norm_from_a_checkpoint_restarts_the_statistics():
    rule = jls.hooks.SpikeRule(threshold=3.0, warmup=2, window=10, action="clip")
    tx = jls.loss_scaling(optax.sgd(1.0), jls.no_scale(), skip_spikes=rule)
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    bad = state.hooks["spikes"]._replace(
        count=jnp.int32(50), norm_mean=jnp.float32(-1e6)
    )
    state = state._replace(hooks={**state.hooks, "spikes": bad})
    updates, state = tx.update({"w": jnp.ones(2)}, state, params)
    np.testing.assert_array_equal(np.asarray(updates["w"]), -np.ones(2))
    assert int(state.hooks["spikes"].count) == 1


def test_a_skipped_step_changes_nothing_in_the_statistics():
    params = {"w": jnp.zeros(16)}
    tx = jls.loss_scaling(optax.adam(0.1), jls.dynamic_scale(8.0), skip_spikes=RULE)
    state = tx.init(params)
    update = jax.jit(tx.update)
    rng = np.random.default_rng(2)
    for _ in range(8):
        _, state = update({"w": jnp.asarray(rng.normal(size=16) * 8.0)}, state, params)
    for bad in (np.inf, np.nan):
        g = np.asarray(rng.normal(size=16) * 8.0)
        g[3] = bad
        updates, new = update({"w": jnp.asarray(g)}, state, params)
        assert bool(jls.metrics(new)["skipped"])
        chex.assert_trees_all_equal(new.inner_state, state.inner_state)
        kept = new.hooks["spikes"]._replace(spike=state.hooks["spikes"].spike)
        chex.assert_trees_all_equal(kept, state.hooks["spikes"])
        assert not bool(new.hooks["spikes"].spike)
        assert np.all(np.asarray(updates["w"]) == 0)


def test_one_trace_for_clipped_and_unclipped_steps():
    traces = []
    params = {"w": jnp.zeros(16)}
    tx = jls.loss_scaling(optax.adam(0.1), skip_spikes=RULE)

    @jax.jit
    def step(g, s, p):
        traces.append(1)
        return jls.apply_gradients(tx, g, s, p)

    state = tx.init(params)
    rng = np.random.default_rng(3)
    scale = float(jls.metrics(state)["loss_scale"])
    for i in range(12):
        factor = 100.0 if i == 9 else 1.0
        g = {"w": jnp.asarray(rng.normal(size=16) * factor * scale, jnp.float32)}
        params, state = step(g, state, params)
    assert int(jls.metrics(state)["total_spikes"]) == 1
    assert len(traces) == 1


def _reductions(tx, params, grads):
    step = jax.jit(lambda g, s, p: jls.apply_gradients(tx, g, s, p))
    text = step.lower(grads, tx.init(params), params).compile().as_text()
    return len(re.findall(r" reduce\(", text))


def test_clipping_reads_the_gradients_no_second_time():
    # The factor is multiplied into the unscaling: the compiled step has the
    # reductions of the skipping rule, no more (optax.clip_by_global_norm
    # would add its own pass over the gradients).
    params = {"w": jnp.zeros((64, 64)), "b": jnp.zeros(64)}
    grads = jax.tree.map(jnp.ones_like, params)
    adam = optax.adam(1e-3)
    skip = jls.loss_scaling(adam, skip_spikes=jls.hooks.SpikeRule(action="skip"))
    clip = jls.loss_scaling(adam, skip_spikes=jls.hooks.SpikeRule(action="clip"))
    chained = jls.loss_scaling(
        optax.chain(optax.clip_by_global_norm(1.0), adam),
        skip_spikes=jls.hooks.SpikeRule(action="skip"),
    )
    n_skip, n_clip = _reductions(skip, params, grads), _reductions(clip, params, grads)
    assert n_clip == n_skip
    assert _reductions(chained, params, grads) > n_skip


def test_replicas_apply_the_same_factor():
    # Four replicas with different (unaveraged) gradients: the statistics
    # and the factor are agreed, so each update is its gradient times the
    # same factor.
    rule = jls.hooks.SpikeRule(threshold=2.0, warmup=3, window=10, action="clip")
    tx = jls.loss_scaling(
        optax.sgd(1.0), jls.no_scale(), axis_name={"r": True}, skip_spikes=rule
    )  # each replica's gradient its own: added as shards
    params = jnp.zeros((4, 32))
    state = jax.vmap(tx.init)(params)
    update = jax.jit(jax.vmap(tx.update, axis_name="r"))
    rng = np.random.default_rng(5)
    for i in range(6):
        factor = 40.0 if i == 5 else 1.0
        g = jnp.asarray(rng.normal(size=(4, 32)) * factor, jnp.float32)
        updates, state = update(g, state, params)
    spikes = state.hooks["spikes"]
    assert np.all(np.asarray(spikes.spike))
    for leaf in jax.tree.leaves(spikes):
        leaf = np.asarray(leaf)
        assert np.all(leaf == leaf[0])
    ratio = np.asarray(updates) / -np.asarray(g)
    np.testing.assert_allclose(ratio, ratio[0, 0], rtol=1e-6)
    assert ratio[0, 0] < 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"action": "shrink"}, "action must be one of"),
        ({"action": "clip", "watch": "loss"}, "needs watch='norm'"),
        ({"action": "clip", "watch": "both"}, "watch='both'"),
    ],
)
def test_action_is_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jls.hooks.SpikeRule(**kwargs)


class _Factor(jls.hooks.Hook):
    name = "factor"

    def __init__(self, value):
        self.value = value

    def gradient_factor(self, state, info):
        return self.value


@pytest.mark.parametrize("value", [2.0, -0.5, np.nan, np.inf])
def test_a_hooks_factor_outside_0_1_changes_nothing(value):
    params = {"w": jnp.ones(4)}
    tx = jls.loss_scaling(optax.sgd(1.0), hooks=[_Factor(jnp.float32(value))])
    g = {"w": jnp.full(4, 2.0**15)}
    updates, _ = tx.update(g, tx.init(params), params)
    np.testing.assert_array_equal(np.asarray(updates["w"]), -np.ones(4))


def test_a_hooks_factor_shrinks_the_update():
    params = {"w": jnp.ones(4)}
    tx = jls.loss_scaling(optax.sgd(1.0), hooks=[_Factor(jnp.float32(0.25))])
    updates, _ = tx.update({"w": jnp.full(4, 2.0**15)}, tx.init(params), params)
    np.testing.assert_array_equal(np.asarray(updates["w"]), -np.full(4, 0.25))


def test_a_hooks_factor_must_be_a_floating_scalar():
    params = {"w": jnp.ones(4)}
    tx = jls.loss_scaling(optax.sgd(1.0), hooks=[_Factor(jnp.ones(2))])
    with pytest.raises(TypeError, match="gradient_factor must return a floating"):
        tx.update(params, tx.init(params), params)
