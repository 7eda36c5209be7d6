"""GRPO in float16 with jls: a transformer policy, a KV-cache sampler, a trainer.

A small causal transformer (pure JAX, float32 master weights) learns to add
two numbers (``"37+48="`` -> ``"580"``, the sum's digits lowest first, the
order a carry is computed in), first supervised, then by a
GRPO-style policy gradient: each prompt gets a group of sampled answers,
reward 1 for a correct sum, advantages are the reward minus the group's mean
divided by its standard deviation, and the loss clips the importance ratio
between the trainer's and the sampler's probability of each sampled token;
no value network. The sampler is a jitted decoding loop with a KV cache
(``lax.fori_loop``, the cache written with ``dynamic_update_slice``); the
trainer a full-sequence forward. Both run in the variant's precision, so
their log-probabilities of the same tokens differ by rounding: the gap that
biases RL in bfloat16 (arXiv 2510.26788). Variants:

- ``f32``: float32, plain optax (the reference);
- ``bf16``: bfloat16, plain optax;
- ``f16-jls``: float16, ``jls.measured_scale()`` via ``jls.train_step``;
- ``f16``: float16, plain optax, no loss scaling;
- ``f16-jls-head32``: ``f16-jls`` with the LM head (its matmul and
  logsumexp) in float32.

Each step's record (reward, the trainer/sampler log-prob gap of the sampled
tokens: mean and max absolute difference and the k3 estimate of
KL(sampler || trainer), non-finite and skipped steps, the loss scale) is a
line of ``records.jsonl`` in ``--out``; ``summary.json`` has each variant's
figures per seed. ``benchmarks/rl_fp16_plot.py`` plots them (docs/rl_fp16.md).

Run: ``python examples/rl_fp16.py`` (minutes on 2 CPU cores), ``--variants
f16-jls,bf16``, ``--seeds 3``, ``--tiny`` for the configuration CI runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jls

# name: (compute dtype, jls loss scaling, LM head in float32)
VARIANTS = {
    "f32": ("float32", False, False),
    "bf16": ("bfloat16", False, False),
    "f16-jls": ("float16", True, False),
    "f16": ("float16", False, False),
    "f16-jls-head32": ("float16", True, True),
}
PLUS, EQUALS, VOCAB = 10, 11, 12
PROMPT, LENGTH = 6, 9  # "ab+cd=" then the three digits of the sum


@dataclasses.dataclass(frozen=True)
class Config:
    """The run's size; refused by name when out of range."""

    sft_steps: int = 200
    rl_steps: int = 200
    batch: int = 16  # prompts per RL step (the supervised batch is batch * group)
    group: int = 8  # sampled answers per prompt
    d: int = 64
    heads: int = 4
    layers: int = 2
    sft_lr: float = 3e-3
    rl_lr: float = 3e-4
    clip: float = 0.2
    warmup: int = 20  # first steps of the run, while the loss scale settles

    def __post_init__(self):
        for name in ("sft_steps", "rl_steps", "batch", "d", "heads", "layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.group, int) or self.group < 2:
            raise ValueError(f"group must be an int >= 2, got {self.group!r}")
        if self.d % self.heads:
            raise ValueError(f"d ({self.d}) must be a multiple of heads ({self.heads})")
        for name in ("sft_lr", "rl_lr", "clip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


TINY = Config(sft_steps=4, rl_steps=4, batch=4, group=4, d=16, heads=2, layers=1)


def init_params(key: jax.Array, cfg: Config) -> dict:
    """Float32 master weights of a pre-LN causal transformer."""
    keys = iter(jax.random.split(key, 3 + 4 * cfg.layers))

    def dense(n_in, n_out):
        return jax.random.normal(next(keys), (n_in, n_out)) / math.sqrt(n_in)

    layer = lambda: {  # noqa: E731
        "qkv": dense(cfg.d, 3 * cfg.d),
        "out": dense(cfg.d, cfg.d),
        "up": dense(cfg.d, 4 * cfg.d),
        "down": dense(4 * cfg.d, cfg.d),
        "ln1": jnp.ones(cfg.d),
        "ln2": jnp.ones(cfg.d),
    }
    return {
        "embed": jax.random.normal(next(keys), (VOCAB, cfg.d)) * 0.1,
        "pos": jax.random.normal(next(keys), (LENGTH, cfg.d)) * 0.1,
        "layers": [layer() for _ in range(cfg.layers)],
        "ln": jnp.ones(cfg.d),
        "head": dense(cfg.d, VOCAB),
    }


def _norm(x, scale):
    """LayerNorm with float32 statistics (``rsqrt``'s backward overflows float16)."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, -1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
    return ((x32 - mean) * lax.rsqrt(var + 1e-5)).astype(x.dtype) * scale[None, None]


def _attend(q, k, v, mask, heads):
    """Multi-head attention over ``k, v`` where ``mask``; softmax in float32."""
    split = lambda a: a.reshape(*a.shape[:2], heads, -1)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    att = jnp.where(mask, att.astype(jnp.float32), -1e9)
    att = jax.nn.softmax(att, -1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(*q.shape[:2], -1)


def _block(layer, h, kv, mask, heads):
    """One layer; ``kv(k, v)`` gives the keys and values attended over."""
    q, k, v = jnp.split(_norm(h, layer["ln1"]) @ layer["qkv"], 3, axis=-1)
    k, v = kv(k, v)
    h = h + _attend(q, k, v, mask, heads) @ layer["out"]
    return h + jax.nn.gelu(_norm(h, layer["ln2"]) @ layer["up"]) @ layer["down"], k, v


def _head(master, p, h, head_f32):
    """Log-probabilities (float32); the matmul and logsumexp in float32 if asked."""
    h = _norm(h, p["ln"])
    w = master["head"] if head_f32 else p["head"]
    return jax.nn.log_softmax(h.astype(w.dtype) @ w, -1).astype(jnp.float32)


def forward(params, tokens, variant, heads):
    """The trainer: log-probabilities at every position of ``tokens``, at once."""
    dtype, _, head_f32 = VARIANTS[variant]
    p = jax.tree.map(lambda x: x.astype(dtype), params)
    t = tokens.shape[1]
    h = p["embed"][tokens] + p["pos"][None, :t]
    mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
    for layer in p["layers"]:
        h, _, _ = _block(layer, h, lambda k, v: (k, v), mask, heads)
    return _head(params, p, h, head_f32)


def token_logp(params, tokens, variant, heads):
    """The trainer's log-probability of each answer token of ``tokens``."""
    logp = forward(params, tokens[:, :-1], variant, heads)
    taken = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    return taken[:, PROMPT - 1 :]


def _write(k_cache, v_cache, i, k, v):
    """The caches with position ``i`` set to this step's keys and values."""
    at = (0, i, 0)
    return lax.dynamic_update_slice(k_cache, k, at), lax.dynamic_update_slice(
        v_cache, v, at
    )


def sample(params, prompts, key, variant, heads):
    """The sampler: decodes answers one token at a time with a KV cache.

    Returns the tokens and the sampler's log-probability of each answer token.
    """
    dtype, _, head_f32 = VARIANTS[variant]
    p = jax.tree.map(lambda x: x.astype(dtype), params)
    n, d = prompts.shape[0], params["ln"].shape[0]
    tokens = jnp.zeros((n, LENGTH), jnp.int32).at[:, :PROMPT].set(prompts)
    cache = [(jnp.zeros((n, LENGTH, d), dtype),) * 2 for _ in p["layers"]]

    def body(i, carry):
        tokens, logps, cache = carry
        token = lax.dynamic_slice_in_dim(tokens, i, 1, axis=1)
        h = p["embed"][token] + lax.dynamic_slice_in_dim(p["pos"], i, 1)[None]
        mask = (jnp.arange(LENGTH) <= i)[None, None, None]
        new = []
        for layer, (kc, vc) in zip(p["layers"], cache, strict=True):
            kv = functools.partial(_write, kc, vc, i)
            h, kc, vc = _block(layer, h, kv, mask, heads)
            new.append((kc, vc))
        logp = _head(params, p, h, head_f32)[:, 0]
        drawn = jax.random.categorical(jax.random.fold_in(key, i), logp)
        given = lax.dynamic_index_in_dim(tokens, i + 1, axis=1, keepdims=False)
        nxt = jnp.where(i + 1 < PROMPT, given, drawn)
        tokens = lax.dynamic_update_slice(tokens, nxt[:, None], (0, i + 1))
        lp = jnp.take_along_axis(logp, nxt[:, None], -1)
        logps = lax.dynamic_update_slice(logps, lp, (0, i + 1))
        return tokens, logps, new

    init = (tokens, jnp.zeros((n, LENGTH), jnp.float32), cache)
    tokens, logps, _ = lax.fori_loop(0, LENGTH - 1, body, init)
    return tokens, logps[:, PROMPT:]


def problems(key, n):
    """``n`` random sums as token rows: the prompt, then the sum's 3 digits reversed."""
    a, b = jax.random.randint(key, (2, n), 0, 100)
    digits = lambda x, k: [(x // 10**j) % 10 for j in reversed(range(k))]  # noqa: E731
    cols = [*digits(a, 2), jnp.full(n, PLUS), *digits(b, 2), jnp.full(n, EQUALS)]
    return jnp.stack([*cols, *digits(a + b, 3)[::-1]], 1).astype(jnp.int32)


def make_tx(cfg: Config, variant: str):
    """Adam at the supervised rate, then the RL rate; jls-wrapped if the variant is."""
    lr = optax.join_schedules(
        [optax.constant_schedule(cfg.sft_lr), optax.constant_schedule(cfg.rl_lr)],
        [cfg.sft_steps],
    )
    adam = optax.adam(lr)
    return (
        jls.loss_scaling(adam, jls.measured_scale()) if VARIANTS[variant][1] else adam
    )


def _update(loss_fn, tx, variant):
    """Step: ``(params, opt_state, *batch) -> (params, opt_state, loss, aux, m)``."""
    if VARIANTS[variant][1]:
        step = jls.train_step(loss_fn, tx, has_aux=True)

        def scaled(params, opt_state, *batch):
            params, opt_state, out = step(params, opt_state, *batch)
            return params, opt_state, out.loss, out.aux, out._asdict()

        return scaled

    def plain(params, opt_state, *batch):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, aux), grads = grad_fn(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        out = {"nonfinite": ~jls.all_finite(grads), "skipped": False, "loss_scale": 1.0}
        return optax.apply_updates(params, updates), opt_state, loss, aux, out

    return plain


@functools.cache
def make_steps(cfg: Config, variant: str):
    """The jitted supervised and RL steps of one variant."""
    tx, heads = make_tx(cfg, variant), cfg.heads
    n = cfg.batch * cfg.group

    def sft_loss(params, tokens):
        return -jnp.mean(token_logp(params, tokens, variant, heads)), None

    def grpo_loss(params, tokens, old_logp, adv):
        logp = token_logp(params, tokens, variant, heads)
        ratio = jnp.exp(logp - old_logp)
        clipped = jnp.clip(ratio, 1 - cfg.clip, 1 + cfg.clip)
        return -jnp.mean(jnp.minimum(ratio * adv, clipped * adv)), logp

    sft_update = _update(sft_loss, tx, variant)
    rl_update = _update(grpo_loss, tx, variant)

    def metrics(loss, out):
        keys = ("nonfinite", "skipped", "loss_scale")
        return {"loss": loss, **{k: out[k] for k in keys}}

    @jax.jit
    def sft_step(params, opt_state, key):
        params, opt_state, loss, _, out = sft_update(
            params, opt_state, problems(key, n)
        )
        return params, opt_state, metrics(loss, out)

    @jax.jit
    def rl_step(params, opt_state, key):
        data_key, sample_key = jax.random.split(key)
        target = jnp.repeat(problems(data_key, cfg.batch), cfg.group, axis=0)
        tokens, old_logp = sample(
            params, target[:, :PROMPT], sample_key, variant, heads
        )
        reward = jnp.all(tokens == target, 1).astype(jnp.float32).reshape(cfg.batch, -1)
        adv = (reward - reward.mean(1, keepdims=True)) / (
            reward.std(1, keepdims=True) + 1e-6
        )
        params, opt_state, loss, logp, out = rl_update(
            params, opt_state, tokens, old_logp, adv.reshape(-1, 1)
        )
        gap = logp - old_logp  # the trainer's log-prob minus the sampler's
        m = metrics(loss, out) | {
            "reward": reward.mean(),
            "gap_mean": jnp.abs(gap).mean(),
        }
        m |= {"gap_max": jnp.abs(gap).max(), "kl_k3": jnp.mean(jnp.expm1(gap) - gap)}
        return params, opt_state, m

    return tx, sft_step, rl_step


def train(cfg: Config, variant: str, seed: int, log=None) -> list[dict]:
    """Runs one variant from one seed; returns (and logs) a record per step."""
    tx, sft_step, rl_step = make_steps(cfg, variant)
    init_key, key = jax.random.split(jax.random.key(seed))
    params = init_params(init_key, cfg)
    opt_state = tx.init(params)
    records, start = [], time.perf_counter()
    for i in range(cfg.sft_steps + cfg.rl_steps):
        rl = i >= cfg.sft_steps
        step = rl_step if rl else sft_step
        params, opt_state, m = step(params, opt_state, jax.random.fold_in(key, i))
        record = {"variant": variant, "seed": seed, "phase": "rl" if rl else "sft"}
        record |= {"step": i, **jax.tree.map(lambda x: np.asarray(x).item(), m)}
        records.append(record)
        if log:
            log.write(json.dumps(record) + "\n")
    print(
        f"{variant:15s} seed {seed}  reward {summarize(cfg, records)['reward']:.3f}  "
        f"{time.perf_counter() - start:.0f} s",
        flush=True,
    )
    return records


def summarize(cfg: Config, records: list[dict]) -> dict:
    """One run's figures: final reward (last tenth of RL), the gap, skips."""
    rl = [r for r in records if r["phase"] == "rl"]
    late = rl[-max(1, len(rl) // 10) :]
    return {
        "reward": float(np.mean([r["reward"] for r in late])),
        "gap_mean": float(np.mean([r["gap_mean"] for r in rl])),
        "gap_max": float(max(r["gap_max"] for r in rl)),
        "kl_k3": float(np.mean([r["kl_k3"] for r in rl])),
        "nonfinite_after_warmup": sum(
            bool(r["nonfinite"]) for r in records if r["step"] >= cfg.warmup
        ),
        "skipped_fraction": float(np.mean([bool(r["skipped"]) for r in records])),
        "final_scale": records[-1]["loss_scale"],
    }


def _names(text: str) -> tuple[str, ...]:
    names = tuple(VARIANTS) if text == "all" else tuple(text.split(","))
    if not names or not set(names) <= set(VARIANTS) or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(
            "variants must be 'all' or a comma-separated subset of "
            f"{','.join(VARIANTS)}, got {text!r}"
        )
    return names


def main(argv=None) -> dict:
    """Trains the chosen variants from each seed; returns the summary."""
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").partition("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--variants", "--variant", type=_names, default="all",
        help=f"'all' or a comma-separated subset of {','.join(VARIANTS)}",
    )  # fmt: skip
    parser.add_argument("--seeds", type=int, default=1, help="run seeds 0..N-1")
    parser.add_argument(
        "--sft-steps", type=int,
        help=f"supervised steps (None: {Config.sft_steps}, --tiny {TINY.sft_steps})",
    )  # fmt: skip
    parser.add_argument(
        "--rl-steps", type=int,
        help=f"GRPO steps (None: {Config.rl_steps}, --tiny {TINY.rl_steps})",
    )  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="the CI configuration")
    parser.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path("jls-rl-fp16"),
        help="folder for records.jsonl and summary.json",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"seeds must be at least 1, got {args.seeds}")
    cfg = TINY if args.tiny else Config()
    try:
        for name in ("sft_steps", "rl_steps"):
            if getattr(args, name) is not None:
                cfg = dataclasses.replace(cfg, **{name: getattr(args, name)})
    except ValueError as e:
        parser.error(str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"config": dataclasses.asdict(cfg), "runs": []}
    with open(args.out / "records.jsonl", "w") as log:
        for variant in args.variants:
            for seed in range(args.seeds):
                run = summarize(cfg, train(cfg, variant, seed, log))
                summary["runs"].append({"variant": variant, "seed": seed, **run})
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out / 'records.jsonl'} and {args.out / 'summary.json'}")
    return summary


if __name__ == "__main__":
    main()
