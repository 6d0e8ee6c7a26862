"""Issue 28, item 3: identification never guesses between pods. A container
matched to the oldest of several pending pods that ask the same units of its
first resource, but differ in the other, gets only what the kubelet allocated
in its first answer, and no owner, until the kubelet's record names it."""

from __future__ import annotations

from collections.abc import Sequence

from tests.core.helpers import UNIT, Kubelet, cards, spec
from vgpu.core.model import ContainerSpec, Placement, Resource
from vgpu.core.packing import Ledger


def _ledger() -> tuple[Ledger, Kubelet]:
    led = Ledger(cards(2), memory_unit_mib=UNIT)
    return led, Kubelet(led)


def _one(
    led: Ledger, kubelet: Kubelet, resource: Resource, size: int, c: Sequence[ContainerSpec]
) -> Placement:
    ids, _ = led.preferred(resource, kubelet.available(resource), [], size, c)
    kubelet.held |= set(ids)
    return led.allocate(resource, ids, c)


def test_an_ambiguous_match_hands_out_no_neighbours_memory_limit() -> None:
    led, kubelet = _ledger()
    older, newer = spec(core=20, mem=12), spec(core=20, mem=8)
    placement = _one(led, kubelet, Resource.CORE, 20, [older, newer])
    assert placement.core_percent == 20
    assert placement.memory_mib == 0  # not older's 12 units: the call may be newer's
    assert placement.owner is None


def test_an_unambiguous_match_carries_both_limits_at_once() -> None:
    led, kubelet = _ledger()
    first, twin = spec(core=20, mem=12), spec(core=20, mem=12)  # either is right
    placement = _one(led, kubelet, Resource.CORE, 20, [first, twin])
    assert placement.memory_mib == 12 * UNIT
    assert placement.owner is not None and placement.owner.pod == first.pod


def test_the_kubelets_record_replaces_a_guess() -> None:
    led, kubelet = _ledger()
    older, newer = spec(core=20, mem=12), spec(core=20, mem=8)
    candidates = [older, newer]
    first = _one(led, kubelet, Resource.CORE, 20, candidates)
    assert led.unattributed_pending() == first.all_ids()
    led.attribute_pending(newer.namespace, newer.pod, newer.container, candidates)
    assert led.unattributed_pending() == frozenset()
    placement = _one(led, kubelet, Resource.MEMORY, 8, candidates)
    assert placement.key == first.key  # one container, one record
    assert placement.memory_mib == 8 * UNIT
    assert placement.owner is not None and placement.owner.pod == newer.pod
    # The older pod is still to be admitted, and its own request matches it.
    second = _one(led, kubelet, Resource.CORE, 20, candidates)
    assert second.memory_mib == 12 * UNIT
    assert second.owner is not None and second.owner.pod == older.pod


def test_without_the_kubelets_record_a_guess_still_pairs_its_own_second_call() -> None:
    """The guess was right and the kubelet could not be asked: the container's
    two calls still make one record with both of its own limits."""
    led, kubelet = _ledger()
    older, newer = spec(core=20, mem=12), spec(core=20, mem=8)
    first = _one(led, kubelet, Resource.CORE, 20, [older, newer])
    placement = _one(led, kubelet, Resource.MEMORY, 12, [older, newer])
    assert placement.key == first.key
    assert (placement.core_percent, placement.memory_mib) == (20, 12 * UNIT)
