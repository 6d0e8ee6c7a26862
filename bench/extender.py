"""The scheduler extender at cluster scale: 1,000 nodes x 8 cards with 20,000
running slices in its caches (quick mode: 100 nodes, 2,000 slices).

In-process, through the extender's own HTTP edge code (JSON in -> decision ->
JSON out, the socket left out): filter and prioritize over the full node list
(NodeNames, as kube-scheduler sends with nodeCacheCapable), bind with the API
writes replaced by a do-nothing binder, and pods/s through filter ->
prioritize -> bind (node_choice "scheduler"), and again with node_choice
"extender" (filter answers one node: filter -> bind). A do-nothing
extender (every node passes, every score 0, every bind succeeds) through the
same edge gives the ratio. Then the real
`vgpu extender` runs as a subprocess against the fake API server holding the
same nodes and pods, for its resident memory once its caches are synced.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.common import Json, Target, ms, percentile
from vgpu.adapters.extender_http import BindRequest, ExtenderHttp, PodRequest
from vgpu.adapters.kube_cluster import node_inventory, pod_info
from vgpu.core.annotations import format_inventory
from vgpu.core.model import Card, CardUuid, Policy
from vgpu.core.scheduling import FilterVerdict
from vgpu.daemon.extender_service import ExtenderService
from vgpu.sim.apiserver import FakeApiServer, make_node, make_pod
from vgpu.sim.cluster import extender_command, free_port
from vgpu.sim.harness import wait_until

DOMAIN = "vendor.io"
CORE, MEM = f"{DOMAIN}/vcuda-core", f"{DOMAIN}/vcuda-memory"
UNIT = 256
H200_MIB = 143771
FILTER_P99_MS = 10.0
PRIORITIZE_P99_MS = 10.0
BIND_P99_MS = 15.0
RSS_LIMIT_MIB = 300.0
PODS_PER_S = 100.0
# Shapes of the running slices and of the pods scheduled (core %, memory units).
RUNNING = [(10, 16), (20, 40), (30, 64), (0, 32), (40, 80), (25, 24)]
ARRIVING = [(10, 16), (30, 40), (50, 160), (0, 64), (60, 200), (90, 400), (100, 0)]


class NullBinder:
    """The API writes of a bind, left out: what is measured is the extender's work."""

    def __init__(self) -> None:
        self.assignments: dict[str, str] = {}  # pod uid -> the annotation it would write

    def bind(self, namespace: str, name: str, uid: str, node: str, assignment: str) -> None:
        self.assignments[uid] = assignment

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return None


class NullExtender:
    """A do-nothing extender: every node passes, scores 0, every bind succeeds."""

    def filter(self, pod: PodRequest, nodes: Sequence[str]) -> FilterVerdict | str:
        return FilterVerdict(list(nodes), {}, {})

    def prioritize(self, pod: PodRequest, nodes: Sequence[str]) -> list[tuple[str, int]]:
        return [(n, 0) for n in nodes]

    def bind(self, request: BindRequest) -> str:
        return ""

    def ready(self) -> bool:
        return True


# ------------------------------------------------------------------ the cluster


def _cards(node: int) -> list[Card]:
    return [
        Card(
            CardUuid(f"GPU-{node:05d}{i:03d}-0000-4000-8000-000000000000"),
            i,
            "NVIDIA H200",
            H200_MIB,
            i,
            numa_node=i // 4,
        )
        for i in range(8)
    ]


def _pod_json(
    name: str, core: int, mem: int, node: str | None, annotations: dict[str, str] | None
) -> dict[str, Any]:
    limits = {k: str(v) for k, v in ((CORE, core), (MEM, mem)) if v}
    pod = make_pod(
        name,
        node=node,
        containers=[{"name": "main", "resources": {"limits": limits}}],
        annotations=annotations,
        phase="Running" if node else "Pending",
    )
    pod["metadata"]["uid"] = f"uid-{name}"
    pod["metadata"]["namespace"] = "default"
    return pod


def cluster(
    nodes: int, slices: int, seed: int = 7
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Node and Pod JSON as the API serves them: every slice placed on a card with room,
    its placements annotation written as the node daemon writes it."""
    rng = random.Random(seed)
    node_json = []
    room: dict[tuple[int, int], list[int]] = {}
    for n in range(nodes):
        annotation = format_inventory(_cards(n), UNIT, Policy.BINPACK)
        node_json.append(
            make_node(f"node-{n:04d}", annotations={f"{DOMAIN}/vgpu-node": annotation})
        )
        for i in range(8):
            room[(n, i)] = [100, H200_MIB // UNIT]
    pods = []
    keys = list(room)
    for s in range(slices):
        core, mem = rng.choice(RUNNING)
        for _ in range(50):
            n, i = rng.choice(keys)
            if room[(n, i)][0] >= core and room[(n, i)][1] >= mem:
                break
        room[(n, i)][0] -= core
        room[(n, i)][1] -= mem
        uuid = _cards(n)[i].uuid
        placements = json.dumps({"main": {"cards": [uuid], "core": core, "memory_mib": mem * UNIT}})
        pods.append(
            _pod_json(
                f"run-{s:05d}",
                core,
                mem,
                f"node-{n:04d}",
                {f"{DOMAIN}/vgpu-placements": placements},
            )
        )
    return node_json, pods


def _service(
    node_json: list[dict[str, Any]], pods: list[dict[str, Any]], *, pick_node: bool = False
) -> ExtenderService:
    """node_choice "scheduler" (every verb on every pod) unless `pick_node`."""
    service = ExtenderService(DOMAIN, Policy.BINPACK, NullBinder(), pick_node=pick_node)
    service.nodes_listed({n["metadata"]["name"]: node_inventory(n, DOMAIN) for n in node_json})
    service.pods_listed([pod_info(p, DOMAIN) for p in pods])
    service.synced("nodes", True)
    service.synced("pods", True)
    return service


# ------------------------------------------------------------------ measuring


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _request(edge: ExtenderHttp, verb: str, args: Json) -> tuple[float, Any]:
    """One request as the edge serves it: body bytes -> JSON -> answer -> body bytes."""
    body = json.dumps(args).encode()

    def serve() -> bytes:
        return edge.handle_bytes(verb, json.loads(body))

    seconds, answer = _timed(serve)
    return seconds, json.loads(answer)


def _stats(values: list[float]) -> Json:
    if not values:
        return {"requests": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    return {
        "requests": len(values),
        "p50_ms": ms(percentile(values, 50)),
        "p99_ms": ms(percentile(values, 99)),
        "max_ms": ms(max(values)),
    }


def _stream(
    edge: ExtenderHttp,
    service: ExtenderService | None,
    names: list[str],
    pods: list[dict[str, Any]],
) -> Json:
    """What kube-scheduler does, one pod after another: filter over every node,
    prioritize when more than one passes, bind to the best; then the pod cache
    sees the pod bound (the assumption turns into the pod's own record)."""
    times: dict[str, list[float]] = {"filter": [], "prioritize": [], "bind": []}
    bound = unschedulable = 0
    started = time.perf_counter()
    for pod in pods:
        if service is not None:
            service.pod_changed(pod_info(pod, DOMAIN))  # the pod cache has the pending pod
        seconds, verdict = _request(edge, "filter", {"Pod": pod, "NodeNames": names, "Nodes": None})
        times["filter"].append(seconds)
        passed = verdict["NodeNames"] or []
        if not passed:
            unschedulable += 1
            continue
        host = passed[0]
        if len(passed) > 1:
            seconds, scores = _request(
                edge, "prioritize", {"Pod": pod, "NodeNames": passed, "Nodes": None}
            )
            times["prioritize"].append(seconds)
            host = max(scores, key=lambda s: s["Score"])["Host"]
        meta = pod["metadata"]
        args = {
            "PodName": meta["name"],
            "PodNamespace": "default",
            "PodUID": meta["uid"],
            "Node": host,
        }
        seconds, answer = _request(edge, "bind", args)
        times["bind"].append(seconds)
        if answer["Error"]:
            continue
        bound += 1
        if service is not None:
            assert isinstance(service.binder, NullBinder)
            text = service.binder.assignments[meta["uid"]]
            bound_pod = {**pod, "spec": {**pod["spec"], "nodeName": host}}
            bound_pod["metadata"] = {**meta, "annotations": {f"{DOMAIN}/vgpu-assignment": text}}
            service.pod_changed(pod_info(bound_pod, DOMAIN))
    wall = time.perf_counter() - started
    return {
        "pods": len(pods),
        "bound": bound,
        "unschedulable": unschedulable,
        "pods_per_s": round(len(pods) / wall, 1),
        **{verb: _stats(values) for verb, values in times.items()},
    }


def _rss(node_json: list[dict[str, Any]], pods: list[dict[str, Any]]) -> Json:
    """The real `vgpu extender` against the fake API server holding the same objects."""
    root = Path(tempfile.mkdtemp(prefix="vgpu-bx-", dir="/tmp"))
    api = FakeApiServer(history_size=100, bookmark_interval_s=60.0)
    for node in node_json:
        api.add_node(node)
    for pod in pods:
        api.add_pod(pod)
    api.start()
    kubeconfig = root / "kubeconfig"
    api.write_kubeconfig(kubeconfig)
    port, metrics = free_port(), free_port()
    log = open(root / "extender.log", "wb")  # noqa: SIM115 - closed below
    started = time.perf_counter()
    proc = subprocess.Popen(
        extender_command(kubeconfig, port, "--metrics-address", f"127.0.0.1:{metrics}"),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        import http.client

        def ready() -> bool:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            try:
                conn.request("GET", "/readyz")
                return conn.getresponse().status == 200
            except OSError:
                return False
            finally:
                conn.close()

        if not wait_until(ready, 120, 0.2):
            raise RuntimeError((root / "extender.log").read_text()[-2000:])
        sync_s = time.perf_counter() - started
        time.sleep(1.0)
        rss = psutil.Process(proc.pid).memory_info().rss / 2**20
        return {"rss_mib": round(rss, 1), "sync_s": round(sync_s, 2)}
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        api.stop()
        shutil.rmtree(root, ignore_errors=True)


def _pod_with_sidecar(name: str, rng: random.Random) -> dict[str, Any]:
    pod = _pod_json(name, *rng.choice(ARRIVING[:4]), None, None)
    limits = {CORE: "10", MEM: "8"}
    pod["spec"]["containers"].append({"name": "sidecar", "resources": {"limits": limits}})
    return pod


def run(nodes: int = 1000, slices: int = 20000, pods: int = 400, cold: int = 12) -> Json:
    node_json, running = cluster(nodes, slices)
    names = [n["metadata"]["name"] for n in node_json]
    rng = random.Random(3)
    arriving = [
        _pod_with_sidecar(f"new-{i:05d}", rng)
        if rng.random() < 0.05
        else _pod_json(f"new-{i:05d}", *rng.choice(ARRIVING), None, None)
        for i in range(pods)
    ]
    service = _service(node_json, running)
    ours = ExtenderHttp(service, DOMAIN, "127.0.0.1:0")
    null = ExtenderHttp(NullExtender(), DOMAIN, "127.0.0.1:0")
    picking = _service(node_json, running, pick_node=True)
    ours_pick = ExtenderHttp(picking, DOMAIN, "127.0.0.1:0")
    try:
        vgpu_stream = _stream(ours, service, names, arriving)
        null_stream = _stream(null, None, names, arriving)
        # node_choice "extender": filter answers one node (and holds its room),
        # so no prioritize; the same pods from the same start.
        pick_stream = _stream(ours_pick, picking, names, arriving)
        # Shapes never seen before: every node's answer is computed afresh.
        fresh: dict[str, list[float]] = {"filter": [], "prioritize": []}
        for i in range(cold):
            pod = _pod_json(f"cold-{i}", 11 + i, 17 + 7 * i, None, None)
            if i % 4 == 3:
                pod = _pod_json(f"cold-{i}", 100 * (1 + i % 2), 20 + i, None, None)
            for verb in fresh:
                fresh[verb].append(
                    _request(ours, verb, {"Pod": pod, "NodeNames": names, "Nodes": None})[0]
                )
        sidecar = _pod_with_sidecar("cold-sidecar", random.Random(99))
        sidecar["spec"]["containers"][1]["resources"]["limits"] = {CORE: "13", MEM: "9"}
        multi = {
            verb: ms(_request(ours, verb, {"Pod": sidecar, "NodeNames": names, "Nodes": None})[0])
            for verb in ("filter", "prioritize")
        }
        full_nodes = {"metadata": {}, "items": node_json}
        full = [
            _request(ours, "filter", {"Pod": arriving[0], "NodeNames": None, "Nodes": full_nodes})[
                0
            ]
            for _ in range(5)
        ]
    finally:
        ours.close()
        ours_pick.close()
        null.close()
    rss = _rss(node_json, running)
    ratio = {
        verb: round(vgpu_stream[verb]["p99_ms"] / max(null_stream[verb]["p99_ms"], 1e-3), 2)
        for verb in ("filter", "prioritize", "bind")
    }
    targets = [
        Target("filter p99, full node list", vgpu_stream["filter"]["p99_ms"], FILTER_P99_MS, "ms"),
        # Picking, filter does prioritize's work too (the fullness of every
        # node that fits) and no prioritize follows: its bound is the two's.
        Target(
            "filter p99 picking the node, full node list",
            pick_stream["filter"]["p99_ms"],
            FILTER_P99_MS + PRIORITIZE_P99_MS,
            "ms",
        ),
        Target(
            "prioritize p99, full node list",
            vgpu_stream["prioritize"]["p99_ms"],
            PRIORITIZE_P99_MS,
            "ms",
        ),
        Target(
            "bind p99 without the API round trip", vgpu_stream["bind"]["p99_ms"], BIND_P99_MS, "ms"
        ),
        Target("extender RSS with the caches synced", rss["rss_mib"], RSS_LIMIT_MIB, "MiB"),
        # "at least 100 pods/s", as a limit on the time per pod
        Target(
            "ms per pod through filter, prioritize, bind",
            round(1000 / max(vgpu_stream["pods_per_s"], 1e-3), 2),
            1000 / PODS_PER_S,
            "ms",
        ),
    ]
    return {
        "nodes": nodes,
        "cards": nodes * 8,
        "running_slices": slices,
        "vgpu": vgpu_stream,
        "vgpu_picking": pick_stream,
        "null": null_stream,
        "p99_ratio_vs_null": ratio,
        "new_shape": {verb: _stats(values) for verb, values in fresh.items()},
        "new_shape_two_containers_ms": multi,
        "filter_full_node_objects_p50_ms": ms(percentile(full, 50)),
        **rss,
        "targets": [t.to_json() for t in targets],
    }


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(run(*(int(a) for a in sys.argv[1:])), indent=1))
