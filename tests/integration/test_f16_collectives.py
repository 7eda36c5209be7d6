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


def test_a_float32_parameter_gathered_as_float16_steps_with_its_finite_mean(fsdp):
    # jls.precision's policy casts the float32 parameter to float16 before the
    # model's all_gather: jax's psum_scatter of its gradient is float16.
    got = fsdp["fsdp_f32_cast"]
    assert not got["skipped"]
    assert got["params"] == [0.08447265625] * 8


@pytest.fixture(scope="module")
def jit():
    return run_script("jit")


def test_the_partitioners_float16_gradient_sum_is_listed_and_warned_about(jit):
    # Under jit over a batch sharded on "data" XLA sums the float16 weight
    # gradient in float16: the report of the compiled step lists it, and
    # train_step said so at trace time, naming the fixes.
    got = jit["f16"]
    assert ["all-reduce", "float16", "jit(step)/transpose(jvp())/dot_general"] in (
        [op[:3] for op in got["collectives"]]
    )
    assert len(got["warnings"]) == 1
    for fix in ("float32 parameters", "shard_map with average_over", "compile()"):
        assert fix in got["warnings"][0]


def test_float32_parameters_send_float32_and_are_not_warned_about(jit):
    assert jit["f32"]["warnings"] == []
    assert {op[1] for op in jit["f32"]["collectives"]} == {"float32"}
    assert jit["f16_one_device"] == {"warnings": [], "collectives": []}


def test_on_a_mesh_of_auto_axes_the_trace_cannot_tell(jit):
    # The gap docs/parallelism.md states: the traced values carry no sharding
    # there, so only the compiled report shows the float16 all-reduce.
    got = jit["f16_auto"]
    assert got["warnings"] == []
    assert ["all-reduce", "float16", "jit(step)/transpose(jvp())/dot_general"] in (
        [op[:3] for op in got["collectives"]]
    )
