"""The default skip (`jls._substitute`): the bits of the select form, or none changed.

A finite step gives the bits of the update with no skip at all (and, with
Adam, those of jls 0.3's default, a select per leaf after the update); a skipped one
leaves the parameters and the inner state bitwise as they were; under jit
with donation and without, under vmap, for inner optimizers whose update
holds nested programs (a ``lax.cond``, a custom_jvp, ``optax.MultiSteps``'
conditional, ``inject_hyperparams``, an ``optax.contrib`` optimizer).
"""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from steps import _params, _poison, _scaled_grads

import jls
from jls import _cond, _substitute


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


INNER = {
    "adam": lambda: optax.adam(1e-2),
    "cond_custom_jvp": _cond_and_custom_jvp,
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=1e-2
    ),
    "schedule_free": lambda: optax.contrib.schedule_free_adamw(1e-2, warmup_steps=2),
}


def _step(tx, path, form, donate):
    def step(params, state, grads):
        saved = _substitute.substituted
        _substitute.substituted = form  # read while the step is traced
        try:
            if path == "fused":
                return jls.apply_gradients(tx, grads, state, params)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state
        finally:
            _substitute.substituted = saved

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _selected(apply, step, skip, operands, after):
    """The default skip of jls 0.3: a select per leaf after the update."""
    new = step(operands)
    old = skip(operands, new)
    out = jax.tree.map(lambda n, o: _cond.select(apply, n, o), new, old)
    return out, after(apply)


def _noskip(apply, step, skip, operands, after):
    """The update with no skip at all: the inner optimizer's own step."""
    return step(operands), after(apply)


def _run(tx, path, form, donate, steps=2):
    """Finite steps, then a nan one: every (params, inner state) on the way."""
    params = _params()
    state = tx.init(params)
    step = _step(tx, path, form, donate)
    seen = []
    for i in range(steps + 1):
        grads = jax.tree.map(lambda p, k=i + 2: jnp.sin(p * k) * 2.0**10, params)
        if i == steps:
            grads = _poison(grads, np.nan, leaf=1, where=1)
        params, state = step(_copy(params), _copy(state), grads)
        seen.append(jax.device_get((params, state.inner_state)))
    return seen


@pytest.mark.parametrize("path", ["fused", "update"])
@pytest.mark.parametrize("inner", list(INNER))
def test_finite_steps_are_the_updates_own_bits_and_a_skipped_step_changes_nothing(
    inner, path
):
    tx = jls.loss_scaling(INNER[inner](), jls.dynamic_scale(2.0**10))
    ref = _run(tx, path, _noskip, donate=False)
    modes = (False, True) if inner == "adam" else (True,)
    for donate in modes:
        got = _run(tx, path, _substitute.substituted, donate=donate)
        chex.assert_trees_all_equal(got[:-1], ref[:-1], strict=True)
        chex.assert_trees_all_equal(got[-1], got[-2], strict=True)


@pytest.mark.parametrize("path", ["fused", "update"])
def test_a_finite_adam_step_gives_the_bits_of_the_select_form(path):
    # The default before this one. (Not for every inner optimizer: on
    # schedule_free_adamw XLA:CPU fuses the select form into other rounding,
    # one ulp off the update's own bits, which the conditional form and this
    # one give.)
    tx = jls.loss_scaling(INNER["adam"](), jls.dynamic_scale(2.0**10))
    ref = _run(tx, path, _selected, donate=False)
    got = _run(tx, path, _substitute.substituted, donate=True)
    chex.assert_trees_all_equal(got, ref, strict=True)


@pytest.mark.parametrize("path", ["fused", "update"])
def test_under_vmap_each_member_applies_or_skips_on_its_own(path):
    tx = jls.loss_scaling(optax.adam(1e-2), jls.dynamic_scale(2.0**10))
    params = _params()
    state = tx.init(params)
    grads = _scaled_grads(params, state)
    bad = _poison(grads, np.inf)
    batch = jax.tree.map(lambda g, b: jnp.stack([g, b, g]), grads, bad)
    stack = lambda t: jax.tree.map(lambda x: jnp.stack([x] * 3), t)  # noqa: E731

    def run(form):
        step = _step(tx, path, form, donate=False)
        return jax.device_get(jax.vmap(step)(stack(params), stack(state), batch))

    got, ref = run(_substitute.substituted), run(_selected)
    chex.assert_trees_all_equal(got[0], ref[0], strict=True)
    chex.assert_trees_all_equal(got[1].inner_state, ref[1].inner_state, strict=True)
    p_skip = jax.tree.map(lambda x: x[1], got[0])
    chex.assert_trees_all_equal(p_skip, jax.device_get(params), strict=True)
    s_skip = jax.tree.map(lambda x: x[1], got[1].inner_state)
    chex.assert_trees_all_equal(s_skip, jax.device_get(state.inner_state), strict=True)


def test_two_state_leaves_made_by_one_variable_each_keep_their_own_old_value():
    # One program variable returned as two state leaves whose old values
    # differ: a skipped step must give each its own.
    def update(grads, state, params=None):
        n = state[0] + 1
        return grads, (n, n)

    inner = optax.GradientTransformation(lambda p: (jnp.int32(0), jnp.int32(0)), update)
    tx = jls.loss_scaling(inner, jls.dynamic_scale(2.0**10))
    params = _params()
    state = tx.init(params)
    state = state._replace(inner_state=(jnp.int32(3), jnp.int32(7)))
    grads = _poison(_scaled_grads(params, state), np.nan)
    _, new = _step(tx, "fused", _substitute.substituted, donate=True)(
        _copy(params), _copy(state), grads
    )
    assert tuple(int(x) for x in new.inner_state) == (3, 7)


def test_parameters_with_a_non_array_leaf_step_as_the_inner_optimizer_does():
    # An unfiltered equinox-style model: a function among the parameters.
    # The skip traces only the array leaves (jls 0.3 did not trace at all).
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
