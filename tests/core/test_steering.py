"""The node follows the extender's assignment (the pod's vgpu-assignment annotation)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.core.helpers import UNIT, Kubelet, cards, spec
from vgpu.adapters.kube import container_specs
from vgpu.core.errors import InsufficientCapacity, PlacementConflict
from vgpu.core.model import CardUuid, ContainerSpec, Policy, Resource
from vgpu.core.packing import Ledger

CORE, MEM = Resource.CORE, Resource.MEMORY


def assigned(s: ContainerSpec, *indexes: int) -> ContainerSpec:
    uuids = tuple(cards(max(indexes) + 1)[i].uuid for i in indexes)
    return replace(s, assigned=uuids)


@pytest.mark.parametrize("order", [[CORE, MEM], [MEM, CORE]], ids=["core-first", "memory-first"])
def test_both_resources_land_on_the_assigned_card(order: list[Resource]) -> None:
    led = Ledger(cards(3), memory_unit_mib=UNIT, policy=Policy.BINPACK)
    p = Kubelet(led).admit(assigned(spec(30, 40), 2), order)
    assert p.cards == (cards(3)[2].uuid,)  # binpack alone would have taken card 0


def test_whole_cards_follow_the_assignment() -> None:
    led = Ledger(cards(4), memory_unit_mib=UNIT)
    p = Kubelet(led).admit(assigned(spec(200), 1, 3))
    assert set(p.cards) == {cards(4)[1].uuid, cards(4)[3].uuid}


def test_pods_without_assignment_keep_the_nodes_rules() -> None:
    led = Ledger(cards(3), memory_unit_mib=UNIT, policy=Policy.SPREAD)
    k = Kubelet(led)
    first = k.admit(spec(30, 40))
    second = k.admit(spec(30, 40))
    assert first.cards != second.cards  # spread, as before


def test_an_unhealthy_assigned_card_is_refused_by_name() -> None:
    sick = [replace(c, healthy=False, xid=79) if c.index == 1 else c for c in cards(2)]
    led = Ledger(sick, memory_unit_mib=UNIT)
    with pytest.raises(PlacementConflict) as err:
        Kubelet(led).admit(assigned(spec(30, 40), 1))
    message = err.value.message
    assert f"card 1 ({sick[1].uuid})" in message and "unhealthy (xid 79)" in message
    assert "delete the pod" in message


def test_an_assigned_card_without_room_is_refused_by_name() -> None:
    led = Ledger(cards(2), memory_unit_mib=UNIT)
    k = Kubelet(led)
    k.admit(assigned(spec(80, 40), 0))
    with pytest.raises(InsufficientCapacity) as err:
        k.admit(assigned(spec(30, 40), 0))
    assert f"card 0 ({cards(2)[0].uuid})" in err.value.message
    assert "offers only 20 of the 30 vendor.io/vcuda-core units" in err.value.message


def test_an_assigned_card_the_node_does_not_have_is_refused() -> None:
    led = Ledger(cards(2), memory_unit_mib=UNIT)
    ghost = replace(spec(30, 40), assigned=(CardUuid("GPU-gone"),))
    with pytest.raises(PlacementConflict, match="no such card"):
        Kubelet(led).admit(ghost)


def test_allocate_refuses_ids_off_the_assigned_card() -> None:
    led = Ledger(cards(2), memory_unit_mib=UNIT)
    k = Kubelet(led)
    s = assigned(spec(30, 40), 1)
    ids, _ = led.preferred(CORE, k.available(CORE), [], 30, [s])
    assert {led.lookup(d)[0] for d in ids} == {cards(2)[1].uuid}  # type: ignore[index]
    led.allocate(CORE, ids, [s])
    wrong = [d for d in k.available(MEM) if led.lookup(d)[0] == cards(2)[0].uuid][:40]  # type: ignore[index]
    with pytest.raises(PlacementConflict, match="extender assigned"):
        led.allocate(MEM, wrong, [s])


def _pod(annotation: str | None, node: str = "n1") -> dict[str, object]:
    meta: dict[str, object] = {"name": "p", "namespace": "ns", "uid": "u1"}
    if annotation is not None:
        meta["annotations"] = {"vendor.io/vgpu-assignment": annotation}
    limits = {"vendor.io/vcuda-core": "30", "vendor.io/vcuda-memory": "40"}
    return {
        "metadata": meta,
        "spec": {
            "nodeName": node,
            "containers": [{"name": "main", "resources": {"limits": limits}}],
        },
    }


@pytest.mark.parametrize(
    ("annotation", "node", "expected"),
    [
        ('{"node": "n1", "containers": {"main": ["GPU-a"]}}', "n1", ("GPU-a",)),
        ('{"node": "n2", "containers": {"main": ["GPU-a"]}}', "n1", None),
        ('{"node": "n1", "containers": {"other": ["GPU-a"]}}', "n1", None),
        ("not json", "n1", None),
        (None, "n1", None),
    ],
    ids=["this-node", "another-node", "another-container", "malformed", "absent"],
)
def test_container_specs_read_the_assignment(
    annotation: str | None, node: str, expected: tuple[str, ...] | None
) -> None:
    (s,) = container_specs(_pod(annotation, node), "vendor.io")
    assert s.assigned == expected


def test_a_whole_card_assignment_to_a_card_in_use_is_refused_for_a_recheck() -> None:
    led = Ledger(cards(2), memory_unit_mib=UNIT)
    k = Kubelet(led)
    k.admit(assigned(spec(0, 8), 1))  # a memory slice on card 1
    with pytest.raises(InsufficientCapacity, match=r"card 1 .* is in use on this node"):
        k.admit(assigned(spec(100), 1))
    whole = k.admit(assigned(spec(100), 0))
    with pytest.raises(InsufficientCapacity, match="held whole on this node"):
        k.admit(assigned(spec(10, 8), 0))
    assert whole.cards == (cards(2)[0].uuid,)


@pytest.mark.parametrize("memory_first", [False, True], ids=["core-first", "memory-first"])
def test_a_reused_resource_completes_its_container(memory_first: bool) -> None:
    """An app container whose memory is its init container's IDs (no
    GetPreferredAllocation for it; the daemon establishes the reuse from the
    kubelet's record) must not leave the next pod's call to join it."""
    led = Ledger(cards(2), memory_unit_mib=UNIT)
    k = Kubelet(led)
    uid = "pod-with-init"
    init = replace(spec(20, 20, name="init"), pod_uid=uid, pod="p1", init=True, order=1)
    main = replace(spec(40, 20, name="main"), pod_uid=uid, pod="p1", order=2)
    both = [init, main]
    first = k.admit(init, candidates=both)
    reused_mem = sorted(first.ids[MEM])
    reused_core = sorted(first.ids[CORE])

    def core_call() -> None:
        ids, _ = led.preferred(CORE, k.available(CORE) + reused_core, reused_core, 40, both)
        led.allocate(CORE, ids, both)
        k.held |= set(ids)

    if memory_first:
        assert led.allocate(MEM, reused_mem, both, reused=[first.key]) == led.placements[first.key]
        core_call()
    else:
        core_call()
        # The reused memory completes main's own placement: its core and that memory.
        done = led.allocate(MEM, reused_mem, both, reused=[first.key])
        assert done.owner is not None and done.owner.container == "main"
        assert done.ids[MEM] == frozenset(reused_mem) and done.core_percent == 40
    # The next pod asks the same memory first: it is a new container, steered to its card.
    other = assigned(spec(10, 20), 1)
    placed = k.admit(other, [MEM, CORE], candidates=[other])
    assert placed.cards == (cards(2)[1].uuid,)
    assert len(placed.ids.get(MEM, ())) == 20  # both resources in one placement, on card 1


@pytest.mark.parametrize("first", [MEM, CORE], ids=["memory-first", "core-first"])
def test_a_container_placed_blind_never_lends_its_pairing_to_the_next_pod(first: Resource) -> None:
    """Found by the 30-minute soak: a container's first resource is placed
    without pod information; its second comes once the pod is known but the
    daemon cannot tell by fact that it is the same container. The next pod, of
    the same size, must not be taken for that container's second resource:
    two pods would share one placement (and one directory)."""
    other = CORE if first is MEM else MEM
    led = Ledger(cards(2), memory_unit_mib=UNIT)
    k = Kubelet(led)
    a, b = spec(5, 4, created_s=1.0), spec(5, 4, created_s=2.0)
    size = {CORE: 5, MEM: 4}
    # a's first resource: Allocate without GetPreferredAllocation, no pod information.
    a_first = k.available(first)[: size[first]]
    led.allocate(first, a_first, [])
    k.held |= set(a_first)
    # a's second resource: the pod is known now, pairing by fact is not possible.
    ids, _ = led.preferred(other, k.available(other), [], size[other], [a, b], blind_pairing=False)
    led.allocate(other, ids, [a, b], blind_pairing=False)
    k.held |= set(ids)
    # b, the next pod: none of its IDs may share a placement with a's.
    held_before = set(k.held)
    k.admit(b, [first, other], candidates=[b])
    b_ids = k.held - held_before
    a_ids = set(a_first) | set(ids)
    for p in led.placements.values():
        mine = p.all_ids()
        assert not (mine & a_ids and mine & b_ids), p
