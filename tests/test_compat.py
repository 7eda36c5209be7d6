"""The jax compatibility layer: the same answers on the floor and the newest jax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jls._compat import (
    bind,
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


def test_weakly_typed_keeps_the_value_and_makes_it_weak():
    x = jnp.asarray(np.float32(1.5))
    weak = weakly_typed(x)
    assert jax.typeof(weak).weak_type and not jax.typeof(x).weak_type
    assert weak.dtype == jnp.float32 and float(weak) == 1.5


def test_bind_runs_each_equation_again_nested_programs_included():
    # A custom_jvp (relu), a nested jit and a cond: the program's own outputs.
    def f(x):
        y = jax.jit(lambda a: a * 2.0)(jax.nn.relu(x))
        return jax.lax.cond(x[0] > 0, lambda a: a + 1.0, lambda a: a - 1.0, y)

    x = jnp.asarray([0.5, -1.0, 3.0])
    closed = jax.make_jaxpr(f)(x)
    env = dict(zip(closed.jaxpr.invars, [x], strict=True))
    env.update(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
    for eqn in closed.jaxpr.eqns:
        outs = bind(eqn, [read(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs, strict=True))
    np.testing.assert_array_equal(env[closed.jaxpr.outvars[0]], f(x))
