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
