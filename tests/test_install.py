"""The install is reproducible: every dependency pyproject.toml declares (main and test extra) is pinned in
constraints.txt, which README command 2 and .ci/run both install with; torch's floor is the real one
(FSDP2's fully_shard, torch 2.6) with no upper cap in the package metadata."""
from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT

tomllib = pytest.importorskip("tomllib")

UNPINNED = {"torch", "triton"}  # the torch build is the user's choice (README); it brings its own triton


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def test_every_declared_dependency_is_pinned_in_constraints():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in [*project["dependencies"], *project["optional-dependencies"]["test"]]}
    pins = _pins()
    assert declared - UNPINNED - set(pins) == set(), "declared but not pinned"
    assert not UNPINNED & set(pins)
    torch = [r for r in project["dependencies"] if _name(r) == "torch"]
    assert torch == ["torch>=2.6"]


def test_readme_command_2_and_ci_install_with_the_constraints():
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if "python -m pytest -q" in line and "pip install" in line)
    assert command in (ROOT / ".ci" / "run").read_text()  # CI runs the README's command verbatim
    installs = [part.strip() for part in command.split("&&") if "pip install" in part and "torch==" not in part]
    assert installs and all("-c constraints.txt" in part for part in installs)
