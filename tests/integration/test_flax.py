"""jls.flax: the nnx Optimizer and linen TrainState drop-ins, and fp8 state."""

# pyright: reportIndexIssue=false, reportArgumentType=false
# pyright: reportAttributeAccessIssue=false, reportOperatorIssue=false

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.linen import fp8_ops
from flax.training import train_state

import jls
import jls.flax

X = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
Y = jnp.ones((4, 2))


def _tx():
    return jls.loss_scaling(optax.adam(1e-2), jls.dynamic_scale(2.0**10))


# linen TrainState ---------------------------------------------------------------


def test_train_state_matches_flax_and_counts_applied_steps():
    model = nn.Dense(2)
    params = model.init(jax.random.key(0), X)

    def loss_fn(p, x):
        return jnp.mean((model.apply(p, x) - Y) ** 2)

    def make(cls):
        return cls.create(apply_fn=model.apply, params=params, tx=_tx())

    @jax.jit
    def step(state, x):
        def scaled(p):
            return jls.scale_loss(loss_fn(p, x), state.opt_state)

        return state.apply_gradients(grads=jax.grad(scaled)(state.params))

    ours, theirs = make(jls.flax.TrainState), make(train_state.TrainState)
    for i in range(6):
        x = X.at[0, 0].set(jnp.nan) if i == 3 else X
        before = ours.params
        ours, theirs = step(ours, x), step(theirs, x)
        if i == 3:
            chex.assert_trees_all_equal(ours.params, before)
        chex.assert_trees_all_close(ours.params, theirs.params, rtol=1e-6)
    # flax counts every call; jls.flax counts applied steps, as Adam does.
    assert int(theirs.step) == 6 and int(ours.step) == 5
    assert int(optax.tree.get(ours.opt_state, "count")) == 5


# nnx Optimizer --------------------------------------------------------------------


def test_nnx_optimizer_matches_flax_and_counts_applied_steps():
    def make(cls):
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        return model, cls(model, _tx(), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        def scaled(m):
            loss = jnp.mean((m(x) - Y) ** 2)
            return jls.scale_loss(loss, optimizer.opt_state)

        optimizer.update(model, nnx.grad(scaled)(model))

    ours, theirs = make(jls.flax.Optimizer), make(nnx.Optimizer)
    for i in range(6):
        x = X.at[0, 0].set(jnp.inf) if i == 2 else X
        before = jax.tree.map(jnp.copy, nnx.state(ours[0], nnx.Param))
        step(*ours, x)
        step(*theirs, x)
        mine = nnx.state(ours[0], nnx.Param)
        if i == 2:
            chex.assert_trees_all_equal(mine, before)
        chex.assert_trees_all_close(mine, nnx.state(theirs[0], nnx.Param), rtol=1e-6)
    assert int(theirs[1].step[...]) == 6 and int(ours[1].step[...]) == 5
    m = jls.metrics(ours[1].opt_state)
    assert int(m["total_skips"]) == 1


# fp8: the _overwrite_with_gradient collection -------------------------------------


class Fp8Model(nn.Module):
    """A Dense layer whose dot is flax's fp8 dot (scales and amax histories)."""

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(2, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp)
        return dense(x)


@pytest.mark.parametrize("finite", [True, False])
def test_fp8_state_is_overwritten_on_applied_steps_only(finite):
    model = Fp8Model()
    variables = model.init(jax.random.key(0), X)
    owg = fp8_ops.OVERWRITE_WITH_GRADIENT
    assert set(variables) == {"params", owg}

    def loss_fn(v, x):
        return jnp.mean((model.apply(v, x) - Y) ** 2)

    tx = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(8.0))
    state = jls.flax.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)
    plain = train_state.TrainState.create(
        apply_fn=model.apply, params=variables, tx=optax.sgd(0.1)
    )

    @jax.jit
    def scaled_grads(state, x):
        def scaled(v):
            return jls.scale_loss(loss_fn(v, x), state.opt_state)

        return jax.grad(scaled)(state.params)

    x = X if finite else X.at[0, 0].set(jnp.inf)
    grads = scaled_grads(state, x)
    new = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
    if finite:
        # The fp8 scales and amax histories are the values flax's ops return,
        # neither unscaled nor held back, as flax's own TrainState sets them.
        chex.assert_trees_all_equal(new.params[owg], grads[owg])
        flax_grads = jax.grad(loss_fn)(variables, x)
        flax_new = plain.apply_gradients(grads=flax_grads)
        chex.assert_trees_all_close(
            new.params["params"], flax_new.params["params"], rtol=1e-6
        )
        assert int(new.step) == 1
    else:
        # The input's inf is clamped by the fp8 cast, so the kernel's gradient
        # is finite, but the recorded amax is not: the step must be skipped
        # and the fp8 state kept, or every later fp8 scale would be 0.
        assert bool(jls.all_finite(grads["params"]))
        assert not bool(jls.all_finite(grads[owg]))
        chex.assert_trees_all_equal(new.params, variables)
        assert int(new.step) == 0
        np.testing.assert_array_equal(jls.metrics(new.opt_state)["total_skips"], 1)


def test_fp8_values_join_the_replicas_decision():
    # A non-finite amax on one replica must make every replica skip: the
    # fp8 values' flag is reduced over axis_name with the gradients'.
    model = Fp8Model()
    variables = model.init(jax.random.key(0), X)
    tx = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(8.0), axis_name="r")
    state = jls.flax.TrainState.create(apply_fn=model.apply, params=variables, tx=tx)

    def grads_for(v, x):
        def scaled(v):
            return jls.scale_loss(
                jnp.mean((model.apply(v, x) - Y) ** 2), state.opt_state
            )

        return jax.grad(scaled)(v)

    xs = jnp.stack([X, X.at[0, 0].set(jnp.inf)])  # replica 1 overflows
    grads = jax.vmap(grads_for, in_axes=(None, 0))(variables, xs)
    owg = fp8_ops.OVERWRITE_WITH_GRADIENT
    assert bool(jls.all_finite(grads["params"]))
    assert not bool(jls.all_finite(jax.tree.map(lambda g: g[1], grads[owg])))
    assert bool(jls.all_finite(jax.tree.map(lambda g: g[0], grads[owg])))
    states = jax.tree.map(lambda x: jnp.stack([x, x]), state)
    new = jax.vmap(lambda s, g: s.apply_gradients(grads=g), axis_name="r")(
        states, grads
    )
    assert np.asarray(new.step).tolist() == [0, 0]
    chex.assert_trees_all_equal(new.params, states.params)
    assert np.asarray(jls.metrics(new.opt_state)["skipped"]).tolist() == [True, True]


def test_metrics_of_an_nnx_optimizer_are_plain_arrays():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    tx = jls.loss_scaling(
        optax.sgd(0.1),
        gradient_norm=True,
        diagnostics=True,
        max_consecutive_skips=3,
        skip_spikes=jls.hooks.SpikeRule(),
    )
    optimizer = jls.flax.Optimizer(model, tx, wrt=nnx.Param)

    def loss(m):
        return jls.scale_loss(m(jnp.ones((1, 2))).sum() * jnp.inf, optimizer.opt_state)

    optimizer.update(model, nnx.grad(loss)(model))
    m = jls.metrics(optimizer.opt_state)
    for key, value in m.items():
        for leaf in jax.tree.leaves(value):
            assert isinstance(leaf, jax.Array), (key, type(leaf))
    assert isinstance(m["nonfinite_leaves"], dict)
    assert bool(m["skipped"]) and not bool(m["spike"]) and not bool(m["diverged"])
    assert f"{m['gradient_norm']:.3f}" == "inf"
    assert jls.hooks.nonfinite_paths(optimizer.opt_state) == ["['bias']", "['kernel']"]


# A skipped step changes nothing: BatchNorm statistics an overflowing forward
# pass wrote are not kept ------------------------------------------------------


class BNNet(nn.Module):
    """Dense, BatchNorm (running statistics in batch_stats), Dense."""

    @nn.compact
    def __call__(self, x, train):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(2)(nn.relu(x))


class BNTrainState(jls.flax.TrainState):
    """A TrainState with BatchNorm's running statistics, as flax's examples."""

    batch_stats: dict


def test_train_state_keeps_its_fields_on_a_skipped_step():
    model = BNNet()
    variables = model.init(jax.random.key(0), X, train=False)
    tx = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(8.0))
    state = BNTrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=tx,
    )

    @jax.jit
    def step(state, x):
        def scaled(params):
            out, updates = model.apply(
                {"params": params, "batch_stats": state.batch_stats},
                x,
                train=True,
                mutable=["batch_stats"],
            )
            loss = jnp.mean((out - Y) ** 2)
            return jls.scale_loss(loss, state.opt_state), updates

        grads, updates = jax.grad(scaled, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])

    state = step(state, X)
    before = state.batch_stats
    # An input of 1e6 (float32 here; the float16 forward pass's inf): the
    # statistics the forward pass wrote are not finite, the step is skipped,
    # and the statistics stay bitwise as they were.
    bad = step(state, X.at[0, 0].set(jnp.inf))
    assert bool(jls.metrics(bad.opt_state)["skipped"])
    chex.assert_trees_all_equal(bad.batch_stats, before)
    chex.assert_trees_all_equal(bad.params, state.params)
    # An applied step writes them.
    good = step(state, X * 2.0)
    assert not bool(jls.metrics(good.opt_state)["skipped"])
    assert not np.array_equal(
        good.batch_stats["BatchNorm_0"]["mean"], before["BatchNorm_0"]["mean"]
    )


def test_nnx_optimizer_keeps_batch_stats_on_a_skipped_step():
    class Net(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(3, 8, rngs=nnx.Rngs(0))
            self.bn = nnx.BatchNorm(8, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(8, 2, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.b(nnx.relu(self.bn(self.a(x))))

    model = Net()
    tx = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(8.0))
    optimizer = jls.flax.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        def scaled(m):
            return jls.scale_loss(jnp.mean((m(x) - Y) ** 2), optimizer.opt_state)

        optimizer.update(model, nnx.grad(scaled)(model))

    step(model, optimizer, X)
    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.BatchStat))
    step(model, optimizer, X.at[0, 0].set(jnp.inf))
    assert bool(jls.metrics(optimizer.opt_state)["skipped"])
    chex.assert_trees_all_equal(nnx.state(model, nnx.BatchStat), before)
    step(model, optimizer, X * 2.0)
    after = nnx.state(model, nnx.BatchStat)
    assert not np.array_equal(after["bn"]["mean"][...], before["bn"]["mean"][...])


def test_a_wrapped_tx_is_refused_when_made_naming_the_order_that_works():
    # It used to be accepted and refused only at the first update, with a
    # message that pointed at tx.update + optax.apply_updates: the order in
    # which one nan micro-batch poisons every later window.
    wrapped = optax.MultiSteps(jls.loss_scaling(optax.sgd(0.1)), 2)
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    for make in (
        lambda: jls.flax.Optimizer(model, wrapped, wrt=nnx.Param),
        lambda: jls.flax.TrainState.create(
            apply_fn=None, params={"w": jnp.ones(2)}, tx=wrapped
        ),
    ):
        with pytest.raises(TypeError) as err:
            make()
        message = str(err.value)
        assert "jls.loss_scaling(optax.MultiSteps(optax.adam(1e-3), k))" in message
        assert "use tx.update" not in message
    fixed = jls.loss_scaling(optax.MultiSteps(optax.sgd(0.1), 2))
    jls.flax.Optimizer(model, fixed, wrt=nnx.Param)
    jls.flax.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=fixed)
