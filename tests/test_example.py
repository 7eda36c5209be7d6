"""examples/train_fp16.py runs and really trains in float16."""

import pathlib
import runpy
import subprocess
import sys

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "train_fp16.py"


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
