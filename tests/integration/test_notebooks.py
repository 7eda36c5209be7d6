"""Every notebook in notebooks/ is committed without outputs and runs cleanly."""

from __future__ import annotations

import ast
import pathlib
import tomllib
from fnmatch import fnmatch

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))


def test_notebooks_are_found():
    assert NOTEBOOKS, "no notebooks found in notebooks/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, path.name


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # The notebooks that use the demo's model find it as "../examples" from
    # their own folder; run here from a temporary one, they find it on the
    # kernel's PYTHONPATH.
    examples = pathlib.Path(__file__).parents[2] / "examples"
    monkeypatch.setenv("PYTHONPATH", str(examples))
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError, with the traceback, on failure
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == "error"
    ]
    assert not errors


def _docs_config() -> dict:
    """The literal settings of docs/conf.py (read, not run: it copies files)."""
    tree = ast.parse((NOTEBOOKS[0].parents[1] / "docs" / "conf.py").read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            try:
                found[target.id] = ast.literal_eval(value)
            except ValueError:
                pass
    return found


def test_the_site_runs_the_notebooks_and_shows_their_outputs():
    # The site used to copy the notebooks in and show them unexecuted: code
    # without outputs or plots (they are committed without outputs).
    config = _docs_config()
    assert config["nb_execution_mode"] in ("force", "cache", "auto")
    assert config["nb_execution_raise_on_error"] is True
    for path in NOTEBOOKS:
        page = f"notebooks/{path.stem}"
        excluded = [
            p for p in config["nb_execution_excludepatterns"] if fnmatch(page, p)
        ]
        assert not excluded, (page, excluded)
    # Each cell's limit covers the slowest notebook's cells (test_notebook_runs
    # allows 300 s), and the docs extra has what the notebooks import.
    assert config["nb_execution_timeout"] >= 300
    docs = tomllib.loads((NOTEBOOKS[0].parents[1] / "pyproject.toml").read_text())
    extra = " ".join(docs["project"]["optional-dependencies"]["docs"])
    assert "matplotlib" in extra and "scikit-learn" in extra
