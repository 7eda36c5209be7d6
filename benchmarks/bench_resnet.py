"""flax's ImageNet step, as flax writes it and converted to jls, measured.

The model and step of ``examples/flax_imagenet.py`` (flax's
``examples/imagenet``: a linen ResNet18 with BatchNorm, a ``TrainState``
with ``batch_stats``, SGD with Nesterov momentum, float16 compute) on
synthetic 32x32 images, data-parallel over the host's devices two ways:
``pmap`` over a ``'batch'`` axis (flax's example) and ``jit`` over a batch
sharded on a ``'batch'`` mesh axis. Each variant runs without donation (as
flax's example does) and with ``donate_argnums=(0,)``; ratios are to flax's
own step in the same mode, in interleaved rounds (medians, per-round ratios,
10th-90th percentiles); the report adds the compiled step's temporary bytes
and copy instructions.

Variants:
  flax        flax's ``DynamicScale.value_and_grad(..., axis_name='batch')``
              and its ``jnp.where`` restore of ``opt_state`` and ``params``.
  jls_fused   ``jls.flax.TrainState`` with ``jls.loss_scaling(sgd,
              jls.presets.flax(), axis_name='batch')``, ``jls.scale_loss``
              and ``lax.pmean`` of the gradients.
  jls_update  flax's own ``TrainState`` with the same ``tx`` (``tx.update``).
  jls_replicas  ``jls_fused`` with ``check_replicas=True`` (the gradient
              fingerprint's cost).

Run: ``python benchmarks/bench_resnet.py [--widths 8 16 32] [--rounds 10]``.
It asks XLA for two host devices when ``XLA_FLAGS`` sets none. Needs the
``bench`` extra (flax).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import argparse  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from bench_step import interleaved, summary  # noqa: E402
from flax.training import dynamic_scale, train_state  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import jls  # noqa: E402
import jls.flax  # noqa: E402

DONATED = " (donated)"


def _example():
    path = pathlib.Path(__file__).resolve().parents[1] / "examples"
    spec = importlib.util.spec_from_file_location(
        "flax_imagenet", path / "flax_imagenet.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["flax_imagenet"] = module
    spec.loader.exec_module(module)
    return module


ex = _example()


class FlaxState(train_state.TrainState):
    """flax's example state: ``batch_stats`` and a ``dynamic_scale``."""

    batch_stats: Any
    dynamic_scale: Any


class JlsUpdateState(train_state.TrainState):
    """flax's ``TrainState`` (``tx.update``) with ``batch_stats``."""

    batch_stats: Any


def _loss(apply_fn, batch_stats, batch):
    def loss_fn(params):
        logits, new_model_state = apply_fn(
            {"params": params, "batch_stats": batch_stats},
            batch["image"],
            mutable=["batch_stats"],
        )
        one_hot = jax.nn.one_hot(batch["label"], ex.CLASSES)
        loss = optax.softmax_cross_entropy(logits, one_hot).mean()
        penalty = sum(jnp.sum(x**2) for x in jax.tree.leaves(params) if x.ndim > 1)
        return loss + 1e-4 * 0.5 * penalty, new_model_state

    return loss_fn


def flax_step(state, batch, axis):
    """Flax's ``train_step`` with ``dynamic_scale`` (examples/imagenet)."""
    loss_fn = _loss(state.apply_fn, state.batch_stats, batch)
    grad_fn = state.dynamic_scale.value_and_grad(loss_fn, has_aux=True, axis_name=axis)
    dyn, is_fin, (_, new_model_state), grads = grad_fn(state.params)
    new_state = state.apply_gradients(
        grads=grads, batch_stats=new_model_state["batch_stats"]
    )
    new_state = new_state.replace(
        opt_state=jax.tree.map(
            functools.partial(jnp.where, is_fin), new_state.opt_state, state.opt_state
        ),
        params=jax.tree.map(
            functools.partial(jnp.where, is_fin), new_state.params, state.params
        ),
        dynamic_scale=dyn,
    )
    return new_state


def jls_step(state, batch, axis):
    """The converted step: one gradient branch, ``jls.scale_loss``."""
    loss_fn = _loss(state.apply_fn, state.batch_stats, batch)
    grads, new_model_state = jax.grad(
        lambda p: (lambda out: (jls.scale_loss(out[0], state.opt_state), out[1]))(
            loss_fn(p)
        ),
        has_aux=True,
    )(state.params)
    if axis is not None:
        grads = lax.pmean(grads, axis)
    return state.apply_gradients(
        grads=grads, batch_stats=new_model_state["batch_stats"]
    )


def make_states(width: int, donated: bool, axis: str | None) -> dict:
    """Each variant's step function (not compiled) and initial state."""
    model = ex.ResNet18(width=width, dtype=jnp.float16)
    variables = model.init(jax.random.key(0), jnp.ones((1, 32, 32, 3)), train=False)
    params, stats = variables["params"], variables["batch_stats"]
    sgd = optax.sgd(0.05, momentum=0.9, nesterov=True)

    def tx(**options):
        return jls.loss_scaling(sgd, jls.presets.flax(), axis_name=axis, **options)

    common = {"apply_fn": model.apply, "params": params, "batch_stats": stats}
    return {
        "flax": (
            functools.partial(flax_step, axis=axis),
            FlaxState.create(
                tx=sgd, dynamic_scale=dynamic_scale.DynamicScale(), **common
            ),
        ),
        "jls_fused": (
            functools.partial(jls_step, axis=axis),
            ex.TrainState.create(tx=tx(), **common),
        ),
        "jls_update": (
            functools.partial(jls_step, axis=axis),
            JlsUpdateState.create(tx=tx(), **common),
        ),
        "jls_replicas": (
            functools.partial(jls_step, axis=axis),
            ex.TrainState.create(tx=tx(check_replicas=True), **common)
            if axis is not None
            else None,
        ),
    }


def compiled_stats(compiled) -> dict:
    """Temporary bytes and copy instructions of a compiled step."""
    text = compiled.as_text()
    return {
        "temp_mb": compiled.memory_analysis().temp_size_in_bytes / 1e6,
        "copies": text.count(" copy("),
    }


def build(width: int, how: str, batch_size: int) -> tuple[dict, Any, dict]:
    """``({key: (step, state)}, batch, facts)`` for one width and ``how``."""
    devices = jax.local_device_count()
    images, labels = ex.make_data(0, batch_size)
    variants, facts = {}, {}
    for donated in (False, True):
        donate = (0,) if donated else ()
        suffix = DONATED if donated else ""
        axis = "batch" if how == "pmap" else None
        for key, (fn, state) in make_states(width, donated, axis).items():
            if state is None:
                continue
            if how == "pmap":
                step = jax.pmap(fn, axis_name="batch", donate_argnums=donate)
                state = jax.tree.map(lambda x: jnp.stack([x] * devices), state)
                batch = {
                    "image": ex.shard(images, devices),
                    "label": ex.shard(labels, devices),
                }
            else:
                mesh = jax.make_mesh((devices,), ("batch",))
                rows = NamedSharding(mesh, PartitionSpec("batch"))
                batch = {
                    "image": jax.device_put(images, rows),
                    "label": jax.device_put(labels, rows),
                }
                state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
                step = jax.jit(fn, donate_argnums=donate)
            facts[key + suffix] = compiled_stats(step.lower(state, batch).compile())
            variants[key + suffix] = (step, state)
    return variants, batch, facts


def run(width: int, how: str, rounds: int, batch_size: int) -> dict:
    variants, batch, facts = build(width, how, batch_size)
    timed = {k: (step, jax.tree.map(jnp.copy, s)) for k, (step, s) in variants.items()}
    times = interleaved(timed, batch, rounds)
    rows = summary(times, lambda k: "flax" + DONATED if k.endswith(DONATED) else "flax")
    params = sum(x.size for x in jax.tree.leaves(variants["flax"][1].params))
    params //= jax.local_device_count() if how == "pmap" else 1
    return {
        "width": width,
        "how": how,
        "params": int(params),
        "rounds": rounds,
        "variants": {k: {**v, **facts[k]} for k, v in rows.items()},
    }


def report(result: dict) -> str:
    lines = [
        f"ResNet18 width {result['width']} ({result['params'] / 1e6:.2f}M params), "
        f"{result['how']}, {result['rounds']} interleaved rounds; ratios to flax's "
        "step with the same donation",
        "",
        "| variant | median step (ms) | per-round ratio: median | p10-p90 | "
        "temp MB | copies |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, v in result["variants"].items():
        lines.append(
            f"| {key} | {v['median_ms']:.1f} | {v['ratio_median']:.3f} | "
            f"{v['ratio_p10']:.3f}-{v['ratio_p90']:.3f} | {v['temp_mb']:.1f} | "
            f"{v['copies']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    """Runs the benchmark and prints a markdown table per width and mode."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--widths",
        type=int,
        nargs="*",
        default=[8, 16, 32],
        help="ResNet18 widths to measure",
    )
    parser.add_argument(
        "--how",
        choices=["pmap", "jit", "both"],
        default="both",
        help="data parallelism: pmap, jit over a sharded batch, or both",
    )
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    print(
        f"jax {jax.__version__}, flax, {jax.local_device_count()} x "
        f"{jax.devices()[0].device_kind}, {platform.processor() or platform.machine()}"
    )
    hows = ["pmap", "jit"] if args.how == "both" else [args.how]
    results = []
    for width in args.widths:
        for how in hows:
            results.append(run(width, how, args.rounds, args.batch_size))
            print()
            print(report(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
