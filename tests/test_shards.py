"""Per-device statistics made global: shards added, replicas kept, per axis."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jls._shards import global_rows


def _nested(rows_of, named=("data", "model")):
    """``rows_of(d, m)`` on a 2 x 3 mesh of named vmaps (nothing tracked)."""
    d, m = jnp.meshgrid(jnp.arange(2.0), jnp.arange(3.0), indexing="ij")

    def device(d, m):
        rows = rows_of(d, m)
        return jnp.stack(
            global_rows(rows, [frozenset()] * len(rows), named, False, added=2)
        )

    return jax.vmap(jax.vmap(device, axis_name="model"), axis_name="data")(d, m)


def test_each_untracked_axis_is_decided_on_its_own():
    out = _nested(
        lambda d, m: [
            jnp.stack([1.0 + 0 * d, 2.0 + 0 * d, 5.0 + 0 * d]),  # replicated
            jnp.stack([1.0 + 0 * d, 1.0 + 0 * d, m]),  # sharded over model
            jnp.stack([1.0 + d + 2 * m, 1.0 + 0 * d, d]),  # over both
        ]
    )
    # Every device reports the same: rows added over the axes they differ on.
    got = np.asarray(out).reshape(6, 3, 3)
    assert (got == got[:1]).all()
    assert got[0, 0].tolist() == [1.0, 2.0, 5.0]
    assert got[0, 1].tolist() == [3.0, 3.0, 2.0]
    # 1 + d + 2m over d in {0,1}, m in {0,1,2}: 6 + 3 + 12 = 21; max of d: 1
    assert got[0, 2].tolist() == [21.0, 6.0, 1.0]


def test_without_named_axes_rows_stay_their_own():
    rows = [jnp.asarray([1.0, 2.0, 3.0])]
    assert global_rows(rows, [frozenset()], (), False, added=2)[0].tolist() == [1, 2, 3]


def test_tracked_rows_are_added_over_exactly_their_axes():
    mesh = jax.make_mesh((1,), ("data",))

    def body(x):
        varying = jnp.stack([x[0], x[0], x[0]])  # varies over "data"
        fixed = jnp.asarray([4.0, 5.0, 6.0])
        a, b = global_rows(
            [varying, fixed], [frozenset({"data"}), frozenset()], (), True, added=2
        )
        return a, b

    a, b = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=(P(), P()))
    )(jax.device_put(jnp.asarray([7.0]), NamedSharding(mesh, P("data"))))
    assert a.tolist() == [7.0, 7.0, 7.0] and b.tolist() == [4.0, 5.0, 6.0]
