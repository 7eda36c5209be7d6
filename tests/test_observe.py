"""The observing interpreter: each value measured once, each op's entries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jls.precision import _measure as measuring
from jls.precision._observe import BACKWARD, observe

F16 = jnp.float16


def _observe(fn, *args):
    closed = jax.make_jaxpr(fn)(*args)
    sites = []

    def run(*args):
        outs, found, record = observe(closed, args)
        sites[:] = found
        return outs, record

    outs, record = jax.jit(run)(*args)
    return outs, sites, jax.device_get(record)


def test_an_ops_entries_are_its_values_and_its_operands():
    x = jnp.array([1.0, 12.0, -3.0], F16)
    outs, sites, record = _observe(lambda x: jnp.exp(x * 0.5), x)
    assert [(s.pass_, s.primitive, s.dtype, s.inputs) for s in sites] == [
        ("forward", "mul", "float16", "float16[3], float16[]"),
        ("forward", "exp", "float16", "float16[3]"),
    ]
    mul, exp = sites
    assert len(mul.ins) == 1 and exp.ins == mul.outs  # the literal 0.5: no operand
    np.testing.assert_array_equal(record.top[list(mul.ins)], [12.0])
    np.testing.assert_array_equal(record.top[list(exp.outs)], [np.exp(F16(6.0))])
    np.testing.assert_array_equal(record.top[list(exp.ins)], [6.0])
    assert len(record.top) == 3  # x, x * 0.5, exp: each measured once


def test_a_non_finite_value_measures_inf_or_nan():
    x = jnp.array([jnp.inf, 1.0], F16)
    _, sites, record = _observe(lambda x: (x * 2, jnp.sqrt(x - 2)), x)
    assert record.top[sites[0].outs[0]] == np.inf and np.isnan(record.top[-1])


def test_a_move_is_measured_as_the_value_it_moved():
    x = jnp.ones((2, 3), F16)
    _, sites, record = _observe(lambda x: jnp.exp(x.T.reshape(6)), x)
    assert [s.primitive for s in sites] == ["exp"] and len(record.top) == 2


def test_a_flush_to_zero_is_counted():
    x = jnp.array([1e-8, 0.0, 1.0, 1e-9], jnp.float32)
    _, sites, record = _observe(lambda x: x.astype(F16), x)  # 0 is no flush
    assert record.flush[sites[0].flush] == 2


def test_a_widening_cast_and_a_negation_are_measured_as_their_operand():
    # Each keeps every |x|: no site, no flush entry; a narrowing cast has both.
    x = jnp.array([65504.0, -3.0], F16)
    _, sites, record = _observe(lambda x: (-x).astype(jnp.float32).astype(F16) * 2, x)
    assert [s.primitive for s in sites] == ["convert_element_type", "mul"]
    cast, mul = sites
    assert (
        cast.ins == (1,) and cast.flush == 0
    )  # the operand is x itself and len(record.flush) == 1
    np.testing.assert_array_equal(record.top, [65504.0, 65504.0, np.inf])


def _reductions(fn, *args):
    """The operand counts of the measuring program's reductions."""
    closed = jax.make_jaxpr(fn)(*args)
    program = jax.make_jaxpr(lambda *a: observe(closed, a)[2])(*args)
    eqns = program.jaxpr.eqns
    return [len(e.invars) // 2 for e in eqns if e.primitive.name == "reduce"]


def _chain(x, n=39, y=None):
    for k in range(n):
        x = x + k
        y = None if y is None else y * 2
    return x, y


def test_values_of_one_shape_are_measured_by_one_reduction_each_their_own_max():
    # x and 39 sums, held 32 at a time: two reductions, each value its own max.
    x = jnp.array([1.0, -2.0], jnp.float32)
    assert _reductions(_chain, x) == [32, 8]
    _, _, record = _observe(_chain, x)
    sums = np.cumsum([0, *range(39)])
    np.testing.assert_array_equal(record.top, np.maximum(abs(1 + sums), abs(sums - 2)))


def test_values_of_two_shapes_in_turn_are_measured_as_two_groups():
    x, y = jnp.ones(2, jnp.float32), jnp.ones((3, 3), jnp.float32)
    assert sorted(_reductions(lambda x, y: _chain(x, 8, y), x, y)) == [9, 9]


def test_no_more_than_hold_bytes_are_held(monkeypatch):
    monkeypatch.setattr(measuring, "HOLD", 16)  # two float32[2]
    assert _reductions(_chain, jnp.ones(2, jnp.float32)) == [2] * 20


def test_a_loop_gives_the_first_iteration_that_made_a_non_finite_value():
    def grow(c):
        return jax.lax.scan(lambda c, _: (c * 4, None), c, length=10)[0]

    _, sites, record = _observe(grow, jnp.ones(2, F16))
    (mul,) = sites
    assert mul.in_loop is not None and record.made[mul.made] == 7  # 4**8 > 65504
    # The figures stop at that iteration: its operand was 4**7.
    assert record.top[mul.ins[0]] == 4.0**7 and record.top[mul.outs[0]] == np.inf


def test_the_branch_not_taken_is_not_observed():
    def branch(x):
        return jax.lax.cond(x[0] > 0, lambda x: x + 1, lambda x: jnp.exp(x * 100), x)

    _, sites, record = _observe(branch, jnp.ones(2, F16))
    exp = next(s for s in sites if s.primitive == "exp")
    add = next(s for s in sites if s.primitive == "add")
    assert record.top[exp.outs[0]] == 0 and record.top[add.outs[0]] == 2


def test_the_backward_is_what_runs_under_its_name_scope():
    def step(x):
        y, pullback = jax.vjp(jnp.sin, x)
        with jax.named_scope(BACKWARD):
            return pullback(y)

    _, sites, _ = _observe(step, jnp.ones(2, F16))
    assert [(s.pass_, s.primitive) for s in sites] == [
        ("forward", "sin"), ("forward", "cos"), ("backward", "mul")
    ]  # fmt: skip


def _temp_bytes(fn, *args):
    closed = jax.make_jaxpr(fn)(*args)
    run = jax.jit(lambda *a: observe(closed, a)[2])
    memory = run.lower(*args).compile().memory_analysis()
    assert memory is not None
    return memory.temp_size_in_bytes


@pytest.mark.parametrize("hold", [2**21, 2**30])
def test_values_held_together_take_at_most_hold_more_memory(monkeypatch, hold):
    # Eight 1 MiB activations (of one shape), measured alone or held together.
    def layers(x, w):
        for i in range(8):
            x = x @ w + i
        return x

    x, w = jnp.ones((1024, 256), jnp.float32), jnp.full((256, 256), 1e-3)
    monkeypatch.setattr(measuring, "ROW", 1)
    alone = _temp_bytes(layers, x, w)
    monkeypatch.setattr(measuring, "ROW", 32)
    monkeypatch.setattr(measuring, "HOLD", hold)
    extra = _temp_bytes(layers, x, w) - alone
    # 2 MiB held, and the two values of the reduction that settles it; with no
    # such bound, more.
    assert (extra <= 2**21 + 2 * 2**20) == (hold == 2**21), extra
