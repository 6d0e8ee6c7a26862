"""Admission latency: GetPreferredAllocation and Allocate through the kubelet simulator.

The vgpu daemon (a subprocess on mock GPUs, with the fake API server) and the
NullDevicePlugin (the do-nothing baseline, registered under two resource names
advertising the very same device IDs, so every request and answer has the same
size) are admitted in turn, pod for pod, in the same simulator, so both see the
same machine load. Fractional pods ask both resources; the resource order
alternates; a sliding window of live pods is deleted as new ones arrive, so the
node never fills.

`strategy` is vgpu's device_list_strategy (envvar, cdi, volume-mounts): with
`cdi`, every Allocate also writes (atomically, fsynced) the container's CDI
spec before it answers. Run one strategy alone:

    python -m bench.admission --strategy cdi --count 400
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Sequence

from bench.common import Json, Target, ms, percentile
from vgpu.sim.harness import SimNode
from vgpu.sim.kubelet import CALL_ALLOCATE, CALL_PREFERRED, Admission, SimPod
from vgpu.sim.nullplugin import NullDevicePlugin

GPUS = "preset:8xH200"
LIVE_WINDOW = 8  # live pods per plugin; 8 small slices never fill 8 cards
WARMUP = 5  # admissions per plugin left out of the statistics
CORE_SIZES = (10, 20, 30, 40)
MEMORY_SIZES = (16, 24, 40, 64, 96)  # units of 256 MiB
NULL_CORE = "null.io/vcuda-core"
NULL_MEMORY = "null.io/vcuda-memory"
P50_RATIO_LIMIT = 4.0
P99_RATIO_LIMIT = 3.0


class _Latencies:
    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {CALL_PREFERRED: [], CALL_ALLOCATE: []}
        self.admit_s: list[float] = []
        self.failures: list[str] = []

    def add(self, admission: Admission, wall_s: float) -> None:
        if not admission.ok:
            self.failures.append(admission.error or "unknown error")
            return
        for kind, values in admission.latencies_s.items():
            self.calls.setdefault(kind, []).extend(values)
        self.admit_s.append(wall_s)

    def summary(self) -> Json:
        out: Json = {"admissions": len(self.admit_s), "failures": len(self.failures)}
        for kind, values in self.calls.items():
            if values:
                out[kind] = {
                    "calls": len(values),
                    "p50_ms": ms(percentile(values, 50)),
                    "p99_ms": ms(percentile(values, 99)),
                    "max_ms": ms(max(values)),
                }
        if self.admit_s:
            out["pod"] = {
                "p50_ms": ms(percentile(self.admit_s, 50)),
                "p99_ms": ms(percentile(self.admit_s, 99)),
            }
        if self.failures:
            out["first_failure"] = self.failures[0][:300]
        return out


def _requests(i: int, core: str, memory: str) -> dict[str, int]:
    return {
        core: CORE_SIZES[i % len(CORE_SIZES)],
        memory: MEMORY_SIZES[(i // 2) % len(MEMORY_SIZES)],
    }


def _ratio(a: float, b: float) -> float:
    return round(a / b, 2) if b > 0 else float("inf")


def run(count: int, strategy: str = "envvar") -> Json:
    """Admit ``count`` pods to vgpu and ``count`` to the null plugin, interleaved."""
    node = SimNode(gpus=GPUS, node="bench-node")
    node.daemon_args += [
        "--device-list-strategy",
        strategy,
        "--cdi-dir",
        str(node.root / "cdi"),
    ]
    nulls: list[NullDevicePlugin] = []
    try:
        node.start(timeout_s=30.0)
        for name, same_as in ((NULL_CORE, node.core), (NULL_MEMORY, node.memory)):
            plugin = NullDevicePlugin(
                node.plugin_dir, name, 0, f"null-{name.rsplit('-', 1)[1]}.sock", workers=8
            )
            # The very same IDs as vgpu advertises: identical message sizes.
            plugin.set_devices(dict.fromkeys(node.kubelet.devices(same_as), "Healthy"))
            plugin.start()
            nulls.append(plugin)
        if not node.kubelet.wait_registered([NULL_CORE, NULL_MEMORY], 20.0):
            raise RuntimeError("the null plugin did not register")

        vgpu, null = _Latencies(), _Latencies()
        live_vgpu: list[SimPod] = []
        live_null: list[SimPod] = []
        started = time.perf_counter()
        for i in range(count + WARMUP):
            forward = i % 2 == 0
            # vgpu: created in the API server, then admitted (what `node.submit` does).
            pod = node.pod(f"bench-{i}", _requests(i, node.core, node.memory))
            order: Sequence[str] = (node.core, node.memory) if forward else (node.memory, node.core)
            t0 = time.perf_counter()
            result = node.submit(pod, order)
            wall = time.perf_counter() - t0
            if i >= WARMUP:
                vgpu.add(result, wall)
            if result.ok:
                live_vgpu.append(pod)
            if len(live_vgpu) > LIVE_WINDOW:
                node.delete(live_vgpu.pop(0))
            # The null plugin: the same kubelet flow, the same sizes and order.
            npod = node.pod(f"null-{i}", _requests(i, NULL_CORE, NULL_MEMORY))
            norder = (NULL_CORE, NULL_MEMORY) if forward else (NULL_MEMORY, NULL_CORE)
            t0 = time.perf_counter()
            nresult = node.kubelet.admit(npod, norder)
            wall = time.perf_counter() - t0
            if i >= WARMUP:
                null.add(nresult, wall)
            if nresult.ok:
                live_null.append(npod)
            if len(live_null) > LIVE_WINDOW:
                node.kubelet.remove_pod(live_null.pop(0).uid)
        elapsed = time.perf_counter() - started

        vs, ns = vgpu.summary(), null.summary()
        targets: list[Target] = []
        ratios: Json = {}
        for kind in (CALL_PREFERRED, CALL_ALLOCATE):
            if kind in vs and kind in ns:
                ratios[kind] = {
                    "p50": _ratio(vs[kind]["p50_ms"], ns[kind]["p50_ms"]),
                    "p99": _ratio(vs[kind]["p99_ms"], ns[kind]["p99_ms"]),
                }
        if CALL_ALLOCATE in ratios:
            targets.append(
                Target(
                    "Allocate p50 vs null plugin",
                    ratios[CALL_ALLOCATE]["p50"],
                    P50_RATIO_LIMIT,
                    "x",
                )
            )
            targets.append(
                Target(
                    "Allocate p99 vs null plugin",
                    ratios[CALL_ALLOCATE]["p99"],
                    P99_RATIO_LIMIT,
                    "x",
                )
            )
        return {
            "config": {
                "gpus": GPUS,
                "strategy": strategy,
                "admissions": count,
                "warmup": WARMUP,
                "live_window": LIVE_WINDOW,
                "core_devices": node.kubelet.capacity(node.core),
                "memory_devices": node.kubelet.capacity(node.memory),
            },
            "vgpu": vs,
            "null": ns,
            "ratios": ratios,
            "elapsed_s": round(elapsed, 2),
            "targets": [t.to_json() for t in targets],
        }
    finally:
        for plugin in nulls:
            plugin.stop()
        node.close()
        shutil.rmtree(node.root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="envvar", choices=["envvar", "cdi", "volume-mounts"])
    parser.add_argument("--count", type=int, default=400)
    args = parser.parse_args()
    print(json.dumps(run(args.count, args.strategy), indent=1))


if __name__ == "__main__":
    main()
