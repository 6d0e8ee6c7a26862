"""Footprint: the daemon's resident memory over admission churn, and its idle CPU.

One daemon on 8 mock H200s; pods are admitted and, beyond a small window of live
ones, deleted, ``count`` times. RSS is read with psutil at the start, half way and
at the end; after the churn settles, CPU time (user + system, all threads) is
sampled over an idle interval.
"""

from __future__ import annotations

import shutil
import time

import psutil  # type: ignore[import-untyped, unused-ignore]

from bench.common import Json, Target
from vgpu.sim.harness import SimNode
from vgpu.sim.kubelet import SimPod

GPUS = "preset:8xH200"
LIVE_WINDOW = 8
RSS_LIMIT_MIB = 100.0
GROWTH_LIMIT_MIB = 2.0
IDLE_CPU_LIMIT_PERCENT = 0.5
SETTLE_S = 2.0
QUIET_S = 2.0
SAMPLE_EVERY = 50
EARLY_SAMPLES = frozenset({1, 2, 5, 10, 25})
MIB = 2**20


def _churn(
    node: SimNode, start: int, count: int, live: list[SimPod], samples: list[tuple[int, float]]
) -> int:
    """Admit ``count`` pods, sampling (admissions so far, RSS MiB) on the way."""
    assert node.proc is not None
    proc = psutil.Process(node.proc.pid)
    failures = 0
    for i in range(start, start + count):
        if i % SAMPLE_EVERY == 0 or i in EARLY_SAMPLES:
            samples.append((i, round(proc.memory_info().rss / MIB, 1)))
        requests = {node.core: 10 + (i % 4) * 10, node.memory: 16 + (i % 7) * 8}
        order = (node.core, node.memory) if i % 2 == 0 else (node.memory, node.core)
        pod = node.pod(f"churn-{i}", requests)
        result = node.submit(pod, order)
        if result.ok:
            live.append(pod)
        else:
            failures += 1
        if len(live) > LIVE_WINDOW:
            node.delete(live.pop(0))
    return failures


def _patches(node: SimNode) -> int:
    """PATCH requests the API server got (the daemon's placement annotations)."""
    assert node.api is not None
    return sum(1 for method, _ in node.api.requests() if method == "PATCH")


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def _settle(node: SimNode, limit_s: float) -> float:
    """Wait until the API server has had no request for ``QUIET_S`` (and ``SETTLE_S`` passed).

    The daemon annotates each pod with its placement from one background thread; after a
    burst of admissions that queue takes a while to drain. Returns the seconds waited.
    """
    assert node.api is not None
    started = last_change = time.perf_counter()
    seen = node.api.request_count
    while True:
        time.sleep(0.25)
        now = time.perf_counter()
        count = node.api.request_count
        if count != seen:
            seen, last_change = count, now
        elif now - last_change >= QUIET_S and now - started >= SETTLE_S:
            return now - started
        if now - started >= limit_s:
            return now - started


def run(count: int, idle_s: float, settle_limit_s: float = 90.0) -> Json:
    node = SimNode(gpus=GPUS, node="bench-node")
    try:
        node.start(timeout_s=30.0)
        assert node.proc is not None
        proc = psutil.Process(node.proc.pid)
        rss_start = proc.memory_info().rss / MIB
        live: list[SimPod] = []
        half = count // 2
        started = time.perf_counter()
        samples: list[tuple[int, float]] = []
        failures = _churn(node, 0, half, live, samples)
        rss_half = proc.memory_info().rss / MIB
        failures += _churn(node, half, count - half, live, samples)
        rss_end = proc.memory_info().rss / MIB
        samples.append((count, round(rss_end, 1)))
        churn_s = time.perf_counter() - started
        patches_churn = _patches(node)
        for pod in live:
            node.delete(pod)
        # Let the deletions, owner syncs and the annotation backlog settle.
        settle_cpu0 = _cpu_s(proc)
        settle_s = _settle(node, settle_limit_s)
        settled = settle_s < settle_limit_s
        settle_cpu_s = _cpu_s(proc) - settle_cpu0
        patches_total = _patches(node)
        cpu0 = proc.cpu_times()
        t0 = time.perf_counter()
        time.sleep(idle_s)
        cpu1 = proc.cpu_times()
        wall = time.perf_counter() - t0
        busy = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
        idle_percent = 100.0 * busy / wall
        rss_idle = proc.memory_info().rss / MIB
        threads = proc.num_threads()
        growth = rss_end - rss_half
        targets = [
            Target("RSS after churn", round(rss_end, 1), RSS_LIMIT_MIB, "MiB"),
            Target("RSS growth, 2nd half of churn", round(growth, 2), GROWTH_LIMIT_MIB, "MiB"),
            Target("idle CPU", round(idle_percent, 3), IDLE_CPU_LIMIT_PERCENT, "% of a core"),
        ]
        return {
            "config": {
                "gpus": GPUS,
                "admissions": count,
                "live_window": LIVE_WINDOW,
                "idle_s": idle_s,
            },
            "rss_start_mib": round(rss_start, 1),
            "rss_half_mib": round(rss_half, 1),
            "rss_end_mib": round(rss_end, 1),
            "rss_idle_mib": round(rss_idle, 1),
            "rss_growth_mib": round(growth, 2),
            "rss_samples_mib": [[n, rss] for n, rss in samples],
            "churn_s": round(churn_s, 2),
            "annotation_patches_during_churn": patches_churn,
            "annotation_patches_total": patches_total,
            "settle_s": round(settle_s, 2),
            "settled": settled,
            "settle_cpu_s": round(settle_cpu_s, 3),
            "failures": failures,
            "idle_cpu_percent": round(idle_percent, 3),
            "idle_cpu_s": round(busy, 4),
            "threads": threads,
            "targets": [t.to_json() for t in targets],
        }
    finally:
        node.close()
        shutil.rmtree(node.root, ignore_errors=True)
