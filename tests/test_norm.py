"""The gradient-norm hook: the norm of the unscaled gradients, for free."""

# pyright: reportIndexIssue=false, reportAttributeAccessIssue=false
# pyright: reportArgumentType=false, reportOperatorIssue=false
# pyright: reportAssignmentType=false

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from measured_grads import _grads, _params

import jls


def test_the_norm_metric_is_optax_tree_norm_of_the_unscaled_gradients():
    params = _params()
    tx = jls.loss_scaling(
        optax.adam(1e-3), jls.dynamic_scale(2.0**10), gradient_norm=True
    )
    state = tx.init(params)
    assert float(jls.metrics(state)["gradient_norm"]) == 0.0
    grads = _grads(params, 2.0**10, np.random.default_rng(1))
    _, new = jax.jit(lambda g, s, p: jls.apply_gradients(tx, g, s, p))(
        grads, state, params
    )
    want = optax.tree.norm(jls.unscale(grads, state))
    np.testing.assert_allclose(jls.metrics(new)["gradient_norm"], want, rtol=1e-6)
    bad = dict(grads, b=grads["b"].at[3].set(jnp.nan))
    _, new = tx.update(bad, state, params)
    assert not np.isfinite(float(jls.metrics(new)["gradient_norm"]))


@pytest.mark.parametrize("scale", [2.0**70, 2.0**100, 2.0**126])
def test_the_gradient_norm_never_skips_a_finite_step(scale):
    # Unscaled norm 1 at a large scale: the scaled squares overflow float32.
    tx = jls.loss_scaling(optax.sgd(0.1), jls.dynamic_scale(scale), gradient_norm=True)
    params = {"w": jnp.zeros((4, 4))}
    grads = {"w": jnp.full((4, 4), 0.25 * scale, jnp.float32)}
    for fused in (False, True):
        state = tx.init(params)
        if fused:
            _, state = jax.jit(lambda g, s, p: jls.apply_gradients(tx, g, s, p))(
                grads, state, params
            )
        else:
            _, state = jax.jit(tx.update)(grads, state, params)
        m = jls.metrics(state)
        assert not bool(m["skipped"])
        assert float(m["gradient_norm"]) == 1.0


@pytest.mark.parametrize("value", [1e10, 1e19, 1e30, 8e37])
def test_the_gradient_norm_does_not_overflow_below_float32_max(value):
    tx = jls.loss_scaling(optax.sgd(0.0), jls.no_scale(), gradient_norm=True)
    params = {"w": jnp.zeros((4,)), "b": jnp.zeros((3,))}
    grads = {"w": jnp.full((4,), value, jnp.float32), "b": jnp.ones(3)}
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    m = jls.metrics(state)
    assert not bool(m["skipped"])
    want = np.sqrt(4 * np.float64(value) ** 2 + 3)
    np.testing.assert_allclose(float(m["gradient_norm"]), want, rtol=1e-6)
