"""Planted overflows: `explain_step` names each one's op, layer, pass and line.

The plants (``tests/planted_faults.py``) cover the forward (an ``exp``,
attention logits, a large activation, a layer-norm variance, a loss over a
large vocabulary, a flushed epsilon, a float32 value cast to float16, a nan),
the backward only (a residual stream and a ``scan`` whose forwards are
finite, a float16 loss's cotangent), ``custom_vjp``, ``checkpoint``,
``scan``, ``while_loop``, ``cond``, a nested ``jit``, flax nnx and linen,
equinox and a casting policy; healthy steps report nothing.
"""

import jax
import jax.numpy as jnp
import pytest
from planted_faults import F16, F32, PLANTS, found

import jls


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_the_planted_op_is_named(name):
    plant = PLANTS[name]()
    report = jls.precision.explain_step(plant.loss, plant.scale, *plant.args)
    assert not found(plant, report), (found(plant, report), str(report))


def test_there_are_at_least_twenty_plants():
    assert len(PLANTS) >= 20


def _mlp(params, x):
    h = jax.nn.gelu(x @ params["w1"])
    return jnp.mean(jnp.square((h @ params["w2"]).astype(F32) - 1.0))


def _masked_attention(w, x):
    logits = (x @ w) @ (x @ w).T
    mask = jnp.tril(jnp.ones(logits.shape, bool))
    logits = jnp.where(mask, logits.astype(F32), -jnp.inf)  # -inf: not an overflow
    return jnp.mean(jax.nn.softmax(logits, -1))


HEALTHY = {
    "mlp": (
        _mlp,
        {"w1": jnp.full((4, 8), 0.5, F16), "w2": jnp.full((8, 2), 0.25, F16)},
        jnp.linspace(-1, 1, 12, dtype=F16).reshape(3, 4),
    ),
    "masked_attention": (
        _masked_attention,
        jnp.full((4, 4), 0.1, F16),
        jnp.ones((3, 4), F16),
    ),
}


@pytest.mark.parametrize("name", sorted(HEALTHY))
def test_a_healthy_step_reports_nothing(name):
    loss, *args = HEALTHY[name]
    report = jls.precision.explain_step(loss, 2.0**10, *args)
    assert report.grads_finite and report.first is None, str(report)
    assert report.nonfinite_args == () and "no op overflowed" in str(report)


def test_the_least_headroom_names_what_overflows_next_as_the_scale_grows():
    # The residual stream's backward doubles the cotangent per block: at
    # 2**7 the second block's sum reaches 2**14 (the first block's input is
    # not differentiated), a quarter of float16's range; at 2**9 it
    # overflows there.
    plant = PLANTS["residual_stream"]()
    low = jls.precision.explain_step(plant.loss, 2.0**7, *plant.args)
    assert low.grads_finite and low.first is None, str(low)
    nearest = low.least_headroom[0]
    assert (nearest.pass_, nearest.primitive, nearest.out_max) == (
        "backward",
        "add_any",
        2.0**14,
    )
    assert nearest.layer.startswith("block1 ") and nearest.headroom == 65504 / 2**14
    high = jls.precision.explain_step(plant.loss, 2.0**9, *plant.args).first
    assert high is not None and (high.pass_, high.primitive, high.where) == (
        "backward",
        "add_any",
        nearest.where,
    )
    assert high.layer.startswith("block1 ")
