"""Per-device statistics made global: shards added, replicas kept, never guessed.

Named ``vmap`` axes, ``pmap`` and ``shard_map(check_vma=False)`` record no
varying axes: there ``axis_name`` says which gradients are sharded over each
axis, and a statistic summed over shards refuses an axis it does not know.
"""

# pyright: reportArgumentType=false

import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jls
from jls._shards import global_rows, named_axes

# A 4 x 2 mesh: "w" is sharded over "model", its two shards mirrored (equal
# values); "b" is replicated; "k" is sharded over both, every shard its own.
MIRRORED = {
    "data": {"w": False, "b": False, "k": True},
    "model": {"w": True, "b": False, "k": True},
}
SPECS = dict.fromkeys(
    ("data", "model"), {"w": P("model"), "b": P(), "k": P(("data", "model"))}
)

SPECS_AXES = named_axes(SPECS)


def _grads(d, m, w=(3.0, 4.0), b=(1.0, 2.0)):
    return {
        "w": jnp.asarray(w) + 0 * d,
        "b": jnp.asarray(b) + 0 * m,
        "k": jnp.stack([d, m]) + 1.0,
    }


def _global(w=(3.0, 4.0), b=(1.0, 2.0)):
    d, m = np.meshgrid(np.arange(4.0), np.arange(2.0), indexing="ij")
    k = np.stack([d.ravel(), m.ravel()], 1).ravel() + 1.0
    return np.concatenate([np.tile(w, 2), b, k])  # "w"'s two model shards


def _on_mesh(axis_name, metric, grads=_grads, **options):
    tx = jls.loss_scaling(
        optax.sgd(0.1), jls.no_scale(), axis_name=axis_name, **options
    )
    d, m = np.meshgrid(np.arange(4.0), np.arange(2.0), indexing="ij")

    def device(d, m):
        g = grads(d, m)
        return jls.metrics(tx.update(g, tx.init(g), g)[1])[metric]

    out = jax.vmap(jax.vmap(device, axis_name="model"), axis_name="data")(d, m)
    out = np.asarray(out)
    assert (out == out.flat[0]).all()  # every device reports the same
    return float(out.flat[0])


@pytest.mark.parametrize("declared", [MIRRORED, SPECS], ids=["bools", "specs"])
def test_mirrored_shards_are_added_into_the_norm(declared):
    got = _on_mesh(declared, "gradient_norm", gradient_norm=True)
    assert got == pytest.approx(np.linalg.norm(_global()), rel=1e-6)  # not once


def test_mirrored_shards_are_added_into_the_scale_statistics():
    def grads(d, m):
        return _grads(d, m, w=(0.0, 1.0), b=(1.0, 1.0))

    got = _on_mesh(MIRRORED, "underflow_fraction", grads, scale_stats=True)
    values = _global(w=(0.0, 1.0), b=(1.0, 1.0))
    assert got == pytest.approx(np.mean(values < 2.0**-14), rel=1e-6)


@pytest.mark.parametrize(
    ("option", "metric"),
    [
        ({"gradient_norm": True}, "gradient_norm"),
        ({"scale_stats": True}, "underflow_fraction"),
        ({"skip_spikes": jls.hooks.SpikeRule()}, "spike"),
    ],
)
def test_an_undeclared_axis_is_refused_not_guessed(option, metric):
    with pytest.raises(ValueError, match=r"axis_name=\{'data': False, 'model': Fa"):
        _on_mesh(("data", "model"), metric, **option)
    with pytest.raises(ValueError, match=r"got axis_name=\('data', 'model'\)"):
        _on_mesh(("data", "model"), metric, **option)


def test_shard_map_without_vma_refuses_an_undeclared_axis_and_takes_a_declared_one():
    mesh = jax.make_mesh((1,), ("data",))
    g = {"w": jnp.asarray([3.0, 4.0])}

    def run(axis_name):
        tx = jls.loss_scaling(
            optax.sgd(0.1), jls.no_scale(), axis_name=axis_name, gradient_norm=True
        )

        def body(g, s):
            return jls.metrics(tx.update(g, s, g)[1])["gradient_norm"]

        f = jax.shard_map(
            body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P(), check_vma=False
        )
        placed = jax.device_put(g, NamedSharding(mesh, P("data")))
        return float(jax.jit(f)(placed, tx.init(g)))

    with pytest.raises(ValueError, match=r"got axis_name=\('data',\)"):
        run("data")
    assert run({"data": {"w": True}}) == 5.0
    assert run({"data": False}) == 5.0  # one device: its shard is the whole


def test_a_bad_declaration_is_named():
    with pytest.raises(TypeError, match="axis_name's values must be"):
        jls.loss_scaling(optax.sgd(0.1), axis_name={"data": "yes"})
    with pytest.raises(TypeError, match="got 'data': {'w': None}"):
        jls.loss_scaling(optax.sgd(0.1), axis_name={"data": {"w": None}})
    with pytest.raises(TypeError, match="axis_name must be None, a str"):
        jls.loss_scaling(optax.sgd(0.1), axis_name={1: False})
    with pytest.raises(
        ValueError, match=r"axis_name\['model'\] must be a pytree prefix"
    ):
        _on_mesh(
            {"data": False, "model": {"w": True}}, "gradient_norm", gradient_norm=True
        )


def test_a_declaration_is_still_the_axes_everywhere():
    tx = jls.LossScaling(optax.sgd(0.1), axis_name=MIRRORED)
    assert tx.axis_name == ("data", "model")
    assert "axis_name={'data': {" in repr(tx)
    for copied in (copy.deepcopy(tx.axis_name), pickle.loads(pickle.dumps(SPECS_AXES))):
        assert copied == ("data", "model") and copied.sharded is not None


def test_rows_are_added_over_exactly_their_axes_untracked():
    d, m = jnp.meshgrid(jnp.arange(2.0), jnp.arange(3.0), indexing="ij")

    def device(d, m):
        rows = [
            jnp.stack([1.0 + 0 * d, 2.0 + 0 * d, 5.0 + 0 * d]),  # replicated
            jnp.stack([1.0 + 0 * d, 1.0 + 0 * d, m]),  # over model, mirrored
            jnp.stack([1.0 + d + 2 * m, 1.0 + 0 * d, d]),  # over both
        ]
        axes = [frozenset(), frozenset({"model"}), frozenset({"data", "model"})]
        return jnp.stack(global_rows(rows, axes, added=2))

    out = jax.vmap(jax.vmap(device, axis_name="model"), axis_name="data")(d, m)
    got = np.asarray(out).reshape(6, 3, 3)
    assert (got == got[:1]).all()
    assert got[0, 0].tolist() == [1.0, 2.0, 5.0]
    assert got[0, 1].tolist() == [3.0, 3.0, 2.0]
    # 1 + d + 2m over d in {0,1}, m in {0,1,2}: 6 + 3 + 12 = 21; max of d: 1
    assert got[0, 2].tolist() == [21.0, 6.0, 1.0]


def test_tracked_rows_are_added_over_exactly_their_axes():
    mesh = jax.make_mesh((1,), ("data",))

    def body(x):
        varying = jnp.stack([x[0], x[0], x[0]])  # varies over "data"
        fixed = jnp.asarray([4.0, 5.0, 6.0])
        a, b = global_rows(
            [varying, fixed], [frozenset({"data"}), frozenset()], added=2
        )
        return a, b

    a, b = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=(P(), P()))
    )(jax.device_put(jnp.asarray([7.0]), NamedSharding(mesh, P("data"))))
    assert a.tolist() == [7.0, 7.0, 7.0] and b.tolist() == [4.0, 5.0, 6.0]
