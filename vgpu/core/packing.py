"""The placement ledger: which card every container's slices live on.

Pure and I/O-free: the daemon feeds it what the kubelet sent, the containers
the API server knows about and the current time, and holds a lock around it.

How a container is placed. The kubelet admits one container at a time and,
per container, calls GetPreferredAllocation then Allocate once per resource,
in random resource order, with device IDs only. The ledger

1. at the first resource's GetPreferredAllocation, matches the call to a
   container of a pod on this node (oldest first, asking exactly this many
   units of this resource), decides its card(s) from BOTH of its requests and
   opens an in-flight *pending* placement;
2. steers the second resource of the same container to the same card(s);
3. at Allocate, derives the card from the IDs themselves, checks they form a
   valid placement and records it under a key derived from the IDs (the
   kubelet's own record), never from a guessed pod.

Without pod information (API server down, or the pod is not in the cache yet)
the fallback rule is: the first resource picks by policy among cards where it
fits, preferring the card with the most free of the other resource, and the
other resource, if it follows, is steered to the same card. The kubelet only
hands out advertised, unallocated IDs, so no rule here can overcommit a card.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from operator import itemgetter
from typing import cast

from vgpu.core import fit
from vgpu.core.errors import (
    InsufficientCapacity,
    InvalidRequest,
    PlacementConflict,
    UnknownCard,
    UnknownDevice,
)
from vgpu.core.fit import CardUsage, NoRoom
from vgpu.core.model import (
    CORE_UNITS_PER_CARD,
    Card,
    CardUuid,
    ContainerSpec,
    DeviceId,
    Owner,
    Placement,
    Policy,
    Request,
    Resource,
)
from vgpu.core.slicing import (
    card_device_ids,
    card_digest,
    format_device_id,
    parse_device_id,
    units_per_card,
)

__all__ = ["RECONCILE_GRACE_S", "CardUsage", "Ledger", "placement_key"]

# A placement whose IDs the kubelet does not list yet is kept this long: the
# kubelet records an allocation only after our Allocate answer reached it.
RECONCILE_GRACE_S = 30.0
MAX_IDS_IN_MESSAGE = 8


@dataclass
class _Pending:
    """The container being admitted right now (admission is serialized per node)."""

    cards: tuple[CardUuid, ...]
    request: Request
    expected: frozenset[Resource] | None  # None: unknown, no pod information
    spec: ContainerSpec | None
    steered: set[Resource] = field(
        default_factory=set
    )  # resources GetPreferredAllocation sent here
    key: str | None = None  # set by the first Allocate
    allocated: set[Resource] = field(default_factory=set)
    assigned: tuple[CardUuid, ...] | None = None  # steered by the extender's assignment
    # The spec was the oldest of several pending containers asking this many
    # units and different other requests: a guess. Its other request is not
    # handed out until the kubelet's record names the container (issue 28).
    guessed: bool = False


def _short(ids: Iterable[str]) -> str:
    items = sorted(ids)
    head = ", ".join(items[:MAX_IDS_IN_MESSAGE])
    more = len(items) - MAX_IDS_IN_MESSAGE
    return head + (f" (+{more} more)" if more > 0 else "")


def placement_key(ids: Iterable[DeviceId]) -> str:
    digest = hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()
    return "p" + digest[:20]


class Ledger:
    """All cards of the node and every placement on them."""

    def __init__(
        self,
        cards: Iterable[Card],
        *,
        memory_unit_mib: int,
        policy: Policy = Policy.BINPACK,
        domain: str = "vendor.io",
    ) -> None:
        self.memory_unit_mib = memory_unit_mib
        self.policy = policy
        self.domain = domain
        self.cards: dict[CardUuid, Card] = {}
        self._seen: dict[CardUuid, Card] = {}  # every card this node ever had
        self._index: dict[str, tuple[CardUuid, Resource, int]] = {}
        self.placements: dict[str, Placement] = {}
        self._holders: dict[DeviceId, set[str]] = {}
        self._held: dict[tuple[CardUuid, Resource], set[DeviceId]] = {}
        self._card_keys: dict[CardUuid, set[str]] = {}
        # Slices held under their legacy ID (the format before issue 19):
        # short ID -> the legacy ID. They are advertised under the legacy ID
        # until released, so the kubelet never sees one slice twice.
        self._legacy: dict[DeviceId, DeviceId] = {}
        self.legacy_version = 0  # bumped whenever _legacy changes
        self.set_cards(cards)
        self._pending: _Pending | None = None
        # (pod uid, resource) of a reuse that came before its container's first call.
        self._reused_first: tuple[str, Resource] | None = None
        # The container the last new-container call matched (note_refused()).
        self._refusing: tuple[str, str] | None = None
        self._claimed: set[tuple[str, str]] = set()
        # Placements the kubelet is known to have recorded (listed once, or
        # recovered from an earlier run): no grace once it stops listing them.
        self._settled: set[str] = set()

    # ----------------------------------------------------------------- views

    def set_cards(self, cards: Iterable[Card]) -> None:
        """Replace the card list (health changes, a card gone). Placements stay."""
        self.cards = {c.uuid: c for c in cards}
        self._seen.update(self.cards)
        # Each card's short IDs of both resources, in index order (_ids_on).
        self._card_ids: dict[CardUuid, list[DeviceId]] = {
            card.uuid: [
                d
                for resource in Resource
                for d in card_device_ids(card, resource, self.memory_unit_mib)
            ]
            for card in self.cards.values()
        }
        self._index = {
            device_id: (card.uuid, resource, i)
            for card in self.cards.values()
            for resource in Resource
            for i, device_id in enumerate(card_device_ids(card, resource, self.memory_unit_mib))
        }
        self._resource_index = {
            resource: {d: found for d, found in self._index.items() if found[1] is resource}
            for resource in Resource
        }
        # What the kubelet should offer: each resource's IDs on healthy cards
        # that no placement holds, and how many per card; kept up to date by
        # restore() and release(), so that an offer equal to it needs no walk
        # over its IDs (preferred()).
        self._free: dict[Resource, set[DeviceId]] = {
            resource: {
                DeviceId(d)
                for d, found in self._resource_index[resource].items()
                if self.cards[found[0]].healthy and d not in self._holders
            }
            for resource in Resource
        }
        self._free_counts: dict[Resource, Counter[CardUuid]] = {
            resource: Counter(self._resource_index[resource][d][0] for d in free)
            for resource, free in self._free.items()
        }

    def lookup(self, device_id: str) -> tuple[CardUuid, Resource, int] | None:
        """(card, resource, index) of a slice of a present card, by its short ID or
        its legacy ID (the format before issue 19); None for anything else."""
        found = self._index.get(device_id)
        if found is not None or "." in device_id:
            return found
        try:
            ref = parse_device_id(device_id)
        except UnknownDevice:
            return None
        card = self.cards.get(ref.card_uuid) if ref.card_uuid is not None else None
        if card is None or ref.index >= units_per_card(card, ref.resource, self.memory_unit_mib):
            return None
        return card.uuid, ref.resource, ref.index

    def slot(self, device_id: str) -> DeviceId:
        """The short ID of the slice a device ID names: one key per slice, whichever
        form the kubelet recorded it under (the ID itself when it names no slice)."""
        if device_id in self._index or "." in device_id:
            return DeviceId(device_id)
        found = self.lookup(device_id)
        if found is None:
            return DeviceId(device_id)
        return format_device_id(self.cards[found[0]], found[1], found[2])

    def advertised(self, card: Card, resource: Resource) -> list[DeviceId]:
        """The IDs to advertise for one card: short IDs, except for slices a
        container holds under a legacy ID, advertised under that ID until released
        (the kubelet re-admits a running pod only if its recorded IDs are listed)."""
        ids = card_device_ids(card, resource, self.memory_unit_mib)
        if not self._legacy:
            return ids
        return [self._legacy.get(d, d) for d in ids]

    def holders_of(self, device_id: DeviceId) -> frozenset[str]:
        return frozenset(self._holders.get(self.slot(device_id), ()))

    def held_ids(self) -> frozenset[DeviceId]:
        return frozenset(self._holders)

    def usage(self, card: CardUuid) -> CardUsage:
        keys = self._card_keys.get(card, set())
        return CardUsage(
            self.cards[card],
            len(self._held.get((card, Resource.CORE), ())),
            len(self._held.get((card, Resource.MEMORY), ())),
            any(self.placements[k].whole for k in keys),
            len(keys),
        )

    def usages(self) -> list[CardUsage]:
        return [self.usage(u) for u in sorted(self.cards, key=lambda u: self.cards[u].index)]

    def placements_on(self, card: CardUuid) -> list[Placement]:
        return [self.placements[k] for k in sorted(self._card_keys.get(card, ()))]

    def describe_free(self) -> str:
        return fit.describe_free(self.usages(), self.memory_unit_mib)

    # --------------------------------------------------------- bookkeeping

    def restore(self, placement: Placement) -> None:
        """Record a placement recovered from state or from the kubelet."""
        self.placements[placement.key] = placement
        for card in placement.cards:
            self._card_keys.setdefault(card, set()).add(placement.key)
        for device_id in placement.all_ids():
            slot = self.slot(device_id)
            self._holders.setdefault(slot, set()).add(placement.key)
            card, resource = self._card_of(device_id, placement)
            self._held.setdefault((card, resource), set()).add(slot)
            free = self._free[resource]
            if slot in free:
                free.discard(slot)
                self._free_counts[resource][card] -= 1
            if slot != device_id:
                self._legacy[slot] = device_id
                self.legacy_version += 1

    def release(self, key: str) -> Placement | None:
        placement = self.placements.pop(key, None)
        if placement is None:
            return None
        for card in placement.cards:
            self._card_keys.get(card, set()).discard(key)
        for device_id in placement.all_ids():
            slot = self.slot(device_id)
            holders = self._holders.get(slot)
            if holders is not None:
                holders.discard(key)
                if not holders:
                    del self._holders[slot]
                    card, resource = self._card_of(device_id, placement)
                    self._held.get((card, resource), set()).discard(slot)
                    present = self.cards.get(card)
                    if (
                        present is not None
                        and present.healthy
                        and slot in self._resource_index[resource]
                    ):
                        self._free[resource].add(slot)
                        self._free_counts[resource][card] += 1
                    if self._legacy.get(slot) == device_id:
                        del self._legacy[slot]
                        self.legacy_version += 1
        if self._pending is not None and self._pending.key == key:
            self._pending = None
        self._settled.discard(key)
        return placement

    def _card_of(self, device_id: str, placement: Placement) -> tuple[CardUuid, Resource]:
        """The card and resource of one of a placement's IDs, also for a card
        no longer present (matched among the placement's own cards)."""
        found = self.lookup(device_id)
        if found is not None:
            return found[0], found[1]
        ref = parse_device_id(device_id)
        for uuid in placement.cards:
            seen = self._seen.get(uuid)
            if ref.card_uuid == uuid or (
                ref.card_uuid is None
                and ref.card_digest == card_digest(uuid)
                and (seen is None or seen.index == ref.card_index)
            ):
                return uuid, ref.resource
        return (placement.cards[0] if placement.cards else CardUuid("?")), ref.resource

    def is_settled(self, key: str) -> bool:
        """Has the kubelet listed this placement (or did an earlier run record it)?"""
        return key in self._settled

    def holders_among(self, ids: Iterable[str]) -> list[str]:
        """Keys of the placements holding any of these IDs, oldest first."""
        keys: set[str] = set()
        for device_id in ids:
            keys |= self._holders.get(self.slot(device_id), set())
        return sorted(keys, key=lambda k: (self.placements[k].created_s, k))

    def mark_settled(self, keys: Iterable[str]) -> None:
        """These placements are known to the kubelet (e.g. recovered at start-up:
        every Allocate of an earlier run has either reached the kubelet or failed)."""
        self._settled |= {k for k in keys if k in self.placements}

    def set_owner(self, key: str, owner: Owner) -> Placement | None:
        placement = self.placements.get(key)
        if placement is None or placement.owner == owner:
            return None
        updated = replace(placement, owner=owner)
        self.placements[key] = updated
        self._claimed.add((owner.pod_uid, owner.container))
        return updated

    def prune_claims(self, live: Collection[tuple[str, str]]) -> None:
        """Forget claims on containers of pods that are gone."""
        self._claimed &= set(live)

    def reconcile(
        self,
        live_ids: Collection[DeviceId],
        now_s: float,
        gone_pods: Collection[str] = (),
        may_release: Callable[[Placement], bool] | None = None,
    ) -> list[Placement]:
        """Release placements the kubelet no longer lists (pod deleted or finished).

        `live_ids` are every device ID of ours that the kubelet's pod-resources
        API lists for an active container; `gone_pods` are UIDs of pods the API
        server says are deleted or finished. The one being admitted is kept for
        the grace period (its other resource may follow). A placement the
        kubelet has not listed yet is kept for the grace period
        (the kubelet records an allocation only after our answer reached it),
        unless its pod is gone. Any other unlisted placement is released when
        `may_release` agrees (the daemon's rules of vgpu.core.release: no
        kubelet restart under way, two sightings, the API server agrees).
        """
        released = []
        live = frozenset(live_ids)
        gone = frozenset(gone_pods)
        pending_key = self._pending.key if self._pending else None
        for key, placement in list(self.placements.items()):
            young = now_s - placement.created_s < RECONCILE_GRACE_S
            if key == pending_key and young and len(placement.ids) < len(Resource):
                continue  # its other resource may still come
            if placement.all_ids() & live:
                self._settled.add(key)
                continue
            owner_gone = placement.owner is not None and placement.owner.pod_uid in gone
            if young and key not in self._settled and not owner_gone:
                continue
            if may_release is not None and not may_release(placement):
                continue
            self.release(key)
            released.append(placement)
        return released

    def release_offered(
        self, resource: Resource, available: Sequence[str], must_include: Sequence[str] = ()
    ) -> list[str]:
        """Release the placements holding IDs the kubelet offers as free (as
        preferred() does first); the keys released."""
        known = self._known_map(resource, available)
        for device_id in must_include:
            known.pop(DeviceId(device_id), None)
        return self._release_offered(resource, list(known))

    def _release_offered(self, resource: Resource, available: Collection[DeviceId]) -> list[str]:
        """IDs the kubelet offers as free are not held by any live container."""
        offered = available.keys() if isinstance(available, dict) else set(available)
        # Held slots among the offered IDs, at C speed: short IDs are their own
        # slot; the few others (legacy IDs) are mapped one by one.
        slots = self._holders.keys() & offered
        slots |= {self.slot(d) for d in offered - self._index.keys()}
        dead: set[str] = set()
        for slot in slots:
            dead |= self._holders.get(slot, set())
        released = []
        for key in dead:
            placement = self.placements.get(key)
            if placement is not None and placement.ids.get(resource, frozenset()) & offered:
                self.release(key)
                released.append(key)
                if placement.owner is not None:
                    # Its pod, if still pending, is being admitted anew (e.g. a
                    # kubelet restart cut its admission short): match it again.
                    self._claimed.discard((placement.owner.pod_uid, placement.owner.container))
        return released

    # ------------------------------------------------------------- choosing

    def _refuse(self, request: Request, why: str) -> InsufficientCapacity:
        return InsufficientCapacity(
            f"no card on this node can hold {self.describe_request(request)}: {why}. "
            f"Free per card: {self.describe_free()}. Wait for running slices to finish, "
            "request less, or let the scheduler place the pod on another node."
        )

    def describe_request(self, request: Request) -> str:
        return fit.describe_request(request, self.domain, self.memory_unit_mib)

    def validate_request(self, request: Request) -> None:
        fit.validate_request(request, self.domain, self.memory_unit_mib)

    def _choose_fractional(
        self,
        request: Request,
        resource: Resource,
        offered: dict[CardUuid, int],
        known_other: bool,
    ) -> CardUuid:
        try:
            return fit.choose_fractional(
                request,
                self.usages(),
                self.memory_unit_mib,
                self.policy,
                resource=resource,
                offered=offered,
                known_other=known_other,
            )
        except NoRoom as exc:
            raise self._refuse(request, exc.why) from None

    def _choose_whole(
        self, request: Request, resource: Resource, offered: dict[CardUuid, int]
    ) -> tuple[CardUuid, ...]:
        try:
            return fit.choose_whole(
                request,
                self.usages(),
                self.memory_unit_mib,
                self.domain,
                resource=resource,
                offered=offered,
            )
        except NoRoom as exc:
            raise self._refuse(request, exc.why) from None

    def _match(
        self, resource: Resource, size: int, candidates: Sequence[ContainerSpec]
    ) -> ContainerSpec | None:
        # Containers that already hold a placement (claims are not persisted:
        # after a restart the owners in the recovered records tell), by UID, or
        # by name for owners adopted before the pod cache knew the UID.
        owned = self._owned()
        for spec in candidates:
            if spec.ident in self._claimed or spec.ident in owned:
                continue
            if (spec.namespace, spec.pod, spec.container) in owned:
                continue
            if spec.request.units(resource) == size:
                return spec
        return None

    def _ambiguous(
        self,
        resource: Resource,
        size: int,
        spec: ContainerSpec,
        candidates: Sequence[ContainerSpec],
    ) -> bool:
        """Would another unplaced container, asking the same `size` of `resource`
        but something else of the other resource, fit this call as well?"""
        rivals = [
            c
            for c in candidates
            if c.ident != spec.ident
            and c.request.units(resource) == size
            and c.request != spec.request
        ]
        if not rivals:  # the usual case: no need to walk the placements
            return False
        owned = self._owned()
        return any(
            other.ident not in self._claimed
            and other.ident not in owned
            and (other.namespace, other.pod, other.container) not in owned
            for other in rivals
        )

    def _owned(self) -> set[tuple[str, ...]]:
        owned: set[tuple[str, ...]] = set()
        for placement in self.placements.values():
            o = placement.owner
            if o is not None:
                owned.add(
                    (o.pod_uid, o.container) if o.pod_uid else (o.namespace, o.pod, o.container)
                )
        return owned

    def _ids_on(
        self,
        cards: Sequence[CardUuid],
        available: Sequence[DeviceId],
        must_include: Sequence[DeviceId],
        size: int,
        where: Mapping[DeviceId, tuple[CardUuid, Resource, int]]
        | AbstractSet[DeviceId]
        | None = None,
    ) -> list[DeviceId]:
        chosen = list(dict.fromkeys(must_include))
        taken = set(chosen)
        if where is None:
            where = self._known_map(None, available)
        if not self._legacy:
            # Every slice is known by its short ID: walk the cards' IDs in index
            # order and stop at `size` (the same choice as ranking every
            # offered ID, without the sort; a binpacked card's free slices sit
            # right after its held ones).
            for card in dict.fromkeys(cards):
                for device_id in self._card_ids.get(card, ()):
                    if len(chosen) >= size:
                        return chosen
                    if device_id in where and device_id not in taken:
                        chosen.append(device_id)
                        taken.add(device_id)
            return chosen
        if not isinstance(where, Mapping):
            where = self._known_map(None, available)
        order = {c: i for i, c in enumerate(cards)}
        ranked = sorted(
            (d for d in available if d not in taken and d in where and where[d][0] in order),
            key=lambda d: (order[where[d][0]], where[d][2]),
        )
        for device_id in ranked:
            if len(chosen) >= size:
                break
            chosen.append(device_id)
        return chosen

    # ---------------------------------------------------- the kubelet's calls

    def preferred(
        self,
        resource: Resource,
        available: Sequence[str],
        must_include: Sequence[str],
        size: int,
        candidates: Sequence[ContainerSpec] = (),
        blind_pairing: bool = True,
    ) -> tuple[list[DeviceId], list[str]]:
        """Answer GetPreferredAllocation: exactly `size` IDs on the right card(s).

        Returns the IDs and the keys of placements found dead on the way.
        `blind_pairing` False: the daemon found that this call may belong to
        another pod than the in-flight container placed without pod
        information, so it is not taken for that container's other resource.
        """
        self.check_preferred(resource, must_include, size)
        must = [DeviceId(d) for d in must_include]
        known: Mapping[DeviceId, tuple[CardUuid, Resource, int]] | AbstractSet[DeviceId]
        free = self._free[resource]
        if not must and not self._legacy and len(available) == len(free) and free == set(available):
            # The kubelet offers exactly what no placement holds (the usual
            # case): nothing to release, and the counts per card are kept.
            known, avail, released = free, [], []
            offered: dict[CardUuid, int] = dict(self._free_counts[resource])
        else:
            mapped = self._known_map(resource, available)
            for device_id in must:
                mapped.pop(device_id, None)
            known, avail = mapped, list(mapped)
            released = self._release_offered(resource, mapped)
            offered = dict(Counter(map(itemgetter(0), mapped.values())))
        if len(must) >= size:
            return must[:size], released

        spec = self._match(resource, size, candidates)
        pending = self._pending
        if pending is not None and self._continues(pending, resource, size, spec, blind_pairing):
            ids = self._ids_on(pending.cards, avail, must, size, known)
            if len(ids) < size and pending.assigned is not None and pending.spec is not None:
                raise self._refuse_assigned(
                    pending.spec, resource, pending.assigned, len(ids), size
                )
            if len(ids) < size:
                raise self._refuse(
                    pending.request,
                    f"{resource.full_name(self.domain)} must land on card(s) "
                    f"{', '.join(pending.cards)} with the container's other resource, and only "
                    f"{len(ids)} of {size} units are free there",
                )
            pending.steered.add(resource)
            if pending.spec is None and spec is not None:
                self._attach(pending, spec)
            return ids, released

        # A new container.
        previous, self._pending = self._pending, None
        self._refusing = spec.ident if spec is not None else None
        if spec is not None:
            request = spec.request
            try:
                fit.check_container(spec, self.domain, self.memory_unit_mib)
            except InvalidRequest:
                # Refused for good (the kubelet fails the pod, and never asks
                # again): it is not the container of any later call.
                self._claimed.add(spec.ident)
                raise
        else:
            request = (
                Request(core_percent=size)
                if resource is Resource.CORE
                else Request(memory_units=size)
            )
            self._validate_partial(request)
        assigned: tuple[CardUuid, ...] | None = None
        if must:
            cards = tuple(dict.fromkeys(self._card_uuid(d) for d in must))
        elif spec is not None and spec.assigned is not None:
            cards = assigned = self._assigned(spec)
        elif request.whole_cards:
            cards = self._choose_whole(request, resource, offered)
        else:
            cards = (self._choose_fractional(request, resource, offered, spec is not None),)
        ids = self._ids_on(cards, avail, must, size, known)
        if len(ids) < size and spec is not None and assigned is not None:
            raise self._refuse_assigned(spec, resource, assigned, len(ids), size)
        if len(ids) < size:
            raise self._refuse(request, f"only {len(ids)} of {size} units free on the chosen card")
        self._pending = _Pending(
            cards=cards,
            request=request,
            expected=request.resources if spec is not None else None,
            spec=spec,
            steered={resource},
            assigned=assigned,
            guessed=spec is not None and self._ambiguous(resource, size, spec, candidates),
        )
        if (
            spec is not None
            and previous is not None
            and previous.spec is None
            and previous.key is not None
            and previous.allocated
            and resource not in previous.allocated
            and all(spec.request.units(r) == previous.request.units(r) for r in previous.allocated)
        ):
            # The container placed just before without pod information got exactly
            # what this one asks for its other resource: it may be this container
            # (the daemon could not tell by fact). Then that resource is already
            # placed, and the next call must never be taken for it: it may be
            # another pod's. At worst this container's resources stay apart.
            self._pending.allocated |= previous.allocated
        reused, self._reused_first = self._reused_first, None
        if spec is not None and reused is not None and reused[0] == spec.pod_uid:
            # This container's other resource came first, as its init containers' IDs.
            self._pending.allocated.add(reused[1])
        if spec is not None:
            self._claimed.add(spec.ident)
        return ids, released

    def _assigned(self, spec: ContainerSpec) -> tuple[CardUuid, ...]:
        """The card(s) the scheduler extender assigned, checked against this node."""
        cards = spec.assigned or ()
        who = _spec_text(spec)
        needed = spec.request.whole_cards or 1
        if len(set(cards)) != needed:
            raise PlacementConflict(
                f"{who} was assigned {len(set(cards))} card(s) ({', '.join(cards)}) by the vgpu "
                f"scheduler extender but asks for {needed}; {_RESCHEDULE}"
            )
        for uuid in cards:
            card = self.cards.get(uuid)
            if card is None:
                raise PlacementConflict(
                    f"{who} was assigned card {uuid} by the vgpu scheduler extender, but this "
                    f"node has no such card (gone since?); {_RESCHEDULE}"
                )
            if not card.healthy:
                why = f"xid {card.xid}" if card.xid else "reported unhealthy"
                raise PlacementConflict(
                    f"{who} was assigned card {card.index} ({uuid}) by the vgpu scheduler "
                    f"extender, but that card turned unhealthy ({why}); {_RESCHEDULE}"
                )
        for uuid in cards:
            # The node's own rule for the card (a card held whole takes no slice, a
            # whole card must be empty): a placement the kubelet has freed but we
            # have not released yet is found by the re-check before refusing.
            usage = self.usage(uuid)
            busy = not usage.empty if spec.request.whole_cards else usage.exclusive
            if busy:
                held = ", ".join(_owner_text(p) for p in self.placements_on(uuid))
                raise InsufficientCapacity(
                    f"{who} was assigned card {self.cards[uuid].index} ({uuid}) by the vgpu "
                    f"scheduler extender, but that card is "
                    f"{'in use' if spec.request.whole_cards else 'held whole'} on this node "
                    f"({held}); {_RESCHEDULE}"
                )
        return tuple(sorted(set(cards), key=lambda u: self.cards[u].index))

    def _refuse_assigned(
        self,
        spec: ContainerSpec,
        resource: Resource,
        cards: Sequence[CardUuid],
        found: int,
        size: int,
    ) -> InsufficientCapacity:
        names = ", ".join(f"{self.cards[c].index} ({c})" for c in cards)
        return InsufficientCapacity(
            f"{_spec_text(spec)} was assigned card {names} by the vgpu scheduler extender, but "
            f"the kubelet offers only {found} of the {size} {resource.full_name(self.domain)} "
            f"units it needs there. Free per card: {self.describe_free()}; {_RESCHEDULE}"
        )

    def _note_reuse(self, resource: Resource, placement: Placement) -> None:
        """An Allocate handed back IDs a placement already holds: an app container
        reusing its init containers' IDs (the kubelet asks no GetPreferredAllocation
        for that resource). Count it as the in-flight container's, so that it does
        not wait for that resource and take another container's call for it."""
        pending = self._pending
        pod_uid = placement.owner.pod_uid if placement.owner is not None else ""
        if (
            pending is not None
            and pending.spec is not None
            and pending.expected is not None
            and resource in pending.expected
            and resource not in pending.allocated
            and pod_uid
            and pod_uid == pending.spec.pod_uid
        ):
            pending.allocated.add(resource)
            if pending.expected <= pending.allocated:
                self._pending = None
        elif pod_uid:
            self._reused_first = (pod_uid, resource)

    def _attach(self, pending: _Pending, spec: ContainerSpec) -> None:
        """The in-flight container turns out to be `spec`: adopt its request and owner."""
        if pending.spec is not None and pending.spec.ident != spec.ident:
            self._claimed.discard(pending.spec.ident)  # the guess was wrong
        pending.spec = spec
        pending.request = spec.request
        pending.expected = spec.request.resources
        pending.guessed = False
        self._claimed.add(spec.ident)
        if pending.key is not None and pending.key in self.placements:
            placement = self.placements[pending.key]
            if placement.owner is None or placement.owner.pod_uid != spec.pod_uid:
                self.placements[pending.key] = replace(placement, owner=spec.owner())

    def note_refused(self) -> None:
        """The daemon refused the last new-container call for good (after its
        re-checks): the kubelet fails that pod and never asks again, so the
        container it matched is no later call's."""
        if self._refusing is not None:
            self._claimed.add(self._refusing)
            self._refusing = None

    def awaits_more(self, key: str) -> bool:
        """Is `key` the in-flight container whose pod asks another resource still
        to be allocated? (Known from its pod spec; never assumed without one.)"""
        pending = self._pending
        return (
            pending is not None
            and pending.key == key
            and pending.expected is not None
            and not pending.expected <= pending.allocated
        )

    def blind_pending_key(self) -> str | None:
        """The in-flight placement made without pod information, if any."""
        pending = self._pending
        if pending is None or pending.spec is not None:
            return None
        return pending.key

    def unattributed_pending(self) -> frozenset[DeviceId]:
        """IDs already allocated to an in-flight container we have no pod for,
        or only a guessed one."""
        pending = self._pending
        if pending is None or pending.key is None:
            return frozenset()
        if pending.spec is not None and not pending.guessed:
            return frozenset()
        placement = self.placements.get(pending.key)
        return placement.all_ids() if placement is not None else frozenset()

    def attribute_pending(
        self, namespace: str, pod: str, container: str, candidates: Sequence[ContainerSpec]
    ) -> None:
        """The kubelet says who holds the in-flight IDs: take that container's spec."""
        pending = self._pending
        if pending is None or (pending.spec is not None and not pending.guessed):
            return
        for spec in candidates:
            if (spec.namespace, spec.pod, spec.container) == (namespace, pod, container):
                self._attach(pending, spec)
                return

    def check_preferred(self, resource: Resource, must_include: Sequence[str], size: int) -> None:
        """Reject a malformed GetPreferredAllocation before anything else."""
        if size <= 0:
            raise InvalidRequest(
                f"allocation_size {size} for {resource.full_name(self.domain)} must be positive"
            )
        self._check_ids(resource, must_include, "must_include_deviceIDs")

    def needs_pod_info(
        self, resource: Resource, size: int, candidates: Sequence[ContainerSpec]
    ) -> bool:
        """Would a GetPreferredAllocation now fall back for lack of a matching pod?"""
        pending = self._pending
        if (
            pending is not None
            and pending.spec is not None
            and self._continues(pending, resource, size, None)
        ):
            return False
        # An in-flight container without pod information may be stale (its
        # other resource never came): wait for the pod rather than pair with it.
        return self._match(resource, size, candidates) is None

    @staticmethod
    def _continues(
        pending: _Pending,
        resource: Resource,
        size: int,
        spec: ContainerSpec | None,
        blind_pairing: bool = True,
    ) -> bool:
        """Is this call the in-flight container's other resource?"""
        if resource in pending.allocated:
            return False
        if pending.spec is not None:
            return (
                pending.expected is not None
                and resource in pending.expected
                and pending.spec.request.units(resource) == size
            )
        # No pod information for the in-flight container. Pair with it when
        # the cache names no unplaced container asking exactly this, or names
        # one whose request for the resource already placed matches it (the
        # pod reached the cache between the two calls). Otherwise it is a new
        # container and the in-flight one was stale. Never when the daemon saw
        # a new pod since the in-flight Allocate (blind_pairing False).
        if spec is None or not blind_pairing:
            return blind_pairing
        return all(
            spec.request.units(r) == pending.request.units(r) for r in pending.allocated
        ) and bool(pending.allocated)

    def _validate_partial(self, request: Request) -> None:
        """Checks that hold without knowing the container's other resource."""
        self.validate_request(replace(request, memory_units=max(request.memory_units, 1)))

    def _known_map(
        self, resource: Resource | None, ids: Iterable[str]
    ) -> dict[DeviceId, tuple[CardUuid, Resource, int]]:
        """The slices of `resource` (any, for None) among `ids`, in their order,
        with what each names; one pass (this walks every offered ID)."""
        index = self._index
        ids = ids if isinstance(ids, list | tuple) else list(ids)
        # At C speed first: the usual offer is short IDs of this resource only.
        get = (index if resource is None else self._resource_index[resource]).get
        fast = {raw: f for raw in ids if (f := get(raw)) is not None}
        if len(fast) == len(ids):
            return cast(dict[DeviceId, tuple[CardUuid, Resource, int]], fast)
        out: dict[DeviceId, tuple[CardUuid, Resource, int]] = {}
        for raw in ids:
            found = index.get(raw)
            if found is None:
                if "." in raw:
                    continue
                found = self.lookup(raw)
                if found is None:
                    continue
            if resource is None or found[1] is resource:
                out[DeviceId(raw)] = found
        return out

    def _check_ids(self, resource: Resource, ids: Sequence[str], what: str) -> None:
        """Every ID must be ours, of this resource, on a known card, and unique."""
        if len(set(ids)) != len(ids):
            dupes = {d for d in ids if ids.count(d) > 1}
            raise InvalidRequest(f"{what} lists the same device ID twice: {_short(dupes)}")
        unknown: list[str] = []
        other: list[str] = []
        for raw in ids:
            found = self.lookup(raw)
            if found is None:
                unknown.append(raw)
            elif found[1] is not resource:
                other.append(raw)
        for raw in unknown:
            try:
                ref = parse_device_id(raw)
            except UnknownDevice:
                continue
            gone = next(
                (c for c in self._seen.values() if c.uuid not in self.cards and ref.names(c)),
                None,
            )
            if gone is not None:
                card = gone.uuid
                raise UnknownCard(
                    f"{what} names card {card} (index {gone.index}), which is no longer on "
                    "this node (it disappeared from the GPU backend); nothing is placed on it. "
                    "The kubelet stops offering its IDs within a second; check the node's GPUs "
                    "(nvidia-smi, dmesg for XIDs)",
                    card,
                )
        if unknown:
            raise UnknownDevice(
                f"{what} has {len(unknown)} device ID(s) this node never advertised for "
                f"{resource.full_name(self.domain)}: {_short(d[:80] for d in unknown)}. Only pass "
                "IDs from this plugin's ListAndWatch",
                tuple(unknown),
            )
        if other:
            raise InvalidRequest(
                f"{what} for {resource.full_name(self.domain)} contains IDs of "
                f"{resource.other.full_name(self.domain)}: {_short(other)}; send each resource's "
                "IDs to its own plugin socket"
            )

    def allocate(
        self,
        resource: Resource,
        device_ids: Sequence[str],
        candidates: Sequence[ContainerSpec] = (),
        now_s: float = 0.0,
        reused: Collection[str] = (),
        blind_pairing: bool = True,
    ) -> Placement:
        """Answer Allocate: validate the IDs and record the new container's placement.

        The kubelet calls Allocate once per container, so IDs a placement still
        holds arrive here only for a new container. `reused` names the holders
        the daemon established, from the kubelet's own record, to be init
        containers of the same pod whose IDs this container reuses: exactly
        their IDs get their placement back. The daemon releases holders it
        found dead before calling; any other holder is kept untouched and this
        container gets a placement (and a directory) of its own.
        """
        if not device_ids:
            raise InvalidRequest(
                f"Allocate for {resource.full_name(self.domain)} carried no device IDs"
            )
        self._check_ids(resource, device_ids, "devices_ids")
        ids = frozenset(DeviceId(d) for d in device_ids)

        pending = self._pending
        completes = (  # this is the other resource of the container placed just before
            pending is not None
            and pending.key is not None
            and resource not in pending.allocated
            and (pending.expected is None or resource in pending.expected)
            and (pending.expected is not None or blind_pairing)
        )
        for key in reused if not completes else ():
            held = self.placements.get(key)
            if held is not None and held.ids.get(resource) == ids:
                self._note_reuse(resource, held)
                return held

        cards = tuple(sorted({self._card_uuid(d) for d in ids}, key=lambda c: self.cards[c].index))
        joins = (
            pending is not None
            and resource not in pending.allocated
            and (pending.expected is None or resource in pending.expected)
            and (resource in pending.steered or pending.key is not None)
            and (pending.expected is not None or blind_pairing)
        )
        if pending is not None and joins and not set(cards) <= set(pending.cards):
            if pending.assigned is not None and pending.spec is not None:
                raise PlacementConflict(
                    f"{resource.full_name(self.domain)} IDs are on card(s) {', '.join(cards)} but "
                    f"the vgpu scheduler extender assigned {_spec_text(pending.spec)} card(s) "
                    f"{', '.join(pending.assigned)}; {_RESCHEDULE}"
                )
            if resource in pending.steered or pending.expected is not None:
                raise PlacementConflict(
                    f"{resource.full_name(self.domain)} IDs are on card(s) {', '.join(cards)} but "
                    f"this container's other resource is on {', '.join(pending.cards)}; a "
                    "container's core and memory must share a card. The kubelet did not use "
                    "the preferred allocation: check that GetPreferredAllocation is enabled"
                )
            joins = False
        if not joins:
            pending = None

        count = len(ids)
        if resource is Resource.CORE:
            whole = count >= CORE_UNITS_PER_CARD
            if whole:
                self._check_whole(ids, cards)
            elif len(cards) > 1:
                raise InvalidRequest(
                    f"a fractional {resource.full_name(self.domain)}={count} must come from one "
                    f"card, got IDs on {len(cards)} cards: {', '.join(cards)}"
                )
        elif len(cards) > 1 and not (pending is not None and pending.request.whole_cards):
            raise InvalidRequest(
                f"{resource.full_name(self.domain)}={count} must come from one card unless it "
                f"goes with whole cards; got IDs on {len(cards)} cards: {', '.join(cards)}"
            )

        own_key = pending.key if pending is not None else None
        for card in cards:
            if not self.cards[card].healthy:
                raise PlacementConflict(
                    f"card {card} is unhealthy (xid {self.cards[card].xid}); nothing new is "
                    "placed on it. The kubelet will stop offering its IDs within a second"
                )
            for other in self.placements_on(card):
                if other.key == own_key or other.ids.get(resource, frozenset()) & ids:
                    continue  # our own pending placement, or a holder of these very IDs
                if other.whole or (resource is Resource.CORE and count >= CORE_UNITS_PER_CARD):
                    raise PlacementConflict(
                        f"card {card} is held whole by another container "
                        f"({_owner_text(other)}) or is asked whole while others use it; "
                        "whole cards are exclusive"
                    )

        if pending is None and resource is Resource.CORE and 0 < count < CORE_UNITS_PER_CARD:
            spec = self._match(resource, count, candidates)
            if spec is not None:
                fit.check_container(spec, self.domain, self.memory_unit_mib)

        if pending is not None and pending.key is not None:
            # The container's other resource is already placed: add this one.
            base = self.placements[pending.key]
            new_ids = dict(base.ids)
            new_ids[resource] = ids
            placement = replace(base, ids=new_ids, cards=tuple(dict.fromkeys(base.cards + cards)))
            settled = base.key in self._settled
            self.release(base.key)
            if settled:
                self._settled.add(base.key)
            self._pending = pending
            other_core, other_mem = placement.core_percent, None
        else:
            # The container's first resource: the other's limit comes from its
            # pod spec when known, so both Allocate answers say the same. A
            # guessed spec's never: the answer says what the kubelet allocated.
            known = pending.spec if pending is not None and not pending.guessed else None
            request = known.request if known is not None else Request()
            placement = Placement(
                key=self._fresh_key(ids),
                cards=cards,
                ids={resource: ids},
                core_percent=0,
                memory_mib=0,
                owner=known.owner() if known is not None else None,
                created_s=now_s,
            )
            other_core, other_mem = request.core_percent, request.memory_units
        if resource is Resource.CORE:
            placement = self._with_limits(placement, count, other_mem)
        else:
            placement = self._with_limits(placement, other_core, count)
        self.restore(placement)
        if pending is not None:
            pending.key = placement.key
            pending.allocated.add(resource)
            if pending.expected is not None and pending.expected <= pending.allocated:
                self._pending = None
        else:
            self._pending = _Pending(
                cards=cards,
                # What it got, so that a pod spec matches it only if it asks that much.
                request=(
                    Request(core_percent=count)
                    if resource is Resource.CORE
                    else Request(memory_units=count)
                ),
                expected=None,
                spec=None,
                key=placement.key,
                allocated={resource},
            )
        return placement

    def _card_uuid(self, device_id: str) -> CardUuid:
        """The card of an ID already checked to be a present card's slice."""
        found = self.lookup(device_id)
        assert found is not None, device_id
        return found[0]

    def _fresh_key(self, ids: frozenset[DeviceId]) -> str:
        """The key of a new placement: from its IDs, made unique if a placement
        the daemon could not prove dead still holds the same IDs."""
        key = placement_key(ids)
        n = 0
        while key in self.placements:
            n += 1
            key = placement_key([*ids, DeviceId(f"#{n}")])
        return key

    def _with_limits(self, placement: Placement, core: int, mem_units: int | None) -> Placement:
        """Core percent per card and per-card memory limit (none for whole cards)."""
        whole = core >= CORE_UNITS_PER_CARD
        memory_mib = placement.memory_mib
        if whole:
            memory_mib = 0
        elif mem_units is not None:
            memory_mib = mem_units * self.memory_unit_mib
        return replace(
            placement, core_percent=CORE_UNITS_PER_CARD if whole else core, memory_mib=memory_mib
        )

    def _check_whole(self, ids: frozenset[DeviceId], cards: Sequence[CardUuid]) -> None:
        count = len(ids)
        if count % CORE_UNITS_PER_CARD:
            raise InvalidRequest(
                f"{Resource.CORE.full_name(self.domain)}={count} is neither a fraction of one "
                "card (1-99) nor whole cards (100, 200, ...)"
            )
        if len(cards) != count // CORE_UNITS_PER_CARD:
            raise InvalidRequest(
                f"a whole-card request for {count // 100} card(s) must receive all 100 core IDs "
                f"of each card, got IDs spread over {len(cards)} cards; enable "
                "GetPreferredAllocation so the plugin can choose"
            )


_RESCHEDULE = "delete the pod so that the scheduler places it again"


def _spec_text(spec: ContainerSpec) -> str:
    return f"container {spec.container} of pod {spec.namespace}/{spec.pod}"


def _owner_text(placement: Placement) -> str:
    if placement.owner is None:
        return f"placement {placement.key}"
    o = placement.owner
    return f"{o.namespace}/{o.pod}/{o.container}"
