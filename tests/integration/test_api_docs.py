"""Every public name has an entry in the API reference, and only those do.

The reference (``docs/api.md``) lists names in ``autosummary`` directives;
Sphinx makes each one's page from its docstring. A name added to
``jls.__all__`` (or ``jls.presets.__all__``) without an entry there would be
missing from the documentation without any warning from the build, so this
test reads the page's source and compares.
"""

from __future__ import annotations

import pathlib
import re

import pytest

import jls
import jls.flax  # noqa: F401  (the two classes the reference lists)
from jls import presets

ROOT = pathlib.Path(__file__).parents[2]
# The reference's sources: docs/api.md, and any pages it is split into.
SOURCES = sorted((ROOT / "docs").glob("api*.md")) + sorted(
    (ROOT / "docs" / "api").glob("*.md")
)

PUBLIC = [
    *(f"jls.{name}" for name in jls.__all__),
    *(f"jls.hooks.{name}" for name in jls.hooks.__all__),
    *(f"jls.precision.{name}" for name in jls.precision.__all__),
    *(f"jls.presets.{name}" for name in presets.__all__),
    "jls.flax.Optimizer",
    "jls.flax.TrainState",
]


def _entries(text: str) -> set[str]:
    """The fully qualified names the autosummary directives of ``text`` list.

    Handles both spellings MyST allows (``.. autosummary::`` inside an
    ``{eval-rst}`` block, and a ```` ```{autosummary} ```` fence), options
    (``:toctree: ...``), ``~`` prefixes and a preceding ``currentmodule``.
    """
    names = set()
    module = None
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        current = re.fullmatch(
            r"(?:\.\. currentmodule::|```\{currentmodule\})\s*(\S+)", line
        )
        if current:
            module = None if current.group(1) == "None" else current.group(1)
        if line in (".. autosummary::", "```{autosummary}"):
            i += 1
            while i < len(lines):
                entry = lines[i].strip()
                if entry.startswith("```") or (
                    entry and not lines[i][0].isspace() and line.startswith("..")
                ):
                    break
                if entry and not entry.startswith(":"):
                    entry = entry.lstrip("~")
                    if module and not entry.startswith("jls."):
                        entry = f"{module}.{entry}"
                    names.add(entry)
                i += 1
            continue
        i += 1
    return names


ENTRIES = set().union(*(_entries(path.read_text()) for path in SOURCES))


def test_the_reference_has_entries():
    assert SOURCES, "no docs/api*.md"
    assert len(ENTRIES) >= len(PUBLIC) // 2


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_has_an_api_entry(name):
    assert name in ENTRIES, f"{name} is public but has no entry in docs/api.md"


def test_every_api_entry_is_a_public_name():
    assert not ENTRIES - set(PUBLIC), "docs/api.md lists names that are not public"


def test_entries_are_read_from_both_spellings():
    text = """
```{eval-rst}
.. currentmodule:: jls

.. autosummary::
   :toctree: _autosummary

   ~loss_scaling
   jls.presets.torch
```

```{autosummary}
:toctree: _autosummary

jls.flax.Optimizer
```
"""
    assert _entries(text) == {
        "jls.loss_scaling",
        "jls.presets.torch",
        "jls.flax.Optimizer",
    }
