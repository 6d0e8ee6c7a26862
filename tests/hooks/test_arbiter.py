"""The compute arbiter end to end on the stand-in driver: the daemon's loop
(vgpu/daemon/arbiter.py) reading NVML through pynvml, the hooks following the
allowed shares it writes, and the budget file's format version.

The accuracy check here is bench/arbiter.py's quick run (2 s segments) with
looser tolerances than the published targets, because this box is shared
and small: +-8 points once converged (published: +-3), a guarantee restored
within 0.5 s of a neighbour's burst (published: 0.2 s), the fallback to the
guarantee once the daemon stops within +-12 points over a window that still
holds the 0.5 s of staleness.

A scenario whose arbiter loop was held off the CPU for longer than
bench.arbiter.STALL_S (the suite's other workers on two cores) measures the
hooks' staleness fallback, not the arbiter; the bench runs such a scenario
again, at most bench.arbiter.ATTEMPTS times, and says so in its result.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from bench import arbiter as arbiter_bench
from tests.hooks.test_hooks import ROOT, base_env, probe, vgpu_lines
from vgpu.adapters import budget


def _rows(result: dict[str, object], scenario: str) -> list[list[dict[str, object]]]:
    for res in result["scenarios"]:  # type: ignore[attr-defined]
        if res["scenario"] == scenario:
            return [seg["tenants"] for seg in res["segments"]]
    raise AssertionError(f"no scenario {scenario}")


@pytest.mark.timeout(120)
def test_quick_accuracy_and_fallback(tmp_path: Path) -> None:
    out = tmp_path / "arbiter.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.arbiter", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.is_file(), run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["available"], result
    print(json.dumps(result["scenarios"], indent=1))
    # a tenant with a cap of 100 alone on the card bursts past its guarantee of 30
    ((alone,),) = _rows(result, "alone-30-cap-100")
    assert alone["achieved"] >= 85, alone
    # 30/60 with caps of 100: idle capacity shared in proportion to the guarantees
    for res in result["scenarios"]:
        assert 1 <= res["attempts"] <= arbiter_bench.ATTEMPTS, res
        assert len(res["arbiter_gaps_s"]) == res["attempts"], res
    ((a, b),) = _rows(result, "30-60-caps-100")
    assert abs(a["achieved"] - 100 / 3) <= 8 and abs(b["achieved"] - 200 / 3) <= 8, (a, b)
    # the noisy neighbour: 50/50, then the greedy one takes the idle card, then 50/50 again
    both, alone_greedy, back = _rows(result, "noisy-neighbour")
    for seg in (both, back):
        greedy, steady = seg
        assert abs(steady["achieved"] - 50) <= 8, seg
        assert abs(greedy["achieved"] - 50) <= 8, seg
        assert steady["below_guarantee_s"] <= 0.5, seg
    assert alone_greedy[0]["achieved"] >= 85, alone_greedy
    # the daemon stops: the tenant allowed 100 falls back to its guarantee of 30
    fb = result["fallback"]
    # while arbitrated it bursts well past its guarantee (the first ~0.3 s of the
    # 2 s phase run at the guarantee, and this box is shared: >= 50, not ~100)
    assert fb["share_while_arbitrated"] >= 50, fb
    assert fb["share_after_daemon_stopped"] <= 30 + 12 + 25, fb  # 0.5 s of 2 s still at 100
    assert fb["said"] and "back to the guarantee of 30%" in fb["said"][0], fb


def _old_file(path: Path, version: int) -> None:
    budget.ensure(path)
    with open(path, "r+b") as f:
        f.write(struct.pack("<II", budget.MAGIC, version))


def test_an_old_format_file_is_refused_by_the_hook_with_both_versions_named(
    tmp_path: Path,
) -> None:
    _old_file(tmp_path / budget.FILE_NAME, 3)
    lines, err = probe("alloc", "mem", 64, VGPU_SHARED_DIR=tmp_path, VGPU_MEMORY_LIMIT_MIB=1024)
    assert lines[0]["rc"] == 0
    said = " ".join(vgpu_lines(err))
    assert f"format version 3, this hook reads only version {budget.VERSION}" in said, err
    assert "restart the pod" in said
    # never misread, never written: the old file is as it was
    assert struct.unpack("<II", (tmp_path / budget.FILE_NAME).read_bytes()[:8]) == (
        budget.MAGIC,
        3,
    )


def test_an_old_format_file_is_refused_by_the_daemon(tmp_path: Path) -> None:
    path = tmp_path / budget.FILE_NAME
    _old_file(path, 3)
    before = path.read_bytes()
    with pytest.raises(
        budget.OldFormat, match=f"version 3, this daemon speaks version {budget.VERSION}"
    ):
        budget.write_arbiter(path, 1, 5000, 3000, 10000, 0)
    assert path.read_bytes() == before
    assert budget.read_arbiter(path) is None
    assert budget.usage_mib(path) is None
    assert budget.live_host_pids(path) is None


def test_the_arbiter_words_round_trip_and_the_hook_keeps_them(tmp_path: Path) -> None:
    path = tmp_path / budget.FILE_NAME
    budget.ensure(path)
    env = base_env(nvml=True)
    lines, _ = probe("alloc", "mem", 8, env=env, VGPU_SHARED_DIR=tmp_path, VGPU_CORE_LIMIT=30)
    assert lines[0]["rc"] == 0
    assert budget.write_arbiter(path, 7, 4550, 3000, 8000, 1234)
    view = budget.read_arbiter(path)
    assert view is not None
    assert (view.seq, view.allowed_percent, view.guarantee_percent, view.cap_percent) == (
        7,
        45.5,
        30.0,
        80.0,
    )
    assert view.achieved_percent == 12.34
    assert budget.usage_mib(path) == 0  # the process exited: its slot no longer counts
    assert os.path.getsize(path) == budget.FILE_BYTES


def test_the_longest_gap_between_arbiter_periods_counts_both_ends() -> None:
    assert arbiter_bench.max_gap([0.1, 0.2, 0.3], 0.4) == pytest.approx(0.1)
    assert arbiter_bench.max_gap([0.1, 0.2, 0.9, 1.0], 1.0) == pytest.approx(0.7)
    # a loop that started late, or stopped early, or never ran
    assert arbiter_bench.max_gap([0.6, 0.7], 0.8) == pytest.approx(0.6)
    assert arbiter_bench.max_gap([0.1, 0.2], 1.0) == pytest.approx(0.8)
    assert arbiter_bench.max_gap([], 2.0) == pytest.approx(2.0)
    # periods outside the scenario do not hide a gap inside it
    assert arbiter_bench.max_gap([-0.1, 0.05, 1.5], 1.0) == pytest.approx(0.95)


def test_a_scenario_whose_arbiter_stalled_is_run_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gaps = iter([0.9, 0.45, 0.12, 0.1])
    calls: list[Path] = []

    def fake_run(
        scenario: object, backend: object, card: object, work: Path, *_: object
    ) -> dict[str, object]:
        calls.append(work)
        return {"scenario": "s", "segments": [], "arbiter_max_gap_s": next(gaps)}

    monkeypatch.setattr(arbiter_bench, "run_scenario", fake_run)
    result = arbiter_bench.run_until_steady(object(), object(), object(), tmp_path, 200)  # type: ignore[arg-type]
    assert result["attempts"] == 3 and result["arbiter_gaps_s"] == [0.9, 0.45, 0.12]
    assert len(set(calls)) == 3  # each run in its own directory
    gaps = iter([1.0, 1.0, 1.0, 0.1])
    result = arbiter_bench.run_until_steady(object(), object(), object(), tmp_path, 200)  # type: ignore[arg-type]
    assert result["attempts"] == arbiter_bench.ATTEMPTS  # bounded: the last run is reported
