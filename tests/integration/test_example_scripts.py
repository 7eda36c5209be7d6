"""examples/train_fp16.py runs and really trains in float16."""

import pathlib
import runpy
import subprocess
import sys

import numpy as np
import pytest

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "train_fp16.py"


@pytest.fixture(autouse=True)
def _examples_importable(monkeypatch):
    # ``python examples/x.py`` puts examples/ on sys.path; runpy does not, and
    # the examples import the shared model (``from mlp import ...``).
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))


def test_example_trains_and_reports():
    main = runpy.run_path(str(EXAMPLE))["main"]
    summary = main(["--steps", "150", "--growth-interval", "50"])
    # The scale starts at 2**24 and must back off: those steps are skipped.
    assert summary["skipped_steps"] >= 1
    assert summary["loss_scale"] < 2.0**24
    assert summary["final_loss"] < 1.0 and summary["accuracy"] > 0.8


def test_example_help():
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "--steps" in out.stdout


def test_equinox_example_trains_in_float16():
    path = EXAMPLE.parent / "equinox_fp16.py"
    summary = runpy.run_path(str(path))["main"](["--steps", "120"])
    # The scale starts at 2**24: float16 overflows and those steps are skipped.
    assert summary["skipped_steps"] >= 1 and summary["loss_scale"] < 2.0**24
    assert summary["final_loss"] < 0.01


def test_char_lm_example_runs_every_mode():
    main = runpy.run_path(str(EXAMPLE.parent / "char_lm.py"))["main"]
    rows = main(["--steps", "8", "--no-plot"])
    assert [r["mode"] for r in rows] == ["f32", "bf16", "f16", "f16-jls"]
    for r in rows:  # every mode learns something in 8 steps (it starts at ln 256)
        assert r["train_loss"] < 5.5 and r["held_out_loss"] < 5.5, r["mode"]
    jls_row = rows[-1]
    # No growth in 8 steps (the interval is 2000): each skip halved the
    # scale once, from 2**15.
    assert jls_row["skipped"] is not None
    assert jls_row["final_scale"] == 2.0 ** (15 - jls_row["skipped"])
    assert rows[0]["skipped"] is None  # plain optax cannot skip


def test_the_gan_survives_a_nan_batch_only_with_keep_if_skipped():
    main = runpy.run_path(str(EXAMPLE.parent / "gan_equinox.py"))["main"]
    args = ["--steps", "60", "--nan-step", "20"]
    # Without the call: the nan batch's BatchNorm statistics stay, and every
    # later step of both models is skipped, with no error; the loss, given,
    # is not finite in a row: jls.metrics names the remedy.
    with pytest.warns(RuntimeWarning, match="for 32 or more.*keep_if_skipped"):
        lost = main([*args, "--no-keep"])
    assert lost["skipped_after_nan"] == lost["steps_after_nan"] == 40
    assert lost["skips_d"] == lost["skips_g"] == 41
    assert not lost["statistics_finite"]
    # With jls.keep_if_skipped: the nan step alone is skipped, training goes on.
    kept = main(args)
    assert kept["skipped_after_nan"] == 0
    assert kept["skips_d"] == kept["skips_g"] == 1
    assert kept["statistics_finite"]
    assert np.isfinite(kept["final_loss_d"]) and np.isfinite(kept["final_loss_g"])
