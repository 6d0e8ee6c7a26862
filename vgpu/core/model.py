"""The data model: cards, resources, requests and placements.

Vocabulary: a *card* is a physical GPU, a *slice* is one advertised unit
(device ID), a *request* is what a container asks for, a *placement* is what
it got.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

CardUuid = NewType("CardUuid", str)
DeviceId = NewType("DeviceId", str)

CORE_UNITS_PER_CARD = 100


class Resource(enum.Enum):
    """The two extended resources vgpu advertises (name without the domain)."""

    CORE = "vcuda-core"
    MEMORY = "vcuda-memory"

    def full_name(self, domain: str) -> str:
        return f"{domain}/{self.value}"

    @property
    def other(self) -> Resource:
        return Resource.MEMORY if self is Resource.CORE else Resource.CORE


class Policy(enum.Enum):
    BINPACK = "binpack"
    SPREAD = "spread"


@dataclass(frozen=True)
class Card:
    """One physical GPU as the backend reports it."""

    uuid: CardUuid
    index: int
    name: str
    memory_mib: int
    minor: int
    numa_node: int | None = None
    healthy: bool = True
    xid: int | None = None  # last critical XID seen, when unhealthy because of one
    # The host device nodes this card needs. None: NVIDIA's own (/dev/nvidia<minor>
    # and the control nodes); a tuple: exactly these (the mock backend's list,
    # empty for a card without nodes). Only nodes present on the host are named.
    device_nodes: tuple[str, ...] | None = None
    # Why the card is unhealthy other than by an XID (e.g. its device node is
    # missing on the host); None when it is not, or only by an XID.
    problem: str | None = None

    def memory_units(self, unit_mib: int) -> int:
        return self.memory_mib // unit_mib


@dataclass(frozen=True)
class Request:
    """What one container asks for: core percent and memory units (0 = not asked)."""

    core_percent: int = 0
    memory_units: int = 0

    def units(self, resource: Resource) -> int:
        return self.core_percent if resource is Resource.CORE else self.memory_units

    @property
    def whole_cards(self) -> int:
        """Number of whole cards asked for (0 for a fractional or memory-only slice)."""
        return self.core_percent // CORE_UNITS_PER_CARD if self.core_percent >= 100 else 0

    @property
    def resources(self) -> frozenset[Resource]:
        return frozenset(r for r in Resource if self.units(r) > 0)


@dataclass(frozen=True)
class Owner:
    """The pod container a placement belongs to, once known."""

    namespace: str
    pod: str
    container: str
    pod_uid: str = ""


@dataclass(frozen=True)
class Placement:
    """What one container got: its card(s) and the device IDs per resource.

    `key` is derived from the device IDs of the first resource allocated, i.e.
    from the kubelet's own record, never from a guessed pod, so two identical
    pods can never swap configs.
    """

    key: str
    cards: tuple[CardUuid, ...]
    ids: dict[Resource, frozenset[DeviceId]] = field(hash=False)
    core_percent: int  # per card; 100 for whole cards; 0 = best effort (memory-only slice)
    memory_mib: int  # per-card limit; 0 = no limit (whole cards or core-only)
    owner: Owner | None = None
    created_s: float = 0.0

    @property
    def whole(self) -> bool:
        return self.core_percent >= CORE_UNITS_PER_CARD

    def all_ids(self) -> frozenset[DeviceId]:
        out: frozenset[DeviceId] = frozenset()
        for ids in self.ids.values():
            out |= ids
        return out


@dataclass(frozen=True)
class ContainerSpec:
    """A container of a pod bound to this node, as the API server describes it."""

    pod_uid: str
    namespace: str
    pod: str
    container: str
    request: Request
    created_s: float  # pod creation time, seconds since the epoch
    init: bool = False
    order: int = 0  # position in the pod: init containers first
    # The card(s) the scheduler extender assigned to this container on this
    # node (the pod's vgpu-assignment annotation); None: the node chooses.
    assigned: tuple[CardUuid, ...] | None = None
    # Why the pod spec cannot be honoured (e.g. a non-integer quantity), naming
    # the container and resource; the admission is refused with it. "" = fine.
    problem: str = ""

    @property
    def ident(self) -> tuple[str, str]:
        return (self.pod_uid, self.container)

    def owner(self) -> Owner:
        return Owner(self.namespace, self.pod, self.container, self.pod_uid)
