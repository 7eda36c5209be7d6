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


EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Pages that may name `donated=` without telling anyone to pass it: the
# changelog (history) and the performance page (the forms it measured).
HISTORY = {"docs/changelog.md", "docs/performance.md"}


def _notebook_text(path: pathlib.Path) -> str:
    import nbformat

    return "\n".join(cell.source for cell in nbformat.read(path, as_version=4).cells)


def _donated_passed() -> list[str]:
    """Every page, notebook and example that passes or advises ``donated=``."""
    units = [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in PAGES]
    units += [(p.relative_to(ROOT).as_posix(), _notebook_text(p)) for p in NOTEBOOKS]
    units += [(p.relative_to(ROOT).as_posix(), p.read_text()) for p in EXAMPLES]
    advice = re.compile(
        r"donated=(True|False|not\b|donated)|pass `donated|`donated` at"
    )
    return [
        f"{where}: {found.group(0)}"
        for where, text in units
        if where not in HISTORY
        for found in advice.finditer(text)
    ]


def test_no_page_tells_users_to_pass_donated():
    # The skip has one form, whatever the caller donates: `donated=` is
    # deprecated and ignored. which_api.md still told users to pass it,
    # getting_started.md said there was nothing to declare and declared it.
    assert _donated_passed() == []


def test_the_advice_catches_a_declaration():
    assert re.search(r"donated=(True|False|not\b|donated)", "x(donated=True)")
    assert not re.search(r"donated=(True|False|not\b|donated)", "not donated / donated")


# The pages that advise on donation say it in one sentence, in substance:
# donating lets XLA update in place; jls's step is the same either way.
DONATION_ADVICE = [
    "README.md",
    "docs/getting_started.md",
    "docs/which_api.md",
    "docs/from_flax.md",
]


@pytest.mark.parametrize("page", DONATION_ADVICE)
def test_the_pages_say_the_same_thing_about_donation(page):
    text = " ".join((ROOT / page).read_text().split())
    assert (
        "in place; jls's step is the same either way, with nothing to declare" in text
    )
    assert "donate_argnums=" in text


# -- The demo: its runtime, its modes, its figure ---------------------------------

MINUTES = re.compile(r"about (\d+)(?:-(\d+))? minutes")


def _demo_table_seconds() -> float:
    """The "time s" column of the demo's output quoted on getting_started.md."""
    sys.path.insert(0, str(ROOT / "examples"))
    import demo  # pyright: ignore[reportMissingImports]

    page = (ROOT / "docs/getting_started.md").read_text()
    header = demo.format_table([]).splitlines()[0]
    table = page[page.index(header) :].split("```")[0].splitlines()
    assert table[0].split()[-2:] == ["time", "s"]
    rows = table[2 : 2 + len(demo.MODES)]
    assert [row.split()[0] for row in rows] == list(demo.MODES)
    return sum(float(row.split()[-1]) for row in rows)


def _demo_durations() -> list[tuple[str, int, int]]:
    """Each "about N minutes" (or "N-M") said of the demo, with its page."""
    found = []
    for name in (
        "README.md",
        "docs/index.md",
        "docs/install.md",
        "docs/getting_started.md",
        "examples/demo.py",
    ):
        text = " ".join((ROOT / name).read_text().split())
        for start in [m.end() for m in re.finditer(r"demo", text)]:
            sentence = text[start : start + 260].split(". ")[0]
            for match in MINUTES.finditer(sentence):
                low, high = match.group(1), match.group(2) or match.group(1)
                found.append((name, int(low), int(high)))
    return found


def test_the_demos_runtime_is_its_own_tables():
    # The README said "about 2-3 minutes" where the demo's own table summed
    # to about 6: the stated time covers the table's training time plus at
    # most 90 s of start-up and compilation, on every page that states one.
    trained = _demo_table_seconds() / 60
    durations = _demo_durations()
    pages = {name for name, _, _ in durations}
    assert {"README.md", "docs/getting_started.md", "examples/demo.py"} <= pages
    for name, low, high in durations:
        assert low <= high and trained <= high <= trained + 1.5, (name, high, trained)


def test_the_readme_caption_counts_the_demos_modes():
    # The figure and caption showed four modes after the demo plotted five.
    sys.path.insert(0, str(ROOT / "examples"))
    import demo  # pyright: ignore[reportMissingImports]

    words = {4: "four", 5: "five", 6: "six"}
    readme = " ".join((ROOT / "README.md").read_text().split())
    caption = readme[readme.index("![") : readme.index("**Documentation:**")]
    assert f"in {words[len(demo.MODES)]} modes" in caption
    install = " ".join((ROOT / "docs/install.md").read_text().split())
    assert f"in {words[len(demo.MODES)]} modes" in install


# -- Pointers: the notebooks' test, pyproject's page, CI's files -----------------


def test_the_notebooks_readme_names_what_runs_them():
    # It named tests/test_notebooks.py, which does not exist and, under its
    # real name, does not run the notebooks (the docs build does).
    text = " ".join((ROOT / "notebooks/README.md").read_text().split())
    named = re.findall(r"`((?:tests|\.ci)/[\w/.]+)`", text)
    assert named, text
    for path in named:
        assert (ROOT / path).exists(), path
    assert "`.ci/docs`" in text and "sphinx" in (ROOT / ".ci/docs").read_text()
    checker = ROOT / "tests/integration/test_notebooks.py"
    assert "`tests/integration/test_notebooks.py`" in text
    assert "nb_execution_mode" in checker.read_text()  # it checks the build runs them


def test_pyprojects_pointers_exist():
    # pyproject.toml's mutmut comment pointed to a docs/testing.md that did
    # not exist.
    text = (ROOT / "pyproject.toml").read_text()
    pointers = re.findall(r"\b(docs/[\w/]+\.md)", text)
    assert "docs/testing.md" in pointers
    for path in pointers:
        assert (ROOT / path).exists(), path
    index = (ROOT / "docs/index.md").read_text()
    assert re.search(r"^testing$", index, re.M)  # in the site's table of contents


def _floors_files() -> list[str]:
    run = (ROOT / ".ci/run").read_text()
    job = run[run.index('HYPOTHESIS_PROFILE=floors "$floors/bin/pytest"') :]
    command = job.split("\n\n")[0].replace("\\\n", " ")
    return [w for w in command.split() if w.startswith("tests/")]


def test_the_floors_job_runs_named_version_sensitive_tests():
    # The floors job ran every unit test again (tests/test_*.py); it runs the
    # tests of what a version floor can break, each file named and present.
    files = _floors_files()
    assert files and not any("*" in f for f in files), files
    for path in files:
        assert (ROOT / path).is_file(), path
    for needed in (
        "tests/test_compat.py",
        "tests/integration/test_flax.py",
        "tests/test_checkpoint.py",
        "tests/integration/test_live_peers.py",
        "tests/integration/test_equinox.py",
    ):
        assert needed in files, needed
    units = len(list((ROOT / "tests").glob("test_*.py")))
    assert sum(f.count("/") == 1 for f in files) < units / 3


# -- The step costs, one table everywhere ----------------------------------------


def _step_table(text: str) -> list[list[str]]:
    table = text.split("| step | 27M LM |", 1)[1].split("\n\n", 1)[0]
    lines = [line for line in table.splitlines() if line.startswith("| ")][1:]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]


def test_which_api_shows_the_readmes_step_costs():
    # which_api.md's tables were jls 0.3's while the README's were 0.4's.
    readme = _step_table((ROOT / "README.md").read_text())
    page_text = (ROOT / "docs/which_api.md").read_text()
    assert _step_table(page_text) == readme  # the README's: bench_step.json
    lm = {row[0]: row[1] for row in readme}
    fused = lm["jls fused (`jls.apply_gradients`)"]
    update = lm["jls `tx.update`"]
    api = page_text.split("| you write | use |", 1)[1].split("\n\n", 1)[0]
    cells = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in api.splitlines()[2:]
    ]
    by_use = {
        row[1]: row[-1]
        for row in cells
        if row[1].startswith(("`tx.update`", "`jls.apply_gradients(tx"))
    }
    assert sorted(by_use.values()) == sorted([fused, update]), by_use


# -- flax: a loss that takes an nnx.Rngs ----------------------------------------


def test_the_flax_page_passes_the_rngs_and_closing_over_it_fails():
    # flax.md's closure pattern failed on flax's own examples, which pass an
    # nnx.Rngs to the loss: the page passes it as an argument, and closing
    # over it raises what the page says.
    from flax import errors

    page = (ROOT / "docs/howto/flax.md").read_text()
    cells = re.findall(r"```\{code-cell\} ipython3\n(.*?)```", page, re.S)
    (source,) = [c for c in cells if "nnx.Rngs(dropout=" in c]
    assert "def scaled(m, rngs):" in source and "(net, rngs)" in source
    namespace: dict = {"__name__": "flax_rngs_cell"}
    exec(compile(source, "howto/flax.md", "exec"), namespace)
    assert int(namespace["net_optimizer"].step[...]) == 3
    closure = source.replace("def scaled(m, rngs):", "def scaled(m):").replace(
        "(net, rngs)  #", "(net)  #"
    )
    assert closure != source
    with pytest.raises(errors.TraceContextError, match="RngCount"):
        exec(compile(closure, "closure", "exec"), {"__name__": "closure"})
    assert "Cannot mutate RngCount from a different trace level" in " ".join(
        page.split()
    )


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


_SMALL_ROWS = {
    "plain, carrying 10 more scalars": "plain_scalars",
    "plain, also checking its gradients": "plain_checked",
    "jls off (`no_scale(skip_nonfinite=False)`)": "jls_off",
    "jls default, `tx.update`": "jls_update",
    "jls default, `jls.train_step`": "jls_train_step",
    "`optax.apply_if_finite`, static scale": "apply_if_finite",
}


def test_the_small_step_table_is_the_stored_run():
    # docs/performance.md's "Small steps" ratios (not donated / donated, per
    # width) and op counts are the CPU-time ratios and ops of
    # benchmarks/results/cpu/bench_small_step.txt.
    stored = (ROOT / "benchmarks/results/cpu/bench_small_step.txt").read_text()
    widths = stored.split("## width ")[1:]
    assert [w.split(":")[0] for w in widths] == ["32", "4096"]
    ratios, ops = {}, {}
    for width, block in zip(("32", "4096"), widths, strict=True):
        for m in re.finditer(
            r"^(\w+)( \(donated\))? +[\d.]+ +([\d.]+) .*$", block, re.M
        ):
            key = (width, m[1], bool(m[2]))
            ratios[key] = f"{float(m[3]):.2f}"
            ops[key] = m[0].split()[-5]
    page = (ROOT / "docs/performance.md").read_text()
    page = page.split("## Small steps")[1].split("\n## ")[0]
    for label, name in _SMALL_ROWS.items():
        row = re.search(rf"^\| {re.escape(label)} \| (.*) \|$", page, re.M)
        assert row is not None, label
        w32, w4096, op_counts, _ = row[1].split(" | ")
        for width, cell in (("32", w32), ("4096", w4096)):
            want = f"{ratios[width, name, False]} / {ratios[width, name, True]}"
            assert cell == want, (label, width)
        assert op_counts == f"{ops['32', name, False]} / {ops['32', name, True]}"
