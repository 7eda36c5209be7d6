"""Exact on every mesh: averaging, the norm and the replica check (8 host devices).

``scripts/mesh.py`` runs in a subprocess (XLA_FLAGS must be set before jax
starts) and reports what each layout computed; each test names its case.
The reference is the same steps on one device over the full batch, with SGD
(whose update is proportional to the gradient: Adam would hide a gradient N
times too large).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "mesh.py"
ROOT = pathlib.Path(__file__).parents[2]
EXACT = 1e-6  # relative, against the single-device full-batch step
# One 8-device run of every layout: run on the newest jax (the floors job
# skips slow tests; the mesh code's jax-version seams are unit-tested there).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mesh():
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    out = subprocess.run(
        [sys.executable, str(SCRIPT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


CASES = [f"retries{r}_k{k}" for r in (False, True) for k in (1, 2)]
LAYOUTS = ["pmap", "vmap", "shard_map_vmaTrue", "shard_map_vmaFalse"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_average_over_gives_the_single_device_step(mesh, case, layout):
    got = mesh["dp"][case][layout]
    assert got["rel"] <= EXACT
    assert got["scales"] == mesh["dp"][case]["ref_scales"]


@pytest.mark.parametrize("k", [1, 2])
def test_the_retried_cases_really_retried(mesh, k):
    # The first scale (2**40) overflows and one retry backs off to 1, which
    # then grows every 2 steps: the scales after 3 steps.
    assert mesh["dp"][f"retriesTrue_k{k}"]["ref_scales"] == [1.0, 2.0, 2.0]


@pytest.mark.parametrize("case", ["tp_k1", "tp_k2", "fsdp_k1", "fsdp_k2"])
def test_average_over_is_exact_on_a_data_by_model_mesh(mesh, case):
    got = mesh["two_d"][case]
    assert got["rel"] <= EXACT
    assert got["scales"] == got["ref_scales"]


def test_a_float16_mean_is_taken_without_overflowing_the_sum(mesh):
    # 4 replicas of 30000: the float16 sum (120000) overflows, the mean does
    # not; the step is applied (lr 1e-6 moves the weight by 0.03).
    got = mesh["f16_sum"]
    assert got["skipped"] == [False] * 4
    assert abs(got["moved"] - 0.03) < 1e-3


def test_a_pmean_of_gradients_jax_already_summed_is_warned_about(mesh):
    bad = mesh["own_pmean"]["reducedFalse"]
    assert bad["rel"] > 1.0  # 8 times the mean's gradient: far off
    assert len(bad["warnings"]) == 1
    message = bad["warnings"][0]
    assert "('data',)" in message and "lax.pmean(loss, 'data')" in message
    assert "average_over='data'" in message
    fixed = mesh["own_pmean"]["reducedTrue"]
    assert fixed["rel"] <= EXACT and fixed["warnings"] == []


NORM_CASES = [
    "tp_vmaTrue_dataxmodel_checkdata",
    "tp_vmaTrue_dataxmodel_checkTrue",
    "tp_vmaTrue_data_checkTrue",
    "tp_vmaFalse_dataxmodel_checkdata",
    "fsdp_vmaTrue_dataxmodel_checkdata",
    "fsdp_vmaFalse_dataxmodel_checkdata",  # declared: shards are not compared
    "fsdp_vmaTrue_dataxmodel_checkTrue",
    "fsdp_vmaTrue_data_checkTrue",
]


@pytest.mark.parametrize("case", NORM_CASES)
def test_the_norm_is_global_and_averaged_replicas_agree_on_a_2d_mesh(mesh, case):
    rows = mesh["measured"][case]
    assert isinstance(rows, list), rows
    assert len(rows) == 1  # every device reports the same
    norm, mismatches = rows[0]
    assert abs(norm - mesh["measured"]["true_norm"]) <= 1e-6 * norm
    assert mismatches == 0


@pytest.mark.parametrize("layout", ["tp", "fsdp"])
def test_check_replicas_true_on_two_axes_without_vma_names_the_fix(mesh, layout):
    got = mesh["measured"][f"{layout}_vmaFalse_dataxmodel_checkTrue"]
    assert got.startswith("ValueError") and "check_replicas='data'" in got


def test_the_norm_under_jit_over_sharded_arrays_is_global(mesh):
    assert mesh["measured"]["jit"] == pytest.approx(
        mesh["measured"]["true_norm"], rel=1e-6
    )


def test_replicas_that_did_not_average_are_reported_on_a_2d_mesh(mesh):
    assert mesh["measured"]["unaveraged_mismatches"] == [1]
