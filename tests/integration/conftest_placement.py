"""Fixtures and checks shared by the placement, recovery and gRPC fuzz tests.

Imported explicitly (``from tests.integration.conftest_placement import ...``);
pytest does not load it as a conftest. Every directory lives directly under
/tmp with a short prefix: Unix socket paths are limited to 107 bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc
import pytest

from tests.conftest import NodeFactory
from tests.conftest import card as test_card
from vgpu.adapters.gpus import PRESETS, preset_cards
from vgpu.cli.status import collect
from vgpu.core.model import Resource
from vgpu.core.slicing import card_digest, parse_device_id
from vgpu.pb import deviceplugin_v1beta1_pb2 as pb
from vgpu.pb import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from vgpu.sim.harness import SimNode, wait_until
from vgpu.sim.kubelet import Admission

UNIT_MIB = 256
CORE = "vendor.io/vcuda-core"
MEM = "vendor.io/vcuda-memory"
SHORT = {CORE: Resource.CORE.value, MEM: Resource.MEMORY.value}
EXPECTED_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
}


def mock_card(i: int, memory_mib: int = 143771, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "uuid": f"GPU-pl{i:04d}-0000-4000-8000-{i:012d}",
        "name": "NVIDIA H200",
        "memory_mib": memory_mib,
        "numa_node": 0,
    }
    out.update(extra)
    return out


def write_mock(path: Path, gpus: Sequence[Mapping[str, Any]]) -> Path:
    """Atomically (re)write a mock GPU file; the new inode makes the watcher notice."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"gpus": list(gpus)}))
    os.replace(tmp, path)
    return path


class NodeMaker(Protocol):
    def __call__(
        self,
        gpus: str | Path = "preset:2xH200",
        *,
        api: bool = True,
        daemon_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        start: bool = True,
    ) -> SimNode: ...


@pytest.fixture
def pl_tmp(short_tmp: Path) -> Path:
    return short_tmp


@pytest.fixture
def sim_node(make_node: NodeFactory) -> NodeMaker:
    """SimNodes with an API server and a 1 s reconcile (the shared make_node
    checks at teardown that each daemon exits 0 on SIGTERM with a clean log)."""

    def make(
        gpus: str | Path = "preset:2xH200",
        *,
        api: bool = True,
        daemon_args: Sequence[str] = ("--reconcile-interval-s", "1"),
        env: Mapping[str, str] | None = None,
        start: bool = True,
    ) -> SimNode:
        return make_node(gpus, api=api, daemon_args=daemon_args, env=env, start=start, seed=7)

    return make


def restart_daemon(node: SimNode) -> None:
    """Start the daemon and wait until both resources stream healthy devices again
    (SimNode.start_daemon returns on registration, before the first ListAndWatch
    message turns the previous run's Unhealthy devices back to Healthy)."""
    node.start_daemon(timeout_s=15)
    assert node.kubelet.wait_for(
        lambda: all(
            node.kubelet.connected(r) and "Healthy" in node.kubelet.devices(r).values()
            for r in (CORE, MEM)
        ),
        10,
    ), node.log()[-2000:]


def restart_kubelet(node: SimNode, **window: float) -> None:
    """Restart the kubelet simulator (KubeletSimulator.restart's windows) and wait
    until the daemon registered again and both resources have capacity."""
    registrations = node.registrations()
    node.kubelet.restart(**window)
    assert node.kubelet.wait_for(
        lambda: (
            node.registrations() > registrations
            and node.kubelet.capacity(CORE) > 0
            and node.kubelet.capacity(MEM) > 0
        ),
        10,
    ), node.log()[-3000:]


# ------------------------------------------------------------------ direct gRPC


def plugin_stub(node: SimNode, resource: Resource) -> tuple[grpc.Channel, Any]:
    path = node.plugin_dir / f"vgpu-{resource.value}.sock"
    channel = grpc.insecure_channel(
        f"unix://{path}", options=[("grpc.max_send_message_length", 64 * 1024 * 1024)]
    )
    return channel, pb_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]


def allocate(node: SimNode, resource: Resource, ids: Sequence[str]) -> pb.AllocateResponse:
    channel, stub = plugin_stub(node, resource)
    with channel:
        req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
        return stub.Allocate(req, timeout=10)


def rpc_error(fn: Callable[[], Any]) -> grpc.RpcError:
    try:
        fn()
    except grpc.RpcError as err:
        return err
    raise AssertionError("the call succeeded; an error was expected")


# ------------------------------------------------------------------ checks


def _known_uuids() -> dict[str, str]:
    """digest -> UUID of every card the tests' mock GPUs can have (the presets and
    mock_card(i)); 20-bit digests of these ~400 UUIDs do not collide (checked)."""
    uuids = [str(c.uuid) for m in PRESETS for c in preset_cards(f"preset:64x{m}")]
    uuids += [mock_card(i)["uuid"] for i in range(64)]
    uuids += [test_card(i)["uuid"] for i in range(32)]
    out = {card_digest(u): u for u in uuids}
    assert len(out) == len(set(uuids))
    return out


_KNOWN = _known_uuids()


def card_of(device_id: str) -> str:
    """The UUID of the card a device ID names (short or legacy form)."""
    ref = parse_device_id(device_id)
    if ref.card_uuid is not None:
        return str(ref.card_uuid)
    return _KNOWN[ref.card_digest]


def cards_of(ids: Mapping[str, Sequence[str]]) -> set[str]:
    return {card_of(d) for resource_ids in ids.values() for d in resource_ids}


def assert_coherent(ids: Mapping[str, Sequence[str]], where: str = "") -> None:
    """A container's core and memory IDs share one card, unless it holds whole cards."""
    core = ids.get(CORE, [])
    if len(core) >= 100:
        assert len(core) % 100 == 0, where
        core_cards = {card_of(d) for d in core}
        assert len(core_cards) == len(core) // 100, where
        assert {card_of(d) for d in ids.get(MEM, [])} <= core_cards, where
        return
    assert len(cards_of(ids)) <= 1, f"{where}: IDs on several cards: {ids}"


def assert_admitted_ok(result: Admission) -> None:
    assert result.ok, result.error
    for c in result.containers:
        assert c.clashes == [], c.clashes
        assert_coherent(c.device_ids, f"{result.pod.name}/{c.name}")


def status(node: SimNode) -> dict[str, Any]:
    return collect(node.state_dir)


def live_app_containers(node: SimNode) -> dict[tuple[str, str], dict[str, list[str]]]:
    """(pod name, container) -> resource -> IDs for every app container the kubelet holds."""
    out: dict[tuple[str, str], dict[str, list[str]]] = {}
    pods = {p.uid: p for p in node.kubelet.active_pods()}
    for uid, containers in node.kubelet.allocated().items():
        pod = pods.get(uid)
        if pod is None:
            continue
        for c in pod.containers:
            ids = containers.get(c.name) or {}
            if any(ids.values()):
                out[(pod.name, c.name)] = ids
    return out


def _record_ids(record: Mapping[str, Any]) -> dict[str, frozenset[str]]:
    return {r: frozenset(v) for r, v in record["device_ids"].items() if v}


def _subset(a: Mapping[str, frozenset[str]], b: Mapping[str, frozenset[str]]) -> bool:
    """Every ID of record `a` is in record `b` (an init container's, reused by an app)."""
    return all(ids <= b.get(r, frozenset()) for r, ids in a.items())


def _container_ids(ids: Mapping[str, Sequence[str]]) -> dict[str, frozenset[str]]:
    return {SHORT[r]: frozenset(v) for r, v in ids.items() if v}


def capacity_problems(node: SimNode) -> list[str]:
    """No card over 100 core or its memory, no ID held twice (kubelet and our state)."""
    problems = []
    doc = status(node)
    # Count unique IDs: a finished init container's record shares IDs with the
    # app container that reused them (both records are kept while the pod lives).
    held: dict[str, dict[str, set[str]]] = {}
    for c in doc["containers"]:
        for resource, ids in c["device_ids"].items():
            for d in ids:
                held.setdefault(card_of(d), {}).setdefault(resource, set()).add(d)
    for card in doc["cards"]:
        limit = card["memory_mib"] // UNIT_MIB
        mine = held.get(card["uuid"], {})
        core = len(mine.get(Resource.CORE.value, ()))
        mem = len(mine.get(Resource.MEMORY.value, ()))
        if core > 100:
            problems.append(f"card {card['uuid']} core {core} > 100")
        if mem > limit:
            problems.append(f"card {card['uuid']} memory {mem} units > {limit}")
    records = [_record_ids(c) for c in doc["containers"]]
    for i, a in enumerate(records):
        for b in records[i + 1 :]:
            if _subset(a, b) or _subset(b, a):
                continue
            for resource in set(a) & set(b):
                if a[resource] & b[resource]:
                    problems.append(f"{sorted(a[resource] & b[resource])[:3]} in two records")
    for (pod, name), ids in live_app_containers(node).items():
        try:
            assert_coherent(ids, f"{pod}/{name}")
        except AssertionError as exc:
            problems.append(str(exc))
    return problems


def state_problems(node: SimNode, exact: bool = True) -> list[str]:
    """Every live container has a config dir with its IDs; with `exact`, nothing else."""
    doc = status(node)
    problems = (
        [f"unreadable records {doc['unreadable_records']}"] if doc["unreadable_records"] else []
    )
    by_ids = {frozenset(_record_ids(c).items()): c for c in doc["containers"]}
    matched = set()
    for (pod, name), ids in live_app_containers(node).items():
        want = frozenset(_container_ids(ids).items())
        record = by_ids.get(want)
        if record is None:
            problems.append(f"{pod}/{name} holds {ids} but no config dir has those IDs")
            continue
        matched.add(record["key"])
        if not Path(record["config_path"]).exists():
            problems.append(f"{pod}/{name}: {record['config_path']} missing")
    if exact:
        live = [_record_ids(c) for c in doc["containers"] if c["key"] in matched]
        extra = sorted(
            c["key"]
            for c in doc["containers"]
            if c["key"] not in matched and not any(_subset(_record_ids(c), b) for b in live)
        )
        if extra:
            problems.append(f"orphaned config dirs {extra}")
    return problems


def wait_consistent(node: SimNode, timeout_s: float = 15.0) -> None:
    ok = wait_until(
        lambda: not state_problems(node) and not capacity_problems(node), timeout_s, 0.2
    )
    assert ok, (
        f"state: {state_problems(node)}\ncapacity: {capacity_problems(node)}\n"
        f"log tail:\n{node.log()[-3000:]}"
    )


def annotated(node: SimNode, namespace: str, pod: str) -> dict[str, Any] | None:
    assert node.api is not None
    obj = node.api.get_pod(namespace, pod)
    if obj is None:
        return None
    raw = (obj.get("metadata", {}).get("annotations") or {}).get("vendor.io/vgpu-placements")
    return json.loads(raw) if raw else None
