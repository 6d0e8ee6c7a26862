"""The compute arbiter end to end on the stand-in driver: the daemon's loop
(vgpu/daemon/arbiter.py) reading NVML through pynvml, the hooks following the
allowed shares it writes, and the budget file's format version.

The accuracy check here is bench/arbiter.py's quick run (2 s segments) with
looser tolerances than the published targets (BENCHMARKS.md): +-8 points once
converged (published: +-3), a guarantee restored within 0.5 s of a
neighbour's burst (published: 0.2 s), the fallback to the guarantee once the
daemon stops within +-12 points over a window that still holds the 0.5 s of
staleness.

What a tenant achieves on the stand-in depends on the CPU the machine leaves
it (it keeps only about 1 ms of kernels queued), and the arbiter takes a
tenant held off the CPU for one that wants less (issue 29: beside two CPU
spinners on two cores the 30-60 split came out 49/50, a lone tenant allowed
the whole card 77 %). So each check is made against what the same run
measured of the load:
- a tenant alone with the whole card must get 85 % of it less the share of
  the window its threads waited for a CPU (their run-queue wait, from /proc),
  whatever the load: a hook that kept it at its guarantee still fails;
- how the card is divided between tenants is judged on the segments in
  which no tenant left its share of the card idle while it waited for a CPU,
  nor fell, in them or shortly before, to where the arbiter takes it for its
  own limit (bench.arbiter.HELD_OFF_S; it then offers such a tenant less for
  up to about a second); the others are named in a warning, never passed
  silently. A tenant short of its share on a full card was squeezed by a
  neighbour, which never excuses. On a machine that leaves the tenants the
  CPU, or a kernel without schedstat, every segment is judged.

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
import warnings
from pathlib import Path
from typing import Any

import pytest

from bench import arbiter as arbiter_bench
from bench.common import RunQueueWait
from tests.hooks.test_hooks import ROOT, base_env, probe, vgpu_lines
from vgpu.adapters import budget


def _segments(result: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    for res in result["scenarios"]:
        if res["scenario"] == scenario:
            return list(res["segments"])
    raise AssertionError(f"no scenario {scenario}")


def _judged(result: dict[str, Any], scenario: str) -> list[bool]:
    """Per segment: whether no tenant was held off the CPU in it or shortly before."""
    for res in result["scenarios"]:
        if res["scenario"] == scenario:
            return arbiter_bench.judged(res)
    raise AssertionError(f"no scenario {scenario}")


def _whole_card_floor(row: dict[str, Any], seg: dict[str, Any], floor: float) -> float:
    """`floor` (percent of the card) less the share of the measured window that
    the tenant's threads spent waiting for a CPU: a greedy tenant with the card
    to itself leaves it idle only while it cannot run (the stand-in queues about
    1 ms of its kernels), so that is all the machine can take from it. A hook
    that holds it at its guarantee of 30 % stays there however idle the CPU."""
    window_s = float(seg["to_s"] - seg["steady_from_s"])
    return floor - 100 * float(row["cpu_wait_s"]) / window_s


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
    for res in result["scenarios"]:
        assert 1 <= res["attempts"] <= arbiter_bench.ATTEMPTS, res
        assert len(res["arbiter_gaps_s"]) == res["attempts"], res
    not_judged = []
    # a tenant with a cap of 100 alone on the card bursts past its guarantee of 30
    (seg,) = _segments(result, "alone-30-cap-100")
    (alone,) = seg["tenants"]
    assert alone["achieved"] >= _whole_card_floor(alone, seg, 85), (alone, seg)
    # 30/60 with caps of 100: idle capacity shared in proportion to the guarantees
    (seg,) = _segments(result, "30-60-caps-100")
    a, b = seg["tenants"]
    if _judged(result, "30-60-caps-100") == [True]:
        assert abs(a["achieved"] - 100 / 3) <= 8 and abs(b["achieved"] - 200 / 3) <= 8, (a, b)
    else:
        not_judged.append(("30-60-caps-100", seg["from_s"]))
    # the noisy neighbour: 50/50, then the greedy one takes the idle card, then 50/50 again
    both, alone_greedy, back = _segments(result, "noisy-neighbour")
    for seg, judged in zip((both, back), _judged(result, "noisy-neighbour")[::2], strict=True):
        greedy, steady = seg["tenants"]
        if not judged:
            not_judged.append(("noisy-neighbour", seg["from_s"]))
            continue
        assert abs(steady["achieved"] - 50) <= 8, seg
        assert abs(greedy["achieved"] - 50) <= 8, seg
        assert steady["below_guarantee_s"] <= 0.5, seg
    greedy = alone_greedy["tenants"][0]
    assert greedy["achieved"] >= _whole_card_floor(greedy, alone_greedy, 85), alone_greedy
    # the daemon stops: the tenant allowed 100 falls back to its guarantee of 30
    fb = result["fallback"]
    # while arbitrated it bursts well past its guarantee: the first ~0.3 s of the
    # 2 s phase run at the guarantee (at most 90 %), less what the CPU took from it
    waited = fb["cpu_wait_while_arbitrated_s"] or 0.0
    assert fb["share_while_arbitrated"] >= 75 - 100 * waited / fb["phase_s"], fb
    # load only lowers this one (0.5 s of 2 s still at 100)
    assert fb["share_after_daemon_stopped"] <= 30 + 12 + 25, fb
    assert fb["said"] and "back to the guarantee of 30%" in fb["said"][0], fb
    if not_judged:
        held = {r["scenario"]: r["held_off"] for r in result["scenarios"] if r["held_off"]}
        warnings.warn(
            f"arbiter accuracy not judged for {not_judged} (scenario, from s): a tenant "
            f"left its share idle while it waited {arbiter_bench.HELD_OFF_S * 1e3:g} ms or "
            f"more for a CPU in them (or was taken for its own limit shortly before); "
            f"first seen: {held}",
            stacklevel=1,
        )


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


def test_a_tenant_is_held_off_only_when_it_waited_and_left_the_card_idle() -> None:
    (scenario,) = (s for s in arbiter_bench.scenarios(2.0) if s.name == "30-60-caps-100")
    wait = arbiter_bench.HELD_OFF_S

    def held(*samples: tuple[float, dict[str, float], dict[str, float], float]) -> object:
        result = arbiter_bench.held_off(scenario, samples)
        return result["starved_s"], result["misled_s"]

    fair = (0.5, {"a": 33.0, "b": 66.0}, {"a": wait, "b": wait}, 99.0)
    # b short of its 66.7 with the card not full, and it waited
    assert held(fair, (0.6, {"a": 33.0, "b": 60.0}, {"b": wait}, 93.0)) == ([0.6], [])
    # ... so far below its guarantee of 60 that the arbiter takes it for its own limit
    assert held(fair, (0.6, {"a": 33.0, "b": 50.0}, {"b": wait}, 83.0)) == ([0.6], [0.6])
    # squeezed on a full card (a neighbour took its share): not the machine
    assert held(fair, (0.6, {"a": 49.0, "b": 50.0}, {"b": 0.05}, 99.0)) == ([], [])
    # short while it hardly waited: the hook's or the arbiter's doing
    assert held(fair, (0.6, {"a": 33.0, "b": 50.0}, {"b": wait / 2}, 83.0)) == ([], [])
    # still starting
    assert held((0.2, {"a": 0.0, "b": 0.0}, {"a": 0.05, "b": 0.05}, 0.0)) == ([], [])
    # a segment is judged unless a tenant starved in it, or was taken for its own
    # limit in it or within MISLED_S before it
    segments = [
        {"from_s": 0.0, "to_s": 2.0},
        {"from_s": 2.0, "to_s": 4.0},
        {"from_s": 4.0, "to_s": 6.0},
    ]

    def judged(starved: list[float], misled: list[float]) -> list[bool]:
        return arbiter_bench.judged(
            {"segments": segments, "starved_s": starved, "misled_s": misled}
        )

    assert judged([3.0], []) == [True, False, True]
    assert judged([], [3.0]) == [True, False, False]
    assert judged([], [2.1]) == [True, False, True]
    assert judged([], []) == [True, True, True]


def test_run_queue_wait_of_a_process() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    try:
        waits = RunQueueWait(proc.pid)
        first = waits.read_s()
        assert first is not None and first >= 0  # since it started
        assert waits.read_s() == pytest.approx(0.0, abs=0.05)
    finally:
        proc.wait()
    assert waits.read_s() == 0.0  # gone: nothing more
    assert RunQueueWait(proc.pid, Path("/nonexistent")).read_s() is None
