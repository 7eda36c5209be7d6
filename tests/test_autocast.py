"""`jls.precision.autocast`: what it returns, one trace per step, bad input refused."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false
# pyright: reportCallIssue=false, reportIndexIssue=false

import re

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


def head(w1, w2, x):
    h = jnp.tanh(x @ w1)
    with jax.named_scope("lm_head"):
        return jax.nn.logsumexp(h @ w2, -1).sum()


def head_from(h16, w2):  # the LM head in float32 on the float16 body's output
    return jax.nn.logsumexp(h16.astype(F32) @ w2, -1).sum()


H16 = jnp.tanh(X.astype(F16) @ PARAMS["w1"].astype(F16))


@pytest.mark.parametrize(
    "keep", ["lm_head", ("other", "lm_head"), lambda op, names: "lm_head" in names]
)
def test_a_kept_scope_computes_in_float32_forward_and_backward(keep):
    w1, w2 = PARAMS["w1"], PARAMS["w2"]
    kept = jls.precision.autocast(head, float32=keep)
    np.testing.assert_allclose(kept(w1, w2, X), head_from(H16, w2), rtol=1e-6)
    plain = jls.precision.autocast(head)(w1, w2, X)  # the head in float16
    assert abs(plain - head_from(H16, w2)) > 1e-5 * abs(plain)
    d1, d2 = jax.grad(kept, (0, 1))(w1, w2, X)
    np.testing.assert_allclose(d2, jax.grad(head_from, 1)(H16, w2), rtol=1e-5)
    assert d1.dtype == F32  # through the float16 body, to the float32 master
    dh = jax.grad(head_from)(H16, w2).astype(F16) * (1 - H16 * H16)
    ref = (X.astype(F16).T @ dh).astype(F32)
    np.testing.assert_allclose(d1, ref, rtol=1e-2, atol=1e-3)
    report = jls.precision.precision_report(jax.grad(kept, (0, 1)), w1, w2, X)
    assert report.counts == {"float16": 2, "float32": 3}  # body x @ w1 and dw1


def test_the_report_shows_each_matmul_where_it_ran():
    kept = jls.precision.autocast(head, float32="lm_head")
    report = jls.precision.precision_report(kept, PARAMS["w1"], PARAMS["w2"], X)
    assert [(op.dtype, op.scope) for op in report.ops] == [
        ("float16", ""),
        ("float32", "lm_head"),
    ]
    assert re.search(r"dot_general float32 at \S+ lm_head\n", str(report))


def test_a_name_matches_whole_components_of_the_path():
    w1, w2 = PARAMS["w1"], PARAMS["w2"]
    for keep in ("head", "lm", "lm_head/x"):
        report = jls.precision.precision_report(
            jls.precision.autocast(head, float32=keep), w1, w2, X
        )
        assert report.counts == {"float16": 2}, keep
    inner = jls.precision.autocast(jax.grad(head, (0, 1)), float32="lm_head")
    report = jls.precision.precision_report(inner, w1, w2, X)  # jvp(lm_head) too
    assert report.counts == {"float16": 2, "float32": 3}


@pytest.mark.parametrize("bad", [3, ("lm_head", 1), (), "", ["lm_head"]])
def test_a_bad_float32_is_refused_by_name(bad):
    with pytest.raises(
        TypeError, match=f"float32 must be .*, got {re.escape(repr(bad))}"
    ):
        jls.precision.autocast(loss, float32=bad)


def test_a_predicate_sees_the_whole_name_stack_inside_a_loop():
    def fn(w, x):
        with jax.named_scope("lm_head"):
            body = lambda c, _: (jnp.tanh(c @ w), None)  # noqa: E731
            return jax.lax.scan(body, x, None, length=2)[0].sum()

    keep = lambda op, names: op == "dot_general" and names == "lm_head"  # noqa: E731
    cast = jls.precision.autocast(fn, float32=keep)
    w = PARAMS["w1"][:, :8]
    assert jls.precision.precision_report(cast, w, X).counts == {"float32": 1}


def test_a_linen_module_path_is_matched():
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="lm_head")(nn.Dense(16, name="body")(x))

    model = Model()
    params = model.init(jax.random.key(0), X)
    for keep in ("lm_head", "Model/lm_head"):
        cast = jls.precision.autocast(model.apply, float32=keep)
        report = jls.precision.precision_report(cast, params, X)
        assert [(op.dtype, op.scope) for op in report.ops] == [
            ("float16", "Model/body"),
            ("float32", "Model/lm_head"),
        ]


def test_a_cast_to_float16_inside_a_kept_scope_is_held_in_float32():
    def head16(w1, w2, x):  # the head's layer casts its weights to float16
        h = jnp.tanh(x @ w1)
        with jax.named_scope("lm_head"):
            return jax.nn.logsumexp(h @ w2.astype(F16), -1).sum()

    kept = jls.precision.autocast(head16, float32="lm_head")
    got = kept(PARAMS["w1"], PARAMS["w2"], X)
    np.testing.assert_allclose(got, head_from(H16, PARAMS["w2"]), rtol=1e-6)


def test_an_nnx_module_scoped_in_its_code_is_kept():
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self):
            self.body = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
            self.lm_head = nnx.Linear(16, 4, rngs=nnx.Rngs(1))

        def __call__(self, x):
            h = self.body(x)
            with jax.named_scope("lm_head"):  # an nnx call adds no name
                return self.lm_head(h)

    cast = jls.precision.autocast(lambda m, x: m(x), float32="lm_head")
    report = jls.precision.precision_report(cast, Model(), X)
    assert [op.dtype for op in report.ops] == ["float16", "float32"]
