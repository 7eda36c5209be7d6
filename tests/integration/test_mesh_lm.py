"""examples/mesh_lm.py: a float16 transformer LM on a data x model mesh.

The example trains the same model on one device, under ``jit`` with
``NamedSharding`` (tensor parallel), under ``shard_map`` (FSDP, averaged by
``average_over``) and across 2 processes of 4 devices, with an inf planted
in one shard's batch at step 3. Every layout must match the single device
step for step: the same scales and skips, nothing changed by the planted
step, and (in float32, with SGD, whose update is linear in the gradient)
parameters within 1e-6. In float16 the layouts round their partial sums in
float16 at different places (a weight gradient summed over a shard of the
batch is rounded before the replicas are added), so they agree to float16
rounding, not to 1e-6.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "mesh_lm.py"
STEPS = 6
# Subprocess runs of the example on 8 devices: the newest jax only (the
# floors job skips slow tests).
pytestmark = pytest.mark.slow


def _run(tmp, *args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), f"--out={tmp}", f"--steps={STEPS}", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return tmp


def _load(folder, name):
    report = json.loads((folder / f"{name}.json").read_text())
    params = dict(np.load(folder / f"{name}.npz"))
    return report, params


def _worst_leaf(params, ref):
    return max(
        float(np.linalg.norm(params[k] - ref[k]) / np.linalg.norm(ref[k])) for k in ref
    )


@pytest.fixture(scope="module")
def float32(tmp_path_factory):
    folder = tmp_path_factory.mktemp("f32")
    return _run(folder, "--dtype=float32", "--optimizer=sgd")


@pytest.fixture(scope="module")
def float16(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("f16"), "--optimizer=sgd")


def _same_steps(report, ref, loss_rel):
    got, want = report["steps"], ref["steps"]
    assert [s["scale"] for s in got] == [s["scale"] for s in want]
    assert [s["skipped"] for s in got] == [s["skipped"] for s in want]
    assert [s["skipped"] for s in want] == [False, False, False, True, False, False]
    for a, b in zip(got, want, strict=True):
        if np.isfinite(b["loss"]):
            assert abs(a["loss"] - b["loss"]) <= loss_rel * abs(b["loss"])
        else:
            assert not np.isfinite(a["loss"])
    assert report["inf_step_unchanged"] is True


@pytest.mark.parametrize("layout", ["jit", "shard_map"])
def test_float32_layouts_match_one_device_within_1e_6(float32, layout):
    ref_report, ref = _load(float32, "single")
    report, params = _load(float32, layout)
    _same_steps(report, ref_report, loss_rel=1e-6)
    assert _worst_leaf(params, ref) <= 1e-6


@pytest.mark.parametrize("layout", ["jit", "shard_map"])
def test_float16_layouts_match_one_device_to_float16_rounding(float16, layout):
    ref_report, ref = _load(float16, "single")
    report, params = _load(float16, layout)
    _same_steps(report, ref_report, loss_rel=1e-3)
    assert _worst_leaf(params, ref) <= 2e-2  # the measured worst: 8e-3


def test_two_processes_match_one_device(float32, tmp_path):
    ref_report, ref = _load(float32, "single")
    _run(tmp_path, "--dtype=float32", "--optimizer=sgd", "--processes=2")
    for pid in range(2):
        report, params = _load(tmp_path, f"jit_p{pid}")
        _same_steps(report, ref_report, loss_rel=1e-6)
        assert _worst_leaf(params, ref) <= 1e-6


def test_help_lists_the_layouts():
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "shard_map" in out.stdout
