"""The fit rules: which card(s) can hold a request, and which to choose.

One implementation, applied by the node's Ledger at admission and by the
scheduler extender before binding, so both judge a card the same way:

- a fractional slice (core 1-99 with memory, or memory only) lands on one
  healthy card that is not held whole and has room for both of its requests;
- a whole-card request (core 100, 200, ...) takes that many entirely free
  healthy cards, preferring one NUMA node, and its memory must fit in them;
- nothing is ever overcommitted: core shares sum to at most 100 per card and
  memory units to at most the card's units;
- binpack picks the fullest card that fits, spread the emptiest.

`place_pod` applies these rules to every container of a pod in the kubelet's
order (init containers first, then app containers), with the kubelet's reuse
of init containers' device IDs. Pure: no I/O, frozen values in and out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from vgpu.core.errors import InvalidRequest
from vgpu.core.model import (
    CORE_UNITS_PER_CARD,
    Card,
    CardUuid,
    ContainerSpec,
    Policy,
    Request,
    Resource,
)
from vgpu.core.slicing import units_per_card


@dataclass(frozen=True)
class CardUsage:
    """How much of one card is sliced out."""

    card: Card
    core_used: int  # percent, counted from held core IDs (a whole card holds 100)
    memory_used_units: int
    exclusive: bool  # held whole by one container
    holders: int  # placements on the card

    def core_free(self) -> int:
        return CORE_UNITS_PER_CARD - self.core_used

    def memory_free_units(self, unit_mib: int) -> int:
        return self.card.memory_units(unit_mib) - self.memory_used_units

    @property
    def empty(self) -> bool:
        return self.holders == 0

    def fullness(self, unit_mib: int) -> float:
        """Core share used plus memory share used (0 to 2): what binpack maximises."""
        return self.core_used / CORE_UNITS_PER_CARD + self.memory_used_units / max(
            1, self.card.memory_units(unit_mib)
        )


class NoRoom(Exception):
    """No card can hold the request now; `why` says what was missing."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


# ----------------------------------------------------------------- requests


def describe_request(request: Request, domain: str, unit_mib: int) -> str:
    parts = []
    if request.core_percent:
        parts.append(f"{Resource.CORE.full_name(domain)}={request.core_percent}")
    if request.memory_units:
        mib = request.memory_units * unit_mib
        parts.append(f"{Resource.MEMORY.full_name(domain)}={request.memory_units} ({mib} MiB)")
    return " + ".join(parts) or "nothing"


def validate_request(request: Request, domain: str, unit_mib: int) -> None:
    """InvalidRequest for a request no card can ever satisfy as written."""
    core, mem = request.core_percent, request.memory_units
    core_name = Resource.CORE.full_name(domain)
    mem_name = Resource.MEMORY.full_name(domain)
    if core > CORE_UNITS_PER_CARD and core % CORE_UNITS_PER_CARD:
        raise InvalidRequest(
            f"{core_name}={core} is neither a fraction of one card (1-99) nor whole cards "
            f"(100, 200, ...): request {core // 100 * 100} or {(core // 100 + 1) * 100}"
        )
    if 0 < core < CORE_UNITS_PER_CARD and mem == 0:
        raise InvalidRequest(
            f"{core_name}={core} is a fractional slice and must come with {mem_name}: "
            f"add e.g. '{mem_name}: 16' (1 unit = {unit_mib} MiB) to the "
            "container's limits"
        )


def check_container(spec: ContainerSpec, domain: str, unit_mib: int) -> None:
    """The request rules for one container, as the node applies them at admission
    and the webhook at create: InvalidRequest naming the problem and the fix."""
    if spec.problem:
        raise InvalidRequest(spec.problem)
    validate_request(spec.request, domain, unit_mib)


def describe_free(usages: Iterable[CardUsage], unit_mib: int) -> str:
    """Every card's free room, for refusal messages."""
    parts = []
    for u in usages:
        where = f"card {u.card.index} ({u.card.uuid}"
        if not u.card.healthy:
            parts.append(f"{where}, UNHEALTHY): takes nothing new")
        elif u.exclusive:
            parts.append(f"{where}, held whole by one container): nothing free")
        else:
            parts.append(
                f"{where}): {u.core_free()} core free, "
                f"{u.memory_free_units(unit_mib)} memory units free"
            )
    return "; ".join(parts) if parts else "no cards on this node"


# ------------------------------------------------------------------ choosing


def _free(
    usage: CardUsage,
    resource: Resource,
    unit_mib: int,
    offered: Mapping[CardUuid, int] | None,
    offered_resource: Resource,
) -> int:
    """Free units of `resource`: the kubelet's offer for the resource being
    placed when there is one, else what the usage leaves."""
    if offered is not None and resource is offered_resource:
        return offered.get(usage.card.uuid, 0)
    if resource is Resource.CORE:
        return usage.core_free()
    return usage.memory_free_units(unit_mib)


def choose_fractional(
    request: Request,
    usages: Sequence[CardUsage],
    unit_mib: int,
    policy: Policy,
    *,
    resource: Resource = Resource.CORE,
    offered: Mapping[CardUuid, int] | None = None,
    known_other: bool = True,
) -> CardUuid:
    """The card for a fractional or memory-only slice; NoRoom if none fits.

    `offered` (the kubelet's free IDs per card) replaces the usage for
    `resource`, the resource being placed. Without pod information
    (`known_other` False) the card with the most free of the other resource
    wins, keeping room for it should it follow.
    """
    fits: list[tuple[float, float, int, CardUuid]] = []
    other = resource.other
    need, need_other = request.units(resource), request.units(other)
    for usage in usages:
        card = usage.card
        if not card.healthy or usage.exclusive:
            continue
        units = card.memory_mib // unit_mib
        core_free = CORE_UNITS_PER_CARD - usage.core_used
        mem_free = units - usage.memory_used_units
        if offered is not None:
            free = offered.get(card.uuid, 0)
        else:
            free = core_free if resource is Resource.CORE else mem_free
        if free < need:
            continue
        other_free = core_free if other is Resource.CORE else mem_free
        if other_free < need_other:
            continue
        fullness = usage.core_used / CORE_UNITS_PER_CARD + usage.memory_used_units / max(1, units)
        if not known_other:
            score = -float(other_free)
        elif policy is Policy.BINPACK:
            score = -fullness
        else:
            score = fullness
        fits.append((score, 0.0, card.index, card.uuid))
    if not fits:
        raise NoRoom("no single card has that much free")
    return min(fits)[3]


def choose_whole(
    request: Request,
    usages: Sequence[CardUsage],
    unit_mib: int,
    domain: str,
    *,
    resource: Resource = Resource.CORE,
    offered: Mapping[CardUuid, int] | None = None,
) -> tuple[CardUuid, ...]:
    """Entirely free cards for a whole-card request, one NUMA node preferred.

    NoRoom when too few are free; InvalidRequest when the memory asked
    alongside cannot fit in that many cards.
    """
    count = request.whole_cards
    empty = [
        u.card
        for u in usages
        if u.card.healthy
        and u.empty
        and _free(u, resource, unit_mib, offered, resource)
        == units_per_card(u.card, resource, unit_mib)
    ]
    if len(empty) < count:
        raise NoRoom(f"only {len(empty)} card(s) are entirely free")
    # Prefer cards on the same NUMA node, then the lowest index.
    by_numa: dict[int, list[Card]] = {}
    for card in empty:
        by_numa.setdefault(card.numa_node if card.numa_node is not None else -1, []).append(card)
    groups = sorted(by_numa.values(), key=lambda g: (len(g) < count, g[0].index))
    chosen = (
        groups[0][:count]
        if len(groups[0]) >= count
        else sorted(empty, key=lambda c: c.index)[:count]
    )
    memory_room = sum(c.memory_units(unit_mib) for c in chosen)
    if request.memory_units > memory_room:
        raise InvalidRequest(
            f"{describe_request(request, domain, unit_mib)}: the memory does not fit in {count} "
            f"whole card(s) ({memory_room} units); request at most {memory_room} units or more "
            "cards"
        )
    return tuple(c.uuid for c in chosen)


def nearest_room(request: Request, usages: Sequence[CardUsage], unit_mib: int) -> str:
    """One line naming the card that comes closest to holding `request`."""
    healthy = [u for u in usages if u.card.healthy]
    if not healthy:
        return "every card is unhealthy"
    if request.whole_cards:
        empty = [u for u in healthy if u.empty]
        return f"{len(empty)} of {len(usages)} card(s) entirely free, {request.whole_cards} needed"
    open_cards = [u for u in healthy if not u.exclusive]
    if not open_cards:
        return "every healthy card is held whole"

    core, mem = request.core_percent, request.memory_units
    best, best_key = open_cards[0], (float("inf"), 0)
    for u in open_cards:
        units = u.card.memory_mib // unit_mib
        short = max(0, core - CORE_UNITS_PER_CARD + u.core_used) / CORE_UNITS_PER_CARD + max(
            0, mem - units + u.memory_used_units
        ) / max(1, units)
        if (short, u.card.index) < best_key:
            best, best_key = u, (short, u.card.index)
    mem_free = best.memory_free_units(unit_mib)
    return (
        f"nearest card {best.card.index} ({best.card.uuid}) has {best.core_free()} core and "
        f"{mem_free} memory units ({mem_free * unit_mib // 1024} GiB) free"
    )


# --------------------------------------------------------------- whole pods


@dataclass(frozen=True)
class Hold:
    """What one pod holds on one card."""

    core: int  # percent (100 for a card held whole)
    memory_units: int
    whole: bool  # held whole: nobody else may use the card
    holders: int  # containers with new units on the card


@dataclass(frozen=True)
class PodPlan:
    """Where each container of a pod goes, and what the pod then holds."""

    cards: Mapping[str, tuple[CardUuid, ...]]  # container name -> its card(s)
    usages: tuple[CardUsage, ...]  # the node's cards with the pod placed
    holds: Mapping[CardUuid, Hold] = field(default_factory=dict)

    def touched(self) -> frozenset[CardUuid]:
        return frozenset(c for cards in self.cards.values() for c in cards)


def _take(pool: dict[CardUuid, int], units: int) -> None:
    """Remove `units` from a reuse pool, card by card."""
    for card in list(pool):
        if units <= 0:
            break
        step = min(units, pool[card])
        pool[card] -= step
        units -= step
        if not pool[card]:
            del pool[card]


def kubelet_order(specs: Iterable[ContainerSpec]) -> list[ContainerSpec]:
    """Init containers first, then app containers, each in pod order."""
    return sorted(specs, key=lambda s: (not s.init, s.order))


def place_pod(
    specs: Sequence[ContainerSpec],
    usages: Sequence[CardUsage],
    unit_mib: int,
    policy: Policy,
    domain: str,
    fixed: Mapping[str, tuple[CardUuid, ...]] | None = None,
) -> PodPlan:
    """Place every container of one pod on a node's cards, as the node would.

    Containers go in the kubelet's order. Like the kubelet, a container first
    reuses the device IDs its pod's init containers hold (app containers take
    them away from the pool, init containers add theirs to it), so a
    container that reuses lands on the pool's card(s) and only what it asks
    beyond the pool must fit there. Containers in `fixed` keep the card(s)
    given (a placement already made: nothing is checked, their use is only
    counted); the others are chosen by `policy`.

    Raises NoRoom (nothing fits now) or InvalidRequest (nothing ever can).
    """
    state = {u.card.uuid: u for u in usages}
    order = [u.card.uuid for u in usages]
    pool_core: dict[CardUuid, int] = {}  # init containers' IDs not yet reused, per card
    pool_mem: dict[CardUuid, int] = {}
    whole_pool: set[CardUuid] = set()
    chosen: dict[str, tuple[CardUuid, ...]] = {}
    holds: dict[CardUuid, Hold] = {}
    ordered = kubelet_order(specs) if any(s.init for s in specs) else specs
    for spec in ordered:
        request = spec.request
        reuse_core = min(request.core_percent, sum(pool_core.values())) if pool_core else 0
        reuse_mem = min(request.memory_units, sum(pool_mem.values())) if pool_mem else 0
        new_core = request.core_percent - reuse_core
        new_mem = request.memory_units - reuse_mem
        given = fixed.get(spec.container) if fixed is not None else None
        if given is not None:
            cards = tuple(c for c in given if c in state)
        elif reuse_core or reuse_mem:
            reused = set(pool_core if reuse_core else ()) | set(pool_mem if reuse_mem else ())
            cards = tuple(c for c in order if c in reused)
            if len(cards) > (request.whole_cards or 1):
                # The kubelet takes reused IDs in no set order: a slice could get
                # its core on one card and its memory on another, a whole card
                # half of one card and half of another.
                raise NoRoom(
                    f"container {spec.container} would reuse init containers' IDs spread "
                    f"over {len(cards)} cards, more than the {request.whole_cards or 1} it "
                    "asks; the kubelet would pick among them arbitrarily"
                )
            if not (new_core or new_mem):
                pass  # everything reused: the kubelet hands the same IDs back
            elif request.whole_cards:
                raise NoRoom(
                    f"container {spec.container} asks whole cards beyond those of its init "
                    "containers; the kubelet would mix reused and new IDs arbitrarily"
                )
            else:
                validate_request(request, domain, unit_mib)
                _check_room(
                    state[cards[0]],
                    new_core,
                    new_mem,
                    unit_mib,
                    spec.container,
                    cards[0] in whole_pool,
                )
        else:
            validate_request(request, domain, unit_mib)
            current = [state[c] for c in order]
            if request.whole_cards:
                cards = choose_whole(request, current, unit_mib, domain)
            else:
                cards = (choose_fractional(request, current, unit_mib, policy),)
        chosen[spec.container] = cards
        added = _apply(state, holds, cards, request, new_core, new_mem, unit_mib) if cards else {}
        if spec.init:
            if request.whole_cards:
                whole_pool.update(cards)
            for card, (core, mem) in added.items():
                if core:
                    pool_core[card] = pool_core.get(card, 0) + core
                if mem:
                    pool_mem[card] = pool_mem.get(card, 0) + mem
        else:
            _take(pool_core, reuse_core)
            _take(pool_mem, reuse_mem)
    return PodPlan(cards=chosen, usages=tuple(state[c] for c in order), holds=holds)


def _check_room(
    usage: CardUsage, new_core: int, new_mem: int, unit_mib: int, container: str, own_whole: bool
) -> None:
    if not usage.card.healthy:
        raise NoRoom(f"container {container} must reuse IDs on unhealthy card {usage.card.index}")
    if usage.exclusive or own_whole:
        raise NoRoom(
            f"container {container} would take a slice of card {usage.card.index}, "
            "which is held whole"
        )
    if new_core > usage.core_free() or new_mem > usage.memory_free_units(unit_mib):
        raise NoRoom(
            f"container {container} must stay on card {usage.card.index} with its init "
            "containers' IDs, and that card lacks room for the rest"
        )


def _apply(
    state: dict[CardUuid, CardUsage],
    holds: dict[CardUuid, Hold],
    cards: Sequence[CardUuid],
    request: Request,
    new_core: int,
    new_mem: int,
    unit_mib: int,
) -> dict[CardUuid, tuple[int, int]]:
    """Count a container's new units on its card(s); returns card -> (core, memory) added."""
    added: dict[CardUuid, tuple[int, int]] = {}
    whole = request.whole_cards > 0
    if whole:
        memory_left = new_mem
        for uuid in cards:
            usage = state[uuid]
            mem = min(memory_left, usage.card.memory_units(unit_mib))
            memory_left -= mem
            added[uuid] = (CORE_UNITS_PER_CARD - usage.core_used, mem)
    elif new_core or new_mem:
        added[cards[0]] = (new_core, new_mem)
    for uuid, (core, mem) in added.items():
        usage = state[uuid]
        state[uuid] = CardUsage(
            usage.card,
            usage.core_used + core,
            usage.memory_used_units + mem,
            usage.exclusive or whole,
            usage.holders + 1,
        )
        hold = holds.get(uuid)
        holds[uuid] = (
            Hold(core, mem, whole, 1)
            if hold is None
            else Hold(
                hold.core + core, hold.memory_units + mem, hold.whole or whole, hold.holders + 1
            )
        )
    return added
