"""One NVML poller per container (issue 20, the start-up storm): the processes of
one container share one utilisation query per control period through the budget
file, hold the container's share together, and a killed poller is taken over.
"""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest

from tests.hooks.test_enforcement import last_json, run_probe, tenant_env
from tests.hooks.test_hooks import PROBE
from vgpu.adapters import budget

POLLS = "polls NVML for the container"


def _poll_seq(path: Path) -> int:
    with open(path, "rb") as f:
        f.seek(budget.POLL_AT)
        return int(struct.unpack("<I", f.read(4))[0])


@pytest.mark.timeout(60)
def test_two_processes_of_one_container_share_one_poller_and_its_limit(
    tmp_path: Path,
) -> None:
    shared = tmp_path / "c"
    shared.mkdir()
    budget.ensure(shared / budget.FILE_NAME)
    env = tenant_env(
        shared,
        tmp_path / "gpu",
        offset=100000,
        VGPU_CORE_LIMIT=40,
        FAKE_CUDA_LAUNCH_US=200,
        VGPU_LOG_LEVEL="trace",
    )
    # traces go to files: a full stderr pipe would stall a process mid-launch
    logs = [tmp_path / f"err{i}" for i in range(2)]
    procs = []
    started = time.monotonic()
    for log in logs:
        with open(log, "w") as f:
            procs.append(
                subprocess.Popen(
                    [str(PROBE), "ctx", "0", "launch", "4"],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=f,
                    text=True,
                )
            )
    shares = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        shares.append(float(json.loads(out.splitlines()[-1])["share"]))
    wall_s = time.monotonic() - started
    errs = [log.read_text() for log in logs]
    pollers = [e.count(POLLS) for e in errs]
    seq = _poll_seq(shared / budget.FILE_NAME)
    print(
        f"shares {shares}, poller lines per process {pollers}, "
        f"{seq} poll sequence in {wall_s:.1f} s"
    )
    # One queries NVML and the other reads it; the other takes over only once the
    # first has exited (it finished first), so each says it once at most.
    assert sum(pollers) >= 1 and max(pollers) == 1, pollers
    # A seqlock: +2 per publication, one every 50 ms by one poller at a time (two
    # pollers at once would double it).
    publications = seq / 2
    assert 20 < publications <= 1.25 * wall_s / 0.05 + 5, (seq, wall_s)
    # together they hold the container's 40 % (a starved box only lowers them)
    assert 0.25 <= sum(shares) <= 0.5, shares


@pytest.mark.timeout(60)
def test_a_killed_poller_is_taken_over(tmp_path: Path) -> None:
    shared = tmp_path / "c"
    shared.mkdir()
    path = shared / budget.FILE_NAME
    budget.ensure(path)
    env = tenant_env(
        shared, tmp_path / "gpu", offset=100000, VGPU_CORE_LIMIT=30, FAKE_CUDA_LAUNCH_US=200
    )
    first_env = {**env, "VGPU_LOG_LEVEL": "trace"}
    log = tmp_path / "first.err"
    with open(log, "w") as f:  # a file: a full stderr pipe would stall it
        first = subprocess.Popen(
            [str(PROBE), "ctx", "0", "launch", "30"],
            env=first_env,
            stdout=subprocess.DEVNULL,
            stderr=f,
        )
    deadline = time.monotonic() + 10
    while _poll_seq(path) < 4 and time.monotonic() < deadline:  # the first one polls
        time.sleep(0.05)
    assert _poll_seq(path) >= 4
    second = run_probe(env, "ctx", 0, "launch", 4)
    time.sleep(1.0)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    assert POLLS in log.read_text()
    killed_at = _poll_seq(path)
    out = last_json(second)
    # the survivor took over: the publication moved on after the poller died
    assert _poll_seq(path) > killed_at + 10
    share = float(out["share"])  # type: ignore[arg-type]
    print(f"survivor's share after the takeover: {share:.3f}")
    assert 0.2 <= share <= 0.4, share
