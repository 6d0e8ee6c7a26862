"""Issue 13, item 2: a deleted pod's placement is never handed to the next tenant.

The kubelet calls Allocate once per container. When it gives a new container,
without GetPreferredAllocation first, the IDs a deleted pod held, the new
container must get a placement, a config and a budget of its own; an app
container reusing its own init container's IDs still shares that placement.
"""

from __future__ import annotations

import pytest

from tests.adversarial.helpers import config, config_dir, plant, sees_planted
from tests.conftest import NodeFactory
from tests.integration.conftest_placement import (
    CORE,
    MEM,
    assert_admitted_ok,
    capacity_problems,
    status,
    wait_until,
)

H200_UNITS = 143771 // 256  # 561 memory units on one card


@pytest.mark.timeout(60)
def test_deleted_pods_ids_straight_to_allocate_get_a_fresh_placement(
    make_node: NodeFactory,
) -> None:
    # One card, no periodic reconcile: only the Allocate path can notice.
    node = make_node(
        "preset:1xH200", api=True, daemon_args=("--reconcile-interval-s", "3600"), seed=3
    )
    assert node.api is not None
    old = node.pod("old", {CORE: 10, MEM: 400})  # 100 GiB
    first = node.submit(old)
    assert_admitted_ok(first)
    filler = node.submit(node.pod("filler", {CORE: 90, MEM: H200_UNITS - 400}))
    assert_admitted_ok(filler)
    assert wait_until(lambda: {c["pod"] for c in status(node)["containers"]} >= {"old"}, 10)
    victim = first.container("main")
    plant(victim)
    assert sees_planted(victim)

    # The API server goes down; the pod is deleted; the kubelet hands exactly
    # its IDs (the only free ones) to the next pod, straight to Allocate.
    node.api.set_down(True)
    node.kubelet.remove_pod(old.uid)
    node.kubelet.call_preferred = False
    new = node.submit(node.pod("new", {CORE: 10, MEM: 4}), [CORE, MEM])  # 1 GiB
    assert_admitted_ok(new)
    got = new.container("main")
    assert set(got.device_ids[CORE]) == set(victim.device_ids[CORE])  # the scenario held

    assert got.envs["VGPU_MEMORY_LIMIT_MIB"] == str(4 * 256), got.envs
    assert got.envs["VGPU_CORE_LIMIT"] == "10"
    record = config(got)
    assert (record["pod"] or {}).get("name") != "old", record
    assert record["memory_limit_mib"] == 4 * 256
    assert sorted(record["device_ids"]["vcuda-memory"]) == sorted(got.device_ids[MEM])
    assert sees_planted(got) == []
    # The card's limits handed out stay within its memory, and nothing is held twice.
    limits = sum(c["memory_mib"] for c in status(node)["containers"])
    assert limits <= 143771, status(node)["containers"]
    assert not capacity_problems(node)
    assert "arrive for a new container" in node.log()
    assert wait_until(lambda: not config_dir(victim).exists() or config(got)["key"], 5)


@pytest.mark.timeout(60)
def test_init_containers_ids_still_shared_with_its_app_container(make_node: NodeFactory) -> None:
    node = make_node(api=True, seed=5)
    pod = node.pod("with-init", {"app": {CORE: 20, MEM: 40}}, init={"setup": {CORE: 20, MEM: 40}})
    result = node.submit(pod, [CORE, MEM])
    assert_admitted_ok(result)
    init, app = result.container("setup"), result.container("app")
    assert set(init.device_ids[CORE]) == set(app.device_ids[CORE])
    # By fact (the kubelet runs the pod, "setup" is not one of its app
    # containers): the app container shares the init container's placement.
    assert config_dir(app) == config_dir(init)
    assert "the new container shares it" in node.log()
    assert not capacity_problems(node)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("first", "order"),
    [({CORE: 100}, [MEM, CORE]), ({MEM: 40}, [CORE, MEM])],
    ids=["after-a-whole-card", "after-memory-only"],
)
def test_without_pod_information_the_next_pod_never_shares_a_directory(
    make_node: NodeFactory, first: dict[str, int], order: list[str]
) -> None:
    # No API server: the daemon cannot know whether a container asks one
    # resource or two. The next pod's first resource must not be taken for
    # the in-flight container's second one (the kubelet lists the new pod).
    node = make_node(api=False, seed=11)
    x = node.submit(node.pod("x", first))
    assert_admitted_ok(x)
    plant(x.container("main"))
    y = node.submit(node.pod("y", {CORE: 10, MEM: 40}), order)
    assert_admitted_ok(y)
    got = y.container("main")
    assert config_dir(got) != config_dir(x.container("main"))
    assert sees_planted(got) == []
    assert (
        got.envs["VGPU_MEMORY_LIMIT_MIB"] == str(40 * 256) and got.envs["VGPU_CORE_LIMIT"] == "10"
    )
    assert not capacity_problems(node)
    # A pod's own two resources are still paired on one card, either order.
    for i, order in enumerate(([CORE, MEM], [MEM, CORE])):
        both = node.submit(node.pod(f"both{i}", {CORE: 20, MEM: 30}), order)
        assert_admitted_ok(both)
        assert both.container("main").envs["VGPU_MEMORY_LIMIT_MIB"] == str(30 * 256)


@pytest.mark.timeout(60)
def test_a_memory_only_pod_after_an_init_reuse_without_pod_information(
    make_node: NodeFactory,
) -> None:
    # The soak's case: an app container reuses its init container's core IDs
    # (Allocate without GetPreferredAllocation, no pod information: its own
    # placement) and its memory ones (shared by fact); the next pod asks
    # memory only. It must get a placement of its own, not the app's.
    node = make_node(api=True, seed=2)
    assert node.api is not None
    node.api.set_down(True)
    pod = node.pod("with-init", {"app": {CORE: 25, MEM: 60}}, init={"setup": {CORE: 25, MEM: 60}})
    assert_admitted_ok(node.submit(pod, [CORE, MEM]))
    node.api.set_down(False)  # the next pod is in the cache
    assert wait_until(lambda: "pod cache synced" in node.log().split("with-init")[-1], 10)
    mem = node.submit(node.pod("mem-only", {MEM: 40}))
    assert_admitted_ok(mem)
    got = mem.container("main")
    record = config(got)
    assert set(record["device_ids"]) == {"vcuda-memory"}, record
    assert record["core_percent"] is None and record["memory_limit_mib"] == 40 * 256
    assert not capacity_problems(node)
