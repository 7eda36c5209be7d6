"""The skip: a skipped step changes nothing, bitwise, in every dtype and leaf kind."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import functools
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from steps import (
    PATHS,
    X,
    _assert_no_nan,
    _loss,
    _params,
    _poison,
    _scaled_grads,
)

import jls
from jls import _cond

BAD = [np.inf, -np.inf, np.nan]


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


def test_skipped_updates_take_the_updates_sharding_not_the_gradients():
    # Parameters sharded on an explicit mesh, gradients replicated: optax's
    # updates follow the parameters, and so must the skip's -0.0 zeros (they
    # took the gradients' sharding, and lax.select / lax.cond refused).
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("d",), axis_types=(AxisType.Explicit,))
    tx = jls.loss_scaling(optax.adam(0.1), jls.static_scale(4.0))
    with jax.set_mesh(mesh):
        params = jax.device_put(jnp.ones((4, 4)), P("d", None))
        state = tx.init(params)
        step = jax.jit(tx.update)
        for value in (1.0, jnp.inf):
            updates, _ = step(jnp.full((4, 4), value), state, params)
            assert jax.typeof(updates).sharding.spec == P("d", None)
    assert np.array_equal(np.asarray(updates), np.full((4, 4), -0.0))
    assert np.signbit(np.asarray(updates)).all()


def test_skipped_updates_vary_as_the_updates_do_under_shard_map():
    # Per-replica parameters, averaged (replicated) gradients: the updates
    # vary over the axis, the gradients do not; the skip's zeros must vary.
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("batch",))
    tx = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(4.0), axis_name="batch")

    def body(g, s, p):
        g, s, p = jax.tree.map(lambda x: x[0], (g, s, p))
        u, s = tx.update(jax.lax.pmean(g, "batch"), s, p)
        return jax.tree.map(lambda x: x[None], (optax.apply_updates(p, u), s))

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("batch"), out_specs=P("batch"))
    )
    rows = jax.sharding.NamedSharding(mesh, P("batch"))
    put = functools.partial(jax.tree.map, lambda x: jax.device_put(x, rows))
    state = put(jax.tree.map(lambda x: x[None], tx.init(jnp.ones(3))))
    params = put(np.ones((1, 3), np.float32))
    new, _ = step(put(np.full((1, 3), np.inf, np.float32)), state, params)
    assert np.array_equal(np.asarray(new), np.asarray(params))


def _cond_and_custom_jvp(lr=0.1):
    """A momentum whose update holds a ``lax.cond`` and a custom_jvp (relu)."""

    def init(params):
        return {
            "mu": jax.tree.map(jnp.zeros_like, params),
            "n": jnp.zeros((), jnp.int32),
        }

    def update(grads, state, params=None):
        del params
        mu = jax.tree.map(lambda m, g: 0.9 * m + jax.nn.relu(g), state["mu"], grads)
        mu = jax.lax.cond(
            state["n"] % 2 == 0,
            lambda t: t,
            lambda t: jax.tree.map(lambda x: 0.5 * x, t),
            mu,
        )
        updates = jax.tree.map(lambda m, g: -lr * (m + g), mu, grads)
        return updates, {"mu": mu, "n": state["n"] + 1}

    return optax.GradientTransformation(init, update)


def _jitted(inner):
    """``inner`` with its update wrapped in ``jax.jit`` (a nested program)."""
    return optax.GradientTransformation(inner.init, jax.jit(inner.update))


INNER = {
    "adam": lambda: optax.adam(1e-2),
    "cond_custom_jvp": _cond_and_custom_jvp,
    "jitted_adam": lambda: _jitted(optax.adam(1e-2)),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=1e-2
    ),
    "schedule_free": lambda: optax.contrib.schedule_free_adamw(1e-2, warmup_steps=2),
}


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _run(inner, path, donate, scaled=True, steps=2):
    """Finite steps, then a nan one: every (params, inner state) on the way.

    The gradients are scaled by 2**10. ``scaled``: through `jls.loss_scaling`;
    else the inner optimizer alone, on the gradients times 2**-10 (as jls
    unscales them: one multiplication, exact), and no nan step.
    """
    tx = jls.loss_scaling(inner, jls.dynamic_scale(2.0**10)) if scaled else inner
    params = _params()
    state = tx.init(params)

    def step(params, state, grads):
        if path == "fused" and scaled:
            return jls.apply_gradients(tx, grads, state, params)
        if not scaled:
            grads = jax.tree.map(lambda g: g * np.float32(2.0**-10), grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step, donate_argnums=(0, 1) if donate else ())
    seen = []
    for i in range(steps + 1 if scaled else steps):
        grads = jax.tree.map(lambda p, k=i + 2: jnp.sin(p * k) * 2.0**10, params)
        if i == steps:
            grads = _poison(grads, np.nan, leaf=1, where=1)
        params, state = step(_copy(params), _copy(state), grads)
        inner_state = state.inner_state if scaled else state
        seen.append(jax.device_get((params, inner_state)))
    return seen


@pytest.mark.parametrize("path", ["fused", "update"])
@pytest.mark.parametrize("inner", list(INNER))
def test_finite_steps_are_the_inner_optimizers_bits_and_a_skip_changes_nothing(
    inner, path
):
    # Nested programs in the update (a lax.cond, a custom_jvp, a jax.jit,
    # MultiSteps' conditional, inject_hyperparams): each finite step gives
    # the bits of the inner optimizer alone, the nan step leaves every leaf.
    ref = _run(INNER[inner](), path, donate=False, scaled=False)
    for donate in (False, True):
        got = _run(INNER[inner](), path, donate=donate)
        chex.assert_trees_all_equal(got[:-1], ref, strict=True)
        chex.assert_trees_all_equal(got[-1], got[-2], strict=True)


@pytest.mark.parametrize("path", ["fused", "update"])
def test_under_vmap_each_member_applies_or_skips_on_its_own(path):
    tx = jls.loss_scaling(optax.adam(1e-2), jls.dynamic_scale(2.0**10))
    params = _params()
    state = tx.init(params)
    grads = _scaled_grads(params, state)
    bad = _poison(grads, np.inf)
    batch = jax.tree.map(lambda g, b: jnp.stack([g, b, g]), grads, bad)
    stack = lambda t: jax.tree.map(lambda x: jnp.stack([x] * 3), t)  # noqa: E731
    got = jax.jit(jax.vmap(PATHS[path](tx)))(stack(params), stack(state), batch)
    alone = PATHS[path](tx)(params, state, grads)
    for i in (0, 2):  # applied, as the step alone
        member = jax.tree.map(lambda x, i=i: x[i], got[:2])
        chex.assert_trees_all_equal(member, alone[:2], strict=True)
    skipped = jax.tree.map(lambda x: x[1], (got[0], got[1].inner_state))
    chex.assert_trees_all_equal(skipped, (params, state.inner_state), strict=True)


def test_two_state_leaves_of_one_value_keep_their_own_old_values():
    # One value returned as two state leaves whose old values differ: a
    # skipped step gives each its own.
    def update(grads, state, params=None):
        n = state[0] + 1
        return grads, (n, n)

    inner = optax.GradientTransformation(lambda p: (jnp.int32(0), jnp.int32(0)), update)
    tx = jls.loss_scaling(inner, jls.dynamic_scale(2.0**10))
    params = _params()
    state = tx.init(params)
    state = state._replace(inner_state=(jnp.int32(3), jnp.int32(7)))
    grads = _poison(_scaled_grads(params, state), np.nan)
    _, new, _ = PATHS["fused"](tx)(params, state, grads)
    assert tuple(int(x) for x in new.inner_state) == (3, 7)


def test_parameters_with_a_non_array_leaf_step_as_the_inner_optimizer_does():
    # An unfiltered equinox-style model: a function among the parameters.
    tx = jls.loss_scaling(optax.adam(1e-3), jls.static_scale(2.0**10))
    params = {"w": jnp.ones((3,)), "act": jax.nn.relu}
    state = tx.init({"w": params["w"], "act": None})
    grads = {"w": jnp.full((3,), 2.0**10), "act": None}
    updates, _ = tx.update(grads, state, params)
    adam = optax.adam(1e-3)
    alone, _ = adam.update({"w": jnp.ones(3)}, adam.init({"w": params["w"]}))
    chex.assert_trees_all_equal(updates["w"], alone["w"])  # pyright: ignore[reportIndexIssue]
    bad = {"w": jnp.full((3,), jnp.nan), "act": None}
    updates, new = tx.update(bad, state, params)
    chex.assert_trees_all_equal(updates["w"], jnp.full((3,), -0.0))  # pyright: ignore[reportIndexIssue]
    chex.assert_trees_all_equal(new.inner_state, state.inner_state)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn])
def test_select_tree_keeps_a_narrow_nan_payload_and_the_old_types(dtype):
    # A narrow float is selected as its bits: XLA:CPU computes it in
    # float32, where a select would canonicalise the nan's payload.
    bits = {1: jnp.uint8, 2: jnp.uint16}[jnp.dtype(dtype).itemsize]
    payload = {1: 0x7F, 2: 0x7FC1}[jnp.dtype(dtype).itemsize]
    old = {"x": jax.lax.bitcast_convert_type(jnp.full(3, payload, bits), dtype)}
    new = {"x": jnp.ones(3, dtype), "weak": jnp.asarray(2.0)}
    old["weak"] = jnp.asarray(1.0)  # weakly typed: kept so
    for apply, want in ((False, old), (True, new)):
        got = jax.jit(_cond.select_tree)(jnp.asarray(apply), new, old)
        as_bits = jax.lax.bitcast_convert_type(got["x"], bits)
        want_bits = jax.lax.bitcast_convert_type(want["x"], bits)
        np.testing.assert_array_equal(as_bits, want_bits)
        assert jax.typeof(got["weak"]).weak_type
        assert float(got["weak"]) == float(want["weak"])


class _Windowed(NamedTuple):
    width: Any  # a Python int the optimizer uses as a shape
    total: Any


def _windowed() -> optax.GradientTransformation:
    def init(params):
        del params
        return _Windowed(3, jnp.zeros(()))

    def update(updates, state, params=None):
        del params
        window = jnp.ones(state.width)  # needs a concrete int
        return updates, _Windowed(state.width, state.total + window.sum())

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused"])
def test_a_python_number_in_the_inner_state_stays_a_number(fused):
    # Eager and traced, over applied and skipped steps: the number the inner
    # optimizer keeps (equal before and after) is returned as it is.
    tx = jls.loss_scaling(_windowed(), jls.static_scale(2.0))
    params = jnp.ones(2)

    def steps(params):
        state = tx.init(params)
        for g in (jnp.ones(2), jnp.full(2, jnp.nan), jnp.ones(2)):
            if fused:
                params, state = jls.apply_gradients(tx, g, state, params)
            else:
                _, state = tx.update(g, state, params)
        return state.inner_state

    eager = steps(params)
    assert type(eager.width) is int and eager.width == 3
    assert float(eager.total) == 6.0  # two applied steps, the nan one skipped
    traced = jax.jit(steps)(params)
    assert float(traced.total) == 6.0


def test_equal_python_numbers_are_kept_and_others_selected():
    apply = jnp.asarray(False)
    kept = _cond.select_tree(apply, {"n": 3}, {"n": 3})["n"]
    assert type(kept) is int and kept == 3
    out = _cond.select_tree(apply, {"n": 4, "z": -0.0}, {"n": 3, "z": 0.0})
    assert type(out["n"]) is int and out["n"] == 3  # outside a trace: the old one
    assert str(float(out["z"])) == "0.0"  # -0.0 and 0.0 are not one number
    # An old Python number the step turned into an array: the number is kept,
    # not rounded into the array's dtype (0.1 is no float32).
    out = _cond.select_tree(apply, {"r": jnp.float32(0.2)}, {"r": 0.1})
    assert type(out["r"]) is float and out["r"] == 0.1
    traced = jax.jit(lambda a: _cond.select_tree(a, {"n": jnp.int32(4)}, {"n": 3}))
    assert int(traced(apply)["n"]) == 3  # under a trace, selected


class _Kinds(NamedTuple):
    """An inner state with a leaf of every kind optax allows."""

    widened: Any  # float16 at init, float32 after a step
    count: Any  # a Python int the update counts in Python
    rate: Any  # a Python float the update changes
    nothing: Any  # None
    empty: Any  # an empty state
    weak: Any  # weakly typed float32, strong after a step
    weak_count: Any  # weakly typed int32, strong after a step


def _kinds(narrowed=jnp.float32) -> optax.GradientTransformation:
    def init(params):
        del params
        return _Kinds(
            jnp.float16(1.5), 0, 0.1, None, optax.EmptyState(), jnp.asarray(0.1), 0
        )._replace(weak_count=jnp.asarray(7))

    def update(updates, state, params=None):
        del params
        return updates, _Kinds(
            state.widened.astype(narrowed) + 1,
            state.count + 1,
            state.rate * 3,
            None,
            optax.EmptyState(),
            state.weak + jnp.float32(1),
            state.weak_count + jnp.int32(1),
        )

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_skip_keeps_every_leaf_kind_in_the_type_an_applied_step_gives(jit):
    tx = jls.loss_scaling(_kinds(), jls.static_scale(2.0))
    update = jax.jit(tx.update) if jit else tx.update
    state = tx.init(jnp.ones(2))
    _, applied = update(jnp.ones(2), state)
    _, skipped = update(jnp.full(2, jnp.nan), state)
    assert bool(jls.metrics(skipped)["skipped"])
    old, kept = state.inner_state, skipped.inner_state
    assert kept.nothing is None and kept.empty == optax.EmptyState()
    # A widened leaf keeps its value exactly, in the dtype the step gives it:
    # under jit one type for both outcomes, so the next step traces once.
    assert kept.widened.dtype == applied.inner_state.widened.dtype == jnp.float32
    assert kept.widened.astype(jnp.float16).tobytes() == old.widened.tobytes()
    if jit:  # jit returns Python numbers as weakly typed arrays, skipped or not
        assert jax.tree.map(jax.typeof, skipped) == jax.tree.map(jax.typeof, applied)
        assert (int(kept.count), float(kept.rate)) == (0, np.float32(0.1))
    else:  # eager, a Python number stays one, bitwise
        assert type(kept.count) is int and kept.count == 0
        assert type(kept.rate) is float and kept.rate == 0.1
        assert (applied.inner_state.count, applied.inner_state.rate) == (1, 0.1 * 3)
    for name in ("weak", "weak_count"):
        assert jax.typeof(getattr(kept, name)) == jax.typeof(getattr(old, name))
        assert getattr(kept, name).tobytes() == getattr(old, name).tobytes()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_leaf_the_step_narrows_is_refused_naming_it(jit):
    # A skip would round the old value into the new dtype: refused at trace
    # time (jit needs one type for the skipped and the applied step).
    tx = jls.loss_scaling(_kinds(narrowed=jnp.float8_e4m3fn), jls.static_scale(2.0))
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(TypeError, match=r"\.widened.*float16.*float8_e4m3fn"):
        update(jnp.ones(2), tx.init(jnp.ones(2)))
