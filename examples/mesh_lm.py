"""A float16 transformer LM with jls on a data x model mesh, three ways.

Runs on a CPU-only machine: it asks XLA for host devices before JAX starts.
A small flax linen decoder (float32 master weights, float16 matmuls,
float32 normalisation, softmax and loss) is trained with
``jls.train_step`` and ``jls.dynamic_scale()``:

- ``single``: one device, the whole batch (the reference);
- ``jit``: the way MaxText and levanter write it: a 4 x 2 ``("data",
  "model")`` mesh, the parameters and the optimizer state sharded with
  ``NamedSharding`` (Megatron-style: attention and MLP column- then
  row-parallel over ``"model"``), the batch over ``"data"``, under
  ``jax.jit``; the gradients are global, jls's check is global;
- ``shard_map``: the same model under ``jax.shard_map`` (``check_vma=True``),
  its parameters and optimizer state stored in shards over both axes (FSDP:
  gathered in the forward pass), the batch over both, the gradients averaged
  by ``jls.train_step(..., average_over=("data", "model"))``.

``--processes 2`` runs the ``jit`` layout across 2 processes of 4 devices
each (``jax.distributed.initialize`` on 127.0.0.1). ``--inf-step k`` puts an
inf into one example's loss weight on the last device's shard at step k:
every replica must skip that step and change nothing.

Each run writes a JSON report (loss, scale and skip of every step; whether
the planted step changed anything) and the final parameters (``.npz``).
``tests/integration/test_mesh_lm.py`` checks that every layout matches the
single device step for step.

Run: ``python examples/mesh_lm.py --layout all --out DIR``.
"""

from __future__ import annotations

import os

# Before jax starts: 8 host devices (a process of a 2-process run is given 4).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jls  # noqa: E402

VOCAB, WIDTH, HEADS, LAYERS, SEQ, BATCH = 64, 64, 4, 2, 16, 32


class Block(nn.Module):
    """Pre-norm attention and MLP; matmuls in ``dtype``, the rest in float32."""

    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        dense = functools.partial(nn.Dense, dtype=self.dtype, param_dtype=jnp.float32)
        h = nn.LayerNorm(dtype=jnp.float32)(x)
        qkv = dense(3 * WIDTH, name="qkv")(h).reshape(*h.shape[:2], 3, HEADS, -1)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
        causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
        logits = jnp.where(causal, logits / np.sqrt(WIDTH // HEADS), -1e9)
        weights = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(h.shape)
        x = x + dense(WIDTH, name="out")(attended).astype(jnp.float32)
        h = nn.LayerNorm(dtype=jnp.float32)(x)
        h = nn.gelu(dense(4 * WIDTH, name="up")(h))
        return x + dense(WIDTH, name="down")(h).astype(jnp.float32)


class LM(nn.Module):
    """A small decoder: embedding, blocks, a float32 head for the loss."""

    dtype: jnp.dtype

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, WIDTH, param_dtype=jnp.float32)(tokens)
        x = x + self.param("position", nn.initializers.normal(0.02), (SEQ, WIDTH))
        for i in range(LAYERS):
            x = Block(self.dtype, name=f"block{i}")(x)
        x = nn.LayerNorm(dtype=jnp.float32)(x)
        head = nn.Dense(VOCAB, dtype=self.dtype, param_dtype=jnp.float32, name="head")
        return head(x).astype(jnp.float32)


def megatron_spec(path, leaf) -> P:
    """Tensor-parallel layout: qkv and up column-, out and down row-parallel."""
    names = [getattr(k, "key", "") for k in path]
    if "qkv" in names or "up" in names:
        return P(None, "model") if names[-1] == "kernel" else P("model")
    if ("out" in names or "down" in names) and names[-1] == "kernel":
        return P("model", None)
    return P()


def fsdp_spec(path, leaf) -> P:
    """FSDP over both axes: the first dimension in 8 shards where it divides."""
    del path
    return P(("data", "model")) if leaf.ndim and leaf.shape[0] % 8 == 0 else P()


def batches(steps: int, inf_step: int):
    """Token sequences that follow a rule with noise, and per-example weights."""
    rng = np.random.default_rng(0)
    for step in range(steps):
        start = rng.integers(0, VOCAB, size=(BATCH, 1))
        tokens = (start + 3 * np.arange(SEQ + 1)) % VOCAB
        noise = rng.random(tokens.shape) < 0.1
        tokens = np.where(noise, rng.integers(0, VOCAB, tokens.shape), tokens)
        weights = np.ones(BATCH, np.float32)
        if step == inf_step:
            weights[-1] = np.inf  # the last example: the last device's shard
        yield tokens.astype(np.int32), weights


def make_loss(model, gather=None):
    """The weighted next-token cross-entropy, in float32."""

    def loss_fn(params, tokens, weights):
        if gather is not None:
            params = gather(params)
        logits = model.apply({"params": params}, tokens[:, :-1])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        return jnp.mean(losses.mean(axis=1) * weights)

    return loss_fn


def train(layout: str, steps: int, dtype: str, inf_step: int, optimizer: str):
    """One layout's run: its report and its final parameters (as numpy)."""
    model = LM(jnp.dtype(dtype))
    params = model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"]
    inner = optax.adamw(3e-3) if optimizer == "adamw" else optax.sgd(0.3, 0.9)
    tx = jls.loss_scaling(inner, jls.dynamic_scale(2.0**15))
    state = tx.init(params)
    mesh = None
    if layout != "single":  # GSPMD's automatic sharding, as MaxText uses it
        auto = (jax.sharding.AxisType.Auto,) * 2
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=auto)
    if layout == "single":
        step = jax.jit(jls.train_step(make_loss(model), tx))
    elif layout == "jit":
        specs = jax.tree_util.tree_map_with_path(megatron_spec, params)
        step = jax.jit(jls.train_step(make_loss(model), tx))
    else:
        specs = jax.tree_util.tree_map_with_path(fsdp_spec, params)

        def gather(p):
            return jax.tree.map(
                lambda x, s: (
                    lax.all_gather(x, ("data", "model"), tiled=True) if s != P() else x
                ),
                p,
                specs,
            )

        local_step = jls.train_step(
            make_loss(model, gather), tx, average_over=("data", "model")
        )
    if mesh is not None:
        state_specs = optax.tree_utils.tree_map_params(
            tx,
            lambda _, s: s,
            state,
            specs,
            transform_non_params=lambda _: P(),
            is_leaf=lambda x: isinstance(x, P),
        )
        params = _place(params, specs, mesh)
        state = _place(state, state_specs, mesh)
        if layout == "shard_map":
            batch = P(("data", "model"))
            step = jax.jit(
                jax.shard_map(
                    local_step,
                    mesh=mesh,
                    in_specs=(specs, state_specs, batch, batch),
                    out_specs=(specs, state_specs, P()),
                )
            )
    rows, unchanged = [], None
    data_axes = ("data", "model") if layout == "shard_map" else "data"
    for i, (tokens, weights) in enumerate(batches(steps, inf_step)):
        if mesh is not None:
            tokens, weights = (
                _batch(a, NamedSharding(mesh, P(data_axes))) for a in (tokens, weights)
            )
        before = _host((params, state.inner_state)) if i == inf_step else None
        params, state, out = step(params, state, tokens, weights)
        if before is not None:  # bitwise: the parameters and Adam's state
            after = _host((params, state.inner_state))
            unchanged = all(
                np.array_equal(a, b, equal_nan=True)
                for a, b in zip(
                    jax.tree.leaves(before), jax.tree.leaves(after), strict=True
                )
            )
        rows.append(
            {
                "loss": float(_host(out.loss)),
                "scale": float(_host(out.loss_scale)),
                "skipped": bool(_host(out.skipped)),
            }
        )
    flat = {
        jax.tree_util.keystr(k): v
        for k, v in jax.tree_util.tree_leaves_with_path(_host(params))
    }
    return {"layout": layout, "steps": rows, "inf_step_unchanged": unchanged}, flat


def _place(tree, specs, mesh):
    """``tree`` (the same on every process) laid out by ``specs`` on ``mesh``."""
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(
            np.shape(x), NamedSharding(mesh, s), lambda idx, x=x: np.asarray(x)[idx]
        ),
        tree,
        specs,
    )


def _batch(array, sharding):
    """The global batch (the same on every process) as a sharded array."""
    return jax.make_array_from_callback(array.shape, sharding, lambda idx: array[idx])


def _host(tree):
    """Every leaf as a numpy array, gathered from every process."""
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(one, tree)


def _parse(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--layout",
        choices=["single", "jit", "shard_map", "all"],
        default="all",
        help="which layout to train (all: the three in one process)",
    )
    parser.add_argument("--steps", type=int, default=8, help="training steps")
    parser.add_argument(
        "--dtype", choices=["float16", "float32"], default="float16", help="compute"
    )
    parser.add_argument(
        "--inf-step", type=int, default=3, help="step with an inf (-1: none)"
    )
    parser.add_argument(
        "--optimizer",
        choices=["adamw", "sgd"],
        default="adamw",
        help="sgd's update is linear in the gradient: layouts compare exactly",
    )
    parser.add_argument(
        "--processes", type=int, default=1, help="1, or 2 for jax.distributed"
    )
    parser.add_argument("--out", default="jls-mesh-lm", help="report folder")
    parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _spawn(args) -> list[dict]:
    """Runs the jit layout in 2 processes of 4 devices; returns their reports."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    common = [
        f"--steps={args.steps}",
        f"--dtype={args.dtype}",
        f"--inf-step={args.inf_step}",
        f"--optimizer={args.optimizer}",
        f"--out={args.out}",
        f"--port={port}",
        "--processes=2",
        "--layout=jit",
    ]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, *common, f"--process-id={i}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(p.returncode for p in procs):
        raise SystemExit("a process failed:\n" + "\n".join(logs))
    out = pathlib.Path(args.out)
    return [json.loads((out / f"jit_p{i}.json").read_text()) for i in range(2)]


def main(argv=None) -> dict:
    """Trains the requested layouts; returns their reports by name."""
    args = _parse(argv)
    if args.processes == 2 and args.process_id is None:
        return {"processes": _spawn(args)}
    if args.processes == 2:
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=2,
            process_id=args.process_id,
            initialization_timeout=60,
        )
    layouts = ["single", "jit", "shard_map"] if args.layout == "all" else [args.layout]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = {}
    for layout in layouts:
        report, params = train(
            layout, args.steps, args.dtype, args.inf_step, args.optimizer
        )
        name = layout if args.process_id is None else f"{layout}_p{args.process_id}"
        (out / f"{name}.json").write_text(json.dumps(report))
        np.savez(out / f"{name}.npz", **params)
        reports[name] = report
        print(name, json.dumps(report["steps"]))
    return reports


if __name__ == "__main__":
    main()
