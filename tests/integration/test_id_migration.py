"""Issue 19: the upgrade from legacy device IDs (``<card uuid>-c<n>``) to short
ones (``<index><c|m><n>.<digest>``), through the real daemon process.

The node before the upgrade is built the way the previous version left it: a
state record with legacy IDs (written by the state store, as before), the
kubelet's checkpoint holding those IDs and every legacy ID registered, and the
pod's ``vgpu-placements`` annotation. After the upgrade the running pod's IDs
must still be advertised (the kubelet re-admits it only then), its slices must
never be handed out twice, and once it ends every ID is short.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.integration.conftest_placement import (
    CORE,
    MEM,
    NodeMaker,
    assert_admitted_ok,
    capacity_problems,
    pl_tmp,
    sim_node,
    status,
)
from vgpu.adapters.fs import ContainerStore
from vgpu.adapters.gpus import preset_cards
from vgpu.core.model import Owner, Placement, Resource
from vgpu.core.packing import placement_key
from vgpu.core.slicing import (
    MAX_DEVICE_ID_LEN,
    card_device_ids,
    format_legacy_device_id,
    parse_device_id,
    units_per_card,
)
from vgpu.pb import deviceplugin_v1beta1_pb2 as pb
from vgpu.sim import checkpoint
from vgpu.sim.harness import SimNode
from vgpu.sim.kubelet import SimContainer, SimPod

__all__ = ["pl_tmp", "sim_node"]

UNIT = 256
OLD_CORE, OLD_MEM = 30, 40  # the running pod's slice, on card 0


def _legacy_node(node: SimNode) -> tuple[SimPod, Placement]:
    """State dir, kubelet checkpoint and API objects as the previous version left them."""
    cards = preset_cards("preset:2xH200")
    uuid = cards[0].uuid
    core = frozenset(format_legacy_device_id(uuid, Resource.CORE, i) for i in range(OLD_CORE))
    mem = frozenset(format_legacy_device_id(uuid, Resource.MEMORY, i) for i in range(OLD_MEM))
    pod = SimPod.new("old", [SimContainer("main", {CORE: OLD_CORE, MEM: OLD_MEM})], [])
    placement = Placement(
        key=placement_key(core),
        cards=(uuid,),
        ids={Resource.CORE: core, Resource.MEMORY: mem},
        core_percent=OLD_CORE,
        memory_mib=OLD_MEM * UNIT,
        owner=Owner("default", "old", "main", pod.uid),
        created_s=time.time() - 3600,
    )
    store = ContainerStore(node.state_dir, UNIT)
    store.root.mkdir(parents=True, exist_ok=True)
    paths = store.write(placement)
    # The old Allocate answer, as the kubelet saved it (it carried the old envs).
    answer = pb.ContainerAllocateResponse(
        envs={"NVIDIA_VISIBLE_DEVICES": uuid, "VGPU_CONFIG": "/etc/vgpu/config.json"},
        annotations={"vendor.io/vgpu-key": placement.key},
    )
    answer.mounts.add(container_path="/etc/vgpu", host_path=str(paths.config_dir), read_only=True)
    registered = {
        name: [
            format_legacy_device_id(c.uuid, r, i)
            for c in cards
            for i in range(units_per_card(c, r, UNIT))
        ]
        for name, r in ((CORE, Resource.CORE), (MEM, Resource.MEMORY))
    }
    entries = [
        checkpoint.Entry(pod.uid, "main", name, {0: sorted(ids)}, answer.SerializeToString())
        for name, ids in ((CORE, core), (MEM, mem))
    ]
    node.plugin_dir.mkdir(parents=True, exist_ok=True)
    checkpoint.write(node.kubelet.checkpoint_path, checkpoint.encode(entries, registered))
    assert node.kubelet.load_checkpoint([pod]) == 2
    assert node.api is not None
    api_pod = node._api_pod(pod)
    api_pod["metadata"]["uid"] = pod.uid
    api_pod["metadata"]["annotations"] = {
        "vendor.io/vgpu-placements": json.dumps(
            {"main": {"cards": [uuid], "core": OLD_CORE, "memory_mib": OLD_MEM * UNIT}}
        )
    }
    api_pod["status"]["phase"] = "Running"
    node.api.add_pod(api_pod)
    return pod, placement


def _ids(node: SimNode) -> dict[str, dict[str, str]]:
    return {r: node.kubelet.devices(r) for r in (CORE, MEM)}


@pytest.mark.timeout(120)
def test_upgrade_keeps_running_pods_admittable_and_never_double_books(
    sim_node: NodeMaker, pl_tmp: Path
) -> None:
    node = sim_node(start=False)
    old, placement = _legacy_node(node)
    node.start(timeout_s=30)
    assert node.kubelet.wait_registered([CORE, MEM], 15)
    legacy = {
        Resource.CORE: placement.ids[Resource.CORE],
        Resource.MEMORY: placement.ids[Resource.MEMORY],
    }

    # 1. The running pod's legacy IDs are advertised (re-admission after a
    # kubelet restart succeeds); every other ID is short; no slice twice.
    cards = preset_cards("preset:2xH200")
    for name, resource in ((CORE, Resource.CORE), (MEM, Resource.MEMORY)):
        ids = node.kubelet.devices(name)
        assert legacy[resource] <= set(ids)
        short = [d for d in ids if d not in legacy[resource]]
        assert all(len(d) <= MAX_DEVICE_ID_LEN and not parse_device_id(d).legacy for d in short)
        assert len(ids) == sum(units_per_card(c, resource, UNIT) for c in cards)
        # The held slices' short IDs are not advertised (the slice is listed once).
        held_slots = set(card_device_ids(cards[0], resource, UNIT)[: len(legacy[resource])])
        assert not held_slots & set(ids)
    assert node.kubelet.readmission_problems() == []
    node.kubelet.restart()
    assert node.kubelet.wait_for(
        lambda: all(
            node.kubelet.connected(r) and len(node.kubelet.devices(r)) > 0 for r in (CORE, MEM)
        ),
        15,
    )
    assert node.kubelet.readmission_problems() == []

    # 2. The recovered placement counts: new pods fill card 0 around it, never over it.
    results = [node.submit(node.pod(f"new-{i}", {CORE: 35, MEM: 100})) for i in range(4)]
    for result in results:
        assert_admitted_ok(result)
    refused = node.submit(node.pod("over", {CORE: 40, MEM: 10}))
    assert not refused.ok
    assert capacity_problems(node) == []
    doc = status(node)
    (row,) = [c for c in doc["containers"] if c["pod"] == "old"]
    assert row["core"] == OLD_CORE

    # 3. The old pod ends: its slices come back under their short IDs.
    node.delete(old)

    def all_short() -> bool:
        return all(
            not parse_device_id(d).legacy for per in _ids(node).values() for d in per
        ) and sum(len(v) for v in _ids(node).values()) == sum(
            units_per_card(c, r, UNIT) for c in cards for r in Resource
        )

    assert node.wait(all_short, 15), node.log()[-2000:]
    after = node.submit(node.pod("after", {CORE: 30, MEM: 40}))
    assert_admitted_ok(after)
    assert capacity_problems(node) == []
    assert node.kubelet.readmission_problems() == []
    # The kubelet's checkpoint now holds short IDs only.
    entries, registered = checkpoint.decode(node.kubelet.checkpoint_path.read_bytes())
    assert all(len(d) <= MAX_DEVICE_ID_LEN for ids in registered.values() for d in ids)
    assert old.uid not in {e.pod_uid for e in entries}
