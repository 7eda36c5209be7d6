"""The README and the docs agree with the code.

Every ``jls.`` name a page shows in code font exists, and every ``python
examples/...`` or ``python benchmarks/...`` command a page shows runs (its
``--help``, which also shows the defaults).
"""

from __future__ import annotations

import importlib
import pathlib
import re
import subprocess
import sys

import pytest

import jls
import jls.flax  # noqa: F401  (jls.flax names are resolved too)

ROOT = pathlib.Path(__file__).parents[2]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "howto").glob("*.md")),
]


def _code_spans(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # blocks run elsewhere
    return re.findall(r"`([^`\n]+)`", text)


def _names(text: str) -> set[str]:
    """Dotted ``jls.`` names in code font, without call arguments."""
    names = set()
    for span in _code_spans(text):
        for name in re.findall(r"\bjls(?:\.[A-Za-z_]\w*)+", span):
            names.add(name)
    return names


def _optimizer():
    import optax
    from flax import nnx

    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    return jls.flax.Optimizer(model, jls.loss_scaling(optax.sgd(0.1)), wrt=nnx.Param)


# Attributes set on instances (nnx Variables made in __init__), checked on one.
INSTANCES = {"jls.flax.Optimizer": _optimizer}


def _resolves(name: str) -> bool:
    parts = name.split(".")
    obj = jls
    for i, part in enumerate(parts[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:  # a submodule not yet imported
            obj = importlib.import_module(".".join(parts[: i + 1]))
            continue
        except ImportError:
            pass
        last = i == len(parts) - 1
        make = INSTANCES.get(".".join(parts[:i]))
        if last and make is not None:
            return hasattr(make(), part)
        fields = {}
        for klass in getattr(obj, "__mro__", ()):
            fields |= getattr(klass, "__annotations__", {})
            fields |= dict.fromkeys(getattr(klass, "_fields", ()))
        return last and part in fields  # a field of a dataclass or NamedTuple
    return True


NAMES = sorted(
    {(p.relative_to(ROOT).as_posix(), n) for p in PAGES for n in _names(p.read_text())}
)


def test_the_pages_show_names():
    assert len(NAMES) > 50


@pytest.mark.parametrize("page, name", NAMES, ids=[f"{p}:{n}" for p, n in NAMES])
def test_every_jls_name_in_code_font_exists(page, name):
    assert _resolves(name), f"{page} shows `{name}`, which jls does not have"


def test_a_misspelt_name_is_caught():
    assert not _resolves("jls.apply_gradient")
    assert not _resolves("jls.flax.TrainState.stepp")
    assert _resolves("jls.flax.TrainState.step")
    assert _resolves("jls.flax.Optimizer.step")
    assert not _resolves("jls.flax.Optimizer.stepp")
    assert _resolves("jls.presets.torch")


COMMANDS = sorted(
    {
        script
        for p in PAGES
        for script in re.findall(
            r"python3? ((?:examples|benchmarks)/\w+\.py)", p.read_text()
        )
    }
)


def test_the_pages_show_commands():
    assert "examples/demo.py" in COMMANDS and "benchmarks/bench_step.py" in COMMANDS


@pytest.mark.parametrize("script", COMMANDS)
def test_every_command_a_page_shows_runs(script):
    out = subprocess.run(
        [sys.executable, script, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout
    # Every option that takes a value says its default.
    options = re.split(r"\n(?=  -)", out.stdout.split("options:", 1)[1])
    for option in options:
        takes_value = re.match(r"\s*(?:-\w, )?--[\w-]+ (?:[A-Z_]+|\{)", option)
        if takes_value:
            assert "(default:" in " ".join(option.split()), option


def _code(text: str) -> list[str]:
    """Every fenced block of a page (python, code-cell, diff), as written."""
    return re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)


DONATES = re.compile(r"^[+ ]?[^#\n]*\b(donate_argnums=|donate=)", re.M)
SAYS_DONATED = re.compile(r"^[+ ]?[^#\n]*\bdonated=True", re.M)


def _donation_mismatches() -> list[str]:
    """Code that tells jls it donates and does not.

    A unit is an example script, or one block of a page; in a diff, the new
    side (removed lines are left out).
    """
    units = [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in EXAMPLES]
    for page in PAGES:
        for i, block in enumerate(_code(page.read_text())):
            new_side = "\n".join(
                line for line in block.splitlines() if not line.startswith("-")
            )
            units.append((f"{page.relative_to(ROOT).as_posix()} block {i}", new_side))
    out = []
    for where, code in units:
        if "loss_scaling(" not in code:
            continue
        donates, says = bool(DONATES.search(code)), bool(SAYS_DONATED.search(code))
        if says and not donates:
            out.append(f"{where}: donates={donates}, donated=True={says}")
    return out


EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def test_no_step_tells_jls_it_donates_when_it_does_not():
    # jls 0.4's skip costs the same whether the step donates or not, so a
    # donating step need not say so (jls 0.3's pages all did, and still may);
    # donated=True still reaches ScaleStats(every=n) and jls.flax, so a page
    # must not declare a donation its step does not make (from_flax's diff
    # did).
    assert not _donation_mismatches()


def _stall_rows(text: str) -> list[list[str]]:
    """The per-tenth rows of a stall table, as ``[tenth, lr, value, ...]``."""
    rows = re.findall(r"^\| (\d+) \| (\d\.\de-\d\d) \| (.*) \|$", text, flags=re.M)
    return [[t, lr, *re.split(r" \| |, ", rest)] for t, lr, rest in rows]


def test_the_stall_table_is_the_stored_run():
    # docs/howto/low_precision_params.md's per-tenth table (loss and
    # stagnant fraction of each variant) is the one stagnation_stall.py
    # wrote to benchmarks/results/cpu/stagnation_stall.txt.
    stored = (ROOT / "benchmarks/results/cpu/stagnation_stall.txt").read_text()
    page = (ROOT / "docs/howto/low_precision_params.md").read_text()
    want = _stall_rows(stored)
    assert [r[0] for r in want] == [str(t) for t in range(1, 11)]
    assert _stall_rows(page) == want
    held_out_row = re.search(r"^\| held-out \|.*$", page, re.M)
    assert held_out_row is not None
    for line in stored.splitlines()[:4]:  # each variant's held-out loss
        name, held_out = line.split()[0], line.split()[2]
        assert f" {held_out} " in held_out_row[0], name
