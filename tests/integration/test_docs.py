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

DOCS = [ROOT / "README.md", ROOT / "notebooks" / "README.md"]


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
    assert local
    for link in local:
        assert (doc.parent / link).exists(), f"{doc.name} links to missing {link}"


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
    assert len(blocks) >= 8
    for block in blocks:
        ast.parse(block)


def test_readme_names_every_public_symbol():
    text = (ROOT / "README.md").read_text()
    missing = [name for name in jls.__all__ if name not in text]
    assert not missing


def test_readme_set_up_commands_and_demo_table():
    text = (ROOT / "README.md").read_text()
    setup = text[text.index("## Set up") : text.index("## Quickstart")]
    commands = re.findall(r"```bash\n(.*?)```", setup, flags=re.S)
    assert len(commands) == 2
    assert commands[0].strip().endswith("pytest")
    assert commands[1].strip().endswith("python examples/demo.py")
    # The quoted demo output has the table's exact header and one row per mode.
    header = demo.format_table([]).splitlines()[0]
    table = setup[setup.index(header) :].split("```")[0].splitlines()
    assert [line.split()[0] for line in table[2:6]] == list(demo.MODES)
