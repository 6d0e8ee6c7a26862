"""Packing quality: a pure simulation of the placement ledger, no daemon.

A seeded random trace of arrivals and departures of mixed slices (fractional
core + memory of various sizes, memory-only slices, whole cards) runs on an
8-card H200 node. Every arrival is first checked against the node totals, as the
scheduler only sees those: when the node as a whole lacks room it is a *capacity*
refusal (the scheduler would not have bound it). Otherwise it is placed, and a
refusal is a *fragmentation* refusal: the node had room in total, no card did.

``binpack`` and ``spread`` drive :class:`vgpu.core.packing.Ledger` like the kubelet
(GetPreferredAllocation then Allocate per resource, in random order, with the
advertised IDs minus the held ones); ``first-fit`` is a naive reference kept in
this module: the lowest-index card that fits.
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.common import Json
from vgpu.adapters.gpus import preset_cards
from vgpu.core.errors import InsufficientCapacity
from vgpu.core.model import CORE_UNITS_PER_CARD, Card, ContainerSpec, Policy, Request, Resource
from vgpu.core.packing import Ledger
from vgpu.core.slicing import card_device_ids

GPUS = "preset:8xH200"
UNIT_MIB = 256
#: offered load: mean demanded core as a share of the node's core, in steady state
LOADS = (0.7, 0.9, 1.1)
MEAN_DURATION_S = 100.0
GIB = 1024 // UNIT_MIB  # memory units per GiB
#: arrivals before this are placed but not counted, and utilisation is averaged after it
WARMUP_S = 3 * MEAN_DURATION_S
_KIND_FIELDS = ("arrivals", "capacity_refusals", "fragmentation_refusals")


@dataclass(frozen=True)
class Arrival:
    at_s: float
    duration_s: float
    request: Request
    kind: str  # fractional | memory-only | whole


def _draw(rng: random.Random) -> tuple[Request, str]:
    roll = rng.random()
    if roll < 0.60:
        core = rng.choice((5, 10, 20, 25, 30, 40, 50, 60))
        memory_gib = rng.choice((4, 8, 12, 16, 24, 32, 40, 48, 64, 80))
        return Request(core_percent=core, memory_units=memory_gib * GIB), "fractional"
    if roll < 0.80:
        memory_gib = rng.choice((4, 8, 16, 24, 32, 48))
        return Request(memory_units=memory_gib * GIB), "memory-only"
    cards = 1 if roll < 0.95 else 2
    return Request(core_percent=cards * CORE_UNITS_PER_CARD), "whole"


def _mean_core(rng: random.Random, samples: int = 20000) -> float:
    """Mean core units asked per request (memory-only asks none)."""
    return sum(_draw(rng)[0].core_percent for _ in range(samples)) / samples


def make_trace(arrivals: int, load: float, cards: int, seed: int) -> list[Arrival]:
    """Poisson arrivals, exponential durations; ``load`` sets the arrival rate."""
    rng = random.Random(seed)
    rate = load * cards * CORE_UNITS_PER_CARD / (_mean_core(random.Random(seed)) * MEAN_DURATION_S)
    now = 0.0
    trace = []
    for _ in range(arrivals):
        now += rng.expovariate(rate)
        request, kind = _draw(rng)
        trace.append(Arrival(now, rng.expovariate(1 / MEAN_DURATION_S), request, kind))
    return trace


# ------------------------------------------------------------------------------ placers


class Placer:
    """Places and releases requests; returns an opaque handle or None when refused."""

    def place(self, index: int, arrival: Arrival) -> object | None:
        raise NotImplementedError

    def release(self, handle: object) -> None:
        raise NotImplementedError


class LedgerPlacer(Placer):
    """Drives the real Ledger the way the kubelet drives the daemon."""

    def __init__(self, cards: list[Card], policy: Policy, seed: int) -> None:
        self.ledger = Ledger(cards, memory_unit_mib=UNIT_MIB, policy=policy)
        self.advertised = {
            r: [d for c in cards for d in card_device_ids(c, r, UNIT_MIB)] for r in Resource
        }
        self.rng = random.Random(seed)

    def place(self, index: int, arrival: Arrival) -> object | None:
        spec = ContainerSpec(
            pod_uid=f"uid-{index}",
            namespace="bench",
            pod=f"pod-{index}",
            container="main",
            request=arrival.request,
            created_s=arrival.at_s,
        )
        resources = sorted(arrival.request.resources, key=lambda r: r.value)
        self.rng.shuffle(resources)  # Go map order
        key: str | None = None
        try:
            for resource in resources:
                held = self.ledger.held_ids()
                available = [d for d in self.advertised[resource] if d not in held]
                size = arrival.request.units(resource)
                ids, _ = self.ledger.preferred(resource, available, [], size, [spec])
                # The kubelet keeps the preferred IDs that are free, fills any shortfall.
                free = set(available)
                chosen = [d for d in ids if d in free][:size]
                if len(chosen) < size:
                    picked = set(chosen)
                    chosen += [d for d in available if d not in picked][: size - len(chosen)]
                key = self.ledger.allocate(resource, chosen, [spec], arrival.at_s).key
        except InsufficientCapacity:
            if key is not None:
                self.ledger.release(key)
            return None
        return key

    def release(self, handle: object) -> None:
        assert isinstance(handle, str)
        self.ledger.release(handle)

    def check(self) -> None:
        unit_cap = {c.uuid: c.memory_units(UNIT_MIB) for c in self.ledger.cards.values()}
        for usage in self.ledger.usages():
            assert usage.core_used <= CORE_UNITS_PER_CARD, usage
            assert usage.memory_used_units <= unit_cap[usage.card.uuid], usage


@dataclass
class _Slot:
    core_free: int
    memory_free: int
    holders: int = 0
    exclusive: bool = False


@dataclass
class _FirstFitHandle:
    cards: tuple[int, ...]
    request: Request
    whole: bool = field(default=False)


class FirstFitPlacer(Placer):
    """Naive reference: the lowest-index card(s) that fit, same rules as vgpu.

    Whole cards need cards nobody uses; slices never go on a card held whole;
    memory-only slices take memory and no core.
    """

    def __init__(self, cards: list[Card]) -> None:
        self.slots = [
            _Slot(CORE_UNITS_PER_CARD, c.memory_units(UNIT_MIB))
            for c in sorted(cards, key=lambda c: c.index)
        ]

    def place(self, index: int, arrival: Arrival) -> object | None:
        request = arrival.request
        if request.whole_cards:
            empty = [i for i, s in enumerate(self.slots) if s.holders == 0]
            if len(empty) < request.whole_cards:
                return None
            chosen = tuple(empty[: request.whole_cards])
            for i in chosen:
                slot = self.slots[i]
                slot.holders, slot.exclusive, slot.core_free = 1, True, 0
            return _FirstFitHandle(chosen, request, whole=True)
        for i, slot in enumerate(self.slots):
            if slot.exclusive:
                continue
            if slot.core_free >= request.core_percent and slot.memory_free >= request.memory_units:
                slot.core_free -= request.core_percent
                slot.memory_free -= request.memory_units
                slot.holders += 1
                return _FirstFitHandle((i,), request)
        return None

    def release(self, handle: object) -> None:
        assert isinstance(handle, _FirstFitHandle)
        for i in handle.cards:
            slot = self.slots[i]
            slot.holders -= 1
            if handle.whole:
                slot.exclusive = False
                slot.core_free = CORE_UNITS_PER_CARD
            else:
                slot.core_free += handle.request.core_percent
                slot.memory_free += handle.request.memory_units


# ---------------------------------------------------------------------------- simulation


def simulate(trace: list[Arrival], cards: list[Card], placer: Placer) -> Json:
    """Replay the trace; count refusals and integrate utilisation over time."""
    core_total = len(cards) * CORE_UNITS_PER_CARD
    memory_per_card = cards[0].memory_units(UNIT_MIB)
    memory_total = sum(c.memory_units(UNIT_MIB) for c in cards)
    core_used = 0
    memory_used = 0  # whole cards count all their memory
    departures: list[tuple[float, int, object, int, int]] = []
    last_s = 0.0
    core_area = 0.0
    memory_area = 0.0
    counts = {"arrivals": 0, "placed": 0, "capacity_refusals": 0, "fragmentation_refusals": 0}
    by_kind: dict[str, dict[str, int]] = {}

    def advance(to_s: float) -> None:
        nonlocal last_s, core_area, memory_area
        span = max(0.0, to_s - max(last_s, WARMUP_S))
        core_area += core_used * span
        memory_area += memory_used * span
        last_s = to_s

    started = time.perf_counter()
    for index, arrival in enumerate(trace):
        while departures and departures[0][0] <= arrival.at_s:
            at_s, _, handle, core, memory = heapq.heappop(departures)
            advance(at_s)
            placer.release(handle)
            core_used -= core
            memory_used -= memory
        advance(arrival.at_s)
        request = arrival.request
        core = request.core_percent
        memory = request.memory_units + request.whole_cards * memory_per_card
        # The scheduler's view: node sums of free IDs per resource.
        if core_used + core > core_total or memory_used + request.memory_units > memory_total:
            outcome = "capacity_refusals"
        else:
            handle = placer.place(index, arrival)
            if handle is None:
                outcome = "fragmentation_refusals"
            else:
                outcome = "placed"
                core_used += core
                memory_used += memory
                departure = (arrival.at_s + arrival.duration_s, index, handle, core, memory)
                heapq.heappush(departures, departure)
        if arrival.at_s >= WARMUP_S:  # warm-up arrivals are placed but not counted
            kind = by_kind.setdefault(arrival.kind, dict.fromkeys(_KIND_FIELDS, 0))
            for bucket in (counts, kind):
                bucket["arrivals"] += 1
                if outcome in bucket:
                    bucket[outcome] += 1
    end_s = trace[-1].at_s if trace else 0.0
    advance(end_s)
    measured_s = max(0.0, end_s - WARMUP_S)
    if isinstance(placer, LedgerPlacer):
        placer.check()
    fitting = counts["arrivals"] - counts["capacity_refusals"]
    return {
        **counts,
        "fragmentation_share": round(counts["fragmentation_refusals"] / max(1, fitting), 4),
        "refused_share": round(
            (counts["fragmentation_refusals"] + counts["capacity_refusals"])
            / max(1, counts["arrivals"]),
            4,
        ),
        "mean_core_utilisation": round(core_area / (core_total * measured_s), 4)
        if measured_s
        else 0.0,
        "mean_memory_utilisation": round(memory_area / (memory_total * measured_s), 4)
        if measured_s
        else 0.0,
        "by_kind": by_kind,
        "elapsed_s": round(time.perf_counter() - started, 2),
    }


def run(arrivals: int, seed: int = 1) -> Json:
    cards = preset_cards(GPUS)
    placers: dict[str, Callable[[], Placer]] = {
        "binpack": lambda: LedgerPlacer(cards, Policy.BINPACK, seed),
        "spread": lambda: LedgerPlacer(cards, Policy.SPREAD, seed),
        "first-fit": lambda: FirstFitPlacer(cards),
    }
    results: list[Json] = []
    for load in LOADS:
        trace = make_trace(arrivals, load, len(cards), seed)
        for name, make in placers.items():
            results.append({"load": load, "policy": name, **simulate(trace, cards, make())})
    return {
        "config": {
            "gpus": GPUS,
            "memory_unit_mib": UNIT_MIB,
            "arrivals": arrivals,
            "loads": list(LOADS),
            "mean_duration_s": MEAN_DURATION_S,
            "seed": seed,
            "mix": "60% fractional (5-60% core, 4-80 GiB), 20% memory-only (4-48 GiB), "
            "15% one whole card, 5% two whole cards",
        },
        "runs": results,
        "targets": [],
    }
