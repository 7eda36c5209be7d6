"""The all-finite check: every dtype, every position, no false results."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jls

all_finite = jax.jit(jls.all_finite)
FLOATS = [jnp.float16, jnp.bfloat16, jnp.float32]
BAD = [np.inf, -np.inf, np.nan]


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("bad", BAD, ids=str)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("leaf", [0, 1, 2])
def test_one_bad_element_anywhere(dtype, bad, where, leaf):
    tree = {
        "a": jnp.ones((3, 5), dtype),
        "b": [jnp.full((1000,), 0.25, dtype), jnp.zeros((), dtype)],
    }
    assert bool(all_finite(tree))
    index = {"first": 0, "middle": None, "last": -1}[where]
    leaves, treedef = jax.tree.flatten(tree)
    flat = leaves[leaf].reshape(-1)
    pos = flat.size // 2 if index is None else index
    leaves[leaf] = flat.at[pos].set(bad).reshape(leaves[leaf].shape)
    assert not bool(all_finite(jax.tree.unflatten(treedef, leaves)))


def test_inf_and_minus_inf_do_not_cancel():
    x = jnp.array([np.inf, -np.inf, 1.0], jnp.float32)
    assert not bool(all_finite([x]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("size", [1, 2, 1024, 3 * 2**20 + 1])
def test_no_false_positive_when_a_plain_sum_overflows(dtype, size):
    # Every element at the largest finite value: a plain sum (or a sum of
    # magnitudes) overflows, the shrunk sum must not, and XLA must not have
    # factored the shrink out of the reduction.
    big = jnp.finfo(dtype).max
    tree = [jnp.full((size,), big, dtype), -jnp.full((3, 5), big, dtype)]
    if size > 1:
        assert jnp.isinf(jax.jit(jnp.sum)(tree[0].astype(jnp.float32)))
    assert bool(all_finite(tree))
    assert not bool(all_finite([tree[0].at[size // 2].set(np.nan), tree[1]]))
    assert not bool(all_finite([tree[0].at[0].set(-np.inf), tree[1]]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_leaves_of_one_size_are_exact_whatever_their_rank(dtype):
    # Leaves of one size get distinct shrinks 2**-(k + j), j < TWINS: the
    # smallest of them must still keep near-maximal values finite, the last
    # rank must still see inf and nan, and the ranks wrap past TWINS.
    from jls._finite import SMALL_LEAF, TWINS

    n = TWINS + 3
    big = jnp.finfo(dtype).max
    leaves = [jnp.full((SMALL_LEAF + 1,), big, dtype) for _ in range(n)]
    assert bool(all_finite(leaves))
    for rank in (0, TWINS - 1, TWINS, n - 1):
        for bad in BAD:
            broken = list(leaves)
            broken[rank] = broken[rank].at[rank].set(bad)
            assert not bool(all_finite(broken)), (rank, bad)


def test_leaves_of_one_size_read_no_broadcast_of_the_shrink():
    # A shrink shared by leaves of one size was one broadcast, which XLA:CPU's
    # YNN reductions read as an array beside each leaf (a temporary of a leaf's
    # size; the char LM's donated step cost 1.39x plain Adam with it): each
    # leaf's shrink is now its own constant, which every reduction takes as a
    # scalar. Measured against the same sums of magnitudes unshrunk (what XLA
    # keeps of the gradients themselves differs by version).
    x = jax.random.normal(jax.random.key(0), (512, 512), jnp.float32)

    def temp(reduce):
        def check(x):
            return reduce([x @ (x + i) for i in range(4)])  # produced by dots

        stats = jax.jit(check).lower(x).compile().memory_analysis()
        assert stats is not None
        return stats.temp_size_in_bytes

    unshrunk = temp(lambda gs: jnp.stack([jnp.sum(jnp.abs(g)) for g in gs]).sum())
    checked = temp(jls.all_finite)
    assert checked <= unshrunk + x.nbytes // 4, (checked, unshrunk)


def test_no_false_positive_with_the_producer_fused_into_the_check():
    # The gradient is produced in the same jit: XLA fuses the product into the
    # check's reduction. Near-maximal finite products must pass, and a
    # product that rounds to inf must not.
    a = jnp.full((4096,), 2.0**63, jnp.float32)
    b = jnp.full((4096,), 2.0**64 * 1.99, jnp.float32)

    @jax.jit
    def check(a, b):
        return all_finite([a * b])

    assert bool(check(a, b))
    assert not bool(check(a, b.at[9].set(2.0**65)))


def test_float16_at_its_maximum_is_finite():
    assert bool(all_finite([jnp.full((4096,), 65504.0, jnp.float16)]))


@pytest.mark.parametrize("dtype", [jnp.complex64])
def test_complex(dtype):
    x = jnp.ones(10, dtype)
    assert bool(all_finite([x]))
    assert not bool(all_finite([x.at[3].set(complex(0, np.inf))]))
    assert not bool(all_finite([x.at[3].set(complex(np.nan, 0))]))


@pytest.mark.parametrize(
    "dtype",
    [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fnuz],
    ids=lambda d: np.dtype(d).name,
)
def test_fp8(dtype):
    x = jnp.ones(64, dtype)
    assert bool(all_finite([x]))
    assert not bool(all_finite([x.at[5].set(np.nan)]))
    if np.isinf(np.array(np.inf, dtype).astype(np.float32)):
        assert not bool(all_finite([x.at[5].set(np.inf)]))


def test_ignored_leaves_and_empty_trees():
    tree = {
        "i": jnp.array([2**31 - 1], jnp.int32),
        "b": jnp.array([True]),
        "u": jnp.array([7], jnp.uint8),
        "none": None,
        "z": np.zeros((2,), jax.dtypes.float0),
    }
    assert bool(all_finite(tree))
    for empty in ({}, [], (), None, {"a": None}, [jnp.zeros((0,), jnp.float32)]):
        assert bool(all_finite(empty))


def test_python_and_numpy_leaves():
    assert bool(jls.all_finite([1.0, np.float32(2.0), np.ones(3)]))
    assert not bool(jls.all_finite([1.0, float("nan")]))


def test_returns_a_scalar_bool():
    out = all_finite({"w": jnp.ones((2, 2))})
    assert out.dtype == jnp.bool_ and out.shape == ()


def test_vmap():
    x = jnp.ones((4, 8)).at[2, 3].set(np.nan)
    out = jax.jit(jax.vmap(jls.all_finite))(x)
    np.testing.assert_array_equal(out, [True, True, False, True])


def test_float64_under_x64():
    code = textwrap.dedent(
        """
        import jax
        jax.config.update("jax_enable_x64", True)
        import jax.numpy as jnp, numpy as np, jls
        big = jnp.full((8,), 1e300, jnp.float64)
        assert big.dtype == jnp.float64
        assert bool(jax.jit(jls.all_finite)([big]))
        assert not bool(jax.jit(jls.all_finite)([big.at[3].set(np.inf)]))
        state = jls.static_scale(4.0).init()
        out = jls.unscale([jnp.full((2,), 1e300, jnp.float64)], state)[0]
        assert out.dtype == jnp.float64 and float(out[0]) == 2.5e299
        loss = jls.scale_loss(jnp.float64(1e300), state)
        assert loss.dtype == jnp.float64 and float(loss) == 4e300
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_explicitly_sharded_small_leaves_are_checked_one_by_one():
    # Under explicit sharding a leaf's type names mesh axes: it cannot be
    # raveled or concatenated with differently sharded leaves, so the small
    # leaves' shared reduction must leave it out.
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Explicit,))
    bad = np.ones((4, 2), np.float32)
    bad[0, 1] = np.nan
    with jax.set_mesh(mesh):
        grads = {
            "rows": jax.device_put(np.ones((4, 2), np.float32), P("x", None)),
            "cols": jax.device_put(np.ones((4, 2), np.float32), P(None, "x")),
            "b": jnp.ones(2),
        }
        assert bool(jax.jit(all_finite)(grads))
        grads["cols"] = jax.device_put(bad, P(None, "x"))
        assert not bool(jax.jit(all_finite)(grads))
        tx = jls.loss_scaling(optax.adam(0.1), jls.dynamic_scale(4.0))
        state = tx.init(grads)
        _, state = jax.jit(lambda g, s, p: jls.apply_gradients(tx, g, s, p))(
            grads, state, grads
        )
        assert float(state.loss_scale.scale) == 2.0
