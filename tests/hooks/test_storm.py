"""No start-up storm, short version of bench/storm.py: 50 processes starting
CUDA at once through the hook and the stand-in driver with a compute limit,
in one container and over 10, some killed -9 mid-start-up.

Checked: no survivor waits on a lock a killed process held (all are ready
well within the deadline), and identification ends with each live process's
budget slot carrying its own host pid (so it is throttled on its own
container's share). Timing is only bounded loosely here (this box is shared
and has 2 cores): every process ready within 10 s; the published numbers
come from `python -m bench.storm` (BENCHMARKS.md).
"""

from __future__ import annotations

import pytest

from bench.storm import storm


@pytest.mark.timeout(120)
@pytest.mark.parametrize("containers", [1, 10])
def test_fifty_processes_start_together_and_survive_kills(containers: int) -> None:
    result = storm(50, containers, hooked=True, kill=True, settle_s=6.0, seed=containers)
    print(result)
    # 5 victims, each killed 0-40 ms after its spawn unless it was ready before
    assert 1 <= result["killed"] <= 5, result
    assert result["stuck"] == 0, result
    assert result["wall_s"] < 10, result
    identified = result["identified"]
    assert identified["wrong"] == 0 and identified["unknown"] == 0, result
    assert identified["right"] == 50 - result["killed"], result
