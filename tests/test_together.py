"""jls._together: the step's scalars made by one kernel, bitwise unchanged."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jls
from jls._together import together

# Scalars whose bits a careless reduction would change: nan, -0.0, the ends of
# every range, and each dtype a state holds.
ODD = [
    np.float32(np.nan),
    np.array(0xFFC00123, np.uint32).view(np.float32)[()],  # -nan with a payload
    np.float32(-0.0),
    np.float32(np.inf),
    np.float32(-np.inf),
    np.finfo(np.float32).max,
    np.finfo(np.float32).smallest_subnormal,
    np.int32(np.iinfo(np.int32).min),
    np.int32(np.iinfo(np.int32).max),
    np.uint32(np.iinfo(np.uint32).max),
    np.int8(-128),
    np.bool_(True),
    np.bool_(False),
    np.float16(-0.0),
    jnp.bfloat16(np.nan),
]


def _bits(x) -> bytes:
    return np.asarray(x).tobytes()


def _reduces(fn, *args) -> list[str]:
    text = jax.jit(fn).lower(*args).compile().as_text()
    return [line for line in text.splitlines() if " reduce(" in line]


def test_every_value_comes_out_bitwise_as_it_went_in():
    owned = [jnp.asarray(x) for x in ODD]
    inner = [jnp.asarray(x) for x in ODD]
    got_owned, got_inner = jax.jit(together)(owned, inner)
    for want, got in zip(owned + inner, got_owned + got_inner, strict=True):
        assert got.dtype == want.dtype
        assert _bits(got) == _bits(want), (want, got)


def test_they_are_made_by_one_variadic_reduce():
    owned = [jnp.float32(1.5), jnp.int32(3), jnp.bool_(True)]
    inner = {"count": jnp.int32(7)}

    def step(owned, inner):
        owned = [owned[0] * 2, owned[1] + 1, ~owned[2]]
        return together(owned, {"count": inner["count"] + 1})

    reduces = _reduces(step, owned, inner)
    assert len(reduces) == 1 and "(f32[], s32[], pred[], s32[])" in reduces[0]
    got = jax.jit(step)(owned, inner)
    assert [float(got[0][0]), int(got[0][1]), bool(got[0][2])] == [3.0, 4, False]
    assert int(got[1]["count"]) == 8


def test_what_may_carry_a_gradient_or_a_weak_type_is_left_alone():
    inner_rate = jnp.float32(0.1)  # an inject_hyperparams rate: differentiable
    weak = jnp.asarray(2.0)  # a Python number's weak type
    vector = jnp.ones(3)
    complex_ = jnp.complex64(1 + 2j)
    owned = [jnp.int32(1), weak, vector, complex_]
    got_owned, got_inner = together(owned, [inner_rate, jnp.int32(2)])
    assert got_inner[0] is inner_rate
    assert got_owned[1] is weak and got_owned[2] is vector
    assert got_owned[3] is complex_
    assert jax.typeof(got_owned[1]).weak_type


def test_a_meta_gradient_through_the_inner_rate_still_flows():
    # optax's inject_hyperparams makes the rate a float state leaf; a user may
    # differentiate an unrolled step with respect to it.
    params = {"w": jnp.ones(3)}
    grads = {"w": jnp.full(3, 2.0**15)}

    def moved(rate):
        inner = optax.inject_hyperparams(optax.sgd)(learning_rate=rate)
        tx = jls.loss_scaling(inner, jls.dynamic_scale())
        state = tx.init(params)
        new, state = jls.apply_gradients(tx, grads, state, params)
        return jnp.sum(new["w"]) + state.inner_state.hyperparams["learning_rate"]

    assert float(jax.grad(moved)(0.1)) == -3.0 + 1.0


def test_under_vmap_batched_and_unbatched_scalars_together():
    def fn(a, b):
        return together([a + 1, jnp.int32(5)], [b * 2])

    a = jnp.arange(4, dtype=jnp.int32)
    owned, inner = jax.jit(jax.vmap(fn, in_axes=(0, None)))(a, jnp.int32(3))
    assert owned[0].tolist() == [1, 2, 3, 4] and owned[1].tolist() == [5] * 4
    assert inner[0].tolist() == [6] * 4


@pytest.mark.parametrize("check_vma", [True, False])
def test_under_shard_map_varying_and_invariant_scalars(check_vma):
    # Values varying over an axis and invariant ones cannot share one reduce
    # (its operands must have one type): they are grouped by their axes.
    mesh = jax.make_mesh((1,), ("d",))

    def fn(x, y):
        varying = jax.lax.axis_index("d") + x
        return tuple(together([varying, y + 1.0, x * 2], []))[0]

    mapped = jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(P(), P()),
        out_specs=P(),
        check_vma=check_vma,
    )
    if check_vma:
        mapped = jax.shard_map(
            lambda x, y: [
                jax.lax.pmax(v, "d") if i == 0 else v for i, v in enumerate(fn(x, y))
            ],
            mesh=mesh,
            in_specs=(P(), P()),
            out_specs=P(),
        )
    got = jax.jit(mapped)(jnp.int32(3), jnp.float32(0.5))
    assert [got[0].item(), got[1].item(), got[2].item()] == [3, 1.5, 6]


def test_a_gradient_through_the_step_meets_no_reduce_without_a_derivative():
    # The hooks' records follow the gradients (the norm here); a user who
    # differentiates a step with respect to what made the gradients (an
    # unrolled meta-step) must not meet the variadic reduce's missing JVP.
    params = {"w": jnp.ones(3)}
    tx = jls.loss_scaling(
        optax.sgd(0.5), jls.static_scale(1.0), hooks=[jls.hooks.GradientNorm()]
    )
    state = tx.init(params)

    def moved(c):
        new, _ = jls.apply_gradients(tx, {"w": c * jnp.ones(3)}, state, params)
        return jnp.sum(new["w"])

    assert float(jax.grad(moved)(2.0)) == -1.5
