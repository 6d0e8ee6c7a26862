"""Issue 4: nothing lost. Crashes, lost or corrupt state, kubelet restarts,
GPU faults and API server outages, through the real daemon process."""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
from pathlib import Path

import grpc
import psutil
import pytest

from tests.adversarial.helpers import config_dir as container_config_dir
from tests.integration.conftest_placement import (
    CORE,
    MEM,
    NodeMaker,
    assert_admitted_ok,
    capacity_problems,
    card_of,
    cards_of,
    live_app_containers,
    mock_card,
    pl_tmp,
    plugin_stub,
    restart_daemon,
    restart_kubelet,
    sim_node,
    state_problems,
    status,
    wait_consistent,
    wait_until,
    write_mock,
)
from vgpu.core.model import Resource
from vgpu.pb import deviceplugin_v1beta1_pb2 as pb
from vgpu.sim.harness import SimNode
from vgpu.sim.kubelet import Admission

__all__ = ["pl_tmp", "sim_node"]


def advertised(node: SimNode) -> tuple[frozenset[str], frozenset[str]]:
    return frozenset(node.kubelet.devices(CORE)), frozenset(node.kubelet.devices(MEM))


def config_dir(result: Admission, container: str = "main") -> Path:
    return container_config_dir(result.container(container))


def assert_mount_points_at_record(result: Admission, container: str = "main") -> None:
    """The directory the kubelet's saved answer mounts holds this container's IDs."""
    c = result.container(container)
    record = json.loads((config_dir(result, container) / "config.json").read_text())
    want = {r.split("/")[1]: sorted(ids) for r, ids in c.device_ids.items()}
    assert record["device_ids"] == want


@pytest.mark.timeout(120)
def test_kill9_during_a_burst(sim_node: NodeMaker) -> None:
    node = sim_node()
    ids_before = advertised(node)
    rng = random.Random(99)
    sizes = [{CORE: 10, MEM: 20}, {CORE: 30, MEM: 100}, {MEM: 40}, {CORE: 100}, {CORE: 5, MEM: 5}]
    live: list[object] = []
    lock = threading.Lock()
    counter = iter(range(10_000))

    def burst(stop: threading.Event, seed: int) -> None:
        brng = random.Random(seed)
        while not stop.is_set():
            with lock:
                victim = (
                    live.pop(brng.randrange(len(live))) if live and brng.random() < 0.35 else None
                )
            if victim is not None:
                node.delete(victim)  # type: ignore[arg-type]
                continue
            pod = node.pod(f"b{next(counter)}", dict(brng.choice(sizes)))
            result = node.submit(pod, brng.choice([[CORE, MEM], [MEM, CORE]]))
            if result.ok:
                with lock:
                    live.append(pod)

    for round_ in range(4):
        stop = threading.Event()
        worker = threading.Thread(target=burst, args=(stop, round_))
        worker.start()
        time.sleep(rng.uniform(0.05, 0.5))
        node.kill_daemon()
        stop.set()
        worker.join(30)
        assert not worker.is_alive()
        restart_daemon(node)
        assert advertised(node) == ids_before
        assert not capacity_problems(node), capacity_problems(node)
        wait_consistent(node, 15)
        # The node still admits, consistently with what it holds.
        with lock:
            while len(live) > 2:
                node.delete(live.pop(0))  # type: ignore[arg-type]
        extra = node.pod(f"after{round_}", {CORE: 5, MEM: 5})
        result = node.submit(extra)
        assert_admitted_ok(result)
        live.append(extra)
    assert "Traceback" not in node.log()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["truncated", "garbage", "missing", "wrong-version"])
def test_corrupt_record_is_rebuilt_from_the_kubelet(sim_node: NodeMaker, damage: str) -> None:
    node = sim_node()
    results = [
        node.submit(node.pod(f"p{i}", {CORE: 10 + i, MEM: 20}), order)
        for i, order in enumerate([[CORE, MEM], [MEM, CORE], [CORE, MEM]])
    ]
    for r in results:
        assert_admitted_ok(r)
    wait_consistent(node)
    node.stop_daemon()
    for r in results[:2]:
        config = config_dir(r) / "config.json"
        if damage == "truncated":
            config.write_bytes(config.read_bytes()[:37])
        elif damage == "garbage":
            config.write_bytes(b"\x00\xff not json")
        elif damage == "missing":
            config.unlink()
        else:
            data = json.loads(config.read_text())
            data["version"] = 99
            config.write_text(json.dumps(data))
    restart_daemon(node)
    assert node.proc is not None and node.proc.poll() is None
    wait_consistent(node)
    assert "unreadable" in node.log()
    for r in results:
        assert_mount_points_at_record(r)
    assert_admitted_ok(node.submit(node.pod("later", {CORE: 10, MEM: 10})))
    assert node.proc.poll() is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", [[CORE, MEM], [MEM, CORE]], ids=["core-first", "memory-first"])
def test_state_lost_entirely_is_readopted(sim_node: NodeMaker, order: list[str]) -> None:
    """Re-adopted under the key the kubelet's saved answer mounts (its
    checkpoint), whichever resource it allocated first (issue 28)."""
    node = sim_node()
    results = [
        node.submit(node.pod("frac", {CORE: 30, MEM: 50}), order),
        node.submit(node.pod("whole", {CORE: 100})),
        node.submit(node.pod("memonly", {MEM: 70})),
    ]
    for r in results:
        assert_admitted_ok(r)
    wait_consistent(node)
    node.kill_daemon()
    shutil.rmtree(node.state_dir)
    restart_daemon(node)
    wait_consistent(node)
    doc = status(node)
    assert len(doc["containers"]) == 3
    assert {c["pod"] for c in doc["containers"]} == {"frac", "whole", "memonly"}
    by_pod = {c["pod"]: c for c in doc["containers"]}
    assert by_pod["frac"]["core"] == 30 and by_pod["frac"]["memory_mib"] == 50 * 256
    assert by_pod["whole"]["whole_cards"]
    for r in results:
        assert_mount_points_at_record(r)
    # The whole card stays exclusive after the re-adoption.
    whole_card = cards_of(results[1].containers[0].device_ids)
    more = node.submit(node.pod("more", {CORE: 10, MEM: 10}))
    assert_admitted_ok(more)
    assert cards_of(more.containers[0].device_ids).isdisjoint(whole_card)


@pytest.mark.timeout(60)
def test_pods_deleted_while_down_are_collected(sim_node: NodeMaker) -> None:
    node = sim_node()
    pods = [node.pod(f"d{i}", {CORE: 10, MEM: 10}) for i in range(4)]
    for pod in pods:
        assert_admitted_ok(node.submit(pod))
    wait_consistent(node)
    node.stop_daemon()
    node.delete(pods[0])
    node.finish(pods[1])
    started = time.monotonic()
    restart_daemon(node)
    wait_consistent(node, 30)
    assert time.monotonic() - started < 30
    assert len(status(node)["containers"]) == 2


@pytest.mark.timeout(60)
def test_kubelet_restart_keeps_everything(sim_node: NodeMaker) -> None:
    node = sim_node()
    whole = node.submit(node.pod("whole", {CORE: 100}))
    frac = node.submit(node.pod("frac", {CORE: 40, MEM: 80}))
    for r in (whole, frac):
        assert_admitted_ok(r)
    wait_consistent(node)
    ids_before = advertised(node)
    keys_before = {c["key"] for c in status(node)["containers"]}
    restart_kubelet(node)
    assert advertised(node) == ids_before
    assert {c["key"] for c in status(node)["containers"]} == keys_before
    whole_card = cards_of(whole.containers[0].device_ids)
    new = node.submit(node.pod("new", {CORE: 30, MEM: 30}))
    assert_admitted_ok(new)
    assert cards_of(new.containers[0].device_ids).isdisjoint(whole_card)
    assert cards_of(new.containers[0].device_ids) == cards_of(frac.containers[0].device_ids)
    assert not node.submit(node.pod("whole2", {CORE: 100})).ok
    wait_consistent(node)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", [{"healthy": False}, {"xid": 79}])
def test_gpu_fault(sim_node: NodeMaker, pl_tmp: Path, fault: dict[str, object]) -> None:
    gpus = write_mock(pl_tmp / "gpus.json", [mock_card(0), mock_card(1)])
    node = sim_node(gpus)
    victim = node.submit(node.pod("victim", {CORE: 20, MEM: 20}), [CORE, MEM])
    assert_admitted_ok(victim)
    (bad,) = cards_of(victim.containers[0].device_ids)
    index = 0 if bad.endswith("0") else 1
    assert wait_until(lambda: status(node)["containers"][0]["pod"] == "victim", 10)
    write_mock(gpus, [mock_card(i, **(fault if i == index else {})) for i in range(2)])
    t0 = time.monotonic()

    def bad_ids_unhealthy() -> bool:
        for resource in (CORE, MEM):
            devices = node.kubelet.devices(resource)
            on_bad = [h for d, h in devices.items() if card_of(d) == bad]
            if not on_bad or any(h != "Unhealthy" for h in on_bad):
                return False
        return True

    assert node.kubelet.wait_for(bad_ids_unhealthy, 3)
    assert time.monotonic() - t0 < 1.5  # 1 s, plus the mock file poll on a loaded CI box
    other = node.submit(node.pod("other", {CORE: 20, MEM: 20}))
    assert_admitted_ok(other)
    assert bad not in cards_of(other.containers[0].device_ids)
    doc = status(node)
    (row,) = [c for c in doc["containers"] if c["pod"] == "victim"]
    assert row["card_health"] == ["Unhealthy"]
    log = node.log()
    assert "unhealthy" in log and "default/victim/main" in log
    # Back in service when the file says so.
    write_mock(gpus, [mock_card(0), mock_card(1)])
    assert node.kubelet.wait_for(
        lambda: all(h == "Healthy" for h in node.kubelet.devices(CORE).values()), 3
    )
    assert "healthy again" in node.log()


@pytest.mark.timeout(90)
def test_api_server_down_or_slow(sim_node: NodeMaker) -> None:
    node = sim_node()
    api = node.api
    assert api is not None
    assert_admitted_ok(node.submit(node.pod("before", {CORE: 10, MEM: 10})))
    refused = node.submit(node.pod("bare0", {CORE: 30}))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT, refused.error

    api.set_down(True)
    assert node.proc is not None
    proc = psutil.Process(node.proc.pid)
    pods = []
    for i in range(4):
        pod = node.pod(f"down{i}", {CORE: 10, MEM: 20})
        t0 = time.monotonic()
        result = node.submit(pod, [MEM, CORE] if i % 2 else [CORE, MEM])
        elapsed = time.monotonic() - t0
        assert_admitted_ok(result)
        assert elapsed < 2.5, elapsed
        pods.append(pod)
    assert not capacity_problems(node)
    # No busy loop while the API server is down.
    cpu0 = sum(proc.cpu_times()[:2])
    time.sleep(3)
    assert sum(proc.cpu_times()[:2]) - cpu0 < 0.6
    api.set_down(False)

    # The cache catches up: a fractional core without memory is refused again.
    attempts = 0

    def refused_again() -> bool:
        nonlocal attempts
        attempts += 1
        pod = node.pod(f"bare{attempts}", {CORE: 5})
        result = node.submit(pod)
        if result.ok:
            node.delete(pod)
            return False
        return result.code == grpc.StatusCode.INVALID_ARGUMENT

    assert wait_until(refused_again, 40, 0.5), node.log()[-2000:]

    # Slow: a 5 s delay on every request costs an admission at most ~2 s.
    api.set_delay(5)
    for i in range(3):
        t0 = time.monotonic()
        result = node.submit(node.pod(f"slow{i}", {CORE: 10, MEM: 10}))
        assert_admitted_ok(result)
        assert time.monotonic() - t0 < 2.5
    api.set_delay(0)
    assert not capacity_problems(node)
    wait_consistent(node, 20)


@pytest.mark.timeout(60)
def test_prestart_recreates_a_deleted_config(sim_node: NodeMaker) -> None:
    node = sim_node()
    result = node.submit(node.pod("p", {CORE: 20, MEM: 30}))
    assert_admitted_ok(result)
    directory = config_dir(result)
    before = json.loads((directory / "config.json").read_text())
    shutil.rmtree(directory)
    for resource, name in ((Resource.MEMORY, MEM), (Resource.CORE, CORE)):
        channel, stub = plugin_stub(node, resource)
        with channel:
            ids = result.containers[0].device_ids[name]
            stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=ids), timeout=5)
        assert (directory / "config.json").exists()
        shutil.rmtree(directory)
    channel, stub = plugin_stub(node, Resource.CORE)
    with channel:
        stub.PreStartContainer(
            pb.PreStartContainerRequest(devices_ids=result.containers[0].device_ids[CORE]),
            timeout=5,
        )
    after = json.loads((directory / "config.json").read_text())
    assert after["device_ids"] == before["device_ids"]
    assert after["core_percent"] == 20
    assert not state_problems(node)
    assert live_app_containers(node)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("lost", ["nothing", "the directory"])
def test_kill9_right_after_allocate_keeps_the_placement(sim_node: NodeMaker, lost: str) -> None:
    """SIGKILL the moment the container's last Allocate answered, before any
    reconcile looked at the kubelet. With "the directory": the container's
    directory is gone as well, as after a power cut before the filesystem
    committed it (only the placement journal's entry was synced, issue 30).
    The restarted daemon has the placement from its own state, under the key
    the kubelet's saved answer mounts, and nothing is adopted."""
    node = sim_node()
    result = node.submit(node.pod("k9", {CORE: 30, MEM: 40}))
    node.kill_daemon()
    assert_admitted_ok(result)
    directory = config_dir(result)
    before = json.loads((directory / "config.json").read_text())
    if lost == "the directory":
        shutil.rmtree(directory)
    restart_daemon(node)
    log = node.log()
    assert "recovered 1 placement(s)" in log
    assert ("restored from the placement journal" in log) == (lost == "the directory")
    assert "adopted" not in log
    assert json.loads((directory / "config.json").read_text()) == before
    assert_mount_points_at_record(result)
    assert (directory / "shared" / "vgpu.shm").is_file()
    wait_consistent(node)
    assert [c["pod"] for c in status(node)["containers"]] == ["k9"]


@pytest.mark.timeout(60)
def test_kill9_between_a_containers_two_allocates_keeps_the_first(sim_node: NodeMaker) -> None:
    """The record of a container's first resource is not synced (its second
    replaces it moments later), but a killed daemon never loses it: the
    restarted one has it, with the IDs and the owner of that first resource."""
    node = sim_node()
    pod = node.pod("half", {CORE: 20, MEM: 30})
    node.create(pod)
    channel, stub = plugin_stub(node, Resource.CORE)
    with channel:
        free = sorted(node.kubelet.devices(CORE))
        preferred = stub.GetPreferredAllocation(
            pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(
                        available_deviceIDs=free, allocation_size=20
                    )
                ]
            ),
            timeout=10,
        )
        ids = list(preferred.container_responses[0].deviceIDs)
        answer = stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]),
            timeout=10,
        )
    node.kill_daemon()
    mounted = {m.container_path: m.host_path for m in answer.container_responses[0].mounts}
    directory = Path(mounted["/etc/vgpu"])
    restart_daemon(node)
    assert "recovered 1 placement(s)" in node.log()
    record = json.loads((directory / "config.json").read_text())
    assert sorted(record["device_ids"]["vcuda-core"]) == sorted(ids)
    assert record["pod"]["name"] == "half"
