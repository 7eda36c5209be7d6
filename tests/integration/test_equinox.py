"""Equinox, first class: the standard loop, and a whole Module on the fused path.

`jls.apply_gradients` and `jls.train_step` take a whole equinox Module:
functions, Python numbers and integer arrays pass by unchanged.
"""

# pyright: reportIndexIssue=false, reportArgumentType=false
# pyright: reportAttributeAccessIssue=false, reportOperatorIssue=false

import pathlib

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jls


class Model(eqx.Module):
    """An MLP whose leaves include a function, a Python number and an int array."""

    mlp: eqx.nn.MLP
    scale: float
    steps: jax.Array

    def __init__(self, key):
        self.mlp = eqx.nn.MLP(3, 2, 8, 2, activation=jax.nn.gelu, key=key)
        self.scale = 0.5
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        return self.scale * self.mlp(x)


X = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
Y = jnp.ones((4, 2))


def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def _model():
    return Model(jax.random.key(0))


def _bitwise(a, b):
    arrays = eqx.filter(a, eqx.is_array), eqx.filter(b, eqx.is_array)
    chex.assert_trees_all_equal(*arrays)
    assert all(
        x is y
        for x, y in zip(
            jax.tree.leaves(eqx.filter(a, eqx.is_array, inverse=True)),
            jax.tree.leaves(eqx.filter(b, eqx.is_array, inverse=True)),
            strict=True,
        )
    )


def test_the_standard_equinox_loop(tmp_path: pathlib.Path):
    model = _model()
    tx = jls.loss_scaling(optax.adam(1e-2), jls.dynamic_scale(2.0**10))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        def scaled(m):
            return jls.scale_loss(loss_fn(m, x, y), opt_state)

        grads = eqx.filter_grad(scaled)(model)
        updates, opt_state = tx.update(
            grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
        )
        return eqx.apply_updates(model, updates), opt_state

    first = loss_fn(model, X, Y)
    for _ in range(30):
        model, opt_state = step(model, opt_state, X, Y)
    assert loss_fn(model, X, Y) < first
    before = model
    model, opt_state = step(model, opt_state, X.at[0, 0].set(jnp.nan), Y)
    _bitwise(model, before)
    m = jls.metrics(opt_state)
    assert bool(m["skipped"]) and float(m["loss_scale"]) == 512.0

    # The optimizer state round-trips through equinox's serialisation.
    path = tmp_path / "opt_state.eqx"
    eqx.tree_serialise_leaves(path, opt_state)
    restored = eqx.tree_deserialise_leaves(
        path, tx.init(eqx.filter(model, eqx.is_inexact_array))
    )
    chex.assert_trees_all_equal(restored, opt_state)
    assert float(jls.metrics(restored)["loss_scale"]) == 512.0


@pytest.mark.parametrize("finite", [True, False])
def test_a_whole_module_on_the_fused_path(finite):
    model = _model()
    tx = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(8.0))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        grads = eqx.filter_grad(lambda m: jls.scale_loss(loss_fn(m, x, y), opt_state))(
            model
        )
        return jls.apply_gradients(tx, grads, opt_state, model)

    x = X if finite else X.at[1, 2].set(jnp.inf)
    new, opt_state = step(model, opt_state, x, Y)
    assert new.mlp.activation is model.mlp.activation and new.scale == 0.5
    assert new.steps.dtype == jnp.int32
    if finite:
        # The same step as equinox's own, with the unscaled gradients.
        grads = eqx.filter_grad(loss_fn)(model, x, Y)
        want = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))
        chex.assert_trees_all_close(
            eqx.filter(new, eqx.is_array), eqx.filter(want, eqx.is_array), rtol=1e-6
        )
    else:
        _bitwise(new, model)
    assert bool(jls.metrics(opt_state)["skipped"]) is not finite


def test_train_step_takes_a_whole_module():
    model = _model()
    tx = jls.loss_scaling(optax.adam(1e-2), jls.dynamic_scale(2.0**10))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    step = eqx.filter_jit(jls.train_step(loss_fn, tx, accumulation_steps=2))
    first = None
    for _ in range(20):
        model, opt_state, out = step(model, opt_state, X, Y)
        first = out.loss if first is None else first
    assert float(out.loss) < float(first)
    assert isinstance(model.scale, float) and model.mlp.activation is jax.nn.gelu
    before = model
    model, opt_state, out = step(model, opt_state, X.at[0, 0].set(jnp.nan), Y)
    assert bool(out.skipped)
    _bitwise(model, before)


def test_integer_and_function_leaves_of_a_plain_tree_pass_by():
    params = {"w": jnp.ones(2), "n": jnp.arange(3), "f": jnp.tanh}
    tx = jls.loss_scaling(optax.sgd(0.5), jls.static_scale(2.0))
    opt_state = tx.init({"w": params["w"], "n": None, "f": None})  # floats only
    grads = {"w": jnp.full(2, 2.0), "n": None, "f": None}
    new, _ = jls.apply_gradients(tx, grads, opt_state, params)
    np.testing.assert_array_equal(new["w"], [0.5, 0.5])
    assert new["n"] is params["n"] and new["f"] is jnp.tanh


@pytest.mark.parametrize("fused", [True, False])
def test_frozen_arrays_with_none_gradients_pass_by(fused):
    # The documented equinox way to freeze part of a model: eqx.partition
    # with a filter_spec, so the frozen arrays' gradients are None. None
    # means "unchanged", as eqx.apply_updates treats it.
    model = Model(jax.random.key(0))
    spec = jax.tree.map(lambda _: False, model)
    last = model.mlp.layers[-1]
    spec = eqx.tree_at(
        lambda m: (m.mlp.layers[-1].weight, m.mlp.layers[-1].bias),
        spec,
        replace=(True, True),
    )
    tx = jls.loss_scaling(optax.adam(1e-2), jls.static_scale(4.0))
    opt_state = tx.init(eqx.filter(model, spec))

    @eqx.filter_jit
    def step(model, opt_state, x):
        trained, frozen = eqx.partition(model, spec)

        def loss(t):
            m = eqx.combine(t, frozen)
            return jls.scale_loss(jnp.mean((jax.vmap(m)(x) - Y) ** 2), opt_state)

        grads = eqx.filter_grad(loss)(trained)
        if fused:
            return jls.apply_gradients(tx, grads, opt_state, model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, spec))
        return eqx.apply_updates(model, updates), opt_state

    new, _ = step(model, opt_state, X)
    for i, layer in enumerate(model.mlp.layers[:-1]):
        chex.assert_trees_all_equal(new.mlp.layers[i], layer)
    assert not np.array_equal(new.mlp.layers[-1].weight, last.weight)
    assert new.scale == model.scale


def test_gradients_of_another_structure_are_refused_by_name():
    params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    tx = jls.loss_scaling(optax.sgd(0.1))
    state = tx.init(params)
    with pytest.raises(TypeError, match="grads must have the structure of params"):
        jls.apply_gradients(tx, {"a": jnp.ones(2)}, state, params)
