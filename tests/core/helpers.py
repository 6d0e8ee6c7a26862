"""Drive a Ledger the way the kubelet drives the plugin, without any I/O."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from vgpu.core.model import Card, CardUuid, ContainerSpec, DeviceId, Placement, Request, Resource
from vgpu.core.packing import Ledger
from vgpu.core.slicing import card_device_ids

UNIT = 256
_uids = itertools.count()


def cards(n: int, memory_mib: int = 143771, numa: Sequence[int] | None = None) -> list[Card]:
    return [
        Card(
            uuid=CardUuid(f"GPU-{i:08d}-aaaa-bbbb-cccc-000000000000"),
            index=i,
            name="NVIDIA H200",
            memory_mib=memory_mib,
            minor=i,
            numa_node=(numa[i] if numa else 0),
        )
        for i in range(n)
    ]


def spec(core: int = 0, mem: int = 0, name: str = "main", created_s: float = 0.0) -> ContainerSpec:
    uid = f"uid-{next(_uids)}"
    return ContainerSpec(uid, "default", f"pod-{uid}", name, Request(core, mem), created_s)


class Kubelet:
    """The kubelet's view: advertised IDs, which are held, and admissions."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.held: set[DeviceId] = set()
        self.by_container: dict[str, set[DeviceId]] = {}

    def available(self, resource: Resource) -> list[DeviceId]:
        out = []
        for card in self.ledger.cards.values():
            if not card.healthy:
                continue
            out += [d for d in card_device_ids(card, resource, UNIT) if d not in self.held]
        return out

    def admit(
        self,
        c: ContainerSpec,
        order: Sequence[Resource] | None = None,
        candidates: Sequence[ContainerSpec] | None = None,
        now_s: float = 0.0,
    ) -> Placement:
        """Preferred then Allocate per resource; raises what the ledger raises."""
        cands = [c] if candidates is None else list(candidates)
        placement = None
        taken: set[DeviceId] = set()
        try:
            for resource in order or sorted(c.request.resources, key=lambda r: r.value):
                size = c.request.units(resource)
                ids, _ = self.ledger.preferred(resource, self.available(resource), [], size, cands)
                assert len(ids) == size
                placement = self.ledger.allocate(resource, ids, cands, now_s)
                self.held |= set(ids)
                taken |= set(ids)
        except Exception:
            self.held -= taken  # the kubelet releases a failed pod's IDs
            raise
        assert placement is not None
        self.by_container[placement.key] = taken
        return placement

    def remove(self, placement: Placement) -> None:
        self.held -= self.by_container.pop(placement.key, set())
        self.ledger.release(placement.key)
