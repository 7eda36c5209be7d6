"""Every example in the package's docstrings runs, from the installed package.

The package is imported as it is installed (a module missing from the wheel
fails here), and each module's doctests run as pytest's doctest integration
would run them, with ``NORMALIZE_WHITESPACE`` and ``ELLIPSIS``.
"""

import doctest
import importlib
import pkgutil

import pytest

import jls


def _modules() -> list[str]:
    names = ["jls"]
    for info in pkgutil.walk_packages(jls.__path__, "jls."):
        names.append(info.name)
    return sorted(names)


MODULES = _modules()


def test_every_module_of_the_checkout_is_installed():
    import pathlib

    checkout = pathlib.Path(__file__).parents[1] / "jls"
    files = {
        ".".join(("jls", *p.relative_to(checkout).with_suffix("").parts)).removesuffix(
            ".__init__"
        )
        for p in checkout.rglob("*.py")
    }
    assert files <= set(MODULES), sorted(files - set(MODULES))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    flags = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=flags)
    tests = [t for t in finder.find(module, name) if t.examples]
    for test in tests:
        runner.run(test, out=lambda text: None)
    failed = runner.summarize(verbose=False).failed
    if failed:
        report = []
        runner = doctest.DocTestRunner(optionflags=flags)
        for test in tests:
            runner.run(test, out=report.append)
        pytest.fail("".join(report))


def test_the_tests_import_the_installed_package(tmp_path):
    # The jls these tests import is the one a fresh interpreter finds outside
    # the checkout: the installed package (with pip install -e, the checkout
    # is what is installed). A checkout folder on sys.path would shadow it.
    import pathlib
    import subprocess
    import sys

    code = "import jls; print(jls.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    installed = pathlib.Path(out.stdout.strip()).resolve()
    assert pathlib.Path(jls.__file__).resolve() == installed
