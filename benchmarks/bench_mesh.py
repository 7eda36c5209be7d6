"""jls's step on a data x model mesh against plain optax on the same mesh.

``examples/mesh_lm.py``'s float16 transformer LM (a wider one with
``--width``), ``jit`` layout: a 4 x 2 ``("data", "model")`` mesh of 8 devices
(host devices on a CPU machine), the parameters and Adam's state sharded
tensor-parallel over ``"model"``, the batch over ``"data"``. Variants, each
without and with donation (``donate_argnums=(0, 1)``), timed side by side
in interleaved rounds (``bench_step.interleaved``), ratios to plain Adam in
the same mode:

  plain          optax.adam, no loss scaling.
  jls_fused      jls.loss_scaling (dynamic rule) + jls.apply_gradients.
  jls_measured   the same with jls.measured_scale() (the squares check).

The report adds each compiled step's all-reduces and all-gathers (the
collectives jls adds: one all-reduce of scalars for the decision).

Run: ``python benchmarks/bench_mesh.py [--rounds 20] [--width 256]``. On a
CPU machine the 8 devices share its cores: the ratios, not the times, are
what carry over.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jls  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
import mesh_lm  # noqa: E402
from bench_step import interleaved, summary  # noqa: E402


def make(width: int):
    """The model, its placed parameters and batch, the mesh and the specs."""
    mesh_lm.WIDTH = width  # the example's module constants size the model
    model = mesh_lm.LM(jnp.float16)
    params = model.init(jax.random.key(0), jnp.zeros((1, mesh_lm.SEQ), jnp.int32))
    params = params["params"]
    mesh = jax.make_mesh(
        (4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )
    specs = jax.tree_util.tree_map_with_path(mesh_lm.megatron_spec, params)
    tokens, weights = next(mesh_lm.batches(1, -1))
    batch = tuple(
        jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (tokens, weights)
    )
    return mesh_lm.make_loss(model), params, batch, mesh, specs


def variants(loss, params, mesh, specs):
    """``{name: (step, (params, state))}``, placed on the mesh."""
    adam = optax.adam(1e-4)

    def place(tree, tree_specs):
        # From host copies: buffers of their own (a variant donates its own).
        return jax.tree.map(
            lambda a, s: jax.device_put(np.asarray(a), NamedSharding(mesh, s)),
            tree,
            tree_specs,
        )

    def state_specs(tx):
        return optax.tree_utils.tree_map_params(
            tx,
            lambda _, s: s,
            tx.init(params),
            specs,
            transform_non_params=lambda _: P(),
            is_leaf=lambda x: isinstance(x, P),
        )

    def plain(p, s, batch):
        g = jax.grad(loss)(p, *batch)
        u, s = adam.update(g, s, p)
        return optax.apply_updates(p, u), s

    def fused(tx):
        def step(p, s, batch):
            g = jax.grad(lambda p: jls.scale_loss(loss(p, *batch), s))(p)
            return jls.apply_gradients(tx, g, s, p)

        return step

    out = {}
    for donated in (False, True):
        jit = functools.partial(jax.jit, donate_argnums=(0, 1) if donated else ())
        suffix = " (donated)" if donated else ""
        txs = {
            "plain": (plain, adam),
            "jls_fused": (None, jls.loss_scaling(adam)),
            "jls_measured": (
                None,
                jls.loss_scaling(adam, jls.measured_scale()),
            ),
        }
        for name, (fn, tx) in txs.items():
            step = jit(fn if fn is not None else fused(tx))
            carry = (place(params, specs), place(tx.init(params), state_specs(tx)))
            out[name + suffix] = (step, carry)
    return out


def collectives(step, carry, batch) -> dict:
    """The compiled step's all-reduces and all-gathers."""
    text = step.lower(*carry, batch).compile().as_text()
    return {
        "all_reduce": len(re.findall(r" all-reduce(?:-start)?\(", text)),
        "all_gather": len(re.findall(r" all-gather(?:-start)?\(", text)),
    }


def main(argv=None) -> dict:
    """Runs the benchmark; prints a markdown table (and JSON with --json)."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds")
    parser.add_argument("--width", type=int, default=256, help="model width")
    parser.add_argument("--steps-per-sample", type=int, default=2, help="steps")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    loss, params, batch, mesh, specs = make(args.width)
    found = variants(loss, params, mesh, specs)
    facts = {k: collectives(step, carry, batch) for k, (step, carry) in found.items()}
    timed = {
        k: (lambda carry, batch, step=step: step(*carry, batch), carry)
        for k, (step, carry) in found.items()
    }
    times = interleaved(timed, batch, args.rounds, args.steps_per_sample)
    base = lambda k: "plain (donated)" if k.endswith("(donated)") else "plain"  # noqa: E731
    rows = summary(times, base)
    n = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}"
        f" ({platform.processor() or platform.machine()}), 4 x 2 mesh, LM of "
        f"{n / 1e6:.2f}M parameters, {args.rounds} rounds; ratios to plain Adam"
    )
    print()
    print(
        "| variant | median step (ms) | ratio | p10-p90 | all-reduces | all-gathers |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for k, r in rows.items():
        print(
            f"| {k} | {r['median_ms']:.1f} | {r['ratio_median']:.3f} | "
            f"{r['ratio_p10']:.2f}-{r['ratio_p90']:.2f} | "
            f"{facts[k]['all_reduce']} | {facts[k]['all_gather']} |"
        )
    result = {"rows": rows, "collectives": facts, "params": int(n)}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
