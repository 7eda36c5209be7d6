"""Every Python block of the README runs as written, and does what it says.

Each block runs in a fresh namespace, in a temporary working directory, with
only the user's own objects supplied: ``params``, ``batch`` and
``compute_loss(params, batch)``, the ones the Quickstart defines. A block
that promises something in its comments (the printed numbers, the metric
keys, a bitwise restore, float16 compute) has that promise checked below.
"""

import contextlib
import io
import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jls

ROOT = pathlib.Path(__file__).parents[2]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _users_objects() -> dict:
    params = {"w": jax.random.normal(jax.random.key(0), (16, 1)), "b": jnp.zeros(1)}
    x = jax.random.normal(jax.random.key(1), (8, 16))

    def compute_loss(params, batch):
        x, y = batch
        return jnp.mean(((x @ params["w"])[:, 0] + params["b"] - y) ** 2)

    return {
        "params": params,
        "batch": (x, jnp.sin(x[:, 0])),
        "compute_loss": compute_loss,
    }


def _run(index: int, **extra: Any) -> tuple[dict, str]:
    namespace = {"__name__": f"readme_block_{index}", **_users_objects(), **extra}
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), namespace)
    return namespace, stdout.getvalue()


def _block(marker: str) -> int:
    (index,) = [i for i, b in enumerate(BLOCKS) if marker in b]
    return index


def test_the_readme_has_its_blocks():
    assert len(BLOCKS) >= 10


# Blocks that read what an earlier block wrote run after it, in the same folder.
NEEDS = {"jls.upgrade_state(raw": "ckptr.save(path"}


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block_runs_as_written(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for marker, needed in NEEDS.items():
        if marker in BLOCKS[index]:
            _run(_block(needed))
    _run(index)


def test_the_checkpoint_block_runs_twice_and_restores_bitwise(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    index = _block("ckptr.save(path")
    for _ in range(2):
        ns, _ = _run(index)
        saved = {"params": ns["params"], "opt_state": ns["opt_state"]}
        restored = ns["restored"]
        assert jax.tree.structure(restored) == jax.tree.structure(saved)
        for a, b in zip(
            jax.tree.leaves(restored), jax.tree.leaves(saved), strict=False
        ):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
    ns, _ = _run(_block("jls.upgrade_state(raw"))
    for a, b in zip(
        jax.tree.leaves(ns["restored"]), jax.tree.leaves(saved), strict=False
    ):
        np.testing.assert_array_equal(a, b)


def test_the_quickstart_prints_what_it_says():
    ns, out = _run(0)
    # The block's comment: "0.057 8192.0 2".
    comment = re.search(r"# ([\d.]+) ([\d.]+) (\d+):", BLOCKS[0])
    assert comment is not None
    loss, scale, skips = out.split()
    assert f"{float(loss):.3f}" == comment.group(1)
    assert scale == comment.group(2) and skips == comment.group(3)
    policy, params = ns["policy"], ns["params"]
    assert policy.compute_dtype == jnp.float16
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    jls.precision_report(ns["compute_loss"], params, ns["batch"]).check(jnp.float16)


def test_the_equinox_recipe_computes_in_float16():
    ns, _ = _run(_block("import equinox"))
    # The README's own step, traced: every matmul of the forward and
    # backward pass in float16.
    report = jls.precision_report(
        ns["step"], ns["model"], ns["opt_state"], ns["x"], ns["y"]
    )
    report.check(jnp.float16)


def test_the_spike_block_has_the_metrics_it_names():
    ns, _ = _run(_block("skip_spikes=jls.SpikeRule"))
    m = ns["m"]
    for key in re.findall(r'm\["(\w+)"\]', BLOCKS[_block("skip_spikes=jls.SpikeRule")]):
        assert key in m, key


def test_the_one_call_block_has_the_fields_it_names():
    index = _block("jls.train_step(loss_fn, tx, has_aux=True")
    ns, _ = _run(index)
    out = ns["out"]
    for field in re.findall(r"out\.(\w+)", BLOCKS[index]):
        assert hasattr(out, field), field
    assert not bool(out.skipped) and out.loss.dtype == jnp.float32
