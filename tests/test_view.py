"""`jls._view`: a part of each update, computed from the same part of its inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jls import _view


def _rows(x):
    """Rows 8 to 15: a view that commutes with elementwise arithmetic."""
    return jax.lax.dynamic_slice_in_dim(x, 8, 8, axis=0)


def _traced(inner, g, state, p, *, sliced=False):
    """The jaxpr of viewing the update with `_rows`, and the view.

    ``sliced``: also the same rows of the update, from the same program (a
    matrix product, as in Muon, may round differently in another one).
    """

    def viewed(g, state, p):
        (update, _), evaluation = _view.evaluate(inner.update, g, state, p)
        view = evaluation.view(update, _rows)
        return (view, _rows(update)) if sliced else view

    return jax.make_jaxpr(viewed)(g, state, p), jax.jit(viewed)(g, state, p)


def test_a_view_is_the_same_slice_of_the_full_result_bitwise():
    # Adam's update (moments, bias corrections, a square root and a
    # division), a global norm, Adafactor's factored means and a matrix
    # product: each output's view equals the same slice of the output.
    rng = np.random.default_rng(0)
    shape = (64, 64)  # square: Muon's products take and make this shape
    g = jnp.asarray(rng.normal(size=shape), jnp.float32)
    p = jnp.asarray(rng.normal(size=shape), jnp.float32)

    for inner in (
        optax.adam(1e-3),
        optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-3)),
        optax.adafactor(1e-3),
        optax.contrib.muon(1e-3),
    ):
        _, (view, rows) = _traced(inner, g, inner.init(p), p, sliced=True)
        np.testing.assert_array_equal(np.asarray(view), np.asarray(rows))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: jnp.cumsum(x, axis=0) * 2.0,  # an entry's value from other rows
        lambda x: jnp.flip(x, axis=0) + 1.0,
        lambda x: (x @ x) - x,  # a product of the view's own shape
    ],
    ids=["cumsum", "flip", "matmul"],
)
def test_only_elementwise_equations_are_followed(fn):
    # Each of these keeps the shape but moves entries between rows: the view
    # is the slice of its result, not the operation on slices.
    x = jnp.asarray(np.random.default_rng(1).normal(size=(64, 64)), jnp.float32)

    def both(x):
        out, evaluation = _view.evaluate(fn, x)
        return evaluation.view(out, _rows), _rows(out)

    view, rows = jax.jit(both)(x)
    np.testing.assert_array_equal(np.asarray(view), np.asarray(rows))


def test_an_elementwise_update_is_computed_from_views_of_what_made_it():
    # Adam's update is elementwise in its new moments (outputs the step holds
    # anyway): its view is computed from their slices, and nothing after the
    # evaluation reads a full-size array but those two slices. A view of
    # the update itself would read the update (a third, whole, consumer).
    shape = (64, 48)
    g, p = jnp.ones(shape), jnp.ones(shape)
    inner = optax.adam(1e-3)
    jaxpr, _ = _traced(inner, g, inner.init(p), p)
    eqns = jaxpr.jaxpr.eqns
    first = next(i for i, e in enumerate(eqns) if e.primitive.name == "dynamic_slice")
    reads = [
        e.primitive.name
        for e in eqns[first:]
        if any(getattr(v.aval, "shape", None) == shape for v in e.invars)
    ]
    assert reads == ["dynamic_slice", "dynamic_slice"], reads


def test_non_array_leaves_pass_through_and_python_numbers_stay_static():
    # A Python number in the arguments is closed over, not traced (an
    # optimizer may branch on it); a non-array leaf of the result comes back.
    seen = []

    def fn(x, n):
        seen.append(type(n))
        return {"y": x * n, "tag": "kept"}

    out, evaluation = _view.evaluate(fn, jnp.arange(64.0).reshape(64, 1), 3)
    assert seen == [int]
    assert out["tag"] == "kept"
    np.testing.assert_array_equal(
        np.asarray(evaluation.view(out["y"], _rows)), 3.0 * np.arange(8, 16)[:, None]
    )


def test_a_value_the_evaluation_did_not_make_is_viewed_as_it_is():
    out, evaluation = _view.evaluate(lambda x: x + 1, jnp.zeros((64, 2)))
    other = jnp.arange(128.0).reshape(64, 2)
    np.testing.assert_array_equal(
        np.asarray(evaluation.view(other, _rows)), np.asarray(_rows(other))
    )
    np.testing.assert_array_equal(np.asarray(evaluation.view(out, _rows)), 1.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_a_scalar_leaf_and_mixed_dtypes(dtype):
    # Shape () outputs (a scalar parameter) and a literal on the chain.
    def fn(x, y):
        return (x.astype(jnp.float32) * 2.0 + y).astype(dtype), jnp.float32(1.5)

    out, evaluation = _view.evaluate(fn, jnp.asarray(3.0, dtype), jnp.float32(0.25))
    reshape = lambda x: jnp.reshape(x, (1, 1))  # noqa: E731
    assert evaluation.view(out[0], reshape).tolist() == [[6.25]]
    assert evaluation.view(out[1], reshape).tolist() == [[1.5]]
