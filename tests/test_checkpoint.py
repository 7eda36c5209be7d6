"""Checkpoints saved by an older jls restore onto today's state (`upgrade_state`).

The old layouts are written here as they were in the commits that saved them:
jls 0.1 (``4939730``: a 7-field ``LossScaleState``, a 4-field
``WrapperState``) and jls 0.2 (``29871bb``: ``headroom`` added, the spike
rule's statistics without ``consecutive_spikes``). Each is saved with orbax
exactly as a run of that version saved it, then restored the documented way.
"""

# pyright: reportAttributeAccessIssue=false

import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jls


class OldLossScaleState(NamedTuple):
    """jls 0.1 (4939730)."""

    scale: Any
    growth_count: Any
    backoff_count: Any
    consecutive_skips: Any
    total_skips: Any
    consecutive_nonfinite: Any
    retries: Any


class OldWrapperState(NamedTuple):
    """jls 0.1 (4939730)."""

    loss_scale: Any
    inner_state: Any
    nonfinite_leaves: Any = None
    diverged: Any = None


class V2SpikeState(NamedTuple):
    """jls 0.2 (29871bb)."""

    count: Any
    norm_mean: Any
    norm_var: Any
    loss_mean: Any
    loss_var: Any
    spike: Any
    total_spikes: Any


class V2WrapperState(NamedTuple):
    """jls 0.2 (29871bb)."""

    loss_scale: Any
    inner_state: Any
    nonfinite_leaves: Any = None
    diverged: Any = None
    gradient_norm: Any = None
    spikes: Any = None


PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.zeros(3)}


def _i32(x):
    return jnp.asarray(np.int32(x))


def _old_scale():
    return OldLossScaleState(
        jnp.float32(2.0**12), _i32(17), _i32(0), _i32(0), _i32(5), _i32(0), _i32(0)
    )


def _save(path: pathlib.Path, tree) -> pathlib.Path:
    path = path.absolute() / "ckpt"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, tree)
    return path


def _restore_raw(path: pathlib.Path):
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path)


def test_a_jls_0_1_checkpoint_resumes(tmp_path):
    inner = optax.adam(1e-2)
    tx = jls.loss_scaling(inner, max_consecutive_skips=10)
    adam = inner.init(PARAMS)
    adam = jax.tree.map(lambda x: x + 1 if x.dtype == jnp.float32 else x + 3, adam)
    old = OldWrapperState(_old_scale(), adam, None, jnp.asarray(False))
    path = _save(tmp_path, {"params": PARAMS, "opt_state": old})

    target = {"params": PARAMS, "opt_state": tx.init(PARAMS)}
    # As it is, orbax refuses: the structure changed.
    with pytest.raises(Exception):  # noqa: B017 (orbax's error type varies)
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.restore(path, target)
    state = jls.upgrade_state(_restore_raw(path), target)
    assert jax.tree.structure(state) == jax.tree.structure(target)
    ls = state["opt_state"].loss_scale
    assert float(ls.scale) == 2.0**12 and int(ls.growth_count) == 17
    assert int(ls.total_skips) == 5
    assert float(ls.headroom) == 1.0 and ls.headroom.dtype == jnp.float32
    for got, want in zip(
        jax.tree.leaves(state["opt_state"].inner_state),
        jax.tree.leaves(adam),
        strict=False,
    ):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype
    # And the run goes on with the restored state, one trace.
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 2.0**12, PARAMS)
    params, opt = jax.jit(lambda g, s, p: jls.apply_gradients(tx, g, s, p))(
        grads, state["opt_state"], state["params"]
    )
    assert int(jls.metrics(opt)["growth_count"]) == 18
    assert int(optax.tree.get(opt, "count")) == int(adam[0].count) + 1


def test_a_jls_0_2_checkpoint_with_spike_statistics_resumes(tmp_path):
    rule = jls.hooks.SpikeRule(warmup=3)
    tx = jls.loss_scaling(optax.sgd(0.1), skip_spikes=rule, gradient_norm=True)
    scale = jls.LossScaleState(*_old_scale(), jnp.float32(4.0))
    spikes = V2SpikeState(
        _i32(40),
        jnp.float32(1.5),
        jnp.float32(0.25),
        jnp.float32(0),
        jnp.float32(0),
        jnp.asarray(True),
        _i32(2),
    )
    old = V2WrapperState(
        scale,
        (optax.EmptyState(), optax.EmptyState()),
        None,
        None,
        jnp.float32(1.25),
        spikes,
    )
    path = _save(tmp_path, old)
    state = jls.upgrade_state(_restore_raw(path), tx.init(PARAMS))
    assert float(state.loss_scale.headroom) == 4.0
    assert (
        int(state.hooks["spikes"].count) == 40
        and float(state.hooks["spikes"].norm_mean) == 1.5
    )
    assert int(state.hooks["spikes"].total_spikes) == 2 and bool(
        state.hooks["spikes"].spike
    )
    assert (
        int(state.hooks["spikes"].consecutive_spikes) == 0
    )  # the new field, its default
    assert float(jls.metrics(state)["gradient_norm"]) == 1.25


def test_only_jls_fields_may_be_missing(tmp_path):
    tx = jls.loss_scaling(optax.adam(1e-2))
    old = OldWrapperState(_old_scale(), optax.sgd(0.1).init(PARAMS))
    path = _save(tmp_path, {"params": PARAMS, "opt_state": old})
    raw = _restore_raw(path)
    target = {"params": PARAMS, "opt_state": tx.init(PARAMS)}
    with pytest.raises(KeyError, match="inner_state"):
        jls.upgrade_state(raw, target)  # sgd's checkpoint, adam's target
    sgd = jls.loss_scaling(optax.sgd(0.1))
    target = {"params": PARAMS, "opt_state": sgd.init(PARAMS)}
    jls.upgrade_state(raw, target)  # the right target
    with pytest.raises(KeyError, match="no place for"):
        jls.upgrade_state({**raw, "extra": jnp.ones(2)}, target)


def test_a_jls_0_3_checkpoint_resumes_bitwise():
    # tests/data/jls_0_3_checkpoint.py wrote both files with jls 0.3: a state
    # with every built-in hook after 5 steps (one skipped), and the step
    # after it. Restored without a target and upgraded onto this jls's
    # structure, the same step gives the same bits.
    import pathlib

    from flax import serialization

    data = pathlib.Path(__file__).parent / "data"
    raw = serialization.msgpack_restore(
        (data / "jls_0_3_checkpoint.msgpack").read_bytes()
    )
    params = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
    tx = jls.loss_scaling(
        optax.adam(1e-2),
        jls.dynamic_scale(2.0**8, growth_interval=2),
        diagnostics=True,
        gradient_norm=True,
        skip_spikes=jls.hooks.SpikeRule(warmup=2),
        scale_stats=True,
    )
    tree = jls.upgrade_state(raw, {"params": params, "opt_state": tx.init(params)})
    g = jax.tree.map(lambda x: jnp.full(x.shape, 3.0 * 2.0**8), params)
    step = jax.jit(lambda p, s, g: jls.apply_gradients(tx, g, s, p, loss=1.0))
    new_params, new_state = step(tree["params"], tree["opt_state"], g)
    want = np.load(data / "jls_0_3_next_step.npz")
    got = {
        "['params']": new_params,
        "['opt_state'].loss_scale": new_state.loss_scale,
        "['opt_state'].inner_state": new_state.inner_state,
    }
    for prefix, tree in got.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            key = prefix + jax.tree_util.keystr(path)
            np.testing.assert_array_equal(np.asarray(leaf), want[key], err_msg=key)
    m = jls.metrics(new_state)
    assert float(m["gradient_norm"]) == float(
        want["['opt_state'].hooks['gradient_norm']"]
    )
    assert bool(m["diverged"]) == bool(want["['opt_state'].hooks['divergence']"])
    hooks = "['opt_state'].hooks"
    assert int(m["total_spikes"]) == int(want[f"{hooks}['spikes'].total_spikes"])


def test_an_off_switch_checkpoint_without_the_nonfinite_loss_record_resumes():
    # Before jls 0.4 a scaler that applies non-finite steps (the off switch)
    # had no nonfinite_loss hook state; it now records one (the metrics keep
    # their keys in every setting). A raw checkpoint of the old layout.
    tx = jls.loss_scaling(optax.sgd(0.1), jls.no_scale(skip_nonfinite=False))
    target = tx.init({"w": jnp.zeros(2)})
    old = jax.tree.map(np.asarray, target._asdict())
    old["hooks"] = {k: v for k, v in old["hooks"].items() if k != "nonfinite_loss"}
    old["loss_scale"] = old["loss_scale"]._asdict()
    old["loss_scale"]["total_skips"] = np.int32(5)
    state = jls.upgrade_state(old, target)
    assert jax.tree.structure(state) == jax.tree.structure(target)
    m = jls.metrics(state)
    assert int(m["total_skips"]) == 5 and not bool(m["nonfinite_loss"])


def test_a_saved_nonfinite_loss_flag_resumes_as_a_count():
    # jls 0.3 to 0.5 kept whether the latest loss was not finite (a bool; in
    # 0.3 the hook's bare state); it is now the steps in a row (int32).
    tx = jls.loss_scaling(optax.sgd(0.1))
    target = tx.init({"w": jnp.zeros(2)})
    for saved in ({"nonfinite": np.bool_(True)}, np.bool_(True)):
        old = jax.tree.map(np.asarray, target._asdict())
        old["loss_scale"] = old["loss_scale"]._asdict()
        old["hooks"] = {**old["hooks"], "nonfinite_loss": saved}
        state = jls.upgrade_state(old, target)
        count = state.hooks["nonfinite_loss"].nonfinite
        assert count.dtype == jnp.int32 and int(count) == 1
        _, state = tx.update({"w": jnp.ones(2)}, state, loss=jnp.float32(np.nan))
        assert int(state.hooks["nonfinite_loss"].nonfinite) == 2


def test_a_state_leaf_whose_dtype_the_optimizer_changed_resumes_bitwise():
    # An optimizer may change a state leaf's dtype after init (optax's
    # inject_hyperparams(adamw) keeps a float16 parameter's moments in float32
    # on newer optax): cast to the target's (init's) dtype, the restored leaf
    # would lose its low bits and the next step would not be the run's.
    from flax import serialization

    def init(params):
        return {"acc": jax.tree.map(jnp.zeros_like, params)}  # float16 at init

    def update(updates, state, params=None):
        del params
        acc = jax.tree.map(
            lambda a, g: a.astype(jnp.float32) + 0.1 * g, state["acc"], updates
        )
        return jax.tree.map(lambda a: -a, acc), {"acc": acc}

    params = {"h": jnp.ones(4, jnp.float16)}
    tx = jls.loss_scaling(
        optax.GradientTransformation(init, update), jls.dynamic_scale(2.0**8)
    )
    step = jax.jit(lambda p, s, g: jls.apply_gradients(tx, g, s, p))
    g = {"h": jnp.full(4, 0.1 * 256, jnp.float16)}
    params, state = step(params, tx.init(params), g)
    acc = state.inner_state["acc"]["h"]
    assert acc.dtype == jnp.float32 != tx.init(params).inner_state["acc"]["h"].dtype
    saved = {"params": params, "opt_state": state}
    raw = serialization.msgpack_restore(
        serialization.msgpack_serialize(serialization.to_state_dict(saved))
    )
    tree = jls.upgrade_state(raw, {"params": params, "opt_state": tx.init(params)})
    resumed = tree["opt_state"].inner_state["acc"]["h"]
    assert resumed.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(resumed), np.asarray(acc))
    want = step(params, state, g)
    got = step(tree["params"], tree["opt_state"], g)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
