"""tests/e2e holds runners for a real node (root, ../shared/realk8s, minutes per run),
started by hand: `python -m tests.e2e.kit_restarts`, and the e2e suite
test_cluster.py against any cluster (see README.md). The default `pytest` run
must never collect or import them: everything here is ignored unless
VGPU_E2E_KUBECONFIG names a cluster (then only test_cluster.py is collected,
the runners having no test_ prefix)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

collect_ignore_glob = [] if os.environ.get("VGPU_E2E_KUBECONFIG") else ["*.py"]

# What each check measured (seconds and counts), printed at the end and
# written to $VGPU_E2E_OUT/measured.json when that is set.
MEASURED: dict[str, dict[str, Any]] = {}


@pytest.fixture
def measured(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    entry: dict[str, Any] = {}
    yield entry
    if entry:
        MEASURED[request.node.name] = entry


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not MEASURED:
        return
    terminalreporter.section("vgpu e2e: measured")
    for name, entry in MEASURED.items():
        terminalreporter.write_line(f"{name}: {json.dumps(entry, default=str)}")
    out = os.environ.get("VGPU_E2E_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "measured.json").write_text(json.dumps(MEASURED, indent=2, default=str))
