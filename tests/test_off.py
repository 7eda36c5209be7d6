"""The off switch: ``no_scale(skip_nonfinite=False)`` is the plain optimizer."""

# pyright: reportAttributeAccessIssue=false, reportArgumentType=false
# pyright: reportIndexIssue=false, reportCallIssue=false

import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jls
import jls.flax
from jls._builtins import hooks_from_options
from jls._off import is_off

OFF = jls.no_scale(skip_nonfinite=False)
PARAMS = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.full((4,), 0.5)}


def _grads():
    """Ordinary, tiny (subnormal), non-finite gradients, one tree a step."""
    rng = np.random.default_rng(0)
    normal = jax.tree.map(
        lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), PARAMS
    )
    subnormal = jax.tree.map(lambda p: jnp.full(p.shape, 1e-40, p.dtype), PARAMS)
    bad = {"w": normal["w"].at[1, 2].set(jnp.nan), "b": normal["b"].at[0].set(-jnp.inf)}
    return [normal, subnormal, normal, bad, normal]


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("inner", [optax.adam(1e-2), optax.sgd(0.1, momentum=0.9)])
@pytest.mark.parametrize("fused", [True, False])
def test_the_off_switch_is_the_plain_step_bitwise(inner, fused):
    tx = jls.loss_scaling(inner, OFF)

    @jax.jit
    def off(params, state, grads):
        if fused:
            return jls.apply_gradients(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    @jax.jit
    def plain(params, state, grads):
        updates, state = inner.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    p1, s1 = PARAMS, tx.init(PARAMS)
    p2, s2 = PARAMS, inner.init(PARAMS)
    for grads in _grads():
        p1, s1 = off(p1, s1, grads)
        p2, s2 = plain(p2, s2, grads)
        assert _bits((p1, s1.inner_state)) == _bits((p2, s2))
    m = jls.metrics(s1)
    assert float(m["loss_scale"]) == 1.0 and int(m["total_skips"]) == 0


def _compiled(step, *args, donate):
    c = jax.jit(step, donate_argnums=(0, 1) if donate else ()).lower(*args).compile()
    text = c.as_text()
    memory = c.memory_analysis()
    assert memory is not None
    return {
        "temp": memory.temp_size_in_bytes,
        # Copies of arrays (the state's scalars that pass through unchanged
        # are copied when not donated: a few bytes).
        "array_copies": len(re.findall(r"= \w+\[\d[\d,]*\]\S* copy\(", text)),
        "conditionals": len(re.findall(r" conditional\(", text)),
        "reductions": len(re.findall(r" reduce\(", text)),
    }


@pytest.mark.parametrize("donate", [False, True])
def test_the_off_switch_compiles_to_the_plain_program(donate):
    adam = optax.adam(1e-3)
    tx = jls.loss_scaling(adam, OFF)

    def off(params, state, x):
        def loss(p):
            return jls.scale_loss(jnp.sum((x @ p["w"] + p["b"][None]) ** 2), state)

        grads = jax.grad(loss)(params)
        return jls.apply_gradients(tx, grads, state, params)

    def plain(params, state, x):
        grads = jax.grad(lambda p: jnp.sum((x @ p["w"] + p["b"][None]) ** 2))(params)
        updates, state = adam.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    x = jnp.ones((5, 3))
    got = _compiled(off, PARAMS, tx.init(PARAMS), x, donate=donate)
    want = _compiled(plain, PARAMS, adam.init(PARAMS), x, donate=donate)
    assert got["temp"] <= want["temp"] + 128  # the scalars
    del got["temp"], want["temp"]
    assert got == want
    assert got["conditionals"] == 0


def _entry_ops(step, *args, donate):
    """The compiled step's instructions but its parameters, and its copies."""
    jitted = jax.jit(step, donate_argnums=(0, 1) if donate else ())
    text = jitted.lower(*args).compile().as_text() or ""
    entry = text[text.index("\nENTRY ") :]
    body = entry[: entry.index("\n}")].splitlines()[1:]
    ops = [line for line in body if " parameter(" not in line]
    return len(ops), sum(" copy(" in line for line in ops)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("donate", [False, True])
def test_the_off_switch_adds_two_scalar_ops_and_no_copy_when_donated(donate, fused):
    # Deterministic proxy of the fixed cost of a small step: the off switch
    # adds one select (the scale set to 1, the loss record to False), and
    # each of the state's other scalars passes through: in place when
    # donated; copied out when not, as any output equal to an input is. It
    # used to write constants: jax then paired the donated buffers with the
    # wrong outputs and XLA copied every scalar of the state, twice.
    adam = optax.adam(1e-3)
    tx = jls.loss_scaling(adam, OFF)

    def loss(p, x):
        return jnp.sum((x @ p["w"] + p["b"][None]) ** 2)

    def off(params, state, x):
        grads = jax.grad(loss)(params, x)
        if fused:
            return jls.apply_gradients(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def plain(params, state, x):
        updates, state = adam.update(jax.grad(loss)(params, x), state, params)
        return optax.apply_updates(params, updates), state

    x = jnp.ones((5, 3))
    state = tx.init(PARAMS)
    got, copies = _entry_ops(off, PARAMS, state, x, donate=donate)
    want, plain_copies = _entry_ops(plain, PARAMS, adam.init(PARAMS), x, donate=donate)
    passed = len(jax.tree.leaves((state.loss_scale, state.hooks))) - 2
    assert copies - plain_copies == (0 if donate else passed)
    assert got == want + 2 + copies - plain_copies


def test_a_state_with_another_scale_is_reset_to_one():
    # A checkpoint from a float16 run (scale 2**15) resumed with the switch
    # off: the documented fix sets the scale to 1; the step resets it anyway.
    tx = jls.loss_scaling(optax.sgd(1.0), OFF)
    state = tx.init(PARAMS)
    state = state._replace(
        loss_scale=state.loss_scale._replace(scale=jnp.float32(2.0**15))
    )
    fixed = jls.set_loss_scale(state, 1.0)
    assert float(jls.scale_loss(jnp.float32(3.0), fixed)) == 3.0
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    params, state = jls.apply_gradients(tx, grads, state, PARAMS)
    chex.assert_trees_all_equal(params, jax.tree.map(lambda p: p - 1.0, PARAMS))
    assert float(jls.metrics(state)["loss_scale"]) == 1.0


def test_float16_gradients_with_the_switch_off_warn_naming_the_fix():
    tx = jls.loss_scaling(optax.sgd(0.1), OFF)
    p16 = jax.tree.map(lambda p: p.astype(jnp.float16), PARAMS)
    with pytest.warns(UserWarning, match=r"loss scaling is off.*jls.dynamic_scale\(\)"):
        tx.update(p16, tx.init(p16), p16)


@pytest.mark.parametrize("fused", [False, True])
def test_float16_gradients_under_no_scale_warn_naming_the_fix(fused):
    # jls.no_scale() still skips non-finite steps, but its scale of 1 lets
    # float16's small gradients underflow: it used to run without a word
    # (bfloat16 gets a hint the other way round).
    tx = jls.loss_scaling(optax.sgd(0.1), jls.no_scale())
    p16 = jax.tree.map(lambda p: p.astype(jnp.float16), PARAMS)

    def step(grads, state, params):
        if fused:
            return jls.apply_gradients(tx, grads, state, params)
        return tx.update(grads, state, params)

    with pytest.warns(UserWarning, match=r"scale of 1.*jls.measured_scale\(\)"):
        jax.jit(step)(p16, tx.init(p16), p16)
    # No warning for float32 and bfloat16 gradients, nor for a real scale.
    pbf = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)
    for params in (PARAMS, pbf):
        jax.jit(step)(params, tx.init(params), params)
    scaled = jls.loss_scaling(optax.sgd(0.1), jls.static_scale(1024.0))
    jax.jit(scaled.update)(p16, scaled.init(p16), p16)


@pytest.mark.parametrize(
    "kw, off",
    [
        ({}, True),
        ({"max_consecutive_skips": None}, True),
        ({"gradient_norm": True}, False),
        ({"diagnostics": True}, False),
    ],
)
def test_only_a_bare_transformation_is_the_plain_optimizer(kw, off):
    scaling = jls.LossScaling(optax.sgd(0.1), OFF, hooks=hooks_from_options(**kw))
    assert is_off(scaling.scaler, scaling.hooks) is off
    assert not is_off(jls.no_scale().__class__ and jls.no_scale(), ())
    assert not is_off(jls.static_scale(2.0, skip_nonfinite=False), ())


class _BN(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(4)(x)
        return nn.BatchNorm(use_running_average=not train)(x)


def test_flax_train_state_with_the_switch_off_is_flax_s():
    # One script, every precision: the float32 branch's TrainState steps and
    # writes its batch statistics exactly as flax's own.
    model = _BN()
    x = jnp.linspace(-1.0, 1.0, 24).reshape(8, 3)
    variables = model.init(jax.random.key(0), x)

    class Plain(train_state.TrainState):
        batch_stats: dict

    class Off(jls.flax.TrainState):
        batch_stats: dict

    def step(state, x):
        def loss(p):
            out, upd = model.apply(
                {"params": p, "batch_stats": state.batch_stats},
                x,
                mutable=["batch_stats"],
            )
            return jnp.mean(out**2), upd

        grads, upd = jax.grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=upd["batch_stats"])

    make = {
        Plain: optax.adam(1e-2),
        Off: jls.loss_scaling(optax.adam(1e-2), OFF),
    }
    states = {
        cls: cls.create(
            apply_fn=None,
            params=variables["params"],
            tx=tx,
            batch_stats=variables["batch_stats"],
        )
        for cls, tx in make.items()
    }
    inputs = [x, x.at[0, 0].set(jnp.inf), x * 2]
    for xs in inputs:
        states = {cls: jax.jit(step)(s, xs) for cls, s in states.items()}
        plain, off = states[Plain], states[Off]
        assert _bits((plain.params, plain.batch_stats, plain.opt_state)) == _bits(
            (off.params, off.batch_stats, off.opt_state.inner_state)
        )
        assert int(plain.step) == int(off.step)
    lowered = jax.jit(step).lower(states[Off], x).as_text()
    assert "case" not in lowered and "conditional" not in lowered
