"""The jax compatibility layer: the same answers on the floor and the newest jax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jls._compat import (
    pvary,
    tracked_in,
    tracks_varying_axes,
    varying_axes,
    weakly_typed,
)

MESH = jax.make_mesh((1,), ("data",))


def _inside_shard_map(fn, check_vma):
    seen = {}

    def body(x):
        seen.update(fn(x))
        return x

    jax.jit(
        jax.shard_map(
            body,
            mesh=MESH,
            in_specs=P("data"),
            out_specs=P("data"),
            check_vma=check_vma,
        )
    )(jax.device_put(jnp.zeros(1), NamedSharding(MESH, P("data"))))
    return seen


@pytest.mark.parametrize("check_vma", [True, False])
def test_varying_axes_are_tracked_only_under_check_vma(check_vma):
    seen = _inside_shard_map(
        lambda x: {
            "x": varying_axes(x),
            "marked": varying_axes(pvary(jnp.ones(()), ("data",))),
            "tracks": tracks_varying_axes(("data",)),
            "tracked_in": tracked_in([jnp.ones(())], ("data",)),
        },
        check_vma,
    )
    axes = frozenset({"data"}) if check_vma else frozenset()
    assert seen == {
        "x": axes,
        "marked": axes,
        "tracks": check_vma,
        "tracked_in": check_vma,
    }


def test_nothing_is_tracked_under_vmap_pmap_or_without_axes():
    seen = {}

    def f(x):
        seen["vmap"] = tracks_varying_axes(("r",))
        return x

    jax.vmap(f, axis_name="r")(jnp.zeros(2))
    jax.pmap(lambda x: seen.update(pmap=tracks_varying_axes(("r",))) or x, "r")(
        jnp.zeros(1)
    )
    assert seen == {"vmap": False, "pmap": False}
    assert not tracks_varying_axes(())
    assert varying_axes(jnp.ones(3)) == frozenset()
    assert pvary(np.float32(2), ()) == 2  # no axes: untouched


@pytest.mark.parametrize(
    "x",
    [
        np.float32(1.5),
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.arange(4, dtype=np.int32),
        np.full((2, 1, 2), 1 - 2j, np.complex64),
        np.zeros((0, 3), np.float32),
    ],
    ids=["scalar", "matrix", "int", "complex", "empty"],
)
def test_weakly_typed_keeps_the_value_and_makes_it_weak(x):
    x = jnp.asarray(x)
    weak = weakly_typed(x)
    assert jax.typeof(weak).weak_type and not jax.typeof(x).weak_type
    assert weak.dtype == x.dtype and weak.shape == x.shape
    np.testing.assert_array_equal(weak, x)
    # Traced, it is one convert_element_type to its own dtype: no copy, no op.
    eqns = jax.make_jaxpr(weakly_typed)(x).jaxpr.eqns
    assert [(e.primitive.name, e.params["weak_type"]) for e in eqns] == [
        ("convert_element_type", True)
    ]


def test_a_weak_leaf_stays_weak_through_a_select_and_the_step_traces_once():
    # What it is for: a weakly typed state leaf (jnp.full(..., 0.1)) selected
    # against a strong new value comes back strong, and a jitted step called
    # again on its own output is traced a second time.
    traces = []

    @jax.jit
    def step(apply, old):
        traces.append(1)
        new = old * np.float32(2)  # strong, as an optimizer's update is
        return weakly_typed(jax.lax.select(apply, new, old))

    state = jnp.full((3,), 0.1)
    assert jax.typeof(state).weak_type
    for apply in (True, False, True):
        state = step(jnp.asarray(apply), state)
    assert len(traces) == 1 and jax.typeof(state).weak_type
    np.testing.assert_array_equal(state, np.full(3, 0.4, np.float32))


def test_a_dtype_no_python_scalar_takes_comes_back_as_it_is():
    x = jnp.ones(3, jnp.float16)  # no public jax makes a weak float16
    assert weakly_typed(x) is x


def test_weakly_typed_keeps_the_varying_axes_inside_shard_map():
    seen = _inside_shard_map(
        lambda x: {
            "weak": jax.typeof(weakly_typed(x)).weak_type,
            "axes": varying_axes(weakly_typed(x)),
        },
        check_vma=True,
    )
    assert seen == {"weak": True, "axes": frozenset({"data"})}
