"""The observing interpreter: each op's row of figures, exactly."""

import jax
import jax.numpy as jnp
import numpy as np

from jls.precision._observe import observe

F16 = jnp.float16


def _rows(fn, *args):
    closed = jax.make_jaxpr(fn)(*args)
    sites = []

    def run(*args):
        outs, found, stats = observe(closed, args)
        sites[:] = found
        return outs, stats

    outs, stats = jax.jit(run)(*args)
    return outs, sites, np.asarray(stats)


def test_an_ops_row_is_its_values_and_its_operands():
    x = jnp.array([1.0, 12.0, -3.0], F16)
    _, sites, rows = _rows(jnp.exp, x)
    assert [s.primitive for s in sites] == ["exp"]
    # out max finite |x|, out non-finite, in max, in non-finite, flushed, made
    want = [np.float32(np.exp(F16(1.0)).astype(F16)), 1, 12, 0, 0, 0]
    np.testing.assert_array_equal(rows[0], np.array(want, np.float32))


def test_an_op_fed_a_non_finite_value_did_not_make_it():
    x = jnp.array([jnp.inf, 1.0], F16)
    _, sites, rows = _rows(lambda x: x * 2, x)
    assert rows[0][1] == 1 and rows[0][3] == 1 and rows[0][5] == np.inf


def test_a_flush_to_zero_is_counted():
    x = jnp.array([1e-4, 0.0, 1.0], F16)
    _, _, rows = _rows(lambda x: x * x, x)  # 1e-8 flushes in float16; 0 * 0 is no flush
    assert rows[0][4] == 1


def test_a_loop_reports_the_first_iteration_that_made_a_non_finite_value():
    def grow(c):
        return jax.lax.scan(lambda c, _: (c * 4, None), c, length=10)[0]

    outs, sites, rows = _rows(grow, jnp.ones(2, F16))
    assert sites[0].in_loop is not None and rows[0][5] == 7  # 4**8 overflows
    assert rows[0][1] == 2 * 3  # non-finite entries over iterations 7, 8, 9


def test_the_branch_not_taken_is_not_observed():
    def branch(x):
        return jax.lax.cond(x[0] > 0, lambda x: x + 1, lambda x: jnp.exp(x * 100), x)

    _, sites, rows = _rows(branch, jnp.ones(2, F16))
    assert {"add", "exp", "mul"} <= {s.primitive for s in sites}
    assert not rows[:, 1].any() and np.isinf(rows[:, 5]).all()
