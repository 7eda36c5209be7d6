"""`jls.precision._cast_eval`: the per-op casting rules, and nested programs."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false
# pyright: reportCallIssue=false, reportIndexIssue=false, reportOptionalMemberAccess=false

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jls

F16, F32 = np.dtype(np.float16), np.dtype(np.float32)


def _ops(fn, *args) -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """(primitive, operand dtypes, result dtypes) of every op, nested included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            ins = tuple(
                getattr(v.aval, "dtype", np.dtype(bool)).name for v in eqn.invars
            )
            outs = tuple(v.aval.dtype.name for v in eqn.outvars)
            found.append((eqn.primitive.name, ins, outs))
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _named(fn, *args, name):
    return [(i, o) for n, i, o in _ops(fn, *args) if n == name]


W, X = jnp.ones((4, 4)), jnp.ones((2, 4))


def test_a_matmul_computes_in_the_compute_dtype_and_returns_it():
    fn = jls.precision.autocast(lambda w, x: x @ w)
    assert _named(fn, W, X, name="dot_general") == [
        (("float16", "float16"), ("float16",))
    ]
    assert fn(W, X).dtype == F32  # the result in the dtype fn returns it in
    bf16 = jls.precision.autocast(lambda w, x: x @ w, jnp.bfloat16)
    assert _named(bf16, W, X, name="dot_general")[0][0] == ("bfloat16", "bfloat16")


def test_a_preferred_element_type_that_asked_for_more_is_kept():
    def fn(w, x):
        a = jax.lax.dot(x.astype(F16), w.astype(F16), preferred_element_type=F32)
        return a, x @ w

    first, second = _named(jls.precision.autocast(fn), W, X, name="dot_general")
    assert first == (("float16", "float16"), ("float32",))  # accumulate in float32
    assert second == (("float16", "float16"), ("float16",))  # it only restated f32


def test_an_integer_matmul_is_left_alone():
    a = jnp.ones((2, 3), jnp.int8)
    fn = jls.precision.autocast(
        lambda a: jax.lax.dot(a, a.T, preferred_element_type=jnp.int32).sum()
    )
    assert _named(fn, a, name="dot_general") == [(("int8", "int8"), ("int32",))]


@pytest.mark.parametrize(
    "op, prim",
    [
        (jnp.exp, "exp"),
        (jnp.log1p, "log1p"),
        (jax.nn.sigmoid, "logistic"),
        (jnp.square, "square"),
        (lambda h: h**3, "integer_pow"),
        (lambda h: jnp.sum(h, -1), "reduce_sum"),
        (lambda h: jnp.cumsum(h, -1), "cumsum"),
        (jax.lax.rsqrt, "rsqrt"),
    ],
)
def test_range_sensitive_ops_compute_in_float32(op, prim):
    fn = jls.precision.autocast(lambda w, x: op(x @ w))
    (ins, outs) = _named(fn, W, X, name=prim)[0]
    assert set(ins) == {"float32"} and outs == ("float32",)


def test_x_times_x_is_a_square():
    fn = jls.precision.autocast(lambda w, x: (x @ w) * (x @ w) + 0.0)
    h = jls.precision.autocast(lambda w, x: (lambda h: h * h)(x @ w))
    assert _named(h, W, X, name="mul") == [(("float32", "float32"), ("float32",))]
    # Two different float16 values multiply in float16.
    assert _named(fn, W, X, name="mul")[0][0] == ("float16", "float16")


def test_other_ops_follow_their_operands_and_promote_as_traced():
    def fn(w, b, x):
        h = x @ w  # float16
        scaled = h * 2.0  # a weak scalar takes float16
        biased = jnp.tanh(h) + b[None]  # float16 + float32 bias: float32
        return scaled, biased

    ops = _ops(jls.precision.autocast(fn), W, jnp.zeros(4), X)
    assert ("mul", ("float16", "float16"), ("float16",)) in ops
    assert ("tanh", ("float16",), ("float16",)) in ops
    assert ("add", ("float32", "float32"), ("float32",)) in ops
    scaled, biased = jls.precision.autocast(fn)(W, jnp.zeros(4), X)
    assert scaled.dtype == biased.dtype == F32  # returned as fn returns them


def test_a_float32_chain_stays_float32_until_the_next_matmul():
    def fn(w, x):
        h = jnp.exp(x @ w)  # float32 from here
        h = jnp.tanh(h - 1.0)
        return h @ w

    ops = _ops(jls.precision.autocast(fn), W, X)
    assert ("tanh", ("float32",), ("float32",)) in ops
    assert [i for n, i, _ in ops if n == "dot_general"] == [("float16", "float16")] * 2


def test_nested_programs_run_by_the_same_rules():
    w = W

    @jax.jit
    def inner(h):
        return jnp.tanh(h @ w)

    def fn(w, x):
        h, ys = jax.lax.scan(lambda c, _: (inner(c), c.sum()), x, None, length=3)
        h = jax.lax.cond(h.sum() > 0, lambda h: h @ w, lambda h: h, h)
        h = jax.checkpoint(lambda h: h @ w)(h)
        h = jax.vmap(lambda r: r @ w)(h)
        return h.sum() + ys.sum()

    def loop(w, x):
        return jax.lax.while_loop(
            lambda c: c[1] < 2, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (x, 0)
        )[0]

    report = jls.precision.precision_report(jls.precision.autocast(fn), W, X)
    assert report.counts == {"float16": 4}
    assert jls.precision.precision_report(
        jls.precision.autocast(loop), W, X
    ).counts == {"float16": 1}
    grads = jls.precision.precision_report(jax.grad(jls.precision.autocast(fn)), W, X)
    assert set(grads.counts) == {"float16"} and sum(grads.counts.values()) > 4
    np.testing.assert_allclose(jls.precision.autocast(fn)(W, X), fn(W, X), rtol=1e-2)
    np.testing.assert_allclose(
        jls.precision.autocast(loop)(W, X), loop(W, X), rtol=1e-2
    )


def test_a_loop_carry_keeps_its_traced_dtype():
    def fn(w, x):
        def step(c, _):
            return jnp.tanh(c @ w), None  # float16 inside, float32 carry

        return jax.lax.scan(step, x, None, length=2)[0]

    carry = [o for n, _, o in _ops(jls.precision.autocast(fn), W, X) if n == "scan"]
    assert carry == [("float32",)]


def test_a_checkpoint_keeps_its_policy():
    policy = jax.checkpoint_policies.dots_saveable

    def fn(w, x):
        return jax.checkpoint(lambda h: jnp.sin(h @ w), policy=policy)(x).sum()

    (eqn,) = [
        e
        for e in jax.make_jaxpr(jls.precision.autocast(fn))(W, X).jaxpr.eqns
        if e.primitive.name in ("remat2", "checkpoint")
    ]
    assert eqn.params["policy"] is policy


def test_custom_derivatives_are_the_ones_written():
    @jax.custom_vjp
    def marked(h):
        return h

    marked.defvjp(lambda h: (h, None), lambda _, g: (jnp.full_like(g, 7.0),))

    def fn(w, x):
        # relu's own rule: gradient 0 at 0 (jnp.maximum's would be 0.5).
        return jax.nn.relu(x @ w - 4.0).sum() + marked(x @ w).sum()

    grads = jax.grad(jls.precision.autocast(fn))(W, X)
    chex.assert_trees_all_close(grads, jax.grad(fn)(W, X))
    # The custom functions ran as traced: float32, on operands cast back.
    assert ("custom_jvp_call", ("float32",), ("float32",)) in _ops(
        jls.precision.autocast(fn), W, X
    )


def test_an_op_that_refuses_the_new_dtype_runs_as_traced():
    def fn(w, x):
        return jax.lax.bitcast_convert_type(x @ w, jnp.int32)

    chex.assert_trees_all_equal(jls.precision.autocast(fn)(W, X), fn(W, X))


def test_closed_over_arrays_and_outer_tracers():
    @jax.jit
    def outer(w, x):
        return jax.grad(lambda w: jls.precision.autocast(lambda x: (x @ w).sum())(x))(w)

    chex.assert_trees_all_close(outer(W, X), jax.grad(lambda w: (X @ w).sum())(W))
    report = jls.precision.precision_report(outer, W, X)
    assert set(report.counts) == {"float16"}


# A float16 program sums in float32 and casts back (jax's sum of float16 is
# convert, reduce, convert): autocast holds the sum wide, so a log or sqrt
# brings it back into range, and the result is float32's within float16
# rounding, forward and backward.
V = 100_000
LOGITS = (jax.random.normal(jax.random.key(3), (V,)) / 32).astype(F16)  # sum > 65504
LARGE = jax.random.uniform(jax.random.key(4), (512,), minval=16, maxval=32).astype(F16)


def _lse(x):
    return jax.nn.logsumexp(x)


def _norm(x):
    return jnp.linalg.norm(x)


def _ulps(got, want):
    """How many float16 ulps (of ``want``) ``got`` is from ``want``."""
    want = np.asarray(want, np.float32)
    spacing = np.spacing(np.abs(want).astype(F16)).astype(np.float32)
    return np.abs(np.asarray(got, np.float32) - want) / np.maximum(spacing, 2.0**-24)


@pytest.mark.parametrize("fn, x", [(_lse, LOGITS), (_norm, LARGE)])
def test_a_float16_sum_is_held_wide_until_a_log_or_sqrt(fn, x):
    cast = jls.precision.autocast(fn)
    assert np.isinf(fn(x))  # the float16 program overflows
    got, want = cast(x), fn(x.astype(F32))
    assert got.dtype == F16  # the output keeps its declared dtype
    assert got == want.astype(F16), (got, want)  # float32's, rounded once
    grad, want_grad = jax.grad(cast)(x), jax.grad(fn)(x.astype(F32))
    assert grad.dtype == F16
    assert np.max(_ulps(grad, want_grad)) <= 1, np.max(_ulps(grad, want_grad))
    # The sum is held in float32: no narrowing convert between it and the log/sqrt.
    ops = [(n, o) for n, _, o in _ops(cast, x)]
    sums = [i for i, (n, _) in enumerate(ops) if n == "reduce_sum"]
    assert ops[sums[0] + 1] != ("convert_element_type", ("float16",)), ops


def test_a_float16_cross_entropy_through_nnx_linear_equals_float32s():
    init = nnx.initializers.normal(0.01)
    model = nnx.Linear(
        8, V, dtype=F16, param_dtype=F32, kernel_init=init, rngs=nnx.Rngs(0)
    )
    x, y = jax.random.normal(jax.random.key(5), (4, 8)), jnp.arange(4) * 7

    def loss(model, x, y, wide=False):
        logits = model(x)
        logits = logits.astype(F32) if wide else logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    cast = jls.precision.autocast(loss)
    assert np.isinf(loss(model, x, y))
    got, want = cast(model, x, y), loss(model, x, y, wide=True)
    assert got.dtype == F16 and got == want.astype(F16), (got, want)
    assert abs(float(want) - 11.5) < 0.5
    grads = nnx.grad(cast)(model, x, y)
    want_grads = nnx.grad(lambda m: loss(m, x, y, wide=True))(model)
    # The matmul's backward is float16 in both: its ~1e-6 entries are float16
    # subnormals, a few subnormal steps (2^-24) apart.
    chex.assert_trees_all_close(grads, want_grads, rtol=4e-3, atol=8 * 2.0**-24)


def test_a_float32_value_the_program_casts_to_float16_is_cast():
    # A float32 bias the program casts to float16 never was float16: the cast
    # is bound, the add stays float16 (only what autocast widened stays wide).
    def fn(b, x):
        return (
            jnp.tanh(x) + b.astype(F16)[None] + jax.lax.iota(F16, 4)[None]
        )  # no operand

    ops = _ops(jls.precision.autocast(fn), jnp.zeros(4), X.astype(F16))
    assert ("add", ("float16", "float16"), ("float16",)) in ops


@pytest.mark.parametrize(
    "op",
    [
        lambda s: jax.lax.bitcast_convert_type(s, jnp.int16),
        lambda s: jax.lax.nextafter(s, jnp.float16(jnp.inf)) - s,
    ],
    ids=["bitcast", "nextafter"],
)
def test_an_op_that_reads_the_dtype_gets_the_value_in_its_traced_dtype(op):
    # A sum held wide is a float32 value: a bitcast of it would be two int16s,
    # a nextafter a float32 step. Such ops take it back in float16.
    def f(x):
        return op(jnp.sum(x))

    x = jnp.full(8, 3.0, jnp.float16)
    got, want = jls.precision.autocast(f)(x), f(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
