"""Train-step overhead of loss scaling: jls against plain optax and peer idioms.

Every variant is a jitted train step (Adam), on the same model and batch,
twice: without donation (as most user code: flax's examples, notebooks, a
plain ``@jax.jit``) and with ``donate_argnums=(0, 1)`` ("(donated)"), each
compared with plain Adam in the same mode (jls's step is the same in both:
nothing is declared). The report adds each compiled step's temporary bytes
and copies.
They run side by side in one process, in interleaved rounds (each round
times one step of every variant, in a shuffled order, a few steps per
sample), and the report gives, per variant, the median step time, the ratio
of its median to plain optax's, and the median and 10th-90th percentile of
its per-round ratio to plain optax.
All steps are finite steps: the common case, and the one whose cost matters.

Variants:
  plain      optax.adam, no loss scaling (the floor).
  jls_fused  jls.loss_scaling + jls.apply_gradients.
  jls_update jls.loss_scaling + tx.update + optax.apply_updates.
  jls_fused_sum_check  jls_fused with jls 0.1's plain-sum check, which the
             compiler can fool (issue 10): what the fusion-proof check costs.
  jmp        jmp.DynamicLossScale, unscale, jmp.all_finite, jmp.select_tree
             over (params, opt_state): the idiom from jmp's README.
  apply_if_finite  optax.apply_if_finite(adam) with a manual static scale.
  flax_dynamic_scale  flax.training.dynamic_scale.DynamicScale.value_and_grad
             and jnp.where over params and opt_state: flax's example idiom.
  jls_off    jls.loss_scaling(adam, jls.no_scale(skip_nonfinite=False)): the
             off switch a float32/bfloat16 run of a float16 script uses.

Models: ``lm`` (27M-parameter transformer), ``mlp`` (3.7M), ``char``
(``examples/char_lm.py``'s 0.47M model in float16).

Run: ``python benchmarks/bench_step.py [--model lm|mlp|char|both|all] [--rounds 30]``.
Needs the ``bench`` extra (flax, jmp).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import pathlib
import platform
import random
import re
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from flax.training.dynamic_scale import DynamicScale

import jls
from jls import _finite

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from char_runs import load_char_lm  # noqa: E402


class Block(nn.Module):
    """A pre-LN transformer block."""

    d: int
    heads: int

    @nn.compact
    def __call__(self, x):  # noqa: D102
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads)(
            h, h, mask=nn.make_causal_mask(x[..., 0])
        )
        x = x + h
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * self.d)(h)
        h = nn.Dense(self.d)(nn.gelu(h))
        return x + h


class LM(nn.Module):
    """A small decoder-only transformer language model."""

    vocab: int = 8192
    d: int = 512
    layers: int = 6
    heads: int = 8

    @nn.compact
    def __call__(self, tokens):  # noqa: D102
        x = nn.Embed(self.vocab, self.d)(tokens)
        for _ in range(self.layers):
            x = Block(self.d, self.heads)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


class MLP(nn.Module):
    """A plain MLP."""

    width: int = 1024
    depth: int = 4
    out: int = 10

    @nn.compact
    def __call__(self, x):  # noqa: D102
        for _ in range(self.depth):
            x = nn.gelu(nn.Dense(self.width)(x))
        return nn.Dense(self.out)(x)


def make_problem(name: str):
    """Returns (loss_fn(params, batch), params, batch)."""
    key = jax.random.key(0)
    if name == "char":
        return _char_problem(key)
    if name == "lm":
        model = LM()
        tokens = jax.random.randint(key, (1, 65), 0, model.vocab)
        params = model.init(key, tokens[:, :-1])

        def loss_fn(params, batch):
            logits = model.apply(params, batch[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, batch[:, 1:]
            ).mean()

        return loss_fn, params, tokens
    model = MLP()
    x = jax.random.normal(key, (256, 512))
    y = jax.random.randint(key, (256,), 0, 10)
    params = model.init(key, x)

    def loss_fn(params, batch):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(
            model.apply(params, x), y
        ).mean()

    return loss_fn, params, (x, y)


def _char_problem(key):
    """``examples/char_lm.py``'s model at its default size, run in float16."""
    char_lm = load_char_lm()
    cfg = char_lm.Config()
    params = char_lm.init_params(key, cfg)
    tokens = jax.random.randint(key, (cfg.batch, cfg.seq + 1), 0, 256)
    return char_lm.make_loss(cfg, "f16"), params, tokens


@contextlib.contextmanager
def _plain_sum_check():
    """While tracing: jls's check as jls 0.1 had it, a plain ``sum(x)``."""
    saved = _finite._shrunk_sum

    def plain_sum(parts, size, dtype):
        return sum(jnp.sum(p, dtype=dtype) for p in parts)

    _finite._shrunk_sum = plain_sum
    try:
        yield
    finally:
        _finite._shrunk_sum = saved


DONATED = " (donated)"


def make_variants(loss_fn, params, modes=(False, True)):
    """Returns {name: (jitted step, initial opt_state)} for each donation mode.

    Each variant is jitted without donation (the name as it is) and with
    ``donate_argnums=(0, 1)`` (the name with `DONATED`).
    """
    adam = optax.adam(1e-4)
    variants = {}
    for donated in modes:
        jit = functools.partial(jax.jit, donate_argnums=(0, 1) if donated else ())
        suffix = DONATED if donated else ""
        for key, (fn, state) in _steps(loss_fn, params, adam).items():
            variants[key + suffix] = (jit(fn), state)
    return variants


def _steps(loss_fn, params, adam):
    """The variants' step functions, not jitted, and their initial states."""
    steps = {}

    def plain(params, state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, state = adam.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    steps["plain"] = (plain, adam.init(params))

    scaler = jls.dynamic_scale(2.0**15, growth_interval=10**6)
    tx = jls.loss_scaling(adam, scaler)

    def jls_fused(params, state, batch):
        grads = jax.grad(lambda p: jls.scale_loss(loss_fn(p, batch), state))(params)
        return jls.apply_gradients(tx, grads, state, params)

    def jls_update(params, state, batch):
        grads = jax.grad(lambda p: jls.scale_loss(loss_fn(p, batch), state))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def jls_fused_sum_check(params, state, batch):
        # jls 0.1's check, a plain sum per leaf, which the compiler can fool
        # (issue 10): the cost of the fusion-proof sum of magnitudes.
        with _plain_sum_check():
            return jls_fused(params, state, batch)

    off = jls.loss_scaling(adam, jls.no_scale(skip_nonfinite=False))

    def jls_off(params, state, batch):
        # The off switch (bfloat16/float32 runs of a float16 script).
        grads = jax.grad(loss_fn)(params, batch)
        return jls.apply_gradients(off, grads, state, params)

    steps["jls_fused"] = (jls_fused, tx.init(params))
    steps["jls_update"] = (jls_update, tx.init(params))
    steps["jls_fused_sum_check"] = (jls_fused_sum_check, tx.init(params))
    steps["jls_off"] = (jls_off, off.init(params))

    def jmp_select(params, state, batch):
        opt_state, loss_scale = state
        grads = jax.grad(lambda p: loss_scale.scale(loss_fn(p, batch)))(params)
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        updates, new_opt_state = adam.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        return params, (opt_state, loss_scale)

    jmp_scale = jmp.DynamicLossScale(jnp.float32(2.0**15), period=10**6)
    steps["jmp"] = (jmp_select, (adam.init(params), jmp_scale))

    guarded = optax.apply_if_finite(adam, max_consecutive_errors=10**6)
    scale = jnp.float32(2.0**15)

    def apply_if_finite(params, state, batch):
        grads = jax.grad(lambda p: loss_fn(p, batch) * scale)(params)
        grads = jax.tree.map(lambda g: g / scale, grads)
        updates, state = guarded.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    steps["apply_if_finite"] = (apply_if_finite, guarded.init(params))

    def flax_dynamic_scale(params, state, batch):
        opt_state, dyn = state
        dyn, is_fin, _, grads = dyn.value_and_grad(loss_fn)(params, batch)
        updates, new_opt_state = adam.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        select = functools.partial(jnp.where, is_fin)
        params = jax.tree.map(select, new_params, params)
        opt_state = jax.tree.map(select, new_opt_state, opt_state)
        return params, (opt_state, dyn)

    dyn = DynamicScale(growth_interval=10**6, scale=jnp.float32(2.0**15))
    steps["flax_dynamic_scale"] = (flax_dynamic_scale, (adam.init(params), dyn))
    return steps


def baseline(key: str) -> str:
    """The plain variant a variant is compared with: the same donation."""
    donated = key.endswith(DONATED)
    return "plain" + DONATED if donated else "plain"


def compiled_stats(step, params, opt_state, batch) -> dict:
    """The compiled step's temporary bytes and copy instructions."""
    try:
        compiled = step.lower(params, opt_state, batch).compile()
    except TypeError:  # jmp's state cannot be unflattened from lowering's ArgInfo
        return {}
    text = compiled.as_text()
    copies = len(re.findall(r"= \S+ copy\(", text))
    temp = compiled.memory_analysis().temp_size_in_bytes
    return {"temp_mb": temp / 1e6, "copies": copies}


def run(
    name: str,
    rounds: int,
    steps_per_sample: int = 1,
    only: list[str] | None = None,
    seed: int = 0,
    variants_fn=None,
    stats=None,
) -> dict:
    """Benchmarks the variants on one model; returns the summary.

    ``variants_fn(loss_fn, params)`` makes the variants (default
    `make_variants`), each ``(step, state)`` with ``step(params, state,
    batch) -> (params, state)``; each is compared with the variant
    `baseline` names (``plain``, or ``plain (donated)`` for a donated one).
    ``stats(step, params, opt_state, batch)``: a dict of facts about each
    compiled step to report (e.g. `compiled_stats`).
    """
    loss_fn, params, batch = make_problem(name)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    n_leaves = len(jax.tree.leaves(params))
    variants = (variants_fn or make_variants)(loss_fn, params)
    if only:
        keep = {"plain", *only}
        variants = {k: v for k, v in variants.items() if k.split(" ")[0] in keep}
    facts = {}
    if stats is not None:
        for key, (step, opt_state) in variants.items():
            facts[key] = stats(step, params, opt_state, batch)
    timed = {
        key: (_pairwise(step), (jax.tree.map(jnp.copy, params), opt_state))
        for key, (step, opt_state) in variants.items()
    }
    times = interleaved(timed, batch, rounds, steps_per_sample, seed)
    result = {
        "model": name,
        "params": int(n_params),
        "leaves": n_leaves,
        "rounds": rounds,
        "steps_per_sample": steps_per_sample,
        "variants": {},
    }
    for key, row in summary(times, baseline).items():
        result["variants"][key] = {**row, **facts.get(key, {})}
    return result


def _pairwise(step):
    return lambda carry, batch: step(*carry, batch)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]
"""What `interleaved` times each sample by: `use_clock` sets it."""


def add_clock_option(parser) -> None:
    """``--clock {wall,cpu}`` on ``parser``; pass its value to `use_clock`."""
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="cpu: time each sample by the process's CPU time (on a shared "
        "machine, pinned to one core with taskset, it counts only this "
        "process's own work)",
    )


def use_clock(name: str) -> None:
    """Time `interleaved`'s samples by ``name``'s clock (`CLOCKS`)."""
    global clock
    clock = CLOCKS[name]


def interleaved(variants, batch, rounds, steps_per_sample=1, seed=0) -> dict:
    """Per-sample seconds per step of each variant, in interleaved rounds.

    ``variants``: ``{key: (step, carry)}`` with ``carry = step(carry,
    batch)``. Each is compiled and warmed up first; each round then times
    ``steps_per_sample`` steps of every variant, in a shuffled order.
    """
    state = {}
    for key, (step, carry) in variants.items():
        carry = step(step(carry, batch), batch)  # compile + warm up
        state[key] = jax.block_until_ready(carry)
    times = {key: [] for key in variants}
    order = list(variants)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for key in order:
            step, carry = variants[key][0], state[key]
            t0 = clock()
            for _ in range(steps_per_sample):
                carry = step(carry, batch)
            jax.block_until_ready(carry)
            times[key].append((clock() - t0) / steps_per_sample)
            state[key] = carry
    return times


def summary(times: dict, base) -> dict:
    """Median time and ratios of each variant to ``base(key)``'s, per round."""
    out = {}
    for key, ts in times.items():
        plain = np.asarray(times[base(key)])
        ratio = np.asarray(ts) / plain
        out[key] = {
            "median_ms": float(np.median(ts) * 1e3),
            "ratio_of_medians": float(np.median(ts) / np.median(plain)),
            "ratio_median": float(np.median(ratio)),
            "ratio_p10": float(np.percentile(ratio, 10)),
            "ratio_p90": float(np.percentile(ratio, 90)),
        }
    return out


def report(result: dict) -> str:
    """A markdown table of one model's results."""
    has_stats = any("temp_mb" in v for v in result["variants"].values())
    extra = " temp MB | copies |" if has_stats else ""
    lines = [
        f"{result['model']}: {result['params'] / 1e6:.1f}M params, "
        f"{result['leaves']} leaves, {result['rounds']} interleaved rounds of "
        f"{result['steps_per_sample']} step(s) per variant; ratios to plain "
        "Adam with the same donation",
        "",
        "| variant | median step (ms) | ratio of medians | per-round ratio: "
        "median | p10-p90 |" + extra,
        "| --- | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if has_stats else ""),
    ]
    for key, v in result["variants"].items():
        row = (
            f"| {key} | {v['median_ms']:.1f} | {v['ratio_of_medians']:.3f} | "
            f"{v['ratio_median']:.3f} | {v['ratio_p10']:.3f}-{v['ratio_p90']:.3f} |"
        )
        if has_stats and "temp_mb" in v:
            row += f" {v['temp_mb']:.1f} | {v['copies']} |"
        elif has_stats:
            row += " - | - |"
        lines.append(row)
    return "\n".join(lines)


def main(argv=None) -> None:
    """Runs the benchmark and prints markdown tables (and JSON with --json)."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        choices=["lm", "mlp", "char", "both", "all"],
        default="both",
        help="which model(s)",
    )
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds")
    parser.add_argument(
        "--steps-per-sample", type=int, default=2, help="steps timed per sample"
    )
    parser.add_argument(
        "--variants", nargs="*", help="only these (plain is always included)"
    )
    parser.add_argument("--json", help="also write the results to this file")
    add_clock_option(parser)
    args = parser.parse_args(argv)
    use_clock(args.clock)
    print(
        f"jax {jax.__version__}, optax {optax.__version__}, "
        f"{jax.devices()[0].device_kind}, {platform.processor() or platform.machine()}"
    )
    models = {"both": ["lm", "mlp"], "all": ["lm", "mlp", "char"]}
    results = [
        run(m, args.rounds, args.steps_per_sample, args.variants, stats=compiled_stats)
        for m in models.get(args.model, [args.model])
    ]
    for r in results:
        print()
        print(report(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
