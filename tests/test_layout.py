"""The package's layout: data flows one way, each module is small and tested.

Read from the source (``docs/design.md`` draws it): every import between jls
modules, function-local ones included, goes from a higher layer to a lower
one, so there is no cycle; no module is much above 350 lines; every module
has a test file of its own name (``tests/test_<module>.py``, integrations in
``tests/integration/``).
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parents[1]
PACKAGE = ROOT / "jls"

# Lowest first: a module may import only from layers below its own.
LAYERS = [
    ["jls._validate", "jls._compat", "jls._shards", "jls.hooks._blocks"],
    ["jls._state", "jls._composition"],
    ["jls._tree"],
    ["jls._scaling"],
    ["jls._rule"],
    ["jls._dynamic"],
    ["jls._static", "jls._measured"],
    ["jls._finite"],
    ["jls._squares"],
    ["jls.hooks._hooks"],
    [
        "jls.hooks._norm",
        "jls.hooks._diagnostics",
        "jls.hooks._divergence",
        "jls.hooks._spikes",
        "jls.hooks._nonfinite_loss",
        "jls.hooks._replicas",
        "jls.hooks._scale_stats",
        "jls.hooks._stagnation",
    ],
    ["jls._builtins", "jls._inner", "jls._cond", "jls._off", "jls._average"],
    ["jls._config"],
    [
        "jls._decision",
        "jls.precision._compensated",
        "jls._keep",
        "jls.precision._scaled_state",
    ],
    ["jls._core"],
    ["jls._transformation"],
    ["jls._loss_scaling"],
    ["jls._set_scale", "jls._checkpoint", "jls._step"],
    ["jls.precision._primitives"],
    ["jls.precision._cast_eval"],
    ["jls.precision._autocast"],
    ["jls.precision._policy", "jls.precision._precision"],
    ["jls.hooks", "jls.precision"],
    ["jls.presets._common"],
    ["jls.presets._frameworks", "jls.presets._keras", "jls.presets._llm"],
    ["jls.presets._jax", "jls.presets._state_dicts"],
    ["jls.presets"],
    ["jls.flax"],
    ["jls"],
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
MAX_LINES = 360  # "about 350"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: pathlib.Path) -> set[str]:
    """Every jls module ``path`` imports, at any depth of the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from jls import presets` imports the module jls.presets;
            # `from jls._state import make_state` imports jls._state.
            names = [
                f"{node.module}.{a.name}"
                if f"{node.module}.{a.name}" in MODULES
                else node.module
                for a in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    own = _module_name(path)
    out.discard(own)
    return out


def test_every_module_has_a_layer():
    assert set(MODULES) == set(LAYER), set(MODULES) ^ set(LAYER)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_down_the_layers(name):
    imported = _imports(MODULES[name])
    up = {m for m in imported if LAYER[m] >= LAYER[name]}
    assert not up, f"{name} (layer {LAYER[name]}) imports {sorted(up)}"


def test_no_cycle():
    graph = {name: _imports(path) for name, path in MODULES.items()}
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError(f"import cycle: {' -> '.join([*stack, nxt])}")
            if nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_are_small(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines"


def _test_file(name: str) -> pathlib.Path:
    if name.startswith("jls.presets"):
        return ROOT / "tests" / "test_presets.py"
    if name == "jls":
        return ROOT / "tests" / "test_init.py"
    if name == "jls.flax":
        return ROOT / "tests" / "integration" / "test_flax.py"
    stem = name.rpartition(".")[2].lstrip("_")
    return ROOT / "tests" / f"test_{stem}.py"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_has_its_test_file(name):
    path = _test_file(name)
    assert path.exists(), f"{name} has no {path.relative_to(ROOT)}"
    assert "def test_" in path.read_text()
