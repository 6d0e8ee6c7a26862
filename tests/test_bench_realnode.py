"""`python -m bench.realnode`: a short run on the real kubelet device manager
(../shared/realk8s), skipped where the kit is not unpacked (CI has none).
No timing is asserted: the targets are the bench's to report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import realnode

ROOT = Path(__file__).resolve().parent.parent


def test_without_the_kit_the_bench_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REALK8S_HOME", str(tmp_path / "none"))
    result = realnode.run(pods=2, rounds=1)
    assert result["available"] is False
    assert "unpack.sh" in result["reason"]


@pytest.mark.timeout(240)
def test_a_short_run_admits_every_pod_with_each_plugin(tmp_path: Path) -> None:
    missing = realnode.kit_missing()
    if missing is not None:
        pytest.skip(missing)
    out = tmp_path / "realnode.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.realnode", "--pods", "4", "--rounds", "1", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=230,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    (round_,) = result["rounds"]
    for kind in realnode.PLUGINS:
        assert round_[kind]["ok"], round_[kind]
        assert round_[kind]["admitted"] == 4, round_[kind]
        assert round_[kind]["Allocate"]["n"] == 8  # one per resource and pod
        assert round_[kind]["GetPreferredAllocation"]["n"] == 8
    assert set(round_["vgpu"]["server_side_mean_ms"]) == set(realnode.PHASES)
    assert all(isinstance(v, float) for v in round_["ratios"].values())
