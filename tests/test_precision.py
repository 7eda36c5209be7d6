"""`jls.precision.precision_report`: which dtype each matmul really runs in."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false
# pyright: reportCallIssue=false, reportIndexIssue=false

import re

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jls

POLICY = jls.precision.get_policy("params=float32,compute=float16,output=float32")
F16 = jnp.float16


def test_counts_matmuls_and_convolutions_by_dtype():
    w = jnp.ones((3, 4))
    k = jnp.ones((3, 3, 2, 5))
    x, img = jnp.ones((2, 3)), jnp.ones((1, 8, 8, 2))

    def fn(w, k, x, img):
        y = jax.lax.conv_general_dilated(
            img.astype(F16),
            k.astype(F16),
            (1, 1),
            "SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        return (x @ w).sum() + y.sum().astype(jnp.float32)

    report = jls.precision.precision_report(fn, w, k, x, img)
    assert report.counts == {"float32": 1, "float16": 1}
    kinds = sorted(op.kind for op in report.ops)
    assert kinds == ["conv_general_dilated", "dot_general"]


def test_nested_programs_are_walked():
    w = jnp.ones((4, 4), F16)

    @jax.jit
    def inner(h):
        return jnp.tanh(h @ w)

    def fn(x):
        h, _ = jax.lax.scan(lambda c, _: (inner(c), None), x, None, length=3)
        h = jax.lax.cond(h.sum() > 0, lambda h: h @ w, lambda h: h, h)
        h = jax.checkpoint(lambda h: h @ w)(h)
        h = jax.vmap(lambda r: r @ w)(h)
        return jax.lax.while_loop(
            lambda c: c[1] < 2, lambda c: (c[0] @ w, c[1] + 1), (h, 0)
        )

    report = jls.precision.precision_report(fn, jnp.ones((2, 4), F16))
    assert report.counts == {"float16": 5}


def test_a_closed_over_model_is_reported_in_its_own_dtype():
    w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
    passed = jls.precision.precision_report(
        POLICY.cast_arguments(lambda w, x: x @ w), w, x
    )
    closed = jls.precision.precision_report(POLICY.cast_arguments(lambda x: x @ w), x)
    assert passed.counts == {"float16": 1}
    assert closed.counts == {"float32": 1}
    message = r"1 of 1 matmuls/convolutions do not compute in float16:\n"
    message += r"  dot_general in float32 at test_precision.py:\d+"
    with pytest.raises(ValueError, match=message):
        closed.check(F16)
    passed.check(F16)  # quietly
    # Autocast casts at the matmul: a closed-over model is float16 too.
    jls.precision.precision_report(POLICY.wrap(lambda x: x @ w), x).check(F16)


def test_an_equinox_gru_with_a_float32_carry():
    class GRU(eqx.Module):
        cell: eqx.nn.GRUCell

        def __init__(self, key):
            self.cell = eqx.nn.GRUCell(3, 8, key=key)

        def __call__(self, xs, carry_dtype):
            def step(h, x):
                return self.cell(x, h), None

            h, _ = jax.lax.scan(step, jnp.zeros(8, carry_dtype), xs)
            return h

    model = GRU(jax.random.key(0))
    xs = jnp.ones((5, 3))

    # The carry made inside the model in float32 promotes every matmul back.
    def forward(carry_dtype):
        return POLICY.cast_arguments(lambda m, xs: m(xs, carry_dtype))

    bad = jls.precision.precision_report(forward(jnp.float32), model, xs)
    good = jls.precision.precision_report(forward(jnp.float16), model, xs)
    # The carry made inside the model in float32 promotes the hidden-state
    # matmuls back to float32 (the input ones stay float16).
    assert bad.counts.get("float32", 0) > 0 and bad.counts.get("float16", 0) > 0
    assert good.counts == {"float16": sum(bad.counts.values())}
    assert "not in float16" in str(bad) or "not in float32" in str(bad)
    assert "not in float16" not in str(good)
    # Autocast casts at each matmul: the float32 carry is no trap.
    autocast = POLICY.wrap(lambda m, xs: m(xs, jnp.float32))
    jls.precision.precision_report(autocast, model, xs).check(F16)


def test_an_nnx_model_with_layer_dtypes():
    class Net(nnx.Module):
        def __init__(self, dtype):
            kw = {"dtype": dtype, "param_dtype": jnp.float32}
            self.a = nnx.Linear(3, 8, rngs=nnx.Rngs(0), **kw)
            self.bn = nnx.BatchNorm(8, rngs=nnx.Rngs(0), **kw)
            self.b = nnx.Linear(8, 2, rngs=nnx.Rngs(1), **kw)

        def __call__(self, x):
            return self.b(nnx.relu(self.bn(self.a(x))))

    x = jnp.ones((4, 3))
    assert jls.precision.precision_report(lambda m, x: m(x), Net(F16), x).counts == {
        "float16": 2
    }
    assert jls.precision.precision_report(lambda m, x: m(x), Net(None), x).counts == {
        "float32": 2
    }


def test_a_linen_lstm_under_scan_and_its_carry():
    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, xs, carry_dtype):
            cell = nn.OptimizedLSTMCell(8, dtype=jnp.float16, param_dtype=jnp.float32)
            scan = nn.scan(
                lambda c, carry, x: c(carry, x),
                variable_broadcast="params",
                split_rngs={"params": False},
                in_axes=0,
                out_axes=0,
            )
            carry = (jnp.zeros((8,), carry_dtype), jnp.zeros((8,), carry_dtype))
            return scan(cell, carry, xs)

    xs = jnp.ones((5, 3), F16)
    model = Encoder()
    params = model.init(jax.random.key(0), xs, jnp.float16)

    def forward(params, xs, dtype):
        return model.apply(params, xs, dtype)

    good = jls.precision.precision_report(forward, params, xs, jnp.float16)
    assert set(good.counts) == {"float16"} and sum(good.counts.values()) >= 2
    # The LSTM keeps its gates' numerics in float16: information, not errors.
    assert any(op.kind == "logistic" for op in good.info)


def test_softmax_and_low_precision_reductions_are_information():
    def fn(x):
        return jax.nn.softmax(x @ x.T).sum() + jnp.exp(x).sum()

    report = jls.precision.precision_report(fn, jnp.ones((3, 3), F16))
    kinds = {op.kind for op in report.info}
    # jnp.sum upcasts a float16 sum to float32: not listed; the softmax's
    # exp, and the other exp, are float16 (its max is exact in any dtype).
    assert kinds == {"softmax", "exp"}
    assert all(op.dtype == "float16" for op in report.info)
    report.check(F16)  # information never fails the check
    text = str(report)
    assert "low-precision numerics (information, not errors)" in text


def test_nothing_is_executed():
    calls = []

    def fn(x):
        jax.debug.callback(lambda: calls.append(1))
        return x @ x

    jls.precision.precision_report(fn, jnp.ones((2, 2)))
    assert calls == []


def test_a_function_without_matmuls_fails_the_check():
    report = jls.precision.precision_report(lambda x: x + 1, jnp.ones(3))
    assert report.counts == {}
    with pytest.raises(ValueError, match="no matmul or convolution was traced"):
        report.check(F16)


def test_a_float32_ragged_dot_fails_the_float16_check():
    # An MoE layer's experts: a float32 ragged dot among float16 matmuls.
    x, w = jnp.ones((6, 4), F16), jnp.ones((4, 8), F16)
    experts = jnp.ones((3, 8, 5))
    sizes = jnp.array([2, 2, 2], jnp.int32)

    def fn(x, w, experts, sizes):
        h = (x @ w).astype(jnp.float32)
        return jax.lax.ragged_dot(h, experts, sizes)

    report = jls.precision.precision_report(fn, x, w, experts, sizes)
    assert report.counts == {"float16": 1, "float32": 1}
    assert [op.kind for op in report.ops] == ["dot_general", "ragged_dot_general"]
    with pytest.raises(ValueError, match="ragged_dot_general in float32 at"):
        report.check(F16)
    cast = jls.precision.precision_report(POLICY.wrap(fn), x, w, experts, sizes)
    cast.check(F16)


def test_the_float32_kept_ops_are_listed_beside_the_matmuls():
    w, x, y = jnp.ones((3, 4)), jnp.ones((2, 3)), jnp.array([0, 1])

    def loss(w, x, y):
        logits = x @ w
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    kept = jls.precision.precision_report(POLICY.wrap(loss), w, x, y)
    assert kept.counts == {"float16": 1}
    # The log-softmax's exp (labelled softmax where optax's pattern shows
    # one), its log and the sums, all float32.
    assert {"log", "reduce_sum"} <= set(kept.numerics)
    assert {"exp", "softmax"} & set(kept.numerics)
    assert all(set(by) == {"float32"} for by in kept.numerics.values()), kept
    text = str(kept)
    assert "range-sensitive ops (softmax, exp, log, sums) by dtype:" in text
    assert re.search(r"\n  log +float32 1\n", text), text
    # Argument casting runs the loss's exp and log in float16: shown too.
    cast = jls.precision.precision_report(POLICY.cast_arguments(loss), w, x, y)
    exp = cast.numerics.get("exp") or cast.numerics["softmax"]
    assert set(exp) == set(cast.numerics["log"]) == {"float16"}


def test_a_softmax_is_counted_as_one_softmax():
    report = jls.precision.precision_report(
        lambda x: jax.nn.softmax(x).sum(), jnp.ones((2, 3))
    )
    assert report.numerics["softmax"] == {"float32": 1}
    assert "exp" not in report.numerics


def test_collectives_are_listed_with_the_dtype_they_send():
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("b",), axis_types=(jax.sharding.AxisType.Auto,))

    def body(g, h):
        return (
            jax.lax.psum(g, "b"),
            jax.lax.all_gather(h, "b", tiled=True),
            jax.lax.psum_scatter(g, "b", tiled=True),
            jax.lax.ppermute(g, "b", [(0, 0)]),
            jax.lax.all_to_all(h, "b", 0, 0, tiled=True),
            jax.lax.psum((g, h), "b"),
        )

    step = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=P("b"), out_specs=P("b"), check_vma=False
        )
    )
    report = jls.precision.precision_report(step, jnp.ones(4, F16), jnp.ones(4))
    found = [(op.kind, op.dtype) for op in report.collectives]
    assert found == [
        ("psum", "float16"),
        ("all_gather", "float32"),
        ("reduce_scatter", "float16"),
        ("ppermute", "float16"),
        ("all_to_all", "float32"),
        ("psum", "float16"),
        ("psum", "float32"),
    ]
    assert all(op.where.startswith("test_precision.py:") for op in report.collectives)
    assert "collectives:\n  psum float16 at test_precision.py:" in str(report)


def test_the_report_says_the_dtype_a_sum_is_held_in():
    x = jnp.ones(8, F16)
    lse = jax.nn.logsumexp
    plain = jls.precision.precision_report(lse, x)
    # jax sums float16 in float32 and casts the sum back: computed in float32,
    # held in float16, where the log reads it.
    assert plain.numerics["reduce_sum"] == {"float32": 1}
    assert plain.held["reduce_sum"] == {"float16": 1}
    assert re.search(r"\n  reduce_sum +float32 1 +held float16 1\n", str(plain))
    cast = jls.precision.precision_report(jls.precision.autocast(lse), x)
    assert cast.held["reduce_sum"] == cast.held["log"] == {"float32": 1}
