"""No float16 collective decides a skip (8 host devices, in a subprocess).

``scripts/f16_collectives.py fsdp``: float16 parameters sharded over "data"
and gathered in the forward pass under ``shard_map``. jax transposes the
gather to a float16 ``psum_scatter`` inside the backward pass; 4 replicas'
scaled gradients of 30000 sum to inf there, before jls averages anything,
though their mean is finite.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).parent / "scripts" / "f16_collectives.py"
ROOT = pathlib.Path(__file__).parents[2]
pytestmark = pytest.mark.slow


def run_script(part: str) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), part],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fsdp():
    return run_script("fsdp")


@pytest.mark.parametrize("k", [1, 2])
def test_a_gathered_float16_parameter_steps_with_its_finite_mean(fsdp, k):
    got = fsdp[f"fsdp_k{k}"]
    assert not got["skipped"] and got["next_scale"] == 1024.0
    # 1 - 2**-5 * 30000 / 1024, exact in float16: the mean, not the sum.
    assert got["params"] == [0.08447265625] * 8
