"""A character-level transformer LM in float16 with jls, on real text.

The text is the Python standard library's own source (every machine has it,
nothing is downloaded): its bytes are the characters. One small causal
transformer (pure JAX, float32 master weights) is trained four times, side by
side, with Adam:

- ``f32``: float32 compute, plain optax (the reference);
- ``bf16``: bfloat16 compute, ``jls.no_scale()`` (skip non-finite steps only);
- ``f16``: float16 compute, plain optax, no loss scaling;
- ``f16-jls``: float16 compute, ``jls.dynamic_scale()`` with the fused step.

Compute precision comes from a jmp-style policy (``jls.precision.get_policy``),
casting the forward pass's arguments (``policy.cast_arguments``): the forward
keeps its norms' statistics and its softmax in float32 itself, and the loss
is computed outside it, in float32 (``policy.wrap`` would cast per op). It
prints a progress line per mode, then a table (final training and held-out
loss in float32, skipped steps, final scale, seconds), and writes
``char_lm.png`` (loss and loss-scale curves) to ``--out`` when matplotlib is
installed.

Run: ``python examples/char_lm.py`` (a few minutes on 2 CPU cores), or
``--large`` for a bigger model and a longer run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jls

MODES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f16-jls": "float16"}


@dataclasses.dataclass(frozen=True)
class Config:
    """The run's size."""

    steps: int = 300
    batch: int = 16
    seq: int = 64
    d: int = 128
    heads: int = 4
    layers: int = 2
    lr: float = 3e-3
    text_bytes: int = 2_000_000
    seed: int = 0


LARGE = Config(steps=2000, batch=32, seq=128, d=256, heads=8, layers=4)


def load_text(n_bytes: int) -> np.ndarray:
    """The standard library's source files, as one array of bytes."""
    root = pathlib.Path(os.__file__).parent
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= n_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:n_bytes], np.uint8)


def init_params(key: jax.Array, cfg: Config) -> dict:
    """Float32 master weights of a pre-LN causal transformer over 256 bytes."""
    keys = iter(jax.random.split(key, 4 + 4 * cfg.layers))

    def dense(n_in, n_out):
        return jax.random.normal(next(keys), (n_in, n_out)) / math.sqrt(n_in)

    layers = [
        {
            "qkv": dense(cfg.d, 3 * cfg.d),
            "out": dense(cfg.d, cfg.d),
            "up": dense(cfg.d, 4 * cfg.d),
            "down": dense(4 * cfg.d, cfg.d),
            "ln1": jnp.ones(cfg.d),
            "ln2": jnp.ones(cfg.d),
        }
        for _ in range(cfg.layers)
    ]
    return {
        "embed": jax.random.normal(next(keys), (256, cfg.d)) * 0.02,
        "pos": jax.random.normal(next(keys), (cfg.seq, cfg.d)) * 0.02,
        "layers": layers,
        "ln": jnp.ones(cfg.d),
        "head": dense(cfg.d, 256),
    }


def _norm(x, scale):
    """LayerNorm with its statistics in float32, as flax's LayerNorm does.

    In float16 the backward pass of ``rsqrt(var)`` overflows.
    """
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, -1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
    normed = ((x32 - mean) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype)
    return normed * scale[None, None, :]


def forward(params: dict, tokens: jax.Array, heads: int) -> jax.Array:
    """Logits for every position; computed in the dtype of ``params``."""
    b, t = tokens.shape
    h = params["embed"][tokens] + params["pos"][None, :t]
    mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
    for layer in params["layers"]:
        q, k, v = jnp.split(_norm(h, layer["ln1"]) @ layer["qkv"], 3, axis=-1)
        q, k, v = (a.reshape(b, t, heads, -1) for a in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
        att = jnp.where(mask, att, jnp.asarray(-1e4, att.dtype))
        att = jax.nn.softmax(att.astype(jnp.float32), -1).astype(q.dtype)
        h = h + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, -1) @ layer["out"]
        h = h + jax.nn.gelu(_norm(h, layer["ln2"]) @ layer["up"]) @ layer["down"]
    return _norm(h, params["ln"]) @ params["head"]


def make_loss(cfg: Config, mode: str):
    """The mean next-byte cross-entropy, the model run in the mode's dtype."""
    policy = jls.precision.get_policy(f"p=f32,c={MODES[mode]},o=f32")

    def loss_fn(params, tokens):
        logits = policy.cast_arguments(functools.partial(forward, heads=cfg.heads))(
            params, tokens[:, :-1]
        )
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, tokens[:, 1:]
        ).mean()

    return loss_fn


def train(mode: str, cfg: Config, data: np.ndarray, held_out: np.ndarray) -> dict:
    """Trains one mode; returns its record."""
    loss_fn = make_loss(cfg, mode)
    params = init_params(jax.random.key(cfg.seed), cfg)
    adam = optax.adam(cfg.lr)
    if mode == "f16-jls":
        tx = jls.loss_scaling(adam, jls.dynamic_scale())
    elif mode == "bf16":
        tx = jls.loss_scaling(adam, jls.no_scale())
    else:
        tx = adam
    opt_state = tx.init(params)
    scaled = tx is not adam

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, tokens):
        if not scaled:
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, 1.0, False

        def scaled_loss(p):
            loss = loss_fn(p, tokens)
            return jls.scale_loss(loss, opt_state), loss

        grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
        params, opt_state = jls.apply_gradients(tx, grads, opt_state, params)
        m = jls.metrics(opt_state)
        return params, opt_state, loss, m["loss_scale"], m["skipped"]

    rng = np.random.default_rng(cfg.seed)
    batch_at = rng.integers(0, len(data) - cfg.seq - 1, (cfg.steps, cfg.batch))
    windows = np.arange(cfg.seq + 1)
    losses, scales, skipped = [], [], []
    start = None
    for i in range(cfg.steps):
        tokens = jnp.asarray(data[batch_at[i][:, None] + windows], jnp.int32)
        params, opt_state, loss, scale, skip = step(params, opt_state, tokens)
        if i == 0:
            jax.block_until_ready(params)
            start = time.perf_counter()  # compilation excluded
        losses.append(float(loss))
        scales.append(float(scale))
        skipped.append(bool(skip))
        if (i + 1) % max(1, cfg.steps // 10) == 0:
            print(f"  {mode:8s} step {i + 1:5d}  loss {losses[-1]:.3f}", flush=True)
    seconds = time.perf_counter() - (start or time.perf_counter())
    f32_loss = jax.jit(make_loss(cfg, "f32"))
    held = rng.integers(0, len(held_out) - cfg.seq - 1, (8, cfg.batch))
    evals = [
        float(f32_loss(params, jnp.asarray(held_out[h[:, None] + windows], jnp.int32)))
        for h in held
    ]
    return {
        "mode": mode,
        "train_loss": float(np.mean(losses[-max(1, cfg.steps // 20) :])),
        "held_out_loss": float(np.mean(evals)),
        "skipped": int(sum(skipped)) if scaled else None,
        "final_scale": scales[-1] if scaled else None,
        "seconds": seconds,
        "losses": losses,
        "scales": scales,
    }


def format_table(rows: list[dict]) -> str:
    """The results as a markdown table."""
    lines = [
        "| mode | train loss | held-out loss | skipped steps | final scale | seconds |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        skipped = "-" if r["skipped"] is None else str(r["skipped"])
        scale = r["final_scale"]
        scale = "-" if scale is None else f"2**{math.log2(scale):.0f}"
        lines.append(
            f"| {r['mode']} | {r['train_loss']:.3f} | {r['held_out_loss']:.3f} | "
            f"{skipped} | {scale} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


def _plot(rows: list[dict], path: pathlib.Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        ax1.plot(r["losses"], label=r["mode"], lw=1)
    ax1.set(xlabel="step", ylabel="training loss", title="char LM, stdlib source")
    ax1.legend()
    jls_row = next(r for r in rows if r["mode"] == "f16-jls")
    ax2.semilogy(jls_row["scales"], base=2)
    ax2.set(xlabel="step", ylabel="loss scale", title="f16-jls loss scale")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv=None) -> list[dict]:
    """Trains every mode and prints the table; returns the rows."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, help="training steps per mode")
    parser.add_argument("--large", action="store_true", help="a bigger, longer run")
    parser.add_argument("--out", default="jls-char-lm", help="folder for the PNG")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    args = parser.parse_args(argv)
    cfg = LARGE if args.large else Config()
    if args.steps:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    text = load_text(cfg.text_bytes)
    cut = int(len(text) * 0.9)
    print(f"{len(text)} bytes of Python stdlib source; {cfg}")
    rows = [train(mode, cfg, text[:cut], text[cut:]) for mode in MODES]
    print(format_table(rows))
    if not args.no_plot:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        if _plot(rows, out / "char_lm.png"):
            print(f"wrote {out / 'char_lm.png'}")
    return rows


if __name__ == "__main__":
    main()
