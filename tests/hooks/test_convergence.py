"""How fast the hook's throttle settles on its limit once it engages (stand-in driver).

A greedy tenant alone at a fixed limit (no daemon): the bucket engages on the
first utilisation sample over the limit, and from then on each quarter second
must sit on the limit. Before the kernel cost was estimated from the busy time
and the launches of the same periods, the first estimate was about half the
real cost: the tenant ran at ~70 % for a 60 % limit, then the gain and the cost
estimate corrected the same error twice and it fell to ~47 % before climbing
back, about 1 s in all.

A tenant held off the CPU (a busy machine) falls short in that quarter, and its
gain's next window reads the shortfall as its own error and overshoots (beside
two CPU spinners on two cores: 50 % then 70 % at a 60 % limit; issue 29). So
each quarter is judged only when the tenant's threads did not wait HELD_OFF_S
for a CPU in it or in the quarter before (their run-queue wait, from /proc,
measured in the same run), and the run is repeated, at most RUNS times, until
the two quarters after the engagement, where the old error showed, were judged
(a warning says so when they never were). On a machine that leaves the tenant
the CPU, or a kernel that cannot tell, every quarter is judged.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import warnings
from pathlib import Path

import pytest

from bench.common import WaitWatch
from tests.hooks.test_hooks import BUILD, base_env
from vgpu.adapters import budget

TENANT = BUILD / "vgpu_tenant"
PHASE_S = 0.25
PHASES = 6
# A quarter in which the tenant's threads (the launching one, and the
# controller that steers the gain) waited this long in all for a CPU says how
# busy the machine was, and so does the next one (the gain's 200 ms window
# reaches into it). Shorter waits cost little: the stand-in keeps 1 ms of
# kernels queued, the bucket carries up to 20 ms of its rate over a wait
# (BURST_NS, hooks/throttle.c), and each quarter that left the band in 60 runs
# beside two CPU spinners had waited 58-350 ms in it or in the one before.
HELD_OFF_S = 0.04
RUNS = 3


def _tenant_env(work: Path, limit: int, kernel_us: int, **extra: str) -> dict[str, str]:
    """A tenant of one container (its budget file in `work`) on the stand-in card."""
    env = base_env(nvml=True)
    env.update(
        VGPU_SHARED_DIR=str(work),
        VGPU_CORE_LIMIT=str(limit),
        FAKE_GPU_STATE=str(work / "gpu"),
        FAKE_CUDA_LAUNCH_US=str(kernel_us),
        **extra,
    )
    return env


def _quarters(env: dict[str, str]) -> tuple[list[float], list[bool]]:
    """One greedy tenant for PHASES quarters: its share of the card in each, and
    whether its threads waited HELD_OFF_S or more for a CPU in each (False where
    the kernel cannot tell: then every quarter is judged)."""
    phases = ",".join([f"100:{PHASE_S}"] * PHASES)
    tenant = subprocess.Popen(
        [str(TENANT), "load", phases], env=env, stdout=subprocess.PIPE, text=True
    )
    assert tenant.stdout is not None
    watch = WaitWatch(tenant.pid)
    ends, lines = [], []
    try:
        for line in tenant.stdout:  # each phase's line comes as it ends
            ends.append(time.monotonic())
            lines.append(json.loads(line))
        assert tenant.wait(timeout=30) == 0
    finally:
        watch.stop()
        tenant.kill()
        tenant.wait()
    assert len(lines) == PHASES, lines
    starts = [ends[0] - lines[0]["seconds"], *ends[:-1]]
    held = [watch.by(b) - watch.by(a) >= HELD_OFF_S for a, b in zip(starts, ends, strict=True)]
    shares = [100 * x["busy_ns"] / (x["seconds"] * 1e9) for x in lines]
    return shares, held


@pytest.mark.timeout(60)
@pytest.mark.parametrize("limit", [30, 60])
def test_a_greedy_tenant_settles_on_its_limit_within_a_quarter_second(
    tmp_path: Path, limit: int
) -> None:
    settled_judged = False
    for run in range(RUNS):
        work = tmp_path / f"run{run}"
        work.mkdir()
        shares, held = _quarters(_tenant_env(work, limit, 200))
        judged = [not held[0]] + [not (held[i] or held[i - 1]) for i in range(1, PHASES)]
        print(
            f"limit {limit}%: quarter-second shares {[round(x, 1) for x in shares]}, "
            f"judged {judged}"
        )
        # the first quarter holds the engagement (the first sample is at full speed)
        if judged[0]:
            assert shares[0] > limit, (shares, judged)
        # then on the limit: no overshoot from a low first cost estimate, no dip
        # from correcting it twice
        for share, fair in zip(shares[1:], judged[1:], strict=True):
            if fair:
                assert limit - 8 <= share <= limit + 5, (shares, judged)
        if judged[1] and judged[2]:  # the two quarters after the engagement
            settled_judged = True
            break
    if not settled_judged:
        warnings.warn(
            f"the quarters after the engagement at {limit}% were not judged in {RUNS} runs: "
            f"the tenant waited {HELD_OFF_S * 1e3:g} ms or more for a CPU in or before them",
            stacklevel=1,
        )


def _voluntary_switches(pid: int) -> int:
    """Voluntary context switches of every thread of the process so far."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            text = status.read_text()
        except OSError:  # a thread that just ended
            continue
        for line in text.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


@pytest.mark.timeout(60)
def test_a_launch_held_for_tokens_sleeps_once_and_wakes_when_its_share_is_raised(
    tmp_path: Path,
) -> None:
    """At a share of 0.5 % a 20 ms kernel earns its tokens in 4 s. The held
    launch sleeps until then (at most 1 s at a time) instead of waking every
    10 ms; the arbiter raising the share wakes it at once, to earn the rest at
    the new rate. (How long the gap is depends on the gain too: beside two CPU
    spinners a first window over the limit cut it to 0.5 and the gap grew to
    9.6 s, as long as a refill clipped to 20 ms made it; so the gap's length
    is not checked here.)"""
    path = tmp_path / budget.FILE_NAME
    budget.ensure(path)
    allowed = {"centi": 50}
    stop = threading.Event()

    def arbiter() -> None:  # the daemon's words, every 50 ms (its period is 100 ms)
        seq = 0
        while not stop.is_set():
            seq += 1
            budget.write_arbiter(path, seq, allowed["centi"], 50, 10000, 0)
            stop.wait(0.05)

    writer = threading.Thread(target=arbiter, daemon=True)
    writer.start()
    env = _tenant_env(tmp_path, 1, 20000, TENANT_LAUNCH_LOG="1")
    tenant = subprocess.Popen(
        [str(TENANT), "load", "100:30"], env=env, stdout=subprocess.PIPE, text=True
    )
    assert tenant.stdout is not None
    try:
        deadline = time.monotonic() + 20
        last_at, last_switches = time.monotonic(), 0
        gap_s = rate = 0.0
        for line in tenant.stdout:  # a long gap: the bucket engaged, the cost estimated
            now, switches = time.monotonic(), _voluntary_switches(tenant.pid)
            gap_s, rate = now - last_at, (switches - last_switches) / (now - last_at)
            last_at, last_switches = now, switches
            if ("launched_ns" in line and gap_s > 0.8) or now > deadline:
                break
        assert gap_s > 0.8, "the throttle never held a launch for long"
        # one sleep per second of the wait and the controller's 20 periods,
        # not a wake-up every 10 ms
        assert rate < 60, f"{rate:.0f} wake-ups/s while a launch was held for tokens"
        time.sleep(0.1)  # the next launch sleeps for 1 s from last_at unless woken
        raised_at = time.monotonic()
        allowed["centi"] = 1000
        line = tenant.stdout.readline()
        assert "launched_ns" in line, line
        woke_s = json.loads(line)["launched_ns"] / 1e9 - raised_at
        # the controller sees the new share within its period (50 ms) of the
        # arbiter's write (50 ms), wakes the launch, and the 20 ms debt is
        # earned at 10 % in 0.2 s (0.4 s in all; without the wake-up on the
        # raise, the disengagement once the debt is paid wakes it about 0.2 s
        # later); a launch nothing wakes sleeps on to 0.9 s
        assert woke_s < 0.7, f"the held launch ran {woke_s:.2f} s after its share was raised"
    finally:
        stop.set()
        tenant.kill()
        tenant.wait()
        writer.join()


# A container's engagement is where a busy machine shows: its controllers
# wait for a CPU before their first samples over the limit, so the buckets
# engage late, and the gain's steps that bring an over-generous first estimate
# down run late too. Beside two CPU spinners on two cores 24 processes held up
# to 54 % of the card over their first 1.5 s (36 % when idle), and 96
# processes 63 % over their first 2 s and then 39 % over the next 2 s (the
# band's top is 38). So the first phase holds the engagement, the second the
# settling, however late, and the third is held to the band (issue 29).
CONTAINER_PHASES = 3


def _container_shares(work: Path, processes: int, phase_s: float) -> list[float]:
    """Greedy tenants in one container under a 30 % limit, CONTAINER_PHASES
    phases of `phase_s`: the container's share of the card in each (the card's
    timeline)."""
    budget.ensure(work / budget.FILE_NAME)
    env = _tenant_env(work, 30, 200)
    phases = ",".join([f"100:{phase_s}"] * CONTAINER_PHASES)
    tenants = [
        subprocess.Popen([str(TENANT), "load", phases], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(processes)
    ]
    shares = [0.0] * CONTAINER_PHASES
    for tenant in tenants:
        out, _ = tenant.communicate(timeout=90)
        assert tenant.returncode == 0
        for i, line in enumerate(out.splitlines()):
            phase = json.loads(line)
            shares[i] += 100 * phase["busy_ns"] / (phase["seconds"] * 1e9)
    return shares


@pytest.mark.timeout(90)
def test_a_container_of_many_greedy_processes_is_held_to_its_limit_from_the_start(
    tmp_path: Path,
) -> None:
    """24 greedy processes share one 30 % limit. Each bucket engages at its
    process's part of the container's work (or an equal part of its live
    processes), not at the whole limit: before, the 24 buckets started at 30 %
    each and the gain's 0.7 steps took seconds to bring them down (the
    container held 100 % of the card over its first 1.5 s, 37 % over the
    next; now 36 % and 31 %)."""
    shares = _container_shares(tmp_path, 24, 1.5)
    print(f"24 processes at 30%: {[round(x, 1) for x in shares]}")
    # the first phase holds the engagement (the first sample runs free): the
    # buckets engaged within its first half (100 % for all of it before)
    assert shares[0] < 65, shares
    assert 22 <= shares[-1] <= 36, shares


@pytest.mark.timeout(120)
def test_a_container_of_a_hundred_small_processes_is_measured_whole(tmp_path: Path) -> None:
    """96 greedy processes under one 30 % limit each use about 0.3 % of the
    card, which NVML's whole-percent samples read as 0 most of the time: summed,
    the container looked like half of what it used, and held about 50 % of the
    card. The card's own utilisation has no such rounding; its excess over all
    processes' samples is what the small ones lost, and goes to their container."""
    shares = _container_shares(tmp_path, 96, 2.0)
    print(f"96 processes at 30%: {[round(x, 1) for x in shares]}")
    assert 22 <= shares[-1] <= 38, shares
