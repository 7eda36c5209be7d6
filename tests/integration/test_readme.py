"""Every Python block of the README runs as written, and does what it says.

Each block runs in a fresh namespace, in a temporary working directory, with
only the user's own objects supplied: ``params``, ``batch`` and
``compute_loss(params, batch)``, the ones the Quickstart defines. A block
that promises something in its comments (the printed numbers, the metric
keys, a bitwise restore, float16 compute) has that promise checked below.
"""

import contextlib
import io
import json
import os
import pathlib
import re
import subprocess
import sys
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
    jls.precision.precision_report(ns["compute_loss"], params, ns["batch"]).check(
        jnp.float16
    )


def test_the_readme_is_a_landing_page():
    # Issue 23: what jls is, install, a quickstart, the tables in short;
    # the rest lives in docs/.
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    quickstart = [line for line in BLOCKS[0].splitlines() if line.strip()]
    assert len(quickstart) <= 25, len(quickstart)


# -- The first two commands, on a fresh machine ----------------------------------

COMMANDS = [
    line.split("  #")[0].strip()
    for block in re.findall(
        r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S
    )
    for line in block.splitlines()
    if line.strip() and not line.strip().startswith("#")
]


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed_by(command: str) -> set[str]:
    """The distributions ``pip install -e ".[extras]"`` brings: jls's closure."""
    import importlib.metadata as md
    import tomllib

    from packaging.requirements import Requirement

    match = re.search(r'pip install -e "\.(?:\[([\w,-]+)\])?"', command)
    assert match, f"no `pip install -e` of the checkout in {command!r}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [(r, "") for r in project["dependencies"]]
    for extra in (match.group(1) or "").split(","):
        if extra:
            todo += [(r, "") for r in project["optional-dependencies"][extra]]
    names: set[str] = set()
    done: set[tuple[str, str]] = set()
    while todo:
        text, extra = todo.pop()
        requirement = Requirement(text)
        if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = _canonical(requirement.name)
        names.add(name)
        for wanted in ("", *requirement.extras):
            if (name, wanted) in done:
                continue
            done.add((name, wanted))
            try:
                todo += [(r, wanted) for r in md.requires(name) or []]
            except md.PackageNotFoundError:
                break
    return names


def _site_of(distributions: set[str], into: pathlib.Path) -> None:
    """A site folder with only ``distributions`` (and jls), as links."""
    import importlib.metadata as md

    for dist in md.distributions():
        if _canonical(dist.metadata["Name"]) not in distributions:
            continue
        tops = {pathlib.PurePath(str(f)).parts[0] for f in dist.files or ()}
        for top in tops - {"..", "__pycache__"}:
            source = pathlib.Path(str(dist.locate_file(top)))
            if source.exists() and not (into / top).exists():
                (into / top).symlink_to(source)
    (into / "jls").symlink_to(pathlib.Path(jls.__file__).parent)


def test_the_first_two_commands_install_and_run_the_demo_on_a_fresh_machine(
    tmp_path,
):
    # The README's first two commands, as a new user runs them: the install
    # must bring what the demo imports (it once installed [flax], and the
    # demo then exited asking for the demo extra). The demo runs here with
    # only what that command installs importable (python -S: no other
    # site-packages), for a few steps (the full run is test_examples.py's).
    install, demo = COMMANDS[:2]
    assert "pip install" in install
    assert demo == "python examples/demo.py"
    site = tmp_path / "site"
    site.mkdir()
    _site_of(_installed_by(install), site)
    out = subprocess.run(
        [
            sys.executable,
            "-S",
            *demo.split()[1:],
            *("--steps", "3", "--no-progress", "--out", str(tmp_path / "out")),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "f16-jls" in out.stdout and (tmp_path / "out" / "demo.png").exists()


def test_the_step_table_prints_the_stored_benchmark():
    # The README's performance table is benchmarks/results/cpu/bench_step.json
    # (bench_step.py --model all --rounds 15 --json), rounded: not donated /
    # donated, jls's steps donated without declaring it.
    runs = json.loads((ROOT / "benchmarks/results/cpu/bench_step.json").read_text())
    rows = {
        "jls fused": "jls_fused",
        "jls `tx.update`": "jls_update",
        "jls off": "jls_off",
        "`optax.apply_if_finite`": "apply_if_finite",
        "jmp": "jmp",
        "flax `DynamicScale`": "flax_dynamic_scale",
    }
    readme = (ROOT / "README.md").read_text()
    table = readme.split("| step | 27M LM |", 1)[1].split("\n\n", 1)[0]
    lines = [line for line in table.splitlines() if line.startswith("| ")][1:]
    assert len(lines) == len(rows)
    for line, (label, key) in zip(lines, rows.items(), strict=True):
        assert line.startswith(f"| {label}"), line
        cells = [c.strip().rstrip("\\*") for c in line.strip("|").split("|")[1:]]
        want = []
        for run in runs:  # lm, mlp, char
            v = run["variants"]
            donated = v.get(f"{key} (donated, undeclared)", v[f"{key} (donated)"])
            r = (v[key]["ratio_of_medians"], donated["ratio_of_medians"])
            want.append(f"{r[0]:.2f} / {r[1]:.2f}")
        assert cells == want, (label, cells, want)
