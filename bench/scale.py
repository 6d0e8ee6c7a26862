"""Scale: ListAndWatch message size and start-up time for big nodes.

For each node shape (cards x memory unit) a fresh daemon is started against the
kubelet simulator; we record the wall time from spawning the process until both
resources are registered with their first ListAndWatch message received, and the
largest ListAndWatch message per resource as the simulator received it.
"""

from __future__ import annotations

import shutil
import statistics
import time

from bench.common import Json, Target
from vgpu.sim.harness import SimNode
from vgpu.sim.kubelet import MAX_MESSAGE_BYTES

#: (mock GPUs, memory unit MiB)
SHAPES: tuple[tuple[str, int], ...] = (
    ("preset:8xH200", 256),
    ("preset:8xH200", 128),
    ("preset:16xH200", 256),
    ("preset:16xH200", 128),
    ("preset:16xH200", 64),
)
MESSAGE_LIMIT_BYTES = 1024 * 1024
STARTUP_LIMIT_S = 3.0


def _one(gpus: str, unit_mib: int) -> tuple[float, dict[str, int], dict[str, int]]:
    """(seconds to registered, max message bytes per resource, devices per resource)."""
    node = SimNode(gpus=gpus, node="bench-node", daemon_args=["--memory-unit-mib", str(unit_mib)])
    try:
        assert node.api is not None
        node.api.start()
        node.api.write_kubeconfig(node.kubeconfig)
        node.kubelet.start()
        t0 = time.perf_counter()
        node.start_daemon(timeout_s=60.0)
        startup = time.perf_counter() - t0
        resources = (node.core, node.memory)
        sizes = {r.rsplit("/", 1)[1]: node.kubelet.max_message_bytes(r) for r in resources}
        devices = {r.rsplit("/", 1)[1]: node.kubelet.capacity(r) for r in resources}
        return startup, sizes, devices
    finally:
        node.close()
        shutil.rmtree(node.root, ignore_errors=True)


def run(repeats: int) -> Json:
    rows: list[Json] = []
    targets: list[Target] = []
    for gpus, unit in SHAPES:
        startups: list[float] = []
        sizes: dict[str, int] = {}
        devices: dict[str, int] = {}
        for _ in range(repeats):
            startup, sizes, devices = _one(gpus, unit)
            startups.append(startup)
        cards = int(gpus.split(":")[1].split("x")[0])
        label = f"{cards} cards, {unit} MiB"
        startup_s = statistics.median(startups)
        rows.append(
            {
                "shape": label,
                "gpus": gpus,
                "memory_unit_mib": unit,
                "devices": devices,
                "message_bytes": sizes,
                "startup_s": round(startup_s, 3),
                "startup_all_s": [round(s, 3) for s in startups],
            }
        )
        biggest = max(sizes.values())
        targets.append(
            Target(f"ListAndWatch bytes, {label}", biggest, MESSAGE_LIMIT_BYTES, "bytes")
        )
        targets.append(Target(f"start to registered, {label}", round(startup_s, 3), 3.0, "s"))
    return {
        "config": {"repeats": repeats, "kubelet_limit_bytes": MAX_MESSAGE_BYTES},
        "shapes": rows,
        "targets": [t.to_json() for t in targets],
    }
