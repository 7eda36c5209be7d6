"""The declared version floors are the ones the floors job installs."""

import pathlib
import tomllib

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _floor(requirement: str) -> tuple[str, Version]:
    req = Requirement(requirement)
    floors = [Version(s.version) for s in req.specifier if s.operator == ">="]
    assert len(floors) == 1, f"{requirement!r} declares no single >= floor"
    return req.name.lower(), floors[0]


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / ".ci" / "floors.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[req.name.lower()] = Version(spec.version)
    return pins


def test_the_floors_job_installs_exactly_the_declared_floors():
    project = _pyproject()["project"]
    declared = dict(
        _floor(r)
        for r in project["dependencies"] + project["optional-dependencies"]["test"]
    )
    assert _pins() == declared


def test_every_extra_declares_the_same_floor_for_a_package():
    extras = _pyproject()["project"]["optional-dependencies"]
    seen: dict[str, Version] = {}
    for name, requirements in extras.items():
        for requirement in requirements:
            package, floor = _floor(requirement)
            assert seen.setdefault(package, floor) == floor, (name, requirement)
