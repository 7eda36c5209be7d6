"""Distributed and resumable: replicas agree, processes agree, checkpoints resume.

The multi-device cases run in subprocesses with 8 (or 2 per process) host
devices, since XLA_FLAGS must be set before jax starts.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization

import jls
from jls import LossScalingState

DIST = pathlib.Path(__file__).parent / "scripts"
ROOT = pathlib.Path(__file__).parents[2]


def _env(devices: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = str(ROOT / "tests") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(args, devices, timeout=240):
    out = subprocess.run(
        [sys.executable, *map(str, args)],
        env=_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def test_a_skip_whose_old_and_new_values_are_placed_differently_runs():
    # Parameters sharded over 8 devices meet optimizer state tx.init left
    # unplaced: under an Auto mesh (jit's default) the skip's select must not
    # reshard (stop 37's CI: a PartitionSpec outside a mesh context), under
    # an Explicit mesh it must, with and without jax.set_mesh.
    result = json.loads(_run([DIST / "mixed_shardings.py"], 8).strip().splitlines()[-1])
    assert len(result) == 12
    for case in result.values():
        assert case == {"unchanged": [False, True], "scale": 16384.0}


@pytest.fixture(scope="module")
def stagnation_mesh():
    return json.loads(_run([DIST / "stagnation_mesh.py"], 8).strip().splitlines()[-1])


def test_stagnation_reads_sharded_parameters_where_they_lie(stagnation_mesh):
    # Stagnation(every=16) reads one index in 16 along an axis of each leaf
    # of a multiple of 256 entries: sharded along it over 8 devices, whole
    # runs of 16 per shard, it gathers nothing (cut along any axis of a
    # multiple of 16, the (64, 4096), (3, 3, 64, 64) and (64, 64) leaves
    # made 9 all-gathers here). Its one addition: the counts' all-reduce.
    # Each leaf's counts are one variadic reduction only in a process with
    # one device: the partitioner gathered a sharded one's operands (12
    # all-gathers here, and as many under scale_stats=True, whose statistics
    # are the same kind).
    # With in_shardings over host arrays the types name no mesh (the one
    # variadic reduction gathered 4 partial counts there). The hooks add no
    # collective there either; the step without them gathers its small
    # sharded leaves there (3: the check concatenates the leaves its types do
    # not show sharded, a known gap, docs/parallelism.md).
    kinds = ("all-gather", "all-to-all", "collective-permute")
    assert all(stagnation_mesh["none"][kind] == 0 for kind in kinds)
    for jitted in ("", " in_shardings"):
        none = stagnation_mesh["none" + jitted]
        for name in ("every16", "every1", "scale_stats"):
            got = stagnation_mesh[name + jitted]
            for kind in kinds:
                assert got[kind] == none[kind], (name + jitted, got)
            # The statistics agree on a count and a largest magnitude: two.
            added = 2 if name == "scale_stats" else 1
            assert got["all-reduce"] <= none["all-reduce"] + added, (name, got)


def test_stagnation_counts_a_replicated_leaf_once_beside_a_sharded_one(
    stagnation_mesh,
):
    # 8 replicated entries, all stuck, beside 36 moving entries of a leaf
    # sharded 8 ways: 8 / 44 on every mesh (summing the leaves before
    # agreeing gave 0.5: the replicated leaf counted 8 times, or the shards'
    # total read as a replica's). Under check_vma=True the state comes back
    # replicated (out_specs=P()).
    want = pytest.approx(8 / 44, rel=1e-6)
    assert stagnation_mesh["shard_map_vmaTrue"] == want
    assert stagnation_mesh["shard_map_vmaFalse"] == want
    assert stagnation_mesh["pmap"] == [want] * 8


@pytest.fixture(scope="module")
def replicas():
    return json.loads(_run([DIST / "replicas.py"], 8).strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["pmap", "shard_map"])
@pytest.mark.parametrize("allreduce", [False, True])
def test_one_nan_replica_makes_every_replica_skip(replicas, mode, allreduce):
    r = replicas[f"{mode}_allreduce{allreduce}"]
    assert r["scales"] == [128.0] * 8  # one scale, backed off once
    assert r["skipped"] == [1] * 8
    assert r["params_unchanged"] and r["no_nan"]
    if allreduce:
        assert r["params_same_across"]


def test_update_path_under_shard_map(replicas):
    r = replicas["shard_map_update"]
    assert r == {"scales": [128.0] * 8, "params_unchanged": True}


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_sharded_jit_decides_globally(replicas, layout):
    r = replicas[f"jit_{layout}"]
    assert r == {
        "scale": 128.0,
        "skipped": 1,
        "params_unchanged": True,
        "w_sharding": [] if layout == "replicated" else [None, "dp"],
    }


def test_the_check_never_gathers_gradients(replicas):
    hlo = replicas["hlo"]
    assert hlo["check_all_gather"] == 0 and hlo["fused_all_gather"] == 0
    assert hlo["check_all_reduce"] >= 1  # scalars are reduced instead


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_agree(tmp_path):
    port = _free_port()
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(DIST / "multiprocess.py"), str(i), str(port), str(o)],
            env=_env(2),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i, o in enumerate(outs)
    ]
    try:
        logs = [p.communicate(timeout=50)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), logs
    seen = [json.loads(o.read_text()) for o in outs]
    assert seen[0] == seen[1]  # same scale, decisions and parameters
    steps = seen[0]
    assert [s["skipped"] for s in steps] == [False, False, True, False]
    assert [s["scale"] for s in steps] == [256.0, 256.0, 128.0, 128.0]
    assert steps[2]["params"] == steps[1]["params"]  # skipped everywhere
    assert steps[3]["params"] != steps[2]["params"]


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True])
def test_orbax_checkpoint_resumes_bitwise(tmp_path, sharded):
    devices = 8 if sharded else 1
    flag = ["--sharded"] if sharded else []
    for mode in ("full", "save", "resume"):
        _run([DIST / "checkpoint.py", mode, tmp_path, *flag], devices)
    full, resumed = np.load(tmp_path / "full.npz"), np.load(tmp_path / "resumed.npz")
    # params (2), Adam (5), the loss-scale state (8 fields), the default
    # hooks' states (the non-finite loss's and the divergence flag)
    assert full.files == resumed.files and len(full.files) == 17
    for k in full.files:
        assert full[k].dtype == resumed[k].dtype
        np.testing.assert_array_equal(full[k], resumed[k])


def test_flax_serialization_round_trip():
    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    tx = jls.loss_scaling(optax.adam(1e-3), jls.dynamic_scale(2.0**10))
    state = tx.init(params)
    grads = {"w": jnp.ones((2, 3)), "b": jnp.array([1.0, jnp.nan, 0.0])}
    _, state = jax.jit(tx.update)(grads, state, params)
    data = serialization.to_bytes(state)
    restored = serialization.from_bytes(tx.init(params), data)
    chex.assert_trees_all_equal(restored, state, strict=True)
    assert isinstance(restored, LossScalingState)
    assert float(jls.metrics(restored)["loss_scale"]) == 512.0


def test_data_parallel_example_runs(tmp_path):
    out = _run(
        [ROOT / "examples" / "data_parallel.py", "--steps", "12", "--out", tmp_path],
        8,
    )
    assert "8 devices" in out
    assert "step   3  loss scale     2048  skipped True   total skips 1" in out
    assert "saved and restored" in out and "bitwise equal" in out


@pytest.fixture(scope="module")
def agreement():
    return json.loads(_run([DIST / "agreement.py"], 4).strip().splitlines()[-1])


@pytest.mark.parametrize("mirrored", ["", "m"])
@pytest.mark.parametrize(
    "case", ["vmaTrue_namedNone", "vmaTrue_namedx", "vmaFalse_namedx"]
)
def test_the_norm_of_a_sharded_gradient_is_the_global_norm(agreement, case, mirrored):
    # Sums of squares over a sharded axis are added, named (with the sharded
    # leaves) or not, with or without jax recording the varying axes; shards
    # that are equal ("m", mirrored) too.
    got = agreement["norm"]["got"][case + mirrored]
    true = agreement["norm"]["true_mirrored" if mirrored else "true"]
    np.testing.assert_allclose(got, [true] * 4, rtol=1e-6)


def test_without_vma_an_unnamed_axis_is_invisible(agreement):
    # Documented: under check_vma=False jax records nothing, so every axis
    # the gradients are sharded over must be named; unnamed, each shard
    # reports its own norm.
    got = agreement["norm"]["got"]["vmaFalse_namedNone"]
    assert len(set(got)) == 4 and max(got) < agreement["norm"]["true"]


@pytest.mark.parametrize("mode", ["pmap", "vmap"])
def test_averaged_replicas_report_their_own_norm(agreement, mode):
    np.testing.assert_allclose(
        agreement["dp"][mode], [agreement["dp"]["true"]] * 4, rtol=1e-6
    )


@pytest.mark.parametrize("norm", [False, True])
def test_shards_over_an_unnamed_axis_agree_on_skip_and_diagnostics(agreement, norm):
    r = agreement["unnamed"][f"norm{norm}"]
    assert r["skipped"] == [True] * 4
    assert r["scales"] == [8.0] * 4
    # Only "w" had the nan (on one shard), and every shard says so.
    assert r["flags"] == [[False, False, True]] * 4
    assert r["unchanged"]


def test_a_loss_watching_rule_feeds_every_replica_the_mean_loss(agreement):
    r = agreement["loss_rule"]
    assert r["stats_equal"]
    # The mean over replicas of 1 + 0.1 i + 0.05 r, averaged over 6 steps.
    want = np.mean([1.0 + 0.1 * i + 0.05 * np.mean(range(4)) for i in range(6)])
    assert r["loss_mean"] == pytest.approx(want, rel=1e-6)
    assert r["shard_map_mean"] == 2.5


@pytest.mark.parametrize("case", ["vmaTrue", "vmaFalse", "pmap"])
def test_scale_stats_agree_across_shards_and_replicas(agreement, case):
    got = np.asarray(agreement["scale_stats"][case])
    assert np.all(got == got[0]), got
    if case == "pmap":  # 2**0..2**3 on four replicas: none small, largest 8
        want = [0.0, np.log2(np.float32(65504.0)) - 3]
    else:  # 9 of 19 entries below float16's smallest normal; largest 8
        want = [9 / 19, np.log2(np.float32(65504.0)) - 3]
    np.testing.assert_allclose(got[0], want, rtol=1e-6)
