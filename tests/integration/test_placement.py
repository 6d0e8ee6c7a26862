"""Issue 3: pod-aware packing, through the real daemon, the kubelet simulator
(gRPC) and the fake API server (HTTP)."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import grpc
import pytest

from tests.integration.conftest_placement import (
    CORE,
    MEM,
    NodeMaker,
    allocate,
    annotated,
    assert_admitted_ok,
    capacity_problems,
    cards_of,
    live_app_containers,
    pl_tmp,
    rpc_error,
    sim_node,
    status,
    wait_consistent,
    wait_until,
)
from vgpu.core.model import Resource
from vgpu.sim.harness import SimNode

__all__ = ["pl_tmp", "sim_node"]

ORDERS = [pytest.param([CORE, MEM], id="core-first"), pytest.param([MEM, CORE], id="memory-first")]


@pytest.fixture
def node(sim_node: NodeMaker) -> SimNode:
    return sim_node()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", ORDERS)
def test_core_and_memory_share_one_card_with_a_full_answer(node: SimNode, order: list[str]) -> None:
    results = []
    for i in range(4):
        pod = node.pod(f"p{i}", {CORE: 20, MEM: 40})
        result = node.submit(pod, order)
        assert_admitted_ok(result)
        results.append(result)
    for result in results:
        c = result.containers[0]
        assert [r for _, r in c.calls] == [order[0], order[0], order[1], order[1]]
        (card,) = cards_of(c.device_ids)
        assert c.envs["NVIDIA_VISIBLE_DEVICES"] == card
        assert c.envs["VGPU_CORE_LIMIT"] == "20"
        assert c.envs["VGPU_MEMORY_LIMIT_MIB"] == str(40 * 256)
        assert c.envs["VGPU_CONFIG"] == "/etc/vgpu/config.json"
        mounts = {m.container_path: m for m in c.mounts}
        config = mounts["/etc/vgpu"]
        assert config.read_only
        assert Path(config.host_path).parent == node.state_dir / "containers"
        shared = [m for m in c.mounts if m.container_path != "/etc/vgpu" and not m.read_only]
        # Only the budget file is writable, and it exists before the container starts.
        assert [m.container_path for m in shared] == ["/var/run/vgpu/vgpu.shm"]
        assert all(Path(m.host_path).is_file() for m in shared)
        # A preset card lists no device nodes: the answer names none, so the
        # runtime starts the container on a host without GPUs.
        assert list(c.devices) == []
        record = json.loads((Path(config.host_path) / "config.json").read_text())
        assert record["core_percent"] == 20
        assert record["memory_limit_mib"] == 40 * 256
        assert record["cards"] == [card]

    def owners_known() -> bool:
        for result in results:
            host = next(m.host_path for m in result.containers[0].mounts if m.read_only)
            record = json.loads((Path(host) / "config.json").read_text())
            pod = record["pod"] or {}
            if (pod.get("namespace"), pod.get("name"), record["container"]) != (
                "default",
                result.pod.name,
                "main",
            ):
                return False
        return True

    assert wait_until(owners_known, 10), node.log()[-2000:]


@pytest.mark.timeout(60)
def test_identical_pods_get_their_own_dirs_and_ids(node: SimNode) -> None:
    pods = [node.pod(f"same{i}", {CORE: 10, MEM: 16}) for i in range(6)]
    results = []
    for i, pod in enumerate(pods):
        result = node.submit(pod, [CORE, MEM] if i % 2 else [MEM, CORE])
        assert_admitted_ok(result)
        results.append(result)
    dirs = [next(m.host_path for m in r.containers[0].mounts if m.read_only) for r in results]
    assert len(set(dirs)) == len(dirs)
    all_ids = [d for r in results for ids in r.containers[0].device_ids.values() for d in ids]
    assert len(all_ids) == len(set(all_ids))
    node.delete(pods[0])
    node.delete(pods[3])
    wait_consistent(node)
    for i, path in enumerate(dirs):
        assert Path(path).exists() == (i not in (0, 3)), (i, path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", ORDERS)
def test_whole_cards_are_exclusive(node: SimNode, order: list[str]) -> None:
    small = node.submit(node.pod("small", {CORE: 10, MEM: 8}), order)
    assert_admitted_ok(small)
    whole = node.submit(node.pod("whole", {CORE: 100}), order)
    assert_admitted_ok(whole)
    whole_card = cards_of(whole.containers[0].device_ids)
    assert len(whole_card) == 1
    assert whole_card.isdisjoint(cards_of(small.containers[0].device_ids))
    c = whole.containers[0]
    assert "VGPU_CORE_LIMIT" not in c.envs and "VGPU_MEMORY_LIMIT_MIB" not in c.envs
    # Nothing else lands on the whole card, memory-only included.
    for i in range(3):
        other = node.submit(node.pod(f"after{i}", {CORE: 10, MEM: 8}), order)
        assert_admitted_ok(other)
        assert cards_of(other.containers[0].device_ids).isdisjoint(whole_card)
    mem_only = node.submit(node.pod("memonly", {MEM: 8}), order)
    assert_admitted_ok(mem_only)
    assert cards_of(mem_only.containers[0].device_ids).isdisjoint(whole_card)
    # A second whole card is refused: the other card is in use.
    again = node.submit(node.pod("whole2", {CORE: 100}), order)
    assert not again.ok
    assert again.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, None), again.error
    assert not capacity_problems(node)


@pytest.mark.timeout(60)
def test_two_whole_cards(node: SimNode) -> None:
    result = node.submit(node.pod("two", {CORE: 200, MEM: 100}))
    assert_admitted_ok(result)
    assert len(cards_of({CORE: result.containers[0].device_ids[CORE]})) == 2
    refused = node.submit(node.pod("none-left", {MEM: 4}))
    assert not refused.ok


@pytest.mark.timeout(60)
def test_invalid_requests_are_refused_with_a_reason(node: SimNode) -> None:
    odd = node.submit(node.pod("odd", {CORE: 150, MEM: 8}))
    assert not odd.ok
    assert odd.code == grpc.StatusCode.INVALID_ARGUMENT, (odd.code, odd.error)
    assert "150" in (odd.error or "") and "200" in (odd.error or "")

    for order in ([CORE], None):
        bare = node.submit(node.pod(f"bare{order is None}", {CORE: 30}), order)
        assert not bare.ok
        assert bare.code == grpc.StatusCode.INVALID_ARGUMENT, (bare.code, bare.error)
        assert MEM in (bare.error or "")

    mem_only = node.submit(node.pod("memonly", {MEM: 64}))
    assert_admitted_ok(mem_only)
    envs = mem_only.containers[0].envs
    assert "VGPU_CORE_LIMIT" not in envs
    assert envs["VGPU_MEMORY_LIMIT_MIB"] == str(64 * 256)
    wait_consistent(node)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", ORDERS)
def test_fits_the_node_but_no_card(node: SimNode, order: list[str]) -> None:
    # 2 x 561 units; 400 + 400 used leaves 161 + 161: 300 fits the node, no card.
    for i in range(2):
        assert_admitted_ok(node.submit(node.pod(f"big{i}", {CORE: 10, MEM: 400}), [CORE, MEM]))
    result = node.submit(node.pod("too-big", {CORE: 10, MEM: 300}), order)
    assert not result.ok
    assert result.code == grpc.StatusCode.RESOURCE_EXHAUSTED, (result.code, result.error)
    error = result.error or ""
    assert f"{MEM}=300" in error
    assert "card 0" in error and "card 1" in error
    assert "161 memory units free" in error and "90 core free" in error
    # The refusal leaves nothing behind.
    wait_consistent(node)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", ORDERS)
def test_init_container_ids_are_reused_coherently(node: SimNode, order: list[str]) -> None:
    assert_admitted_ok(node.submit(node.pod("filler", {CORE: 30, MEM: 30}), order))
    pod = node.pod("with-init", {"app": {CORE: 20, MEM: 40}}, init={"setup": {CORE: 20, MEM: 40}})
    result = node.submit(pod, order)
    assert_admitted_ok(result)
    init, app = result.container("setup"), result.container("app")
    assert {r: set(v) for r, v in init.device_ids.items()} == {
        r: set(v) for r, v in app.device_ids.items()
    }
    assert init.envs == app.envs
    # A bigger app than its init container.
    pod2 = node.pod("grow", {"app": {CORE: 40, MEM: 60}}, init={"setup": {CORE: 10, MEM: 20}})
    result2 = node.submit(pod2, order)
    assert_admitted_ok(result2)
    app2 = result2.container("app")
    assert app2.envs["VGPU_CORE_LIMIT"] == "40"
    assert app2.envs["VGPU_MEMORY_LIMIT_MIB"] == str(60 * 256)
    wait_consistent(node)


@pytest.mark.timeout(60)
def test_multi_container_pod(node: SimNode) -> None:
    pod = node.pod(
        "multi",
        {"a": {CORE: 30, MEM: 100}, "b": {MEM: 50}, "c": {CORE: 25, MEM: 25}, "d": {CORE: 100}},
    )
    result = node.submit(pod)
    assert_admitted_ok(result)
    assert result.container("a").envs["VGPU_CORE_LIMIT"] == "30"
    assert "VGPU_CORE_LIMIT" not in result.container("b").envs
    assert result.container("c").envs["VGPU_MEMORY_LIMIT_MIB"] == str(25 * 256)
    whole = cards_of(result.container("d").device_ids)
    for name in "abc":
        assert cards_of(result.container(name).device_ids).isdisjoint(whole)
    wait_consistent(node)
    assert wait_until(lambda: set(annotated(node, "default", "multi") or {}) == set("abcd"), 10)


@pytest.mark.timeout(60)
def test_unknown_and_foreign_ids_are_invalid_argument(node: SimNode) -> None:
    devices = sorted(node.kubelet.devices(MEM))
    cases = [
        (Resource.CORE, ["no-such-device"]),
        (Resource.CORE, ["GPU-nope-c1"]),
        (Resource.CORE, devices[:3]),  # memory IDs sent to the core socket
        (Resource.MEMORY, sorted(node.kubelet.devices(CORE))[:2]),
        (Resource.CORE, []),
    ]
    for resource, ids in cases:
        err = rpc_error(lambda r=resource, i=ids: allocate(node, r, i))  # type: ignore[misc]
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (ids, err.code(), err.details())
        assert err.details(), ids
    assert_admitted_ok(node.submit(node.pod("after", {CORE: 10, MEM: 10})))


@pytest.mark.timeout(60)
def test_allocate_makes_no_api_call(node: SimNode) -> None:
    assert node.api is not None
    assert wait_until(lambda: any("watch" in p for _, p in node.api.requests()), 10)
    assert_admitted_ok(node.submit(node.pod("warm", {CORE: 10, MEM: 10})))
    free = sorted(
        d for d, h in node.kubelet.devices(MEM).items() if h == "Healthy" and d.startswith("1m")
    )[-5:]
    before = node.api.request_count
    allocate(node, Resource.MEMORY, free)
    after = node.api.requests()[before:]
    # A watch re-opened by its own timeout would be the only legitimate newcomer.
    assert [r for r in after if "watch" not in r[1]] == [], after


@pytest.mark.timeout(60)
def test_concurrent_admissions(node: SimNode) -> None:
    pods = [node.pod(f"c{i}", {CORE: 5 + i, MEM: 10 + i}) for i in range(10)]
    for pod in pods:
        node.create(pod)
    results: list[object] = []

    def run(i: int) -> None:
        results.append(node.admit(pods[i], [CORE, MEM] if i % 2 else [MEM, CORE]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(pods))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == len(pods)
    for result in results:
        assert_admitted_ok(result)  # type: ignore[arg-type]
    wait_consistent(node)


@pytest.mark.timeout(90)
def test_randomized_churn(node: SimNode) -> None:
    rng = random.Random(1234)
    sizes = [
        {CORE: 10, MEM: 20},
        {CORE: 25, MEM: 100},
        {CORE: 50, MEM: 200},
        {CORE: 5, MEM: 5},
        {MEM: 60},
        {CORE: 100},
        {CORE: 30, MEM: 300},
        {CORE: 15, MEM: 450},
    ]
    live: list[object] = []
    refused = admitted = 0
    for op in range(150):
        roll = rng.random()
        if live and roll < 0.3:
            node.delete(live.pop(rng.randrange(len(live))))  # type: ignore[arg-type]
        elif live and roll < 0.4:
            node.finish(live.pop(rng.randrange(len(live))))  # type: ignore[arg-type]
        else:
            pod = node.pod(f"churn{op}", dict(rng.choice(sizes)))
            order = rng.choice([[CORE, MEM], [MEM, CORE], None])
            result = node.submit(pod, order)
            if result.ok:
                admitted += 1
                assert_admitted_ok(result)
                live.append(pod)
            else:
                refused += 1
                assert result.code in (
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    None,  # the kubelet itself found too few free IDs
                ), (result.code, result.error)
    assert admitted > 30 and refused > 0
    assert not capacity_problems(node)
    wait_consistent(node, 15)
    assert node.api is not None
    for pod in live:
        assert wait_until(lambda p=pod: annotated(node, "default", p.name) is not None, 10), pod
    holders = live_app_containers(node)
    assert len(holders) == len(live)
    assert len(status(node)["containers"]) == len(live)
