"""The soak's 2-minute CI run (``python -m bench soak --minutes 2``): churn,
kill -9, kubelet restarts, API outages, card faults, tenant attacks, a metrics
flood and a full disk, with every invariant checked after every step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_soak_two_minutes(short_tmp: Path) -> None:
    out = short_tmp / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "soak", "--minutes", "2", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["violations"] == [] and proc.returncode == 0, report["violations"]
    steps = report["steps"]
    for kind in (
        "admit",
        "delete",
        "kill9",
        "kubelet_restart",
        "api_outage",
        "card_fault",
        "tenant_attack",
        "status",
        "full_disk",
    ):
        assert steps.get(kind, 0) >= 1, (kind, steps)
    assert report["disk_faults"] == "ran"
    # Enough work to mean something; a busy machine (or a parallel test worker) admits fewer.
    assert report["admissions"]["ok"] > 40
    assert report["metrics_hammer"]["half_open_connections"] > 1000
