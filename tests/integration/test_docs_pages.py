"""The documentation pages' code runs, and does what the pages say.

The Sphinx build (``.ci/docs``) executes every ``{code-cell}`` of the MyST
pages under ``docs/``; these tests run the same cells under pytest (with the
suite's ``filterwarnings = error``), so a page is checked without building
the site, and they check what the cells and the text around them promise:
the numbers a cell prints, the metric keys and fields its comments name, a
bitwise checkpoint restore, float16 compute, the signatures and defaults
the API tables show, the version floors and extras the install page names,
and that every test file a page cites exists.

A page's cells run in order in one namespace (as one Jupyter kernel runs
them), in a temporary working directory (as the build's
``nb_execution_in_temp``), with nothing supplied from outside: each page
defines its own ``params``, ``batch`` and ``compute_loss``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import pathlib
import re
import subprocess
import sys
import tempfile
import tomllib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from packaging.version import Version

import jls
import jls.flax
from jls import presets

ROOT = pathlib.Path(__file__).parents[2]
DOCS = ROOT / "docs"
# Folders Sphinx fills at build time (the notebooks are copied in and run by
# tests/integration/test_notebooks.py): not sources.
GENERATED = {"_build", "_autosummary", "notebooks", "jupyter_execute"}
SOURCES = sorted(
    path
    for path in DOCS.rglob("*.md")
    if not GENERATED & set(path.relative_to(DOCS).parts[:-1])
)

FENCE = re.compile(r"^(`{3,}|~{3,})\{code-cell\}")


def cells(page: pathlib.Path) -> list[str]:
    """The code of each ``{code-cell}`` of a MyST page, in order.

    MyST cell options are left out: the ``:key: value`` lines at the top of
    a cell, or a ``---``-delimited YAML block there.
    """
    found = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        i += 1
        if not opening:
            continue
        fence = opening.group(1)
        body = []
        while not (
            lines[i].startswith(fence[0] * len(fence)) and not lines[i].strip(fence[0])
        ):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        if body and body[0].strip() == "---":
            body = body[body.index("---", 1) + 1 :]
        while body and body[0].startswith(":"):
            body = body[1:]
        found.append("\n".join(body).strip("\n") + "\n")
    return found


PAGES = [page for page in SOURCES if cells(page)]
PAGE_IDS = [str(page.relative_to(DOCS)) for page in PAGES]


def run(page: str, *, until: str | None = None) -> tuple[dict, list[str]]:
    """Run a page's cells in order, in one namespace; return it and each output.

    ``until``: stop after the first cell containing this text (a later cell
    may redefine what a check reads). Each cell's stdout is captured; a cell
    that writes to stderr fails, as it fails the build
    (``nb_output_stderr = "warn"`` under ``-W``).
    """
    path = DOCS / page
    namespace: dict[str, Any] = {"__name__": "__main__"}
    outputs = []
    for index, source in enumerate(cells(path)):
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            exec(compile(source, f"{page} cell {index}", "exec"), namespace)
        assert not stderr.getvalue(), f"{page} cell {index} wrote to stderr"
        outputs.append(stdout.getvalue())
        if until is not None and until in source:
            return namespace, outputs
    assert until is None, f"no cell of {page} contains {until!r}"
    return namespace, outputs


def cell(page: str, marker: str) -> str:
    """The one cell of ``page`` that contains ``marker``."""
    (found,) = [c for c in cells(DOCS / page) if marker in c]
    return found


@pytest.fixture(autouse=True)
def _in_a_temporary_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


# -- Every page's cells --------------------------------------------------------


def test_the_pages_have_their_cells():
    # Every MyST notebook page (it declares a kernel) has cells, and pages
    # that declare none have none to run.
    for page in SOURCES:
        declares_a_kernel = page.read_text().startswith("---\njupytext:")
        assert declares_a_kernel == (page in PAGES), page
        assert len(cells(page)) == page.read_text().count("```{code-cell}"), page
    assert {"getting_started.md", "howto/spikes.md", "howto/veto.md"} <= set(PAGE_IDS)


def needs_devices(page: str) -> bool:
    """Whether a page asks XLA for host devices in its first cell.

    jax reads ``XLA_FLAGS`` once, when it starts: such a page runs in a fresh
    Python, as the build runs each page in a kernel of its own.
    """
    found = cells(DOCS / page)
    return bool(found) and "xla_force_host_platform_device_count" in found[0]


@functools.cache  # the page's two tests share one run (8 devices: slow)
def run_apart(page: str) -> str:
    """Run a page's cells in a fresh Python (warnings are errors); its stdout."""
    source = "\n".join(cells(DOCS / page))
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", source],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0 and not out.stderr, out.stderr[-4000:]
    return out.stdout


@pytest.mark.parametrize("page", PAGE_IDS)
def test_every_cell_of_the_page_runs(page):
    if needs_devices(page):
        run_apart(page)
    else:
        run(page)


def test_the_parallelism_page_shows_every_layout_exact():
    out = run_apart("parallelism.md")
    assert out.startswith("8 devices")
    offs = dict(re.findall(r"^(.+): off by (\S+)", out, re.M))
    wrong = offs.pop("pmean of the gradients")
    assert float(wrong) == pytest.approx(7.0, abs=0.05)  # 8 times the step
    assert len(offs) == 6, offs
    assert all(float(v) <= 1e-6 for v in offs.values()), offs
    assert "jls warned: the loss varies over the shard_map axes ('data',)" in out
    norms = re.findall(r"norm (\S+) \(true (\S+)\), mismatches (\d+)", out)
    assert len(norms) == 2
    assert all(a == b and m == "0" for a, b, m in norms), norms


# -- What the cells say ----------------------------------------------------------


def test_the_quickstart_prints_what_it_says():
    ns, outputs = run("getting_started.md", until="for _ in range(200)")
    quickstart = cell("getting_started.md", "for _ in range(200)")
    # The cell's comment: "0.057 8192.0 2".
    comment = re.search(r"# ([\d.]+) ([\d.]+) (\d+):", quickstart)
    assert comment is not None
    loss, scale, skips = outputs[-1].split()
    assert f"{float(loss):.3f}" == comment.group(1)
    assert scale == comment.group(2) and skips == comment.group(3)
    policy, params = ns["policy"], ns["params"]
    assert policy.compute_dtype == jnp.float16
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    jls.precision.precision_report(ns["compute_loss"], params, ns["batch"]).check(
        jnp.float16
    )


def test_the_quickstarts_agree():
    # The README and Getting started once taught different defaults
    # (measured_scale with the fused step, dynamic_scale with tx.update):
    # Getting started's quickstart is the README's, exactly.
    readme = (ROOT / "README.md").read_text()
    (first, *_) = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert cell("getting_started.md", "for _ in range(200)") == first
    assert "jls.measured_scale()" in first and "jls.apply_gradients" in first


def test_the_users_objects_are_the_same_on_every_page():
    # The how-to pages say they define small objects "as Getting started
    # does": their first (folded) cell is that page's, exactly.
    (own,) = [
        c
        for c in cells(DOCS / "getting_started.md")
        if "def compute_loss" in c and "policy" not in c
    ]
    pages = [p for p in PAGES if "this page defines small ones" in p.read_text()]
    assert len(pages) >= 6
    for page in pages:
        assert cells(page)[0] == own, page
        first = page.read_text().split("```{code-cell} ipython3\n")[1]
        assert first.startswith(":tags: [hide-input]\n"), page


def test_the_checkpoint_cell_runs_twice_and_restores_bitwise(tmp_path, monkeypatch):
    # The cell saves into tempfile.mkdtemp(); give it the same folder both
    # times, so the second save overwrites the first ("force").
    folder = tmp_path / "ckpt"
    folder.mkdir()
    make_temp = tempfile.mkdtemp
    monkeypatch.setattr(
        tempfile,
        "mkdtemp",
        lambda *a, **k: str(folder) if not (a or k) else make_temp(*a, **k),
    )
    ns, _ = run("howto/checkpoint.md", until="ckptr.save(path")
    save = cell("howto/checkpoint.md", "ckptr.save(path")
    for _ in range(2):
        exec(compile(save, "checkpoint cell", "exec"), ns)
        saved = {"params": ns["params"], "opt_state": ns["opt_state"]}
        restored = ns["restored"]
        assert jax.tree.structure(restored) == jax.tree.structure(saved)
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
    upgrade = cell("howto/checkpoint.md", "jls.upgrade_state(raw")
    exec(compile(upgrade, "upgrade cell", "exec"), ns)
    saved = {"params": ns["params"], "opt_state": ns["opt_state"]}
    for a, b in zip(
        jax.tree.leaves(ns["restored"]), jax.tree.leaves(saved), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_the_equinox_cell_computes_in_float16():
    ns, _ = run("howto/equinox.md", until="model, opt_state = step(")
    # The page's own step, traced: every matmul of the forward and backward
    # pass in float16.
    report = jls.precision.precision_report(
        ns["step"], ns["model"], ns["opt_state"], ns["x"], ns["y"]
    )
    report.check(jnp.float16)


def test_the_equinox_state_cell_prints_what_it_says():
    marker = "jls.keep_if_skipped(new_state, bn_state, opt_state)"
    _, outputs = run("howto/equinox.md")
    assert outputs[-1].split() == ["False", "True", "True", "True", "False", "True"]
    # Its comment: without the call, the nan batch's statistics stay and every
    # later step is skipped.
    source = cell("howto/equinox.md", marker)
    without = source.replace(f"bn_state = {marker}", "bn_state = new_state")
    assert without != source
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(without, "without keep_if_skipped", "exec"), {})
    assert stdout.getvalue().split() == [
        "False",
        "True",
        "True",
        "False",
        "True",
        "False",
    ]


def test_the_flax_cell_prints_the_unscaled_loss():
    # (The cell checks its own float16 compute: precision_report(...).check.)
    ns, outputs = run("howto/flax.md")
    # Its only output was "0.0" (a loss of a constant batch): now the loss
    # trained down, and the applied and skipped steps, as its comment says.
    printing = cell("howto/flax.md", 'print(f"loss {losses[0]')
    comment = re.search(r"^# (loss .*? skipped):", printing, re.M)
    assert comment is not None and outputs[-1].strip() == comment.group(1)
    losses = ns["losses"]
    assert losses[-1] < losses[0] / 1000 and np.isfinite(losses).all()
    assert isinstance(ns["optimizer"], jls.flax.Optimizer)
    assert int(ns["optimizer"].step[...]) + ns["skipped"] == len(losses)


def test_the_policy_cell_prints_what_it_says():
    _, outputs = run("howto/policy.md")
    printing = cell("howto/policy.md", "print(passed.counts")
    comment = re.search(r"# (\{.*\}) (\{.*\})$", printing, re.M)
    assert comment is not None
    assert outputs[-1].strip() == f"{comment.group(1)} {comment.group(2)}"


def test_the_autocast_cell_prints_what_it_says():
    ns, outputs = run("howto/policy.md")
    report = ns["report"]
    assert report.counts == {"float16": 2}  # the cell's comment
    assert all(set(by) == {"float32"} for by in report.numerics.values())
    assert outputs[0].splitlines() == [
        "{'float16': 2}",
        "{'float32': 1} {'float32': 2}",
    ]


def test_the_float32_cell_prints_what_it_says():
    ns, _ = run("howto/policy.md")
    assert [(op.dtype, op.scope) for op in ns["grads"].ops[:2]] == [
        ("float16", "jvp()"),
        ("float32", "jvp(lm_head)"),
    ]
    assert ns["grads"].counts == {"float16": 2, "float32": 3}  # the cell's comment


def test_the_spike_cell_has_the_metrics_it_names():
    ns, _ = run("howto/spikes.md")
    m = ns["m"]
    named = re.findall(
        r'm\["(\w+)"\]', cell("howto/spikes.md", "skip_spikes=jls.hooks.SpikeRule")
    )
    assert {"gradient_norm", "spike", "total_spikes"} <= set(named)
    for key in named:
        assert key in m, key
    assert float(m["gradient_norm"]) > 0
    # The page's numbers: SpikeRule's documented defaults.
    rule = jls.hooks.SpikeRule()
    assert (rule.threshold, rule.warmup, rule.window, rule.watch, rule.patience) == (
        6.0,
        100,
        100,
        "norm",
        25,
    )


def test_the_veto_cell_prints_what_it_says():
    ns, outputs = run("howto/veto.md")
    assert "# True" in cell("howto/veto.md", "class SkipHighLoss")
    assert outputs[-2] == "True\n"
    # The state-metrics cell counts the steps its own hook let through.
    assert "# 3" in cell("howto/veto.md", "applied_steps")
    assert outputs[-1] == "3\n"
    assert int(jls.metrics(ns["opt_state"])["applied_steps"]) == 3


def test_the_one_call_cell_has_the_fields_it_names():
    ns, _ = run("howto/one_call.md")
    out = ns["out"]
    fields = re.findall(
        r"out\.(\w+)", cell("howto/one_call.md", "jls.train_step(loss_fn")
    )
    assert len(fields) >= 7
    for field in fields:
        assert hasattr(out, field), field
    assert not bool(out.skipped) and out.loss.dtype == jnp.float32


def test_the_torch_checkpoint_resumes_with_its_scale_and_counters():
    ns, _ = run("howto/migrate.md")
    m = jls.metrics(ns["opt_state"])
    scaler_dict = ns["torch_ckpt"]["scaler"]
    assert float(m["loss_scale"]) == scaler_dict["scale"]
    assert int(m["growth_count"]) == scaler_dict["_growth_tracker"]


def test_the_pmap_cell_prints_one_entry_per_replica():
    ns, _ = run("howto/many_devices.md")
    m = ns["m"]
    assert m["loss_scale"].shape == (jax.local_device_count(),)
    assert not np.asarray(m["replicas_differ"]).any()


# -- What the tables say -------------------------------------------------------


def _table(text: str, header: str) -> list[list[str]]:
    """The body rows of the markdown table whose header row starts with ``header``."""
    lines = text.splitlines()
    (start,) = [i for i, line in enumerate(lines) if line.startswith(f"| {header} |")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def _public_names() -> list[str]:
    return [
        *(f"jls.{name}" for name in jls.__all__ if name != "presets"),
        "jls.presets",
        "jls.flax.Optimizer",
        "jls.flax.TrainState",
    ]


def _resolve(dotted: str) -> Any:
    obj: Any = jls
    for part in dotted.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


def test_every_public_name_has_a_line():
    rows = _table((DOCS / "which_api.md").read_text(), "name")
    first_column = " ".join(row[0] for row in rows)
    missing = [
        n for n in _public_names() if not re.search(rf"`{re.escape(n)}\b", first_column)
    ]
    assert not missing


def test_the_signatures_shown_are_the_real_ones():
    # "`jls.f(a, *, b=1, ...)`" in the table: every argument named is one of
    # f's, and every default shown is f's (where f's default is a value, not
    # None standing for one).
    rows = _table((DOCS / "which_api.md").read_text(), "name")
    checked = 0
    for row in rows:
        for name, arguments in re.findall(r"`(jls(?:\.\w+)+)\(([^`]*)\)`", row[0]):
            parameters = inspect.signature(_resolve(name)).parameters
            # Split at the commas outside string literals.
            for argument in re.findall(r'(?:[^,"]|"[^"]*")+', arguments):
                argument = argument.strip()
                if argument in ("*", "...") or argument.startswith(('"', "**")):
                    continue  # a literal value shown in a call, not a name
                key, _, shown = argument.partition("=")
                key = key.lstrip("*")
                assert key in parameters, f"{name} has no argument {key}"
                real = parameters[key].default
                if shown and real is not None and real is not inspect.Parameter.empty:
                    value = eval(shown, {"float16": jnp.float16, "jnp": jnp})
                    assert value == real, f"{name}: {key}={shown}, not {real!r}"
                checked += 1
    assert checked >= 30


def test_the_dynamic_rules_knobs_are_its_arguments():
    parameters = inspect.signature(jls.dynamic_scale).parameters
    rows = _table((DOCS / "scalers.md").read_text(), "knob")
    assert len(rows) == 8
    for row in rows:
        knob = re.fullmatch(r"`(\w+)=[^`]+`", row[0])
        assert knob is not None and knob.group(1) in parameters, row[0]


def test_the_scalers_the_tables_recommend_are_scalers():
    # The scaler column of scalers.md's "pick it when" table and of
    # which_api.md's scaler table: each is a function returning a scaler,
    # and the arguments shown are its own.
    picks = [row[0] for row in _table((DOCS / "scalers.md").read_text(), "scaler")]
    picks += [
        row[2] for row in _table((DOCS / "which_api.md").read_text(), "compute dtype")
    ]
    assert len(picks) == 11
    for pick in picks:
        match = re.fullmatch(r"`(jls\.[\w.<>]+)\(([^)]*)\)`", pick)
        assert match is not None, pick
        name, arguments = match.groups()
        if name == "jls.presets.<framework>":
            assert isinstance(presets.torch(), jls.LossScaler)
            continue
        function = _resolve(name)
        keywords = re.findall(r"(\w+)=", arguments)
        assert set(keywords) <= set(inspect.signature(function).parameters), pick
        value = [1.0] if name == "jls.static_scale" else []
        assert isinstance(function(*value), jls.LossScaler), pick


# -- The install page ------------------------------------------------------------


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _floors(requirements: list[str]) -> dict[str, str]:
    floors = {}
    for requirement in requirements:
        match = re.fullmatch(
            r"([A-Za-z0-9_.\[\]-]+?)(?:\[[^\]]*\])?>=([\w.]+)", requirement
        )
        if match:
            floors[match.group(1).lower()] = match.group(2)
    return floors


def test_the_install_page_names_the_declared_floors():
    project = _pyproject()
    declared = _floors(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        declared.update(_floors(extra))
    text = (DOCS / "install.md").read_text()
    versions = text[text.index("## Versions") : text.index("CI (`.ci/run`)")]
    versions = " ".join(versions.split())
    named = re.findall(r"([a-z][a-z-]*) >= ([\d.]+)", versions)
    assert len(named) >= 8
    assert "jax and jaxlib >= " in versions  # the jaxlib floor is jax's
    assert Version(declared["jax"]) == Version(declared["jaxlib"])
    for package, version in named:
        assert package in declared, package
        assert Version(declared[package]) == Version(version), (package, version)
    assert "Python 3.11-3.13" in versions
    assert project["requires-python"] == ">=3.11"


def test_the_install_pages_extras_are_pyprojects():
    extras = _pyproject()["optional-dependencies"]
    rows = _table((DOCS / "install.md").read_text(), "extra")
    assert {row[0].strip("`") for row in rows} == set(extras)
    for row in rows:
        declared = set(_floors(extras[row[0].strip("`")]))
        named = {n.strip() for n in row[1].split(",") if n.strip() != "..."}
        assert named <= declared, (row[0], named - declared)


# -- The tests the pages cite --------------------------------------------------------


def test_every_test_file_a_page_cites_exists():
    tests = ROOT / "tests"
    everywhere = {p.name for p in tests.rglob("*.py")}
    cited = 0
    for page in SOURCES:
        text = " ".join(page.read_text().split())
        for path, name in re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", text):
            assert (ROOT / path).exists(), f"{page.name} cites missing {path}"
            if name:
                assert f"def {name}(" in (ROOT / path).read_text(), (
                    page.name,
                    path,
                    name,
                )
            cited += 1
        for file, name in re.findall(r"`(test_\w+\.py)(?:::(\w+))?`", text):
            assert file in everywhere, f"{page.name} cites missing {file}"
            if name:
                (path,) = [p for p in tests.rglob(file)]
                assert f"def {name}(" in path.read_text(), (page.name, file, name)
            cited += 1
    assert cited >= 20


def _front_pages() -> dict[str, str]:
    pages = {"README.md": (ROOT / "README.md").read_text()}
    for name in ("index.md", "install.md", "getting_started.md"):
        pages[name] = (DOCS / name).read_text()
    return {name: " ".join(text.split()) for name, text in pages.items()}


def test_the_front_pages_agree_on_python_and_the_demos_duration():
    # index.md said "Python 3.11 or newer" where install.md said 3.11-3.13,
    # and "about a minute" for the demo where the README said 2-3 minutes.
    pythons, durations = {}, {}
    for name, text in _front_pages().items():
        for found in re.findall(
            r"Python (?:>= )?3\.\d+(?:(?: to |-)3\.\d+| or newer)?", text
        ):
            pythons.setdefault(" ".join(re.findall(r"3\.\d+|newer", found)), set()).add(
                name
            )
        for start in [m.end() for m in re.finditer(r"demo", text)]:
            window = text[start : start + 160].split(". ")[0]  # its sentence
            for found in re.findall(r"about ([\d-]+ minutes?|a minute)", window):
                durations.setdefault(found, set()).add(name)
    assert list(pythons) == ["3.11 3.13"], pythons
    assert len(pythons["3.11 3.13"]) == 4
    assert len(durations) == 1 and len(next(iter(durations.values()))) >= 3, durations
