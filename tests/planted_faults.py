"""Planted overflows for `jls.precision.explain_step`: each names its op.

``PLANTS[name]()`` returns a `Plant`: a loss function, the scale, its
arguments and what `explain_step` must name: the pass, the primitive, a
part of the layer path and the line (a ``# plant`` marker on it). Shared by
``tests/test_explain_faults.py`` and ``benchmarks/bench_explain.py`` (which
counts how many are found). Shapes are small, parameters float16.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import jls

F16, F32 = jnp.float16, jnp.float32
_SOURCE = pathlib.Path(__file__).read_text().splitlines()


def line(marker: str) -> str:
    """``planted_faults.py:N`` of the line that ends with ``# plant: marker``."""
    for i, text in enumerate(_SOURCE, 1):
        if text.endswith(f"# plant: {marker}"):
            return f"{pathlib.Path(__file__).name}:{i}"
    raise KeyError(marker)


class Plant(NamedTuple):
    """A planted fault and what names it."""

    loss: Callable[..., Any]
    scale: float
    args: tuple
    pass_: str
    primitive: str
    layer: str
    where: str
    iteration: int | None = None
    kwargs: dict = {}


def full(shape: Any, value: float, dtype: Any = F16) -> jax.Array:
    return jnp.full(shape, value, dtype)


def exp_gate() -> Plant:
    def loss(w, x):
        with jax.named_scope("gate"):
            h = jnp.exp(x * w)  # plant: exp
        return jnp.mean(h.astype(F32))

    return Plant(
        loss, 1.0, (full(4, 1), full(4, 12)), "forward", "exp", "gate", line("exp")
    )


def attention_logits() -> Plant:
    def loss(w, x):
        q, k = x @ w, x @ w
        with jax.named_scope("attention"):
            logits = jnp.einsum("qd,kd->qk", q, k)  # plant: logits
        return jnp.mean(jax.nn.softmax(logits.astype(F32)))

    args = (full((8, 8), 4), full((4, 8), 16))
    return Plant(loss, 1.0, args, "forward", "dot_general", "attention", line("logits"))


def large_activation() -> Plant:
    def loss(w, x):
        with jax.named_scope("mlp"):
            h = jax.nn.relu(x @ w) ** 2  # plant: act
        return jnp.mean(h.astype(F32))

    args = (full((4, 4), 1), full((2, 4), 80))
    return Plant(loss, 1.0, args, "forward", "integer_pow", "mlp", line("act"))


def layer_norm_variance() -> Plant:
    def loss(w, x):
        with jax.named_scope("ln"):
            mu = jnp.mean(x, -1, keepdims=True)
            var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)  # plant: var
            h = (x - mu) * jax.lax.rsqrt(var + 1e-3) * w
        return jnp.mean(h.astype(F32))

    x = jnp.array([[300.0, -300.0, 1.0, 2.0]], F16)
    args = (full((1, 4), 1), x)
    return Plant(loss, 1.0, args, "forward", "square", "ln", line("var"))


def vocabulary_loss() -> Plant:
    def loss(w, x):
        logits = x @ w
        with jax.named_scope("xent"):
            z = jnp.sum(jnp.exp(logits), -1)  # plant: vocab
            return jnp.mean(jnp.log(z).astype(F32) - logits[:, 0])

    # jnp.sum adds float16 in float32: its cast back to float16 overflows.
    args = (full((4, 8192), 1), full((2, 4), 1.25))
    where = line("vocab")
    return Plant(loss, 1.0, args, "forward", "convert_element_type", "xent", where)


def flushed_epsilon() -> Plant:
    def loss(w, x):
        with jax.named_scope("norm"):
            var = jnp.mean(jnp.square(x - jnp.mean(x)))
            h = x * jax.lax.rsqrt(var + 1e-8) * w  # plant: eps
        return jnp.mean(h.astype(F32))

    return Plant(
        loss, 1.0, (full(4, 1), full(4, 3)), "forward", "rsqrt", "norm", line("eps")
    )


def float32_to_float16() -> Plant:
    def loss(w, x):
        wide = x.astype(F32) * 1000.0
        with jax.named_scope("cast"):
            h = wide.astype(F16) * w  # plant: cast
        return jnp.mean(h.astype(F32))

    args = (full(4, 1), full(4, 100))
    return Plant(
        loss, 1.0, args, "forward", "convert_element_type", "cast", line("cast")
    )


def nan_from_sqrt() -> Plant:
    def loss(w, x):
        with jax.named_scope("dist"):
            d = jnp.sqrt(x * w - 2)  # plant: sqrt
        return jnp.mean(d.astype(F32))

    return Plant(
        loss, 1.0, (full(4, 1), full(4, 1)), "forward", "sqrt", "dist", line("sqrt")
    )


def residual_stream() -> Plant:
    # Forward finite (the stream doubles per block from 1e-3); the backward
    # doubles the scaled cotangent per block and overflows in the last one.
    def loss(ws, x):
        h = x
        for i, w in enumerate(ws):
            with jax.named_scope(f"block{i}"):
                h = h + h @ w  # plant: residual
        return jnp.sum(h.astype(F32))

    ws = [jnp.eye(4, dtype=F16) for _ in range(8)]
    args = (ws, full((2, 4), 1e-3))
    return Plant(loss, 2.0**15, args, "backward", "add_any", "block7", line("residual"))


def float16_loss() -> Plant:
    def loss(w, x):
        return jnp.mean(x * w)  # a float16 loss: its cotangent is cast to float16

    args = (full(4, 1), full(4, 1))
    return Plant(
        loss, 2.0**17, args, "backward", "convert_element_type", "", "jls.scale_loss"
    )


@jax.custom_vjp
def _amplify(x):
    return x * 2


def _amplify_fwd(x):
    return jnp.exp(x), x  # plant: cvjp-fwd


def _amplify_bwd(x, g):
    return (g * jnp.full_like(g, 1000),)


_amplify.defvjp(_amplify_fwd, _amplify_bwd)


def custom_vjp_backward() -> Plant:
    # jax gives the backward rule's ops the line that calls the function.
    def loss(w):
        with jax.named_scope("amp"):
            h = _amplify(w)  # plant: cvjp-bwd
        return jnp.sum(h.astype(F32))

    args = (full(4, 1),)
    return Plant(loss, 256.0, args, "backward", "mul", "amp", line("cvjp-bwd"))


def custom_vjp_forward() -> Plant:
    def loss(w):
        with jax.named_scope("amp"):
            h = _amplify(w)
        return jnp.mean(h.astype(F32))

    return Plant(loss, 1.0, (full(4, 12),), "forward", "exp", "amp", line("cvjp-fwd"))


def remat_forward() -> Plant:
    @jax.checkpoint
    def block(w):
        with jax.named_scope("ckpt"):
            return jnp.exp(w * 3)  # plant: remat-fwd

    return Plant(
        lambda w: jnp.mean(block(w).astype(F32)),
        1.0,
        (full(4, 4),),
        "forward",
        "exp",
        "ckpt",
        line("remat-fwd"),
    )


def remat_backward() -> Plant:
    @jax.checkpoint
    def block(w, big):
        with jax.named_scope("ckpt"):
            return w * big  # plant: remat-bwd

    def loss(w, big):
        return jnp.sum(block(w, big).astype(F32))

    args = (full(4, 1e-3), full(4, 1000))
    return Plant(loss, 128.0, args, "backward", "mul", "ckpt", line("remat-bwd"))


def scan_forward() -> Plant:
    def loss(w, c0):
        def step(c, _):
            with jax.named_scope("rnn"):
                return c * w, c  # plant: scan-fwd

        c, _ = jax.lax.scan(step, c0, length=10)
        return jnp.mean(c.astype(F32))

    return Plant(
        loss,
        1.0,
        (full(4, 4), full(4, 1)),
        "forward",
        "mul",
        "rnn",
        line("scan-fwd"),
        7,
    )


def scan_backward() -> Plant:
    # The carry shrinks forward; the cotangent triples per step backward.
    def loss(w, c0):
        def step(c, _):
            with jax.named_scope("rnn"):
                return c * w, None  # plant: scan-bwd

        c, _ = jax.lax.scan(step, c0, length=6)
        return jnp.sum(c.astype(F32))

    args = (full(4, 3), full(4, 1e-4))
    return Plant(loss, 2.0**13, args, "backward", "mul", "rnn", line("scan-bwd"), 1)


def while_forward() -> Plant:
    def loss(w, x):
        def body(c):
            with jax.named_scope("grow"):
                return c[0] + 1, c[1] * 4  # plant: while

        _, h = jax.lax.while_loop(lambda c: c[0] < 10, body, (0, x))
        return jnp.mean((w * h).astype(F32))

    args = (full(4, 1), full(4, 1))
    return Plant(loss, 1.0, args, "forward", "mul", "grow", line("while"), 7)


def cond_branch() -> Plant:
    def loss(w, x):
        def hot(x):
            with jax.named_scope("hot"):
                return jnp.exp(x * w)  # plant: cond

        h = jax.lax.cond(jnp.sum(x) > 0, hot, lambda x: x * w, x)
        return jnp.mean(h.astype(F32))

    return Plant(
        loss, 1.0, (full(4, 1), full(4, 12)), "forward", "exp", "hot", line("cond")
    )


def jitted_attention() -> Plant:
    @jax.jit
    def attention(q, k):
        return jnp.einsum("qd,kd->qk", q, k)  # plant: jit

    def loss(w, x):
        return jnp.mean(attention(x @ w, x @ w).astype(F32))

    args = (full((8, 8), 4), full((4, 8), 16))
    return Plant(loss, 1.0, args, "forward", "dot_general", "attention", line("jit"))


class _Block(nnx.Module):
    def __init__(self):
        self.up = nnx.Linear(4, 4, dtype=F16, param_dtype=F16, rngs=nnx.Rngs(0))
        self.down = nnx.Linear(4, 4, dtype=F16, param_dtype=F16, rngs=nnx.Rngs(1))

    def __call__(self, x):
        h = self.up(x)  # plant: nnx-up
        return self.down(h)  # plant: nnx-down


def _nnx_block(up: float, down: float) -> _Block:
    block = _Block()
    block.up.kernel[...] = full((4, 4), up)
    block.down.kernel[...] = full((4, 4), down)
    return block


def nnx_forward() -> Plant:
    def loss(model, x):
        return jnp.mean(model(x).astype(F32))

    args = (_nnx_block(300, 1), full((2, 4), 100))
    return Plant(loss, 1.0, args, "forward", "dot_general", "_Block", line("nnx-up"))


def nnx_backward() -> Plant:
    # Forward 1e-3 -> 0.256 -> 65.5; the scaled cotangent 4096 -> 1e6 back
    # through the second layer.
    def loss(model, x):
        return jnp.sum(model(x).astype(F32))

    args = (_nnx_block(64, 64), full((2, 4), 1e-3))
    return Plant(
        loss, 2.0**12, args, "backward", "dot_general", "_Block", line("nnx-down")
    )


class _EqxBlock(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __call__(self, x):
        return self.down(self.up(x))  # plant: eqx


def _eqx_block(up: float, down: float) -> _EqxBlock:
    keys = jax.random.split(jax.random.key(0))
    block = _EqxBlock(*(eqx.nn.Linear(4, 4, key=k, dtype=F16) for k in keys))
    block = eqx.tree_at(lambda b: b.up.weight, block, full((4, 4), up))
    return eqx.tree_at(lambda b: b.down.weight, block, full((4, 4), down))


def equinox_forward() -> Plant:
    def loss(model, x):
        return jnp.mean(jax.vmap(model)(x).astype(F32))

    args = (_eqx_block(300, 1), full((2, 4), 100))
    return Plant(loss, 1.0, args, "forward", "dot_general", "_EqxBlock", line("eqx"))


def equinox_backward() -> Plant:
    def loss(model, x):
        return jnp.sum(jax.vmap(model)(x).astype(F32))

    args = (_eqx_block(64, 64), full((2, 4), 1e-3))
    return Plant(
        loss, 2.0**12, args, "backward", "dot_general", "_EqxBlock", line("eqx")
    )


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="proj", dtype=F16, param_dtype=F16)(x)  # plant: linen


def linen_forward() -> Plant:
    params = _Dense().init(jax.random.key(0), jnp.ones((2, 4), F16))
    params = jax.tree.map(lambda w: jnp.full_like(w, 300), params)

    def loss(params, x):
        return jnp.mean(jnp.asarray(_Dense().apply(params, x)).astype(F32))

    args = (params, full((2, 4), 100))
    return Plant(
        loss, 1.0, args, "forward", "dot_general", "_Dense/proj", line("linen")
    )


def autocast_matmul() -> Plant:
    policy = jls.precision.get_policy("params=float32,compute=float16,output=float32")

    def loss(w, x):
        with jax.named_scope("proj"):
            return jnp.mean(x @ w)  # plant: autocast

    args = (full((4, 4), 300, F32), full((2, 4), 100, F32))
    where = line("autocast")
    return Plant(policy.wrap(loss), 1.0, args, "forward", "dot_general", "proj", where)


PLANTS: dict[str, Callable[[], Plant]] = {
    f.__name__: f
    for f in (
        exp_gate, attention_logits, large_activation, layer_norm_variance,
        vocabulary_loss, flushed_epsilon, float32_to_float16, nan_from_sqrt,
        residual_stream, float16_loss, custom_vjp_backward, custom_vjp_forward,
        remat_forward, remat_backward, scan_forward, scan_backward, while_forward,
        cond_branch, jitted_attention, nnx_forward, nnx_backward, equinox_forward,
        equinox_backward, linen_forward, autocast_matmul,
    )
}  # fmt: skip


def found(plant: Plant, report: Any) -> list[str]:
    """What the report got wrong about ``plant`` (empty: it named it)."""
    op = report.first
    if op is None:
        return ["no op named"]
    wrong = []
    want = {"pass": plant.pass_, "primitive": plant.primitive, "where": plant.where}
    got = {"pass": op.pass_, "primitive": op.primitive, "where": op.where}
    wrong += [f"{k}: {got[k]} != {v}" for k, v in want.items() if got[k] != v]
    if plant.layer not in op.layer:
        wrong.append(f"layer: {plant.layer!r} not in {op.layer!r}")
    if op.iteration != plant.iteration:
        wrong.append(f"iteration: {op.iteration} != {plant.iteration}")
    return wrong
