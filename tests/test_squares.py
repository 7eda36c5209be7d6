"""The squares check: its flag, its measurements and the norm."""

# pyright: reportIndexIssue=false, reportAttributeAccessIssue=false
# pyright: reportArgumentType=false, reportOperatorIssue=false
# pyright: reportAssignmentType=false

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from measured_grads import F32_MAX, _grads, _params

import jls
from jls._decision import decide
from jls._finite import SMALL_LEAF
from jls._squares import leaves_squares


def test_the_check_measures_each_reduction_and_the_norm():
    rng = np.random.default_rng(0)
    big = rng.normal(size=(SMALL_LEAF + 1,)).astype(np.float32) * 3
    small = [rng.normal(size=(7,)).astype(np.float32), np.ones(5, np.float16) * 2]
    leaves = [jnp.asarray(big), *(jnp.asarray(x) for x in small)]
    m = jax.jit(leaves_squares)(leaves)
    as64 = [np.asarray(x, np.float64) for x in (big, *small)]
    group = np.concatenate([x.ravel() for x in as64[1:]])  # one float32 group
    rms = max(np.sqrt(np.mean(as64[0] ** 2)), np.sqrt(np.mean(group**2)))
    np.testing.assert_allclose(float(m.magnitude), rms, rtol=1e-6)
    np.testing.assert_allclose(
        float(m.low), sum(float((x**2).sum()) for x in as64), rtol=1e-6
    )
    assert bool(m.finite)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_the_check_sees_every_nonfinite_value(bad):
    x = np.ones((SMALL_LEAF * 2,), np.float32)
    x[123] = bad
    assert not bool(jax.jit(leaves_squares)([jnp.asarray(x)]).finite)
    y = np.ones((9,), np.float16)
    y[3] = bad
    assert not bool(jax.jit(leaves_squares)([jnp.asarray(y)]).finite)


def test_a_fused_producer_that_rounds_to_inf_is_seen():
    # The stored gradient a * b is inf, though its producer is fused into the
    # check's reduction.
    @jax.jit
    def check(a, b):
        return leaves_squares([a * b]).finite

    a = jnp.ones((SMALL_LEAF * 2,), jnp.float32).at[77].set(2.0**60)
    b = jnp.ones_like(a).at[77].set(2.0**70)
    assert not bool(check(a, b))
    assert bool(check(a, jnp.ones_like(a)))


@pytest.mark.parametrize("value", [1e20, 1e30, 3e38])
def test_finite_values_whose_squares_overflow_are_finite(value):
    # The plain sum of squares overflows float32; the shrunk second pass
    # (taken only then) proves the values finite and measures them.
    x = jnp.full((4,), value, jnp.float32)
    m = jax.jit(leaves_squares)([x])
    assert bool(m.finite) and float(m.low) == np.inf
    np.testing.assert_allclose(float(m.magnitude), value, rtol=1e-6)
    want = 2 * value  # the norm of four equal values
    got = float(jls._squares.unscaled_norm(m, jnp.float32(1.0)))
    if want < float(F32_MAX):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    else:
        assert got == np.inf
    bad = x.at[2].set(jnp.inf)
    assert not bool(jax.jit(leaves_squares)([bad]).finite)


def test_decide_reports_the_range_and_norm():
    params = _params()
    scaling = jls.LossScaling(optax.sgd(0.1), jls.measured_scale())
    grads = _grads(params, 2.0**15, np.random.default_rng(2))
    d = decide(scaling.config, grads, scaling.scaler.init())
    leaves = {k: np.asarray(v, np.float64) for k, v in grads.items()}
    small = np.concatenate([leaves["b"], leaves["h"]])
    rms = max(np.sqrt(np.mean(leaves["w"] ** 2)), np.sqrt(np.mean(small**2)))
    np.testing.assert_allclose(float(d.magnitude), rms, rtol=1e-6)
    norm = np.sqrt(sum((x**2).sum() for x in leaves.values())) / 2.0**15
    np.testing.assert_allclose(float(d.norm), norm, rtol=1e-6)


def test_replicas_agree_on_the_measurements():
    params = {"w": jnp.ones((8, 4))}
    tx = jls.loss_scaling(
        optax.sgd(0.1), jls.measured_scale(), axis_name={"r": True}, gradient_norm=True
    )  # each replica's gradient its own: added as shards
    state = tx.init(params)
    grads = {"w": jnp.arange(1.0, 3.0)[:, None, None] * jnp.ones((2, 8, 4)) * 2.0**15}

    def step(g):
        return jls.metrics(tx.update(g, state, params)[1])

    m = jax.vmap(step, axis_name="r")(grads)
    assert float(m["gradient_norm"][0]) == float(m["gradient_norm"][1])
    assert float(m["loss_scale"][0]) == float(m["loss_scale"][1])
