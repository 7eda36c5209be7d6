"""scale_loss, unscale, loss_scale_state and metrics."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false
# pyright: reportIndexIssue=false

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jls

F32_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize(
    "dtype", [jnp.float16, jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name
)
def test_scale_loss_is_float32_and_exact(dtype):
    state = jls.dynamic_scale(2.0**20).init()
    out = jax.jit(jls.scale_loss)(jnp.asarray(60000.0, dtype), state)
    assert out.dtype == jnp.float32
    assert float(out) == float(jnp.asarray(60000.0, dtype)) * 2.0**20
    assert np.isfinite(out)


def test_scale_loss_gradients_are_scaled():
    w = jnp.asarray([1.0, 2.0], jnp.float16)

    def loss(w):
        return jnp.sum(w * jnp.float16(2**-10))  # a float16 loss

    def grads(scale):
        state = jls.static_scale(scale).init()
        return jax.grad(lambda w: jls.scale_loss(loss(w), state))(w)

    g = grads(2.0**14)
    assert g.dtype == jnp.float16
    np.testing.assert_array_equal(g, np.float16([16.0, 16.0]))
    # The scaled loss itself stays finite above the float16 maximum, but a
    # float16 graph's backward pass gets the scale as a float16 cotangent:
    # inf, which loss_scaling detects, skips and backs off from.
    state = jls.static_scale(2.0**17).init()
    assert np.isfinite(jls.scale_loss(loss(w), state))
    assert not bool(jls.all_finite(grads(2.0**17)))


def test_scale_loss_reads_any_optimizer_state():
    tx = jls.loss_scaling(optax.MultiSteps(optax.sgd(1.0), 2))
    state = tx.init({"w": jnp.zeros(2)})
    assert float(jls.scale_loss(jnp.float32(2.0), state)) == 2.0**16
    per_example = jls.scale_loss(jnp.ones(3), state)
    assert per_example.shape == (3,)


def test_scale_loss_rejects_integer_losses():
    with pytest.raises(
        TypeError, match="loss must be a floating array, got dtype int32"
    ):
        jls.scale_loss(jnp.int32(3), jls.no_scale().init())


def test_unscale_keeps_dtypes():
    state = jls.static_scale(4.0).init()
    tree = {
        "f16": jnp.full((2,), 8.0, jnp.float16),
        "bf16": jnp.full((2,), 8.0, jnp.bfloat16),
        "f32": jnp.full((2,), 8.0, jnp.float32),
        "c64": jnp.full((2,), 8.0 + 4.0j, jnp.complex64),
        "i": jnp.array([8], jnp.int32),
        "none": None,
    }
    out = jax.jit(jls.unscale)(tree, state)
    for key in ("f16", "bf16", "f32"):
        assert out[key].dtype == tree[key].dtype
        np.testing.assert_array_equal(np.asarray(out[key], np.float32), [2.0, 2.0])
    assert out["c64"].dtype == jnp.complex64 and complex(out["c64"][0]) == 2 + 1j
    assert int(out["i"][0]) == 8 and out["none"] is None


def test_unscale_at_huge_scales_does_not_flush_to_zero():
    # 1/2**127 is subnormal and XLA flushes it to 0; jls divides instead.
    state = jls.dynamic_scale(2.0**127, max_scale=F32_MAX).init()
    out = jax.jit(jls.unscale)([jnp.float32(2.0**127)], state)
    assert float(out[0]) == 1.0


@pytest.mark.parametrize(
    "scale",
    [
        2.0**-20,
        0.75,
        1.0,
        3.0,
        1000.0,
        2.0**64,
        2.0**65,
        3 * 2.0**80,
        2.0**127,
        F32_MAX,
    ],
)
def test_unscale_against_float64_division(scale):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(4096) * 10.0 ** rng.integers(-30, 30, 4096)).astype(
        np.float32
    )
    x[:3] = [F32_MAX, -F32_MAX, np.float32(np.finfo(np.float32).tiny)]
    state = jls.dynamic_scale(scale, min_scale=2.0**-20, max_scale=F32_MAX).init()
    got = np.asarray(jax.jit(jls.unscale)(jnp.asarray(x), state))
    with np.errstate(over="ignore", under="ignore"):
        want = (x.astype(np.float64) / np.float32(scale)).astype(np.float32)
    normal = np.abs(want) >= np.finfo(np.float32).tiny  # XLA flushes subnormals
    finite = np.isfinite(want)
    np.testing.assert_array_equal(np.isfinite(got), finite)
    if np.log2(scale).is_integer():
        np.testing.assert_array_equal(got[normal & finite], want[normal & finite])
    else:  # a reciprocal multiplication: within one float32 ulp of division
        np.testing.assert_array_max_ulp(got[normal & finite], want[normal & finite], 1)
    if scale >= 1:
        assert np.all(np.abs(got) <= np.abs(x))


@pytest.mark.parametrize(
    "scaler",
    [
        jls.dynamic_scale(min_scale=float(np.finfo(np.float32).tiny)),  # one factor
        jls.presets.torch(),  # max_scale = float32 max: two factors
    ],
    ids=["one_factor", "two_factors"],
)
@pytest.mark.parametrize("fused", [False, True], ids=["update", "fused"])
def test_unscaling_is_exact_across_the_whole_range(scaler, fused):
    # Every power-of-two scale of the range, its ends included, on both paths:
    # sgd(1) returns -g / scale, which must be the float64 quotient exactly.
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(512) * 2.0 ** rng.integers(-20, 20, 512)).astype(
        np.float32
    )
    lo = int(np.log2(scaler.min_scale_f32))
    hi = int(np.floor(np.log2(scaler.max_scale_f32)))
    tx = jls.loss_scaling(optax.sgd(1.0), scaler)
    params = {"w": jnp.zeros(512)}
    if fused:
        run = jax.jit(lambda g, s, p: jls.apply_gradients(tx, g, s, p)[0]["w"])
    else:
        run = jax.jit(lambda g, s, p: tx.update(g, s, p)[0]["w"])
    for e in sorted({lo, lo + 1, -1, 0, 1, 63, 64, 65, 100, hi - 1, hi}):
        scale = 2.0**e
        grads = x.astype(np.float64) * scale
        tiny = np.finfo(np.float32).tiny  # XLA flushes subnormals, inputs too
        keep = (np.abs(grads) <= F32_MAX) & (np.abs(grads) >= tiny)
        grads = np.where(keep, grads, 0.0).astype(np.float32)
        state = jls.set_loss_scale(tx.init(params), jls.static_scale(scale).init())
        got = np.asarray(run({"w": jnp.asarray(grads)}, state, params))
        want = -(grads.astype(np.float64) / scale).astype(np.float32)
        normal = np.abs(want) >= np.finfo(np.float32).tiny  # XLA flushes subnormals
        np.testing.assert_array_equal(got[normal], want[normal], err_msg=str(e))


def test_the_default_scaler_unscales_with_one_multiplication():
    params = {"w": jnp.zeros(8)}

    def multiplies(scaler):
        tx = jls.loss_scaling(optax.sgd(1.0), scaler)
        jaxpr = jax.make_jaxpr(tx.update)(params, tx.init(params), params)
        return str(jaxpr).count(" mul ")

    one = multiplies(jls.dynamic_scale())
    assert one == multiplies(jls.dynamic_scale(max_scale=float(F32_MAX))) - 1


def _scale_in_shard_map(reduce, check_vma):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("data",))
    state = jls.static_scale(4.0).init()

    def body(x):
        loss = jnp.sum(x)
        if reduce:
            loss = jax.lax.pmean(loss, "data")
        return jls.scale_loss(loss, state)[None]

    x = jax.device_put(jnp.ones(2), NamedSharding(mesh, P("data")))
    f = jax.shard_map(
        body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=check_vma
    )
    return float(jax.jit(f)(x)[0])


def test_a_loss_varying_over_a_shard_map_axis_is_warned_about():
    with pytest.warns(UserWarning, match=r"varies over the shard_map axes \('data',\)"):
        assert _scale_in_shard_map(reduce=False, check_vma=True) == 8.0


@pytest.mark.parametrize("check_vma", [True, False])
def test_a_reduced_loss_or_untracked_axes_scale_silently(check_vma):
    assert _scale_in_shard_map(reduce=True, check_vma=check_vma) == 8.0
    assert _scale_in_shard_map(reduce=False, check_vma=False) == 8.0


def _gan_step(tx_g, tx_d, *, swap, fused):
    """One step of two jls optimizers; ``swap``: G's loss scaled with D's state."""

    def step(pg, pd, sg, sd):
        gg = jax.grad(lambda p: jls.scale_loss(p["w"].sum(), sd if swap else sg))(pg)
        gd = jax.grad(lambda p: jls.scale_loss(p["w"].sum(), sd))(pd)
        if fused:
            return jls.apply_gradients(tx_g, gg, sg, pg)[0]
        updates, _ = tx_g.update(gg, sg, pg)
        tx_d.update(gd, sd, pd)
        return optax.apply_updates(pg, updates)

    return step


@pytest.mark.parametrize("fused", [False, True])
def test_a_loss_scaled_with_the_other_optimizers_state_is_caught(fused):
    # A GAN's two jls optimizers, their states swapped in scale_loss: with
    # SGD the generator's update came out at 2**9 / 2**15 = 2**-6 of its size,
    # silently. scale_loss tags the scale it hands out; the update warns at
    # trace time that its own scale was not among them.
    tx_g = jls.loss_scaling(optax.sgd(1.0), jls.static_scale(2.0**15))
    tx_d = jls.loss_scaling(optax.sgd(1.0), jls.static_scale(2.0**9))
    p = {"w": jnp.ones(2)}
    args = (p, p, tx_g.init(p), tx_d.init(p))
    swapped = jax.jit(_gan_step(tx_g, tx_d, swap=True, fused=fused))
    with pytest.warns(UserWarning, match=r"jls.scale_loss\(loss_g, opt_state_g\)"):
        new = swapped(*args)
    np.testing.assert_array_equal(new["w"], np.float32([1.0 - 2.0**-6] * 2))
    paired = jax.jit(_gan_step(tx_g, tx_d, swap=False, fused=fused))
    np.testing.assert_array_equal(paired(*args)["w"], np.float32([0.0, 0.0]))


def test_nothing_to_compare_is_no_warning():
    # Eagerly (no trace), a loss scaled in another jit, and a scale of 1
    # (no_scale: any pairing is right) leave nothing to warn about.
    tx = jls.loss_scaling(optax.sgd(1.0), jls.static_scale(4.0))
    other = jls.loss_scaling(optax.sgd(1.0), jls.no_scale())
    p = {"w": jnp.ones(2)}
    state, other_state = tx.init(p), other.init(p)
    grads = jax.jit(jax.grad(lambda q: jls.scale_loss(q["w"].sum(), state)))(p)
    jax.jit(tx.update)(grads, state, p)
    tx.update(jax.grad(lambda q: jls.scale_loss(q["w"].sum(), state))(p), state, p)

    @jax.jit
    def step(p, state, other_state):
        g = jax.grad(lambda q: jls.scale_loss(q["w"].sum(), state))(p)
        return tx.update(g, state, p), other.update(g, other_state, p)

    step(p, state, other_state)
