"""Data-parallel averaging: replicas' own gradients averaged, summed ones divided."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jls._average import local, mean
from jls._compat import varying_axes


def test_a_float16_mean_does_not_overflow_where_the_sum_would():
    grads = jnp.full((4, 3), 30000.0, jnp.float16)  # the sum, 120000, is inf

    def f(g, loss):
        return mean({"w": g}, loss, ("r",), {"w": ()})

    out, loss = jax.vmap(f, axis_name="r")(grads, jnp.arange(4.0, dtype=jnp.float16))
    assert out["w"].dtype == jnp.float16
    assert np.asarray(out["w"]).tolist() == [[30000.0] * 3] * 4
    assert loss.dtype == jnp.float32 and np.asarray(loss).tolist() == [1.5] * 4


def test_an_unbound_axis_names_the_fix():
    with pytest.raises(NameError, match="average_over=\\('nope',\\).*jax.pmap"):
        jax.jit(lambda g: mean(g, jnp.float32(0), ("nope",), ()))(jnp.ones(2))


def _traced_under_check_vma(fn):
    mesh = jax.make_mesh((1,), ("data",))
    seen = {}

    def body(replicated, sharded):
        seen.update(fn(replicated, sharded))
        return replicated

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))(
        jax.device_put(jnp.ones(2), NamedSharding(mesh, P())),
        jax.device_put(jnp.ones(2), NamedSharding(mesh, P("data"))),
    )
    return seen


def test_replicated_parameters_are_marked_local_and_sharded_ones_are_summed():
    def fn(replicated, sharded):
        marked, summed = local({"r": replicated, "s": sharded}, ("data",))
        return {
            "axes": {k: varying_axes(v) for k, v in marked.items()},
            "summed": summed,
        }

    seen = _traced_under_check_vma(fn)
    data = frozenset({"data"})
    assert seen["axes"] == {"r": data, "s": data}
    # The sharded leaf's gradient comes back summed over "data" by jax.
    assert seen["summed"] == {"r": (), "s": ("data",)}


def test_a_summed_gradient_is_divided_not_summed_again():
    def fn(replicated, sharded):
        jaxpr = jax.make_jaxpr(lambda g: mean(g, jnp.float32(0), ("data",), ("data",)))
        return {"jaxpr": str(jaxpr(sharded))}

    jaxpr = _traced_under_check_vma(fn)["jaxpr"]
    # Only the loss and the replica count are reduced: the gradient is not.
    assert jaxpr.count("psum") == 2


def test_without_varying_axes_nothing_is_marked():
    params = {"w": jnp.ones(2)}
    marked, summed = local(params, ())
    assert marked is params and summed == {"w": ()}
