"""`jls.precision._interpret`: tracing, the array leaves, and binding again."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jls.precision._interpret import (
    as_closed,
    bind,
    interpret,
    is_array,
    is_literal,
    loop,
    read,
    trace,
)


def _run(closed, *args):
    """``closed`` run on ``args``, each equation bound again by `bind`."""
    env = dict(zip(closed.jaxpr.invars, args, strict=True))
    env.update(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    for eqn in closed.jaxpr.eqns:
        outs = bind(eqn, [read(v, env) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v, env) for v in closed.jaxpr.outvars]


def test_arrays_are_traced_and_every_other_leaf_is_passed_as_it_is():
    seen = []

    def fn(p, scale, *, act):
        seen.append((p["w"], scale, act))
        return {"y": act(p["w"] * scale), "name": "out", "n": 3}

    args = ({"w": np.arange(3.0)}, 2.0)  # float64 numpy: float32 without x64
    traced = trace(fn, args, {"act": jnp.tanh})
    assert [a.dtype for a in traced.arrays] == [jnp.float32]
    # The numpy array came in traced (a jax value), the others as they were.
    assert isinstance(seen[0][0], jax.Array) and seen[0][1:] == (2.0, jnp.tanh)
    result = traced.rebuild(_run(traced.closed, *traced.arrays))
    assert result["name"] == "out" and result["n"] == 3
    np.testing.assert_array_equal(result["y"], jnp.tanh(jnp.arange(3.0) * 2))


@pytest.mark.parametrize(
    ("x", "want"),
    [
        (jnp.ones(2), True),
        (np.ones(2), True),
        (np.float32(1), True),
        (1.0, False),
        (jnp.tanh, False),
        ("a", False),
    ],
)
def test_is_array_says_which_leaves_are_traced(x, want):
    assert is_array(x) is want


def test_bind_runs_each_equation_again_nested_programs_included():
    # A custom_jvp (relu), a nested jit, a cond and an inlined literal.
    def f(x):
        y = jax.jit(lambda a: a * 2.0)(jax.nn.relu(x))
        return jax.lax.cond(x[0] > 0, lambda a: a + 1.0, lambda a: a - 1.0, y)

    x = jnp.asarray([0.5, -1.0, 3.0])
    closed = jax.make_jaxpr(f)(x)
    assert {e.primitive.name for e in closed.jaxpr.eqns} >= {"custom_jvp_call", "cond"}
    np.testing.assert_array_equal(_run(closed, x)[0], f(x))


def test_a_literal_is_read_from_the_program_and_an_open_jaxpr_closes():
    closed = jax.make_jaxpr(lambda x: x * 3.0)(jnp.float32(2))
    (eqn,) = closed.jaxpr.eqns
    assert [is_literal(v) for v in eqn.invars] == [False, True]
    assert float(read(eqn.invars[1], {})) == 3.0
    again = as_closed(closed.jaxpr)
    assert again.consts == [] and again.jaxpr is closed.jaxpr


def test_interpret_gives_each_equation_to_step_and_drops_dead_values():
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2.0 + x)(1.0)
    seen = []

    def step(eqn, invals):
        seen.append(eqn.primitive.name)
        return bind(eqn, invals)

    assert interpret(closed, [jnp.float32(1.0)], step) == _run(closed, 1.0)
    assert seen == ["sin", "mul", "add"]


def test_loop_threads_a_state_and_keeps_the_carry_in_its_traced_dtype():
    def f(c, xs):
        c, ys = jax.lax.scan(lambda c, x: (c * x, c + x), c, xs)
        return jax.lax.while_loop(lambda c: c < 100, lambda c: c * 2, c), ys

    c, xs = jnp.float16(1), jnp.arange(1, 4, dtype=jnp.float16)
    scan, while_ = jax.make_jaxpr(f)(c, xs).jaxpr.eqns

    def run(closed):  # each program run wide, the state counting its runs
        def fn(n, *args):
            outs = _run(closed, *args)
            wide = [
                x.astype(jnp.float32) if x.dtype == jnp.float16 else x for x in outs
            ]
            return n + 1, wide

        return fn

    n, (carry, ys) = loop(scan, [c, xs], run, 0)
    assert (n, carry, carry.dtype) == (3, 6, jnp.float16)
    assert ys.dtype == jnp.float32  # what the iterations return: as computed
    n, (carry,) = loop(while_, [carry], run, 0)
    assert (n, carry, carry.dtype) == (5, 192, jnp.float16)
