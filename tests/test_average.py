"""Data-parallel averaging: replicas' own gradients averaged, summed ones divided."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jls._average import local, mean, pow2_at_most_inverse, share
from jls._compat import varying_axes


def test_a_float16_mean_does_not_overflow_where_the_sum_would():
    # Each replica's gradient is 30000 (their float16 sum, 120000, is inf),
    # of a loss scaled by share=1/4 too: 7500 each, summed to 30000 at most.
    grads = jnp.full((4, 3), 30000.0 / 4, jnp.float16)

    def f(g, loss):
        return mean({"w": g}, loss, ("r",), {"w": ()}, 0.25)

    out, loss = jax.vmap(f, axis_name="r")(grads, jnp.arange(4.0, dtype=jnp.float16))
    assert out["w"].dtype == jnp.float16
    assert np.asarray(out["w"]).tolist() == [[30000.0] * 3] * 4
    assert loss.dtype == jnp.float32 and np.asarray(loss).tolist() == [1.5] * 4


def test_an_unbound_axis_names_the_fix():
    with pytest.raises(NameError, match="average_over=\\('nope',\\).*jax.pmap"):
        jax.jit(lambda g: mean(g, jnp.float32(0), ("nope",), (), 1.0))(jnp.ones(2))


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
        jaxpr = jax.make_jaxpr(
            lambda g: mean(g, jnp.float32(0), ("data",), ("data",), 1.0)
        )
        return {"jaxpr": str(jaxpr(sharded))}

    jaxpr = _traced_under_check_vma(fn)["jaxpr"]
    # Only the loss is reduced: the gradient is not.
    assert jaxpr.count("psum") == 1


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_the_shared_scale_is_multiplied_back_bitwise(n):
    # Scaling the loss by share = 2**-k (2**k >= n) and dividing the sum by
    # n * share gives what dividing the unshared sum by n does, bit for bit.
    rng = np.random.default_rng(n)
    grads = jnp.asarray(rng.normal(size=(n, 64)) * 2.0 ** rng.integers(-20, 20, 64))
    grads = grads.astype(jnp.float32)

    s = pow2_at_most_inverse(n)
    assert s == 2.0 ** -((n - 1).bit_length()) and 0.5 < s * n <= 1

    def shared(g):
        return mean({"w": g * jnp.float32(s)}, jnp.float32(0), ("r",), {"w": ()}, s)[0]

    got = jax.vmap(shared, axis_name="r")(grads)["w"]
    want = jax.vmap(lambda g: jax.lax.psum(g, "r") / n, axis_name="r")(grads)
    np.testing.assert_array_equal(
        np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32)
    )


def test_without_varying_axes_nothing_is_marked():
    params = {"w": jnp.ones(2)}
    marked, summed = local(params, ())
    assert marked is params and summed == {"w": ()}


@pytest.mark.parametrize(
    ("summed", "want"),
    [
        (("r",), 0.25),  # jax sums it: 2**2 >= 3 replicas
        ((), 1.0),  # its own gradient: jls sums it in float32
    ],
)
def test_the_loss_is_shared_wherever_jax_sums_a_gradient(summed, want):
    # Whatever the parameter's dtype: a float32 parameter gathered as float16
    # (a policy's cast) has its gradient summed in float16 by jax.
    def fn(x):
        del x
        return jnp.float32(share({"a": (), "b": summed}, ("r",)))

    got = jax.vmap(fn, axis_name="r")(jnp.ones((3, 2)))
    assert got.tolist() == [want] * 3
