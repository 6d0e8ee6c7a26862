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

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.storm import storm
from tests.hooks.test_hooks import BUILD


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("containers", "teller", "together"),
    [(1, True, False), (10, True, False), (10, False, False), (1, True, True), (10, False, True)],
    ids=[
        "1-container-told",
        "10-containers-told",
        "10-containers-self-identified",
        "1-container-told-at-once",
        "10-containers-self-identified-at-once",
    ],
)
def test_fifty_processes_start_together_and_survive_kills(
    containers: int, teller: bool, together: bool
) -> None:
    """told: the daemon's arbiter tells host pids (vgpu/daemon/pidteller.py);
    self-identified: it does not, and each hook diffs the card's process lists.
    at-once: all 50 are held at a gate before their exec and let go together
    (the kills land 0-40 ms after that), not started one by one as spawned."""
    for attempt in range(3):
        # settle_s: each process lives that long once ready; the harness reads the
        # slots from 2.5 s on until every survivor is identified or the first one
        # ends (then kills the rest). Twice, at a load of 50 beside two CPU
        # spinners, the teller's process went 5.6 s without telling (it used 3 ms
        # of CPU: held up, not slow), so it has 20 s; a teller that never tells
        # still fails, after them.
        result = storm(
            50,
            containers,
            hooked=True,
            kill=True,
            settle_s=20.0,
            seed=containers + 100 * attempt,
            teller=teller,
            together=together,
        )
        print(result)
        # Every victim ready before its kill came (an idle machine readies all 50
        # in 50 ms when they start at once): nothing was killed mid-start-up, so
        # again, with other kill times.
        if result["killed"]:
            break
    assert result["teller"] is teller
    # 5 victims, each killed 0-40 ms after its spawn unless it was ready before
    assert 1 <= result["killed"] <= 5, result
    assert result["stuck"] == 0, result
    assert result["wall_s"] < 10, result
    # each process's own CPU at ready (exec, loader, hook, driver): a few ms at most
    assert 0 < result["ready_cpu_ms_p50"] < 100, result
    # the harness's own spawning, and its wait for a CPU in it (Linux schedstat)
    assert 0 <= result["spawn_runqueue_wait_s"] <= result["spawn_s"], result
    identified = result["identified"]
    assert identified["wrong"] == 0 and identified["unknown"] == 0, result
    assert identified["right"] == 50 - result["killed"], result


# The same pid, a new process image: what a recycled pid looks like to the
# stand-in card (a storm on a busy box wraps pid_max within minutes).
_RECYCLED = """
import ctypes, json, os, sys
build = sys.argv[1]
cuda = ctypes.CDLL(os.path.join(build, "fake", "libcuda.so.1"))
assert cuda.cuInit(0) == 0
if sys.argv[2] == "first":
    ctx = ctypes.c_void_p()
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
    env = dict(os.environ, FAKE_PIDNS_OFFSET="200000")
    os.execve(sys.executable, [sys.executable, __file__, build, "second"], env)
nvml = ctypes.CDLL(os.path.join(build, "fake-nvml", "libnvidia-ml.so.1"))
assert nvml.nvmlInit_v2() == 0
dev = ctypes.c_void_p()
assert nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(dev)) == 0
class Info(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong),
                ("gi", ctypes.c_uint), ("ci", ctypes.c_uint)]
infos = (Info * 64)()
count = ctypes.c_uint(64)
assert nvml.nvmlDeviceGetComputeRunningProcesses_v3(dev, ctypes.byref(count), infos) == 0
print(json.dumps({"pid": os.getpid(), "listed": [infos[i].pid for i in range(count.value)]}))
"""


@pytest.mark.timeout(60)
def test_a_recycled_pid_inherits_no_context_on_the_stand_in_card(tmp_path: Path) -> None:
    """A process that gets a dead process's pid must not be handed that process's
    record on the stand-in card (its host pid, contexts, memory): the card would
    list it under the dead one's host pid, and identification could settle on
    that. Here the first image creates a context, then execs (same pid) into a
    second image with another PID-namespace offset, which lists the card."""
    script = tmp_path / "recycled.py"
    script.write_text(_RECYCLED)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VGPU_", "FAKE_", "LD_"))}
    env.update(FAKE_GPU_STATE=str(tmp_path / "gpu"), FAKE_PIDNS_OFFSET="100000")
    out = subprocess.run(
        [sys.executable, str(script), str(BUILD), "first"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    # the new image has no context yet: listed neither under the old host pid
    # nor under a new one
    assert seen["pid"] + 100000 not in seen["listed"], seen
    assert seen["pid"] + 200000 not in seen["listed"], seen
