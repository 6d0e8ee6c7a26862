"""constraints.txt pins every runtime dependency, and pip resolves vgpu with it.

The image's pip steps use it (tests/deploy/test_dockerfile.py). The offline
checks walk the runtime closure from vgpu's installed metadata; the resolver
check asks pip itself (`pip install --dry-run`) and needs the package index,
so it runs when VGPU_NETWORK_TESTS=1.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"

_spec = importlib.util.spec_from_file_location("freeze", ROOT / "tools" / "freeze_constraints.py")
assert _spec and _spec.loader
freeze = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(freeze)
runtime_requirements = freeze.runtime_requirements


def pins() -> dict[str, Version]:
    out: dict[str, Version] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and version and "*" not in version, f"not an exact pin: {line!r}"
        key = canonicalize_name(name)
        assert key not in out, f"{name} pinned twice"
        out[key] = Version(version)
    return out


def test_every_runtime_dependency_is_pinned_exactly() -> None:
    pinned = pins()
    needed = {canonicalize_name(req.name) for _, req in runtime_requirements()}
    assert needed - pinned.keys() == set(), "add these to constraints.txt"
    assert pinned.keys() - needed == set(), "no longer needed at run time: remove them"


def violations(pinned: dict[str, Version]) -> list[str]:
    out = []
    for who, req in runtime_requirements():
        version = pinned.get(canonicalize_name(req.name))
        if version is None or not req.specifier.contains(version, prereleases=True):
            out.append(f"{who} requires {req}, constraints.txt pins {version}")
    return out


def test_pins_satisfy_every_requirement_of_the_closure() -> None:
    assert violations(pins()) == []


def test_pins_satisfy_pyproject_and_match_what_the_tests_run_on() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = pins()
    for text in project["dependencies"]:
        req = Requirement(text)
        assert req.specifier.contains(pinned[canonicalize_name(req.name)]), text
    # The suite runs against the pinned versions, so the image gets what was tested.
    assert CONSTRAINTS.read_text() == freeze.frozen(), "run `make constraints`"
    for name, version in pinned.items():
        assert Version(metadata.version(name)) == version, (
            f"{name}: installed {metadata.version(name)}, pinned {version}; "
            "pip install -c constraints.txt -e '.[test]'"
        )


def test_a_constraint_that_breaks_a_requirement_is_caught() -> None:
    # The checker can fail: protobuf below vgpu's floor, and a pin gone missing.
    broken = {**pins(), "protobuf": Version("3.20.0")}
    assert any(v.startswith("vgpu requires protobuf") for v in violations(broken))
    missing = {k: v for k, v in pins().items() if k != "urllib3"}
    assert any("urllib3" in v and v.endswith("pins None") for v in violations(missing))


@pytest.mark.skipif(
    os.environ.get("VGPU_NETWORK_TESTS") != "1",
    reason="resolves against the package index: set VGPU_NETWORK_TESTS=1",
)
def test_pip_resolves_vgpu_with_the_constraints(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            "-c",
            str(CONSTRAINTS),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    chosen = {
        canonicalize_name(item["metadata"]["name"]): Version(item["metadata"]["version"])
        for item in json.loads(report.read_text())["install"]
    }
    assert chosen.pop("vgpu") == Version(metadata.version("vgpu"))
    assert chosen == pins()
