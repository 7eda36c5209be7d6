"""The optax wrapper and the fused path: skipping, dtypes, composition, traces."""

# Optax types its states loosely (OptState is any pytree); attribute access
# on them and numpy scalars passed as config are checked at run time here.
# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jls

BAD = [np.inf, -np.inf, np.nan]


def _params(dtype=jnp.float32):
    return {
        "dense": {"w": jnp.linspace(-1, 1, 12, dtype=dtype).reshape(3, 4)},
        "bias": jnp.full((4,), 0.5, dtype),
    }


def _loss(params, x):
    h = x @ params["dense"]["w"].astype(jnp.float32)
    h = h + params["bias"].astype(jnp.float32)[None, :]
    return jnp.mean(h**2)


X = jnp.linspace(0, 1, 6, dtype=jnp.float32).reshape(2, 3)


def _scaled_grads(params, state, x=X):
    return jax.grad(lambda p: jls.scale_loss(_loss(p, x), state))(params)


def _poison(tree, bad, leaf=0, where=0):
    leaves, treedef = jax.tree.flatten(tree)
    flat = leaves[leaf].reshape(-1)
    pos = {0: 0, 1: flat.size // 2, 2: flat.size - 1}[where]
    leaves[leaf] = flat.at[pos].set(bad).reshape(leaves[leaf].shape)
    return jax.tree.unflatten(treedef, leaves)


def _update_path(tx):
    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    return step


def _fused_path(tx):
    @jax.jit
    def step(params, state, grads):
        params, state = jls.apply_gradients(tx, grads, state, params)
        return params, state, None

    return step


PATHS = {"update": _update_path, "fused": _fused_path}


def _assert_no_nan(tree):
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            assert bool(jnp.all(jnp.isfinite(leaf))), leaf


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", BAD, ids=str)
@pytest.mark.parametrize("leaf", [0, 1])
@pytest.mark.parametrize("where", [0, 1, 2], ids=["first", "middle", "last"])
def test_skip_leaves_everything_bitwise_unchanged(path, bad, leaf, where):
    params = _params()
    sched = optax.linear_schedule(1e-2, 1e-3, 100)
    tx = jls.loss_scaling(optax.adamw(sched), jls.dynamic_scale(2.0**10))
    state = tx.init(params)
    step = PATHS[path](tx)
    params, state, _ = step(params, state, _scaled_grads(params, state))
    grads = _poison(_scaled_grads(params, state), bad, leaf, where)
    new_params, new_state, updates = step(params, state, grads)
    chex.assert_trees_all_equal(new_params, params, strict=True)
    chex.assert_trees_all_equal(new_state.inner_state, state.inner_state, strict=True)
    assert float(new_state.loss_scale.scale) == 2.0**9
    m = jls.metrics(new_state)
    assert bool(m["skipped"]) and int(m["total_skips"]) == 1
    _assert_no_nan((new_params, new_state))
    if updates is not None:
        chex.assert_trees_all_equal(
            updates, jax.tree.map(jnp.zeros_like, params), strict=True
        )


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


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "pdtype, gdtype",
    [
        (jnp.float32, jnp.float32),
        (jnp.float16, jnp.float16),
        (jnp.bfloat16, jnp.bfloat16),
        (jnp.bfloat16, jnp.float32),  # adam's state becomes float32
        (jnp.float32, jnp.float16),
    ],
    ids=lambda d: jnp.dtype(d).name,
)
@pytest.mark.filterwarnings("ignore:every gradient is bfloat16")
def test_dtypes(path, pdtype, gdtype):
    params = _params(pdtype)
    tx = jls.loss_scaling(optax.adam(1e-2), jls.dynamic_scale(2.0**8))
    state = tx.init(params)
    step = PATHS[path](tx)
    grads = jax.tree.map(lambda g: g.astype(gdtype), _scaled_grads(params, state))
    traces = 0
    for i in range(4):
        g = _poison(grads, np.nan) if i == 2 else grads
        before = (params, state)
        params, state, updates = step(params, state, g)
        if i == 2:
            chex.assert_trees_all_equal(params, before[0], strict=True)
            # Values unchanged; adam's state keeps the dtypes it chose on step 1.
            chex.assert_trees_all_equal(
                jax.tree.map(lambda x: x.astype(jnp.float32), state.inner_state),
                jax.tree.map(lambda x: x.astype(jnp.float32), before[1].inner_state),
            )
        if updates is not None:
            plain = optax.adam(1e-2).update(grads, optax.adam(1e-2).init(params))[0]
            chex.assert_trees_all_equal_dtypes(updates, plain)
        traces = step._cache_size()
    chex.assert_trees_all_equal_dtypes(params, _params(pdtype))
    assert traces <= 2  # plain adam retraces once too when its state dtype changes
    _assert_no_nan((params, state))


@pytest.mark.parametrize("path", PATHS)
def test_integer_and_none_leaves(path):
    params = {"w": jnp.ones(3), "step": jnp.int32(5), "frozen": None}
    inner = optax.multi_transform(
        {"train": optax.sgd(0.5), "int": optax.set_to_zero()},
        {"w": "train", "step": "int", "frozen": "int"},
    )
    tx = jls.loss_scaling(inner, jls.static_scale(4.0))
    state = tx.init(params)
    grads = {"w": jnp.full((3,), 4.0), "step": jnp.int32(0), "frozen": None}
    new_params, _, updates = PATHS[path](tx)(params, state, grads)
    np.testing.assert_array_equal(new_params["w"], np.full(3, 0.5, np.float32))
    assert int(new_params["step"]) == 5 and new_params["step"].dtype == jnp.int32
    bad = dict(grads, w=grads["w"].at[0].set(np.nan))
    skipped, skip_state, updates = PATHS[path](tx)(params, state, bad)
    chex.assert_trees_all_equal(skipped, params, strict=True)
    if updates is not None:
        assert updates["step"].dtype == jnp.int32 and updates["frozen"] is None
    assert bool(jls.metrics(skip_state)["skipped"])


def test_float0_gradients_pass_through():
    params = {"w": jnp.ones(3), "step": jnp.int32(5)}
    state = jls.static_scale(4.0).init()
    grads = jax.grad(lambda p: jls.scale_loss(jnp.sum(p["w"]), state), allow_int=True)(
        params
    )
    assert grads["step"].dtype == jax.dtypes.float0
    out = jax.jit(jls.unscale)(grads, state)
    assert out["step"].dtype == jax.dtypes.float0
    np.testing.assert_array_equal(out["w"], np.ones(3, np.float32))
    assert bool(jax.jit(jls.all_finite)(grads))


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


def test_chain_with_clipping_sees_unscaled_gradients():
    params = _params()
    # A threshold between the unscaled norm and the scaled one (1024x): the
    # clip must leave the step alone, which it does only if it sees the
    # unscaled gradients.
    norm = float(optax.tree.norm(jax.grad(_loss)(params, X)))
    inner = optax.chain(optax.clip_by_global_norm(4 * norm), optax.sgd(1.0))
    tx = jls.loss_scaling(inner, jls.static_scale(2.0**10))
    state = tx.init(params)
    grads = _scaled_grads(params, state)
    new_params, _, _ = _update_path(tx)(params, state, grads)
    sgd = optax.sgd(1.0)
    unclipped = optax.apply_updates(
        params, sgd.update(jax.grad(_loss)(params, X), sgd.init(params))[0]
    )
    chex.assert_trees_all_close(new_params, unclipped, rtol=1e-6)
    plain = optax.apply_updates(
        params, inner.update(jax.grad(_loss)(params, X), inner.init(params))[0]
    )
    chex.assert_trees_all_equal(new_params, plain)


def test_loss_scaling_chained_beside_other_transformations_is_refused():
    params = _params()
    for tx in (
        optax.chain(optax.clip_by_global_norm(1.0), jls.loss_scaling(optax.sgd(0.1))),
        optax.chain(jls.loss_scaling(optax.sgd(0.1)), optax.add_decayed_weights(0.1)),
        optax.chain(optax.identity(), jls.loss_scaling(optax.sgd(0.1))),
    ):
        state = tx.init(params)
        fix = r"jls.loss_scaling\(optax.chain\("
        for use in (
            lambda s: jls.scale_loss(jnp.float32(1.0), s),
            jls.metrics,
            jls.loss_scale_state,
        ):
            with pytest.raises(ValueError, match=fix):
                use(state)
        with pytest.raises(TypeError, match="made by jls.loss_scaling"):
            jls.apply_gradients(tx, params, state, params)
    # Alone in a chain, or with the others inside, it is found.
    for tx in (
        optax.chain(jls.loss_scaling(optax.sgd(0.1))),
        jls.loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))),
    ):
        state = tx.init(params)
        assert float(jls.loss_scale_state(state).scale) == 2.0**15
        assert float(optax.tree.get(state, "scale")) == 2.0**15


def test_extra_args_are_forwarded():
    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None, *, factor):
        return jax.tree.map(lambda u: u * factor, updates), state

    inner = optax.GradientTransformationExtraArgs(init, update)
    tx = jls.loss_scaling(inner, jls.static_scale(2.0))
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    updates, _ = jax.jit(tx.update)({"w": jnp.full(2, 6.0)}, state, params, factor=5.0)
    np.testing.assert_array_equal(updates["w"], np.full(2, 15.0, np.float32))
    updates, _ = jax.jit(tx.update)(
        {"w": jnp.array([np.nan, 6.0])}, state, params, factor=5.0
    )
    np.testing.assert_array_equal(updates["w"], np.zeros(2, np.float32))


@pytest.mark.parametrize("outer", [False, True])
def test_inject_hyperparams(outer):
    params = _params()
    if outer:
        tx = optax.inject_hyperparams(
            lambda learning_rate: jls.loss_scaling(optax.sgd(learning_rate))
        )(learning_rate=0.1)
    else:
        tx = jls.loss_scaling(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
    state = tx.init(params)
    scale = jls.loss_scale_state(state).scale
    assert float(scale) == 2.0**15
    grads = _scaled_grads(params, state)
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    expected = jax.tree.map(lambda g: -0.1 * g, jax.grad(_loss)(params, X))
    chex.assert_trees_all_close(updates, expected, rtol=1e-6)
    bad = _poison(grads, np.nan)
    updates, skipped = jax.jit(tx.update)(bad, new_state, params)
    chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, params))
    assert bool(jls.metrics(skipped)["skipped"])
    if not outer:
        chex.assert_trees_all_equal(skipped.inner_state, new_state.inner_state)


@pytest.mark.parametrize("outer", [False, True])
def test_masked(outer):
    params = _params()
    mask = {"dense": {"w": True}, "bias": False}
    if outer:
        tx = optax.masked(jls.loss_scaling(optax.sgd(1.0), jls.static_scale(4.0)), mask)
    else:
        tx = jls.loss_scaling(optax.masked(optax.sgd(1.0), mask), jls.static_scale(4.0))
    state = tx.init(params)
    grads = _scaled_grads(params, state)
    updates, state = jax.jit(tx.update)(grads, state, params)
    true = jax.grad(_loss)(params, X)
    np.testing.assert_array_equal(updates["dense"]["w"], -true["dense"]["w"])
    if not outer:  # masked-out leaves pass through (unscaled, as jls saw them)
        np.testing.assert_array_equal(updates["bias"], true["bias"])
    bad = _poison(grads, np.nan, leaf=1)  # the masked-in leaf
    updates, state = jax.jit(tx.update)(bad, state, params)
    np.testing.assert_array_equal(updates["dense"]["w"], np.zeros((3, 4), np.float32))
    assert bool(jls.metrics(state)["skipped"])


def _micro_grads(params, state, i, bad):
    g = _scaled_grads(params, state, X + i)
    return _poison(g, np.nan) if bad else g


def test_multisteps_inside_loss_scaling_recommended_order():
    params = _params()
    k = 3
    tx = jls.loss_scaling(optax.MultiSteps(optax.sgd(0.1), k), jls.dynamic_scale(8.0))
    state = tx.init(params)
    step = _update_path(tx)
    # A nan micro-batch (index 1) is dropped alone: the window then completes
    # with micro-batches 0, 2, 3, whatever the scale did in between.
    for i, bad in enumerate([False, True, False, False]):
        params, state, _ = step(params, state, _micro_grads(params, state, i, bad))
        if bad:
            assert float(jls.metrics(state)["loss_scale"]) == 4.0
    _assert_no_nan(state)
    ref = optax.MultiSteps(optax.sgd(0.1), k)
    ref_params = _params()
    ref_state = ref.init(ref_params)
    for i in [0, 2, 3]:
        u, ref_state = ref.update(
            jax.grad(_loss)(ref_params, X + i), ref_state, ref_params
        )
        ref_params = optax.apply_updates(ref_params, u)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-6)
    assert int(state.inner_state.gradient_step) == 1


def test_multisteps_outside_loss_scaling_is_not_poisoned():
    params = _params()
    k = 2
    tx = optax.MultiSteps(
        jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(8.0)),
        k,
        should_skip_update_fn=optax.skip_not_finite,
    )
    state = tx.init(params)
    step = _update_path(tx)
    for i, bad in enumerate([False, True, False, False, False]):
        params, state, _ = step(params, state, _micro_grads(params, state, i, bad))
    _assert_no_nan((params, state))
    assert int(state.gradient_step) == 2
    # The scale is read from inside MultiSteps and stays constant per window.
    assert float(jls.metrics(state)["loss_scale"]) == 8.0


def test_vmap_over_independent_runs():
    params = jax.tree.map(lambda x: jnp.stack([x, x, x]), _params())
    tx = jls.loss_scaling(optax.adam(1e-2), jls.dynamic_scale(16.0))
    state = jax.vmap(tx.init)(params)
    grads = jax.vmap(lambda p, s: _scaled_grads(p, s))(params, state)
    grads = jax.tree.map(lambda g: g.at[1].set(jnp.nan), grads)  # run 1 only
    new_params, new_state = jax.jit(
        jax.vmap(lambda g, s, p: jls.apply_gradients(tx, g, s, p))
    )(grads, state, params)
    np.testing.assert_array_equal(new_state.loss_scale.scale, np.float32([16, 8, 16]))
    chex.assert_trees_all_equal(
        jax.tree.map(lambda x: x[1], new_params), jax.tree.map(lambda x: x[1], params)
    )
    assert not np.array_equal(new_params["bias"][0], params["bias"][0])
    _assert_no_nan((new_params, new_state))


def test_axis_name_makes_replicas_agree():
    params = _params()
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(16.0), axis_name="batch")
    state = tx.init(params)
    xs = jnp.stack([X, X + 1, X + 2, X + 3])
    poison = jnp.array([1.0, 1.0, np.nan, 1.0])

    def replica(x, p):
        grads = jax.grad(lambda q: jls.scale_loss(_loss(q, x) * p, state))(params)
        return jls.apply_gradients(tx, grads, state, params)

    new_params, new_state = jax.jit(jax.vmap(replica, axis_name="batch"))(xs, poison)
    np.testing.assert_array_equal(new_state.loss_scale.scale, np.float32([8] * 4))
    for r in range(4):
        replica_params = jax.tree.map(lambda x, r=r: x[r], new_params)
        chex.assert_trees_all_equal(replica_params, params)
    # Without axis_name each replica decides alone.
    tx_local = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(16.0))

    def local(x, p):
        grads = jax.grad(lambda q: jls.scale_loss(_loss(q, x) * p, state))(params)
        return jls.apply_gradients(tx_local, grads, state, params)

    _, local_state = jax.jit(jax.vmap(local))(xs, poison)
    np.testing.assert_array_equal(
        local_state.loss_scale.scale, np.float32([16, 16, 8, 16])
    )


def test_donated_buffers():
    params = _params()
    tx = jls.loss_scaling(optax.adam(1e-2))
    state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, state, x):
        grads = jax.grad(lambda p: jls.scale_loss(_loss(p, x), state))(params)
        return jls.apply_gradients(tx, grads, state, params)

    for i in range(3):
        old = jax.tree.leaves((params, state))
        params, state = train_step(params, state, X + i)
        # Every donated buffer was consumed (the step updated it in place).
        assert all(x.is_deleted() for x in old)
    _assert_no_nan((params, state))
    assert int(state.inner_state[0].count) == 3


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


def test_weakly_typed_state_keeps_its_types_over_a_skipped_step():
    # jnp.full(..., 0.1) is weakly typed, and so are Adam's moments made
    # from it. A skipped step must return the same types (optax.tree.cast_like
    # would make them strong and the next step would retrace).
    params = {"b": jnp.full((3,), 0.1)}
    tx = jls.loss_scaling(optax.adam(1e-2))
    state = tx.init(params)
    traces = []

    @jax.jit
    def fused(params, state, grads):
        traces.append(1)
        return jls.apply_gradients(tx, grads, state, params)

    for value in (jnp.nan, 1.0, jnp.inf, 2.0):  # the gradients are weak too
        params, state = fused(params, state, {"b": jnp.full((3,), value)})
    assert len(traces) == 1
    # tx.update: the skipped step's state has the types of the initial state
    # (optax.apply_updates itself makes weak parameters strong, as without jls).
    state = tx.init({"b": jnp.full((3,), 0.1)})
    _, after = jax.jit(tx.update)({"b": jnp.full((3,), jnp.nan)}, state)
    assert jax.tree.map(jax.typeof, after) == jax.tree.map(jax.typeof, state)


def test_extra_args_reach_the_inner_optimizer_through_multisteps_and_fused():
    # reduce_on_plateau needs value=; MultiSteps forwards extra args to its
    # inner optimizer, and so must jls, on tx.update and on the fused path.
    inner = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=1))
    params = jnp.ones(2)
    for wrapped in (inner, optax.MultiSteps(inner, every_k_schedule=1)):
        tx = jls.loss_scaling(wrapped, jls.static_scale(2.0))
        state = tx.init(params)
        updates, _ = jax.jit(tx.update)(jnp.full(2, 2.0), state, params, value=1.0)
        np.testing.assert_array_equal(updates, [-1.0, -1.0])
        fused = functools.partial(jls.apply_gradients, tx, value=jnp.float32(1.0))
        new, _ = jax.jit(fused)(jnp.full(2, 2.0), state, params)
        np.testing.assert_array_equal(new, [0.0, 0.0])


def test_inject_hyperparams_inside_keeps_the_fused_path():
    # Wrapped around loss_scaling, inject_hyperparams rebuilds the whole
    # transformation on every update, so there is no LossScaling to reach:
    # the error says to put it inside, where the fused path works and the
    # hyperparameters stay reachable.
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
    tx = jls.loss_scaling(inner, jls.static_scale(2.0))
    params = jnp.ones(2)
    state = tx.init(params)
    state = optax.tree.set(state, learning_rate=jnp.asarray(0.25))
    new, state = jax.jit(functools.partial(jls.apply_gradients, tx))(
        jnp.full(2, 2.0), state, params
    )
    np.testing.assert_array_equal(new, [0.75, 0.75])
    outer = optax.inject_hyperparams(jls.loss_scaling)(inner=optax.sgd(0.1))
    with pytest.raises(TypeError, match="put those inside"):
        jls.apply_gradients(outer, jnp.ones(2), outer.init(params), params)


# jls 0.3 promises: wrong calls fail loudly, naming the fix -------------------------


def _misuse_cases():
    params = {"w": jnp.ones(3)}
    tx = jls.loss_scaling(optax.sgd(0.1))
    state = tx.init(params)
    grads = {"w": jnp.ones(3)}
    scaling = jls.LossScaling.of(tx)
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
            "decide given the whole optimizer state",
            lambda: scaling.decide(grads, state),
            TypeError,
            r"loss_scale must be a jls.LossScaleState.*pass its .loss_scale",
        ),
        (
            "decide given the old (finite, apply) pair",
            lambda: scaling.decide(grads, (jnp.asarray(True), jnp.asarray(True))),
            TypeError,
            r"loss_scale must be a jls.LossScaleState, got tuple",
        ),
        (
            "decide given a Python-float scale",
            lambda: scaling.decide(grads, state.loss_scale._replace(scale=1024.0)),
            TypeError,
            r"loss_scale.scale must be a float32",
        ),
        (
            "apply_gradients with a decision that is not one",
            lambda: scaling.apply_gradients(
                grads, state, params, (jnp.asarray(True), jnp.asarray(True))
            ),
            TypeError,
            r"decision must be the jls Decision",
        ),
        (
            "a loss scale state that is the whole state",
            lambda: jls.loss_scale_state(params),
            ValueError,
            r"found none\.",
        ),
    ]


@pytest.mark.parametrize(
    "case", range(len(_misuse_cases())), ids=[c[0] for c in _misuse_cases()]
)
def test_wrong_calls_name_the_argument_and_the_fix(case):
    _, call, error, match = _misuse_cases()[case]
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize(
    "dtype", [jnp.bool_, jnp.int8, jnp.uint8, jnp.int16, jnp.int32]
)
def test_train_step_refuses_a_loss_that_is_not_floating(dtype):
    tx = jls.loss_scaling(optax.sgd(0.1))
    params = {"w": jnp.ones(3)}
    step = jls.train_step(lambda p, x: (jnp.sum(p["w"] * x) > 0).astype(dtype), tx)
    with pytest.raises(TypeError, match=f"floating loss, got dtype {jnp.dtype(dtype)}"):
        jax.jit(step)(params, tx.init(params), jnp.ones(3))


def test_raise_if_diverged_inside_jit_says_where_to_call_it():
    tx = jls.loss_scaling(optax.sgd(0.1), max_consecutive_skips=2)
    state = tx.init(jnp.zeros(2))

    def checked(s):
        jls.raise_if_diverged(s)
        return s

    with pytest.raises(TypeError, match="on the host after the step.*checkify"):
        jax.jit(checked)(state)
    from jax.experimental import checkify

    err, _ = jax.jit(checkify.checkify(checked))(state)
    assert err.get() is None


def test_bfloat16_gradients_with_a_dynamic_scale_get_a_hint():
    params = {"w": jnp.ones(3, jnp.bfloat16)}
    tx = jls.loss_scaling(optax.sgd(0.1))
    with pytest.warns(UserWarning, match=r"bfloat16.*jls.no_scale\(\)"):
        jax.jit(tx.update)(params, tx.init(params), params)
    quiet = jls.loss_scaling(optax.sgd(0.1), jls.no_scale())
    jax.jit(quiet.update)(params, quiet.init(params), params)  # no warning


def test_jls_flax_without_importing_it():
    code = "import jls; print(jls.flax.TrainState.__name__)"
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "TrainState"
