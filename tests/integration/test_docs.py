"""The docs stay true: links resolve, code parses, every public name is shown."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re
import sys

import pytest

import jls
import jls.flax as jls_flax
from jls import presets

ROOT = pathlib.Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "examples"))
import demo  # noqa: E402  # pyright: ignore[reportMissingImports]  (examples/demo.py)

DOCS = [
    ROOT / "README.md",
    ROOT / "notebooks" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "howto").glob("*.md")),
]


def _all_docs_text() -> str:
    """The README and every docs page: where a claim may live."""
    return "\n".join(doc.read_text() for doc in DOCS)


def _public(module, names=None):
    """Functions and classes exported by ``names``, else defined in ``module``."""
    for name in names if names is not None else dir(module):
        obj = getattr(module, name)
        if name.startswith("_") or not (
            inspect.isfunction(obj) or inspect.isclass(obj)
        ):
            continue
        if names is not None or obj.__module__ == module.__name__:
            yield f"{module.__name__}.{name}", obj


PUBLIC = [
    *_public(jls, jls.__all__),
    *_public(presets, presets.__all__),
    *_public(jls_flax, ["Optimizer", "TrainState"]),
]


@pytest.mark.parametrize("name, obj", PUBLIC, ids=[n for n, _ in PUBLIC])
def test_every_public_name_has_a_doctested_example(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert "Example" in doc and ">>> " in doc, f"{name} has no doctest example"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    text = doc.read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    if doc.name == "README.md":
        assert local  # the landing pages point into the docs
    for link in local:
        target = doc.parent / link
        if link.endswith(".ipynb") and doc.parent.name in ("docs", "howto"):
            # The docs build copies notebooks/ into docs/notebooks/.
            target = ROOT / "notebooks" / pathlib.Path(link).name
        assert target.exists(), f"{doc.name} links to missing {link}"


def test_readme_anchors_exist():
    text = (ROOT / "README.md").read_text()
    headings = {
        re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.*)$", text, flags=re.M)
    }
    for anchor in re.findall(r"\]\(#([^)]+)\)", text):
        assert anchor in headings, anchor


def test_readme_python_blocks_parse():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 1
    for block in blocks:
        ast.parse(block)


def test_the_docs_name_every_public_symbol():
    text = _all_docs_text()
    missing = [name for name in jls.__all__ if name not in text]
    assert not missing


def test_readme_test_command_and_the_demo_table():
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install") : readme.index("## Quickstart")]
    commands = re.findall(r"```bash\n(.*?)```", install, flags=re.S)
    assert commands[-1].strip().endswith("pytest")  # what CI runs
    text = _all_docs_text()
    setup = text[text.index("python examples/demo.py") :]
    # The quoted demo output has the table's exact header and one row per mode.
    header = demo.format_table([]).splitlines()[0]
    table = setup[setup.index(header) :].split("```")[0].splitlines()
    rows = table[2 : 2 + len(demo.MODES)]
    assert [line.split()[0] for line in rows] == list(demo.MODES)
