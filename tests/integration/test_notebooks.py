"""Every notebook in notebooks/ is committed without outputs and the site runs it.

The notebooks run in the site's build (.ci/docs, in CI), which fails on any
error, so their ``assert`` cells hold; running them here too doubled their
minutes in CI. These tests check that the build runs every one of them.
"""

from __future__ import annotations

import ast
import pathlib
import tomllib
from fnmatch import fnmatch

import nbformat
import pytest

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
    # Each cell's limit covers the slowest notebook's cells, and the docs
    # extra has what the notebooks import.
    assert config["nb_execution_timeout"] >= 300
    docs = tomllib.loads((NOTEBOOKS[0].parents[1] / "pyproject.toml").read_text())
    extra = " ".join(docs["project"]["optional-dependencies"]["docs"])
    assert "matplotlib" in extra and "scikit-learn" in extra
