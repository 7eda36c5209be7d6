"""`jls.precision.autocast` (and `Policy.wrap`) on real models: linen, nnx, equinox.

The first test is the trap issue 33 found: a float32 linen MLP converted to
float16 the README's way, ``@policy.wrap`` around the whole loss. With
argument casting the loss's log-softmax and mean ran in float16 and the
logged loss ended far below the float32 loss of the same parameters; per-op
casting keeps it within 1%, with every matmul in float16.
"""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false
# pyright: reportCallIssue=false, reportIndexIssue=false

import chex
import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jls

POLICY = jls.precision.get_policy("params=float32,compute=float16,output=float32")
F16 = jnp.float16
X = jax.random.normal(jax.random.key(1), (256, 32))
Y = jax.random.randint(jax.random.key(2), (256,), 0, 10)


class MLP(nn.Module):
    """The issue's model: a float32 ReLU MLP."""

    @nn.compact
    def __call__(self, x):
        for width in (64, 64):
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(10)(x)


def test_the_readme_pattern_gives_a_float32_accurate_loss_on_a_linen_mlp():
    model = MLP()
    params = model.init(jax.random.key(0), X)

    def float32_loss(params, x, y):
        logits = model.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    compute_loss = POLICY.wrap(float32_loss)  # the README's @policy.wrap
    tx = jls.loss_scaling(optax.adam(1e-2), jls.measured_scale())
    opt_state = tx.init(params)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def train_step(params, opt_state):
        def scaled(p):
            loss = compute_loss(p, X, Y)
            return jls.scale_loss(loss, opt_state), loss

        grads, loss = jax.grad(scaled, has_aux=True)(params)
        params, opt_state = jls.apply_gradients(tx, grads, opt_state, params)
        return params, opt_state, loss

    for _ in range(300):
        params, opt_state, _ = train_step(params, opt_state)
    logged = float(compute_loss(params, X, Y))
    exact = float(float32_loss(params, X, Y))
    assert exact < 2e-3  # trained to a small loss, where float16 loses it
    assert abs(logged - exact) <= 0.01 * exact, (logged, exact)
    report = jls.precision.precision_report(jax.grad(compute_loss), params, X, Y)
    report.check(F16)  # forward and backward
    assert all(set(by) == {"float32"} for by in report.numerics.values()), report


class BatchNet(nn.Module):
    """A linen model with BatchNorm (a mutable collection)."""

    @nn.compact
    def __call__(self, x, train):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dense(10)(nn.relu(x))


def test_linen_with_mutable_batch_stats():
    model = BatchNet()
    variables = model.init(jax.random.key(0), X, False)

    def loss(params, stats, x, y):
        logits, updates = model.apply(
            {"params": params, "batch_stats": stats}, x, True, mutable=["batch_stats"]
        )
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return ce, updates["batch_stats"]

    args = (variables["params"], variables["batch_stats"], X, Y)
    cast = POLICY.wrap(loss)
    (got, got_stats), (want, want_stats) = cast(*args), loss(*args)
    np.testing.assert_allclose(got, want, rtol=1e-2)
    chex.assert_trees_all_close(got_stats, want_stats, atol=1e-3, rtol=1e-2)
    chex.assert_trees_all_equal_dtypes(got_stats, want_stats)  # float32 kept
    grad = jax.grad(cast, has_aux=True)
    jls.precision.precision_report(grad, *args).check(F16)


class NnxNet(nnx.Module):
    """An nnx model with state its forward pass updates: BatchNorm, Dropout."""

    def __init__(self, rngs):
        self.a = nnx.Linear(32, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.b = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        return self.b(self.drop(nnx.relu(self.bn(self.a(x)))))


def _nnx_loss(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def test_nnx_state_lands_on_the_caller_s_model():
    mine, reference = NnxNet(nnx.Rngs(0)), NnxNet(nnx.Rngs(0))
    before = jnp.copy(mine.bn.mean[...])
    got = POLICY.wrap(_nnx_loss)(mine, X, Y)
    want = _nnx_loss(reference, X, Y)
    np.testing.assert_allclose(got, want, rtol=1e-2)
    # BatchNorm's running statistics moved on the caller's model, as a plain
    # call moves them, and stay float32.
    assert not np.array_equal(mine.bn.mean[...], before)
    np.testing.assert_allclose(mine.bn.mean[...], reference.bn.mean[...], atol=1e-3)
    assert mine.bn.mean[...].dtype == jnp.float32
    # Dropout drew from the caller's RNG stream: the same count, the same key.
    rng_state = lambda m: nnx.state(m, nnx.RngState)  # noqa: E731
    chex.assert_trees_all_equal(rng_state(mine), rng_state(reference))


def test_nnx_under_nnx_jit_and_grad_trains_in_float16():
    model = NnxNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    loss_fn = POLICY.wrap(_nnx_loss)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, X, Y)) for _ in range(5)]
    assert losses[-1] < losses[0]
    jls.precision.precision_report(nnx.grad(loss_fn), model, X, Y).check(F16)


class EqxNet(eqx.Module):
    """An equinox model with a State (BatchNorm) and a function leaf."""

    first: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    last: eqx.nn.Linear
    activation: object  # a function: a non-array leaf

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.activation = jax.nn.gelu
        self.first = eqx.nn.Linear(32, 16, key=k1)
        self.norm = eqx.nn.BatchNorm(16, "batch", mode="batch")
        self.last = eqx.nn.Linear(16, 10, key=k2)

    def __call__(self, x, state):
        h, state = self.norm(self.first(x), state)
        return self.last(self.activation(h)), state


def test_equinox_with_state_and_non_array_leaves():
    model, state = eqx.nn.make_with_state(EqxNet)(jax.random.key(0))

    def loss(model, state, x, y):
        batched = jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )
        logits, state = batched(x, state)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return ce, state

    cast = POLICY.wrap(loss)
    (got, got_state), (want, want_state) = (
        cast(model, state, X, Y),
        loss(model, state, X, Y),
    )
    np.testing.assert_allclose(got, want, rtol=1e-2)
    chex.assert_trees_all_close(got_state, want_state, atol=1e-3, rtol=1e-2)
    grads, _ = eqx.filter_grad(cast, has_aux=True)(model, state, X, Y)
    assert {g.dtype for g in jax.tree.leaves(eqx.filter(grads, eqx.is_array))} == {
        jnp.dtype(jnp.float32)
    }
    report = jls.precision.precision_report(
        eqx.filter_grad(cast, has_aux=True), model, state, X, Y
    )
    report.check(F16)


@pytest.mark.parametrize(
    "head",
    [
        lambda z, y: optax.softmax_cross_entropy(z, jax.nn.one_hot(y, 10)).mean(),
        lambda z, y: jax.nn.logsumexp(z, -1).mean(),
        lambda z, y: (jax.nn.softmax(z) * jax.nn.one_hot(y, 10)).sum(),
        lambda z, y: optax.sigmoid_binary_cross_entropy(z, 0.5).mean(),
    ],
    ids=["softmax_cross_entropy", "logsumexp", "softmax", "sigmoid_bce"],
)
def test_losses_and_their_derivatives_stay_float32_accurate(head):
    w = jax.random.normal(jax.random.key(3), (32, 10)) / 6

    def loss(w, x, y):
        return head(x @ w, y)

    got = jax.value_and_grad(POLICY.wrap(loss))(w, X, Y)
    want = jax.value_and_grad(loss)(w, X, Y)
    # float16 matmuls, forward and backward: float16's rounding, no more.
    chex.assert_trees_all_close(got, want, rtol=1e-2, atol=1e-3)
    report = jls.precision.precision_report(jax.grad(POLICY.wrap(loss)), w, X, Y)
    report.check(F16)
    assert all(set(by) == {"float32"} for by in report.numerics.values()), report
