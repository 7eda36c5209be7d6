"""Test configuration: warnings are errors (pyproject), strict rank promotion.

The tests import jls as it is installed (``--import-mode=importlib``: the
checkout is not put on ``sys.path``), so that a module missing from the wheel
fails them; with ``pip install -e`` the installed package is the checkout.
Their own helpers (the reference models, the soak, shared test models) sit
next to them in ``tests/`` and are imported by name.
"""

import os
import pathlib
import sys

import hypothesis
import jax
import pytest

TESTS = pathlib.Path(__file__).parent
ROOT = TESTS.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

# Scripts the distributed tests run in subprocesses (with their own devices
# and arguments); not test modules.
collect_ignore = ["integration/scripts"]

hypothesis.settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, print_blob=True
)
hypothesis.settings.register_profile("dev", max_examples=200, deadline=None)
# CI's floors job (.ci/run) checks that the code runs on the lowest declared
# versions; the input space is searched by the main job's 60 examples.
hypothesis.settings.register_profile(
    "floors", max_examples=10, deadline=None, derandomize=True, print_blob=True
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _strict_rank_promotion():
    with jax.numpy_rank_promotion("raise"):
        yield
