"""The transformation: `jls.loss_scaling`, `jls.apply_gradients`, `jls.metrics`."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from steps import (
    PATHS,
    X,
    _assert_no_nan,
    _fused_path,
    _loss,
    _params,
    _poison,
    _scaled_grads,
    _update_path,
)

import jls

# pyright: reportIndexIssue=false


def _misuse_cases():
    params = {"w": jnp.ones(3)}
    tx = jls.loss_scaling(optax.sgd(0.1))
    state = tx.init(params)
    grads = {"w": jnp.ones(3)}
    return [
        (
            "apply_gradients without opt_state",
            lambda: jls.apply_gradients(tx, grads, params),
            TypeError,
            r"opt_state is missing",
        ),
        (
            "apply_gradients with params and opt_state swapped",
            lambda: jls.apply_gradients(tx, grads, params, state),
            TypeError,
            r"swapped.*apply_gradients\(tx, grads, opt_state, params\)",
        ),
        (
            "update with params and opt_state swapped",
            lambda: tx.update(grads, params, state),
            TypeError,
            r"swapped",
        ),
        (
            "loss_scaling with the scaler first",
            lambda: jls.loss_scaling(jls.dynamic_scale(), optax.sgd(0.1)),
            TypeError,
            r"inner must be .* the optimizer comes first",
        ),
        (
            "loss_scaling with the optimizer factory",
            lambda: jls.loss_scaling(optax.adam),
            TypeError,
            r"call it: loss_scaling\(optax.adam\(1e-3\)\)",
        ),
        (
            "scale_loss with its arguments swapped",
            lambda: jls.scale_loss(state, jnp.float32(1.0)),
            TypeError,
            r"scale_loss\(loss, opt_state\).*swapped",
        ),
        (
            "unscale with its arguments swapped",
            lambda: jls.unscale(state, grads),
            TypeError,
            r"unscale\(tree, opt_state\).*swapped",
        ),
        (
            "set_loss_scale with its arguments swapped",
            lambda: jls.set_loss_scale(1024.0, state),
            TypeError,
            r"set_loss_scale\(opt_state, scale\).*swapped",
        ),
        (
            "train_step with its arguments swapped",
            lambda: jls.train_step(tx, lambda p, x: jnp.sum(p["w"])),
            TypeError,
            r"train_step\(loss_fn, tx\).*swapped",
        ),
        (
            "update given a state with a Python-float scale",
            lambda: tx.update(
                grads,
                state._replace(loss_scale=state.loss_scale._replace(scale=1024.0)),
                params,
            ),
            TypeError,
            r"opt_state.loss_scale.scale must be a float32",
        ),
        (
            "a loss scale state that is the whole state",
            lambda: jls.loss_scale_state(params),
            ValueError,
            r"found none\.",
        ),
    ]


@pytest.mark.parametrize("path", PATHS)
def test_finite_step_matches_the_plain_optimizer_bitwise(path):
    params = _params()
    inner = optax.adam(1e-2)
    tx = jls.loss_scaling(inner, jls.dynamic_scale(2.0**12, growth_interval=2))
    state, plain_state = tx.init(params), inner.init(params)
    plain_params = params

    @jax.jit
    def plain_step(params, state, scaled_grads, scale_state):
        # The plain optimizer, fed the gradients times 1 / scale (the one
        # factor a scaler capped at 2**126 unscales with) in the same program.
        inv = 1 / scale_state.scale
        grads = jax.tree.map(lambda g: g * inv, scaled_grads)
        u, state = inner.update(grads, state, params)
        return optax.apply_updates(params, u), state

    step = PATHS[path](tx)
    for i in range(3):
        x = X + i
        grads = _scaled_grads(params, state, x)
        # Power-of-two scales unscale exactly.
        scale = jls.metrics(state)["loss_scale"]
        expected = jax.tree.map(lambda g, s=scale: g / s, grads)
        chex.assert_trees_all_equal(jls.unscale(grads, state), expected, strict=True)
        chex.assert_trees_all_close(expected, jax.grad(_loss)(params, x), rtol=1e-6)
        scale_state = jls.loss_scale_state(state)
        params, state, _ = step(params, state, grads)
        plain_params, plain_state = plain_step(
            plain_params, plain_state, grads, scale_state
        )
        chex.assert_trees_all_equal(params, plain_params, strict=True)
        chex.assert_trees_all_equal(state.inner_state, plain_state, strict=True)
    assert float(jls.metrics(state)["loss_scale"]) == 2.0**13


def test_nan_from_the_forward_pass_is_skipped():
    params = _params()
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(4.0))
    state = tx.init(params)

    @jax.jit
    def train_step(params, state, x):
        def loss_fn(p):
            return jls.scale_loss(jnp.sqrt(_loss(p, x) - 10.0), state)  # nan

        grads = jax.grad(loss_fn)(params)
        return jls.apply_gradients(tx, grads, state, params)

    new_params, new_state = train_step(params, state, X)
    chex.assert_trees_all_equal(new_params, params, strict=True)
    assert bool(jls.metrics(new_state)["skipped"])


@pytest.mark.parametrize("path", PATHS)
def test_scaled_gradients_are_unscaled_before_the_inner_optimizer(path):
    params = {"w": jnp.ones(4)}
    tx = jls.loss_scaling(optax.sgd(1.0), jls.static_scale(1024.0))
    state = tx.init(params)
    grads = {"w": jnp.full((4,), 1024.0 * 0.25)}
    new_params, _, _ = PATHS[path](tx)(params, state, grads)
    np.testing.assert_array_equal(new_params["w"], np.full(4, 0.75, np.float32))


@pytest.mark.parametrize("path", PATHS)
def test_scale_below_one_never_applies_an_unscaled_overflow(path):
    # torch checks the scaled gradients; at scale 2**-4 a finite scaled
    # gradient of 1e38 unscales to inf (> float32 max) and must be skipped.
    params = {"w": jnp.zeros(3)}
    tx = jls.loss_scaling(
        optax.sgd(1.0), jls.dynamic_scale(2.0**-4, min_scale=2.0**-10)
    )
    state = tx.init(params)
    grads = {"w": jnp.array([1.0, 1e38, 2.0])}
    new_params, new_state, _ = PATHS[path](tx)(params, state, grads)
    chex.assert_trees_all_equal(new_params, params, strict=True)
    assert bool(jls.metrics(new_state)["skipped"])
    assert float(new_state.loss_scale.scale) == 2.0**-5
    # The same gradient is fine once unscaled at a scale >= 1.
    state = jls.loss_scaling(optax.sgd(1.0)).init(params)
    ok, ok_state, _ = PATHS[path](jls.loss_scaling(optax.sgd(1.0)))(
        params, state, grads
    )
    assert not bool(jls.metrics(ok_state)["skipped"])
    assert float(ok["w"][1]) == -np.float32(1e38) / np.float32(2.0**15)


def test_float16_gradient_overflowing_on_unscale_below_one():
    params = {"w": jnp.zeros(2, jnp.float16)}
    tx = jls.loss_scaling(optax.sgd(1.0), jls.dynamic_scale(0.5, min_scale=2.0**-10))
    state = tx.init(params)
    grads = {"w": jnp.array([60000.0, 1.0], jnp.float16)}  # 120000: f16 inf
    new_params, new_state, _ = _fused_path(tx)(params, state, grads)
    chex.assert_trees_all_equal(new_params, params, strict=True)
    assert bool(jls.metrics(new_state)["skipped"])


def test_skip_nonfinite_false_applies_the_step():
    params = {"w": jnp.ones(2)}
    tx = jls.loss_scaling(optax.sgd(1.0), jls.static_scale(2.0, skip_nonfinite=False))
    state = tx.init(params)
    new_params, new_state, _ = _update_path(tx)(
        params, state, {"w": jnp.array([np.inf, 2.0])}
    )
    assert np.isneginf(new_params["w"][0]) and float(new_params["w"][1]) == 0.0
    m = jls.metrics(new_state)
    assert int(m["total_skips"]) == 0 and not bool(m["skipped"])
    assert int(m["consecutive_nonfinite"]) == 1 and bool(m["nonfinite"])


def test_one_trace_for_100_steps_with_random_overflow():
    params = _params()
    tx = jls.loss_scaling(
        optax.adam(1e-3), jls.dynamic_scale(2.0**4, growth_interval=3)
    )
    state = tx.init(params)
    rng = np.random.default_rng(0)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def train_step(params, state, x, poison):
        def loss_fn(p):
            return jls.scale_loss(_loss(p, x) * poison, state)

        grads = jax.grad(loss_fn)(params)
        return jls.apply_gradients(tx, grads, state, params)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def update_step(params, state, x, poison):
        grads = jax.grad(lambda p: jls.scale_loss(_loss(p, x) * poison, state))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    skips = 0
    for i in range(100):
        bad = rng.random() < 0.2
        skips += bad
        poison = jnp.float32(np.inf if bad else 1.0)
        x = X + i / 100
        params, state = train_step(params, state, x, poison)
        params, state = update_step(params, state, x, poison)
    assert int(jls.metrics(state)["total_skips"]) == 2 * skips
    _assert_no_nan((params, state))


def test_no_scale_is_skip_on_nan_for_bf16():
    params = _params(jnp.bfloat16)
    tx = jls.loss_scaling(optax.adam(1e-2), jls.no_scale())
    state = tx.init(params)
    grads = jax.grad(lambda p: jls.scale_loss(_loss(p, X), state))(params)
    assert jls.scale_loss(jnp.bfloat16(3), state).dtype == jnp.float32
    new_params, _, _ = _fused_path(tx)(params, state, _poison(grads, np.nan))
    chex.assert_trees_all_equal(new_params, params, strict=True)


def test_bad_arguments():
    with pytest.raises(
        TypeError, match="inner must be an optax.GradientTransformation"
    ):
        jls.loss_scaling(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="scaler must be a jls scaler"):
        jls.loss_scaling(optax.sgd(1.0), 1024.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="axis_name must be None, a str"):
        jls.loss_scaling(optax.sgd(1.0), axis_name=0)  # type: ignore[arg-type]
    tx = jls.loss_scaling(optax.sgd(1.0))
    with pytest.raises(TypeError, match="opt_state must be the state made by"):
        tx.update({"w": jnp.ones(2)}, optax.sgd(1.0).init({"w": jnp.ones(2)}))
    with pytest.raises(TypeError, match="made by jls.loss_scaling"):
        jls.apply_gradients(optax.sgd(1.0), {}, (), {})


@pytest.mark.parametrize(
    "case", range(len(_misuse_cases())), ids=[c[0] for c in _misuse_cases()]
)
def test_wrong_calls_name_the_argument_and_the_fix(case):
    _, call, error, match = _misuse_cases()[case]
    with pytest.raises(error, match=match):
        call()


def test_metrics():
    scaler = jls.dynamic_scale(8.0, growth_interval=2)
    state = scaler.init()
    seen = []
    for finite in [True, False, False, True, True]:
        state = scaler.adjust(state, finite)
        m = jax.jit(jls.metrics)(state)
        seen.append(
            (
                float(m["loss_scale"]),
                bool(m["skipped"]),
                int(m["consecutive_skips"]),
                int(m["total_skips"]),
            )
        )
    assert seen == [
        (8.0, False, 0, 0),
        (4.0, True, 1, 1),
        (2.0, True, 2, 2),
        (2.0, False, 0, 2),
        (4.0, False, 0, 2),
    ]
    assert {k: v.dtype for k, v in jls.metrics(state).items()} == {
        "loss_scale": jnp.float32,
        "skipped": jnp.bool_,
        "consecutive_skips": jnp.int32,
        "total_skips": jnp.int32,
        "growth_count": jnp.int32,
        "nonfinite": jnp.bool_,
        "consecutive_nonfinite": jnp.int32,
        "retries": jnp.int32,
    }


SETTINGS = {
    "dynamic": jls.dynamic_scale(),
    "measured": jls.measured_scale(),
    "static": jls.static_scale(8.0),
    "no_scale": jls.no_scale(),
    "off": jls.no_scale(skip_nonfinite=False),
    "applying": jls.presets.mindspore_fixed(1024.0, False),
}
OPTIONS = [
    {},
    {"max_consecutive_skips": None},
    {"gradient_norm": True},
    {"diagnostics": True, "skip_spikes": jls.hooks.SpikeRule(), "scale_stats": True},
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "default")
def test_every_setting_reports_the_same_metric_keys(options):
    # One script, every precision: a logger written for the float16 run
    # (dynamic or measured) must not crash on the bfloat16 or float32 one
    # (no_scale, or jls off). The off switch used to lack nonfinite_loss.
    params = _params()
    keys = {}
    for name, scaler in SETTINGS.items():
        tx = jls.loss_scaling(optax.sgd(0.1), scaler, **options)
        state = tx.init(params)
        keys[name, "init"] = set(jls.metrics(state))
        grads = _scaled_grads(params, state)
        for path, step in PATHS.items():
            _, after, _ = step(tx)(params, state, grads)
            keys[name, path] = set(jls.metrics(after))
    assert len({frozenset(k) for k in keys.values()}) == 1, keys
    assert "nonfinite_loss" in keys["off", "init"]


@pytest.mark.parametrize("name", ["off", "applying", "dynamic"])
def test_the_nonfinite_loss_key_is_recorded_in_every_setting(name):
    tx = jls.loss_scaling(optax.sgd(0.1), SETTINGS[name])
    params = _params()
    state = tx.init(params)
    grads = _scaled_grads(params, state)
    step = jax.jit(lambda g, s, loss: jls.apply_gradients(tx, g, s, params, loss=loss))
    _, after = step(grads, state, jnp.float32(jnp.nan))
    assert bool(jls.metrics(after)["nonfinite_loss"])
    # Recorded only where the scaler applies non-finite steps: not skipped.
    assert bool(jls.metrics(after)["skipped"]) == (name == "dynamic")
    _, after = step(grads, after, jnp.float32(1.0))
    assert not bool(jls.metrics(after)["nonfinite_loss"])


def test_the_docstring_names_every_key_a_default_transformation_reports():
    # jls.metrics' "Returns:" lists the keys of jls.loss_scaling(inner)'s
    # state one by one; hooks added on top are named by builtin_metrics.
    import re

    doc = jls.metrics.__doc__ or ""
    returns = doc[doc.index("Returns:") : doc.index("Example:")]
    named = set(re.findall(r"``(\w+)``", returns))
    tx = jls.loss_scaling(optax.sgd(0.1))
    keys = set(jls.metrics(tx.init({"w": jnp.zeros(2)})))
    assert keys <= named, sorted(keys - named)
