"""The package's housekeeping numbers, as a markdown table.

Reads the source of ``jls/`` with :mod:`ast` (no jax is imported for it) and
prints: package lines, files, import arrows between jls modules, public
names, modules that re-run jaxprs, ``jax.extend`` / ``jax._src`` imports,
the longest functions, and the docstrings' lines (their share of the
package, and those that carry version history or machine figures).

Only the public-name count imports jls, in a fresh interpreter whose
``PYTHONPATH`` is the checkout, so the numbers are those of the files read.

Usage::

    python benchmarks/house.py               # the checkout this file is in
    python benchmarks/house.py --root DIR    # another checkout (e.g. a tag's
                                             # ``git worktree add``)
"""

import argparse
import ast
import json
import os
import pathlib
import re
import subprocess
import sys

# A docstring line that tells history rather than behaviour.
VERSION = re.compile(r"jls 0\.|since 0\.|(?<=\s)0\.[1-4](?![\d%-])")
# A docstring line that quotes a measurement of some machine.
FIGURE = re.compile(
    r"\d(?:\.\d+)?\s*(?:ms\b|GB/s|MB\b|KB\b)|\d\.\d+\s*x(?![\w])|\d+x(?=[\s,;:.)])"
)

PUBLIC = """
import importlib, json, types
import jls
names, where = set(), jls.__file__
for mod in ["jls", "jls.hooks", "jls.precision", "jls.presets", "jls.flax"]:
    try:
        m = importlib.import_module(mod)
    except ImportError:
        continue
    for n in getattr(m, "__all__", []):
        if not isinstance(getattr(m, n, None), types.ModuleType):
            names.add(n)
print(json.dumps({"file": where, "names": sorted(names)}))
"""


def module_name(package: pathlib.Path, path: pathlib.Path) -> str:
    """``jls/hooks/_norm.py`` -> ``jls.hooks._norm``; packages drop ``__init__``."""
    parts = path.relative_to(package.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(tree: ast.Module, own: str, modules: set[str]) -> set[str]:
    """Every jls module a file imports, at any depth (as tests/test_layout.py)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [
                f"{node.module}.{a.name}"
                if f"{node.module}.{a.name}" in modules
                else node.module
                for a in node.names
            ]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    out.discard(own)
    return out


def import_statements(tree: ast.Module) -> list[list[str]]:
    """Per import statement, the modules it may import.

    ``from jax import extend`` may import ``jax.extend``: both are listed.
    """
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.append([a.name for a in node.names])
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append([node.module] + [f"{node.module}.{a.name}" for a in node.names])
    return out


def _under(names: list[str], prefix: str) -> bool:
    return any(n == prefix or n.startswith(prefix + ".") for n in names)


def reruns_jaxprs(tree: ast.Module) -> bool:
    """Whether the file iterates the ``.eqns`` of a jaxpr."""
    for node in ast.walk(tree):
        if isinstance(node, ast.For | ast.comprehension):
            for sub in ast.walk(node.iter):
                if isinstance(sub, ast.Attribute) and sub.attr == "eqns":
                    return True
    return False


def docstring_nodes(tree: ast.Module) -> list[ast.Constant]:
    """The module's, its classes' and its functions' docstring expressions."""
    owners = [tree] + [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    out = []
    for owner in owners:
        body = owner.body
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            out.append(body[0].value)
    return out


def measure(root: pathlib.Path) -> dict:
    """Every number of the table for the checkout at ``root``."""
    package = root / "jls"
    paths = sorted(package.rglob("*.py"))
    modules = {module_name(package, p): p for p in paths}
    lines = arrows = extend = private = 0
    rerun, functions, doc_lines = [], [], 0
    version_lines, figure_lines = [], []
    for name, path in modules.items():
        text = path.read_text()
        source = text.splitlines()
        tree = ast.parse(text)
        lines += len(source)
        arrows += len(imports(tree, name, set(modules)))
        for statement in import_statements(tree):
            extend += _under(statement, "jax.extend")
            private += _under(statement, "jax._src")
        if reruns_jaxprs(tree):
            rerun.append(name)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                functions.append((length, f"{name}.{node.name}"))
        for doc in docstring_nodes(tree):
            span = range(doc.lineno, (doc.end_lineno or doc.lineno) + 1)
            doc_lines += len(span)
            for number in span:
                line = source[number - 1]
                where = f"{path.relative_to(root)}:{number}"
                if VERSION.search(line):
                    version_lines.append(where)
                if FIGURE.search(line):
                    figure_lines.append(where)
    everything = [p for p in package.rglob("*") if p.is_file()]
    everything = [p for p in everything if "__pycache__" not in p.parts]
    return {
        "lines": lines,
        "files": len(everything),
        "top_files": sum(p.parent == package for p in everything),
        "arrows": arrows,
        "public": public_names(root),
        "rerun": rerun,
        "extend": extend,
        "private": private,
        "longest": sorted(functions, reverse=True)[:5],
        "doc_lines": doc_lines,
        "version_lines": version_lines,
        "figure_lines": figure_lines,
    }


def public_names(root: pathlib.Path) -> int | str:
    """The union of the public namespaces' ``__all__``, less module objects."""
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, "-c", PUBLIC],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        check=False,
    )
    if run.returncode:
        return f"import failed ({run.stderr.strip().splitlines()[-1]})"
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if not pathlib.Path(out["file"]).resolve().is_relative_to(root.resolve()):
        return f"imported {out['file']}, not this checkout"
    return len(out["names"])


def table(numbers: dict) -> str:
    """The markdown table of :func:`measure`'s numbers."""
    longest = ", ".join(f"`{n}` {k}" for k, n in numbers["longest"])
    share = numbers["doc_lines"] / numbers["lines"]
    rows = [
        ("package lines (all .py under jls/)", numbers["lines"]),
        (
            "files in jls/ (recursively) / directly in jls/",
            f"{numbers['files']} / {numbers['top_files']}",
        ),
        ("import arrows between jls modules", numbers["arrows"]),
        ("public names", numbers["public"]),
        (
            "modules re-running jaxprs (iterate `.eqns`)",
            f"{len(numbers['rerun'])} ({', '.join(numbers['rerun'])})",
        ),
        (
            "`jax.extend` / `jax._src` imports",
            f"{numbers['extend']} / {numbers['private']}",
        ),
        ("5 longest functions (lines)", longest),
        (
            "docstring lines / share of the package",
            f"{numbers['doc_lines']} / {share:.0%}",
        ),
        ("docstring lines with version history", len(numbers["version_lines"])),
        ("docstring lines with machine figures", len(numbers["figure_lines"])),
    ]
    out = ["| measure | value |", "| --- | --- |"]
    out += [f"| {key} | {value} |" for key, value in rows]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    here = pathlib.Path(__file__).resolve().parents[1]
    parser.add_argument("--root", type=pathlib.Path, default=here)
    parser.add_argument(
        "--where", action="store_true", help="list the flagged docstring lines"
    )
    args = parser.parse_args()
    numbers = measure(args.root)
    print(table(numbers))
    if args.where:
        print("\nversion history:", *numbers["version_lines"], sep="\n  ")
        print("\nmachine figures:", *numbers["figure_lines"], sep="\n  ")


if __name__ == "__main__":
    main()
