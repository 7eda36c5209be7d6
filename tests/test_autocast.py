"""`jls.precision.autocast`: what it returns, one trace per step, bad input refused."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false
# pyright: reportCallIssue=false, reportIndexIssue=false

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jls

F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
PARAMS = {
    "w1": jax.random.normal(jax.random.key(0), (8, 16)) / 3,
    "w2": jax.random.normal(jax.random.key(1), (16, 4)) / 4,
    "b": jnp.zeros(16),
}
X = jax.random.normal(jax.random.key(2), (32, 8))
Y = jnp.arange(32) % 4


def loss(params, x, y):
    h = jax.nn.gelu(x @ params["w1"] + params["b"][None])
    logits = h @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def test_matmuls_are_float16_forward_and_backward_and_the_loss_float32():
    cast = jls.precision.autocast(loss)
    jls.precision.precision_report(cast, PARAMS, X, Y).check(F16)
    report = jls.precision.precision_report(jax.grad(cast), PARAMS, X, Y)
    report.check(F16)
    assert sum(report.counts.values()) == 2 + 3  # dx of the first needs none
    assert all(set(by) == {"float32"} for by in report.numerics.values())
    grads = jax.grad(cast)(PARAMS, X, Y)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}  # the master weights'
    chex.assert_trees_all_close(
        grads, jax.grad(loss)(PARAMS, X, Y), rtol=2e-2, atol=2e-4
    )
    assert cast(PARAMS, X, Y).dtype == F32
    np.testing.assert_allclose(cast(PARAMS, X, Y), loss(PARAMS, X, Y), rtol=2e-3)


def test_a_step_traces_once_and_the_function_once_per_trace():
    calls = []

    def counted(params, x, y):
        calls.append(1)
        return loss(params, x, y)

    cast = jls.precision.autocast(counted)
    tx = optax.adam(1e-2)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(params, state, x, y):
        grads = jax.grad(cast)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, state = PARAMS, tx.init(PARAMS)
    for _ in range(3):
        params, state = step(params, state, X, Y)
    assert len(calls) == 1


def test_the_result_has_the_structure_and_dtypes_fn_returns():
    def fn(params, x, tag):
        h = x @ params["w1"]
        return {
            "h": h,
            "half": h.astype(F16),
            "count": jnp.int32(3),
            "tag": tag,
            "act": jnp.tanh,
            "n": 2,
        }

    out = jls.precision.autocast(fn)(PARAMS, X, "label")
    assert out["h"].dtype == F32 and out["half"].dtype == F16
    assert out["count"].dtype == jnp.int32 and int(out["count"]) == 3
    assert out["tag"] == "label" and out["act"] is jnp.tanh and out["n"] == 2


def test_eager_jit_and_vmap_agree():
    cast = jls.precision.autocast(lambda w, x: jnp.tanh(x @ w).sum())
    w = PARAMS["w1"]
    eager, jitted = cast(w, X), jax.jit(cast)(w, X)
    chex.assert_trees_all_equal(eager, jitted)
    mapped = jax.vmap(cast, in_axes=(None, 0))(w, X[:, None])
    np.testing.assert_allclose(mapped.sum(), eager, rtol=1e-3)


def test_numpy_arrays_and_python_numbers_are_arguments():
    cast = jls.precision.autocast(lambda w, x, scale: (x @ w).sum() * scale)
    got = cast(np.asarray(PARAMS["w1"]), np.asarray(X), 0.5)
    np.testing.assert_allclose(got, (X @ PARAMS["w1"]).sum() * 0.5, rtol=1e-2)


def test_a_float32_compute_dtype_changes_nothing():
    cast = jls.precision.autocast(loss, jnp.float32)
    chex.assert_trees_all_close(cast(PARAMS, X, Y), loss(PARAMS, X, Y), rtol=1e-6)
    assert jls.precision.precision_report(cast, PARAMS, X, Y).counts == {"float32": 2}


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, None, "f16x"])
def test_a_non_floating_dtype_is_refused_by_name(dtype):
    with pytest.raises(TypeError, match="dtype must be a floating dtype, got"):
        jls.precision.autocast(loss, dtype)


def test_a_non_callable_is_refused_by_name():
    with pytest.raises(TypeError, match="fn must be callable, got 3"):
        jls.precision.autocast(3)  # type: ignore[arg-type]


def test_the_wrapped_function_keeps_its_name():
    assert jls.precision.autocast(loss).__name__ == "loss"
