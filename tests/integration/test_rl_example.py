"""examples/rl_fp16.py: its tiny configuration runs, and its sampler is the trainer."""

from __future__ import annotations

import json
import math
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import rl_fp16  # noqa: E402  # pyright: ignore[reportMissingImports]  (a program, not API)

CFG = rl_fp16.TINY


def test_tiny_run_writes_a_record_per_step(tmp_path):
    summary = rl_fp16.main(["--tiny", "--variants", "f16-jls", "--out", str(tmp_path)])
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    steps = CFG.sft_steps + CFG.rl_steps
    assert [r["step"] for r in records] == list(range(steps))
    assert [r["phase"] for r in records] == ["sft"] * CFG.sft_steps + [
        "rl"
    ] * CFG.rl_steps
    for r in records:
        assert r["variant"] == "f16-jls" and r["seed"] == 0
        assert math.isfinite(r["loss"]) and not r["nonfinite"] and not r["skipped"]
        mantissa, _ = math.frexp(r["loss_scale"])
        assert mantissa == 0.5 and r["loss_scale"] > 1  # a power of two, scaling
    for r in records[CFG.sft_steps :]:
        assert 0.0 <= r["reward"] <= 1.0
        assert 0.0 <= r["gap_mean"] <= r["gap_max"] < 1.0 and r["kl_k3"] >= 0.0
    assert records[0]["loss"] > records[CFG.sft_steps - 1]["loss"]  # it learns
    (run,) = summary["runs"]
    assert run["variant"] == "f16-jls" and run["skipped_fraction"] == 0.0
    assert run["final_scale"] == records[-1]["loss_scale"]
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


def _sampled(variant, seed=0):
    params = rl_fp16.init_params(jax.random.key(seed), CFG)
    prompts = rl_fp16.problems(jax.random.key(seed + 1), 32)[:, : rl_fp16.PROMPT]
    sample = jax.jit(rl_fp16.sample, static_argnums=(3, 4))
    tokens, logp = sample(params, prompts, jax.random.key(2), variant, CFG.heads)
    return params, prompts, tokens, logp


def test_the_kv_cache_sampler_gives_the_trainers_log_probs_in_float32():
    params, prompts, tokens, sampled = _sampled("f32")
    np.testing.assert_array_equal(tokens[:, : rl_fp16.PROMPT], prompts)
    assert tokens.shape == (32, rl_fp16.LENGTH) and sampled.shape == (32, 3)
    trained = rl_fp16.token_logp(params, tokens, "f32", CFG.heads)
    np.testing.assert_allclose(sampled, trained, rtol=0, atol=1e-5)
    # Untrained, the answers are random draws: their log-probs are far from 0.
    assert float(jnp.mean(sampled)) < -1.0


def test_the_float32_head_computes_the_log_probs_in_float32():
    params, _, tokens, _ = _sampled("f16-jls")
    f32, f16, head32 = (
        rl_fp16.forward(params, tokens, v, CFG.heads)
        for v in ("f32", "f16-jls", "f16-jls-head32")
    )
    # float16 log-probs are float16 numbers; the float32 head's are not.
    assert np.array_equal(f16, f16.astype(jnp.float16).astype(jnp.float32))
    assert not np.array_equal(head32, head32.astype(jnp.float16).astype(jnp.float32))
    assert float(jnp.abs(head32 - f32).max()) < float(jnp.abs(f16 - f32).max())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--variants", "f16,fp8"], "variants must be 'all' or a comma-separated"),
        (["--variant", "f32,f32"], "variants must be 'all' or a comma-separated"),
        (["--seeds", "0"], "seeds must be at least 1, got 0"),
        (["--sft-steps", "0"], "sft_steps must be an int >= 1, got 0"),
        (["--rl-steps", "-2"], "rl_steps must be an int >= 1, got -2"),
    ],
)
def test_bad_options_are_refused_by_name(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        rl_fp16.main(["--tiny", "--out", str(tmp_path), *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "records.jsonl").exists()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("group", 1, "group must be an int >= 2, got 1"),
        ("heads", 3, "d (16) must be a multiple of heads (3)"),
        ("clip", 0.0, "clip must be positive, got 0.0"),
    ],
)
def test_bad_config_is_refused_when_made(field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        rl_fp16.Config(**{**vars(CFG), field: value})


STORED = EXAMPLES.parent / "benchmarks" / "results" / "cpu" / "rl_fp16"


def test_the_stored_runs_summary_is_its_records():
    summary = json.loads((STORED / "summary.json").read_text())
    cfg = rl_fp16.Config(**summary["config"])
    runs = {}
    for line in (STORED / "records.jsonl").read_text().splitlines():
        r = json.loads(line)
        runs.setdefault((r["variant"], r["seed"]), []).append(r)
    assert [(r["variant"], r["seed"]) for r in summary["runs"]] == list(runs)
    assert len(runs) == 3 * len(rl_fp16.VARIANTS)
    for run in summary["runs"]:
        records = runs[run["variant"], run["seed"]]
        assert len(records) == cfg.sft_steps + cfg.rl_steps
        assert {"variant": run["variant"], "seed": run["seed"]} | rl_fp16.summarize(
            cfg, records
        ) == run


def test_the_page_shows_the_stored_runs_tables():
    sys.path.insert(0, str(EXAMPLES.parent / "benchmarks"))
    import rl_fp16_plot  # pyright: ignore[reportMissingImports]  (a script)

    _, summary = rl_fp16_plot.load([STORED, STORED / "no_excess_precision"])
    tables = rl_fp16_plot.tables(summary)
    assert "| bf16, no excess precision | 0.863 (0.809, 0.812, 0.967) |" in tables
    page = (EXAMPLES.parent / "docs" / "rl_fp16.md").read_text()
    for line in tables.splitlines():
        assert line in page, line
    assert tables == (STORED / "table.md").read_text().strip()
