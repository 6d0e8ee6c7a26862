"""DRA mode: NodePrepareResources latency and slice publication after a health change.

One DRA driver (`vgpu serve --mode dra`, a subprocess on 8 mock H200s) with the
fake API server, the scheduler stand-in and the DRA kubelet stand-in:

* prepare: pods of one claim and pods of 8 claims (1 core and 256 MiB each,
  so the node never fills) are allocated by the stand-in, then prepared with
  one NodePrepareResources call per pod, as the kubelet makes it; each pod is
  then unprepared, deallocated and its claims deleted. Latency is the
  kubelet-side time of the call (fsync'd claim record, limit config and CDI
  spec per claim included). Between allocation and prepare the bench waits
  10 ms, far less than a real bind and pod sync take, and reports how many
  claims came from the driver's watch cache and how many from a GET.
* publication: card 1 of the mock file turns unhealthy, then healthy again;
  the time from the file write to the ResourceSlice in the API server showing
  the change (the mock backend polls its file every 0.2 s, NVML reports
  events as they happen).
"""

from __future__ import annotations

import json
import shutil
import socket
import time
import urllib.request
from pathlib import Path

from bench.common import Json, Target, ms, percentile
from vgpu.adapters.gpus import preset_cards
from vgpu.sim.draharness import DraSimNode, PodRun
from vgpu.sim.harness import wait_until

CARDS = 8
WARMUP = 5
CLAIMS_PER_POD = 8
BIND_DELAY_S = 0.01
PREPARE_ONE_P99_LIMIT_MS = 50.0
PREPARE_POD_P99_LIMIT_MS = 200.0
PUBLISH_LIMIT_S = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _mock_file(root: Path, unhealthy: bool) -> Path:
    path = root / "gpus.json"
    gpus = [
        {
            "uuid": c.uuid,
            "name": c.name,
            "memory_mib": c.memory_mib,
            "numa_node": c.numa_node,
            "healthy": not (unhealthy and c.index == 1),
        }
        for c in preset_cards(f"preset:{CARDS}xH200")
    ]
    tmp = root / ".gpus.json.tmp"
    tmp.write_text(json.dumps({"gpus": gpus}))
    tmp.replace(path)
    return path


def _pods(node: DraSimNode, pods: int, claims: int, tag: str) -> list[float]:
    latencies: list[float] = []
    for i in range(pods + WARMUP):
        names = [f"{tag}{i}-{j}" for j in range(claims)]
        for name in names:
            node.claim(name, {"cores": "1", "memory": "256Mi"})
        pod = f"{tag}-pod-{i}"
        time.sleep(BIND_DELAY_S)
        before = len(node.kubelet.latencies_s["prepare"])
        run: PodRun = node.run_pod(pod, names)
        if not run.ok:
            raise RuntimeError(f"prepare failed: {run.reply}")
        if i >= WARMUP:
            latencies.append(node.kubelet.latencies_s["prepare"][before])
        node.end_pod(run)
        for name in names:
            node.api.delete_object("resourceclaims", name, "default")
    return latencies


def _summary(values: list[float]) -> Json:
    return {
        "calls": len(values),
        "p50_ms": ms(percentile(values, 50)),
        "p99_ms": ms(percentile(values, 99)),
        "max_ms": ms(max(values)),
    }


def _publication(node: DraSimNode, root: Path, toggles: int) -> list[float]:
    times: list[float] = []
    for i in range(toggles):
        sick = i % 2 == 0
        want = [f"gpu-{k}" for k in range(CARDS) if not (sick and k == 1)]
        started = time.perf_counter()
        _mock_file(root, unhealthy=sick)
        if not wait_until(lambda w=want: node.schedulable() == w, 10.0, 0.002):  # type: ignore[misc]
            raise RuntimeError(f"the slice did not follow the health change: {node.schedulable()}")
        times.append(time.perf_counter() - started)
    return times


def _claim_reads(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("vgpu_dra_claim_reads{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            out[source] = float(line.rsplit(" ", 1)[1])
    return out


def run(pods: int) -> Json:
    """``pods`` one-claim pods, ``pods // 4`` eight-claim pods, up to 20 health changes."""
    port = _free_port()
    node = DraSimNode(node="bench-node", daemon_args=["--metrics-address", f"127.0.0.1:{port}"])
    node.gpus = str(_mock_file(node.root, unhealthy=False))
    try:
        node.start(timeout_s=60.0)
        one = _pods(node, pods, 1, "a")
        eight = _pods(node, max(pods // 4, 5), CLAIMS_PER_POD, "b")
        publication = _publication(node, node.root, max(4, min(20, pods // 3)))
        reads = _claim_reads(port)
    finally:
        node.close()
        shutil.rmtree(node.root, ignore_errors=True)
    result: Json = {
        "cards": CARDS,
        "prepare_one_claim": _summary(one),
        "prepare_pod_of_8_claims": _summary(eight),
        "publication_s": {
            "changes": len(publication),
            "p50_s": round(percentile(publication, 50), 3),
            "p99_s": round(percentile(publication, 99), 3),
            "max_s": round(max(publication), 3),
        },
        "claim_reads": reads,
    }
    result["targets"] = [
        Target(
            "NodePrepareResources p99, 1 claim",
            result["prepare_one_claim"]["p99_ms"],
            PREPARE_ONE_P99_LIMIT_MS,
            "ms",
        ).to_json(),
        Target(
            "NodePrepareResources p99, pod of 8 claims",
            result["prepare_pod_of_8_claims"]["p99_ms"],
            PREPARE_POD_P99_LIMIT_MS,
            "ms",
        ).to_json(),
        Target(
            "slice publication after a health change, max",
            result["publication_s"]["max_s"],
            PUBLISH_LIMIT_S,
            "s",
        ).to_json(),
    ]
    return result
