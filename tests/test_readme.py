"""Every Python block of the README runs as written.

Each block runs in a fresh namespace, in a temporary working directory, with
only the user's own objects supplied: ``params``, ``batch`` and
``compute_loss(params, batch)``, the ones the Quickstart defines.
"""

import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import pytest

ROOT = pathlib.Path(__file__).parents[1]
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


def test_the_readme_has_its_blocks():
    assert len(BLOCKS) >= 10


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block_runs_as_written(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"readme_block_{index}", **_users_objects()}
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), namespace)


def test_the_quickstart_trains_in_float16():
    namespace: dict[str, Any] = {"__name__": "quickstart"}
    exec(compile(BLOCKS[0], "README.md block 0", "exec"), namespace)
    policy, params = namespace["policy"], namespace["params"]
    assert policy.compute_dtype == jnp.float16
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    loss = namespace["compute_loss"](params, namespace["batch"])
    assert loss.dtype == jnp.float32 and float(loss) < 0.1
    metrics = namespace["m"]  # float16 overflowed at the first scales: skipped
    assert 1 <= int(metrics["total_skips"]) <= 10
