"""Table-driven tests and properties of the placement ledger."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.helpers import UNIT, Kubelet, cards, spec
from vgpu.core.errors import (
    InsufficientCapacity,
    InvalidRequest,
    PlacementConflict,
    UnknownCard,
    UnknownDevice,
)
from vgpu.core.model import CardUuid, Policy, Resource
from vgpu.core.packing import Ledger
from vgpu.core.slicing import format_device_id

CORE, MEM = Resource.CORE, Resource.MEMORY


def ledger(n: int = 2, policy: Policy = Policy.BINPACK, **kw: object) -> Ledger:
    return Ledger(cards(n, **kw), memory_unit_mib=UNIT, policy=policy)  # type: ignore[arg-type]


# ------------------------------------------------------------ placements


@pytest.mark.parametrize("order", [[CORE, MEM], [MEM, CORE]], ids=["core-first", "memory-first"])
def test_fractional_lands_core_and_memory_on_one_card(order: list[Resource]) -> None:
    led = ledger(2)
    k = Kubelet(led)
    p = k.admit(spec(30, 40), order)
    assert len(p.cards) == 1
    assert p.core_percent == 30
    assert p.memory_mib == 40 * UNIT
    assert {led.lookup(d)[0] for d in p.all_ids()} == set(p.cards)  # type: ignore[index]
    assert len(p.ids[CORE]) == 30 and len(p.ids[MEM]) == 40


@pytest.mark.parametrize(
    ("policy", "expected_second_card"),
    [(Policy.BINPACK, 0), (Policy.SPREAD, 1)],
    ids=["binpack-fills-first-card", "spread-uses-empty-card"],
)
def test_policy(policy: Policy, expected_second_card: int) -> None:
    led = ledger(2, policy)
    k = Kubelet(led)
    first = k.admit(spec(30, 40))
    second = k.admit(spec(30, 40))
    assert led.cards[first.cards[0]].index == 0
    assert led.cards[second.cards[0]].index == expected_second_card


def test_whole_cards_are_exclusive() -> None:
    led = ledger(2)
    k = Kubelet(led)
    whole = k.admit(spec(100))
    assert whole.whole and whole.core_percent == 100 and whole.memory_mib == 0
    # A memory-only slice must avoid the card held whole.
    mem_only = k.admit(spec(0, 8))
    assert mem_only.cards[0] != whole.cards[0]
    assert mem_only.core_percent == 0  # best-effort compute
    # A second whole card: none is entirely free now.
    with pytest.raises(InsufficientCapacity, match="entirely free"):
        k.admit(spec(100))


def test_two_whole_cards_prefer_one_numa_node() -> None:
    led = Ledger(cards(4, numa=[0, 1, 1, 0]), memory_unit_mib=UNIT)
    k = Kubelet(led)
    p = k.admit(spec(200))
    assert {led.cards[c].numa_node for c in p.cards} == {0}
    assert len(p.ids[CORE]) == 200


def test_whole_card_with_memory_that_fits() -> None:
    led = ledger(2)
    p = Kubelet(led).admit(spec(100, 100))
    assert p.whole and len(p.ids[MEM]) == 100 and p.cards == p.cards[:1]


@pytest.mark.parametrize(
    ("core", "mem", "error", "message"),
    [
        (30, 0, InvalidRequest, r"must come with vendor\.io/vcuda-memory"),
        (150, 10, InvalidRequest, "request 100 or 200"),
        (101, 0, InvalidRequest, "neither a fraction"),
        (100, 10_000, InvalidRequest, "does not fit in 1 whole card"),
    ],
    ids=["fraction-without-memory", "150-not-whole", "101-not-whole", "whole-memory-too-big"],
)
def test_invalid_requests(core: int, mem: int, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        Kubelet(ledger(2)).admit(spec(core, mem))


def test_refusal_names_request_and_each_card() -> None:
    led = ledger(2)
    k = Kubelet(led)
    k.admit(spec(60, 400))
    k.admit(spec(60, 400))
    # 100 GiB free in total (two cards x ~50 GiB), but no card alone has 60 GiB.
    with pytest.raises(InsufficientCapacity) as info:
        k.admit(spec(10, 240))
    text = str(info.value)
    assert "vendor.io/vcuda-core=10 + vendor.io/vcuda-memory=240 (61440 MiB)" in text
    assert "card 0" in text and "card 1" in text and "40 core free" in text


def test_unhealthy_card_gets_nothing_new() -> None:
    led = ledger(2)
    led.set_cards(
        [
            c if c.index else c.__class__(**{**c.__dict__, "healthy": False})
            for c in led.cards.values()
        ]
    )
    p = Kubelet(led).admit(spec(30, 40))
    assert led.cards[p.cards[0]].index == 1


def test_identical_pods_get_distinct_keys() -> None:
    led = ledger(1)
    k = Kubelet(led)
    a, b = spec(20, 16), spec(20, 16)
    pa = k.admit(a, candidates=[a, b])
    pb = k.admit(b, candidates=[a, b])
    assert pa.key != pb.key
    assert not pa.all_ids() & pb.all_ids()


def test_oldest_pending_pod_is_matched_first() -> None:
    led = ledger(2)
    k = Kubelet(led)
    old, new = spec(30, 40, created_s=1), spec(30, 8, created_s=2)
    p = k.admit(old, [CORE, MEM], candidates=[old, new])
    assert p.memory_mib == 40 * UNIT


def test_fallback_without_pod_information_pairs_resources() -> None:
    led = ledger(2)
    k = Kubelet(led)
    c = spec(30, 40)
    p = k.admit(c, [MEM, CORE], candidates=[])
    assert len(p.cards) == 1 and p.core_percent == 30 and p.memory_mib == 40 * UNIT


# -------------------------------------------------- Allocate stands alone


def test_allocate_validates_ids() -> None:
    led = ledger(2)
    card = next(iter(led.cards))
    with pytest.raises(UnknownDevice, match="never advertised"):
        led.allocate(CORE, ["GPU-nope-c1"])
    with pytest.raises(UnknownDevice):
        led.allocate(CORE, ["garbage"])
    with pytest.raises(InvalidRequest, match="no device IDs"):
        led.allocate(CORE, [])
    with pytest.raises(InvalidRequest, match="same device ID twice"):
        led.allocate(CORE, [format_device_id(led.cards[card], CORE, 1)] * 2)
    with pytest.raises(InvalidRequest, match=r"contains IDs of vendor\.io/vcuda-memory"):
        led.allocate(CORE, [format_device_id(led.cards[card], MEM, 1)])
    with pytest.raises(UnknownDevice):
        led.allocate(CORE, [format_device_id(led.cards[card], CORE, 100)])


def test_fractional_core_over_two_cards_is_refused() -> None:
    led = ledger(2)
    a, b = list(led.cards)
    ids = [format_device_id(led.cards[a], CORE, 0), format_device_id(led.cards[b], CORE, 0)]
    with pytest.raises(InvalidRequest, match="must come from one card"):
        led.allocate(CORE, ids)


def test_whole_request_must_cover_whole_cards() -> None:
    led = ledger(2)
    a, b = list(led.cards)
    ids = [format_device_id(led.cards[a], CORE, i) for i in range(50)] + [
        format_device_id(led.cards[b], CORE, i) for i in range(50)
    ]
    with pytest.raises(InvalidRequest, match="all 100 core IDs"):
        led.allocate(CORE, ids)


def test_memory_on_other_card_than_core_is_a_conflict() -> None:
    led = ledger(2)
    a, b = list(led.cards)
    c = spec(30, 4)
    ids, _ = led.preferred(
        CORE, [format_device_id(led.cards[a], CORE, i) for i in range(100)], [], 30, [c]
    )
    led.allocate(CORE, ids, [c])
    with pytest.raises(PlacementConflict, match="must share a card"):
        led.allocate(MEM, [format_device_id(led.cards[b], MEM, i) for i in range(4)], [c])


def test_held_ids_reused_by_the_same_pod_share_its_placement() -> None:
    led = ledger(1)
    k = Kubelet(led)
    p = k.admit(spec(30, 40))
    again = led.allocate(CORE, sorted(p.ids[CORE]), reused=[p.key])
    assert again == p


def test_held_ids_not_proven_reused_get_a_placement_of_their_own() -> None:
    # The kubelet calls Allocate once per container: held IDs arriving again
    # belong to a new container, which must never get the holder's limits.
    led = ledger(1)
    k = Kubelet(led)
    p = k.admit(spec(30, 400))
    fresh = led.allocate(CORE, sorted(p.ids[CORE]))
    assert fresh.key != p.key
    assert fresh.owner is None and fresh.memory_mib == 0
    assert led.placements[p.key] == p  # the holder is kept, untouched
    # Its memory joins the new container, not the old one.
    mem = [d for d in k.available(MEM)][:4]
    joined = led.allocate(MEM, mem)
    assert joined.key == fresh.key and joined.memory_mib == 4 * UNIT
    assert led.usage(p.cards[0]).core_used == 30  # shared IDs are counted once


def test_memory_on_a_card_held_whole_is_refused() -> None:
    led = ledger(1)
    k = Kubelet(led)
    k.admit(spec(100))
    card = next(iter(led.cards))
    with pytest.raises(PlacementConflict, match="held whole"):
        led.allocate(MEM, [format_device_id(led.cards[card], MEM, 0)])


def test_preferred_releases_placements_the_kubelet_offers_as_free() -> None:
    led = ledger(1)
    k = Kubelet(led)
    p = k.admit(spec(30, 40))
    k.held.clear()  # the pod is gone; the kubelet offers its IDs again
    _, released = led.preferred(CORE, k.available(CORE), [], 10, [spec(10, 1)])
    assert released == [p.key]


def test_reconcile_keeps_young_and_live_placements() -> None:
    led = ledger(1)
    k = Kubelet(led)
    live = k.admit(spec(30, 40), now_s=0)
    dead = k.admit(spec(30, 40), now_s=0)
    young = k.admit(spec(10, 4), now_s=100)
    released = led.reconcile(live.all_ids(), now_s=110)
    assert [p.key for p in released] == [dead.key]
    assert set(led.placements) == {live.key, young.key}


def test_init_container_ids_reused_by_app_container() -> None:
    led = ledger(1)
    k = Kubelet(led)
    init = k.admit(spec(30, 40, name="init"))
    # The app container reuses the init container's IDs (must_include covers all).
    ids, _ = led.preferred(CORE, [], sorted(init.ids[CORE]), 30)
    assert set(ids) == init.ids[CORE]
    assert led.allocate(CORE, ids, reused=[init.key]) == init


def test_ids_of_a_card_that_disappeared_name_the_card() -> None:
    led = ledger(2)
    gone = led.cards[next(iter(led.cards))]
    led.set_cards([c for c in led.cards.values() if c.uuid != gone.uuid])
    with pytest.raises(UnknownCard, match=f"card {gone.uuid} .index 0., which is no longer"):
        led.allocate(CORE, [format_device_id(gone, CORE, 0)])
    with pytest.raises(UnknownDevice, match="never advertised"):
        led.allocate(
            CORE, [format_device_id(replace(gone, uuid=CardUuid("GPU-never-seen")), CORE, 0)]
        )


# ------------------------------------------------------------ properties

request_st = st.one_of(
    st.tuples(st.integers(1, 99), st.integers(1, 300)),
    st.tuples(st.just(0), st.integers(1, 300)),
    st.tuples(st.sampled_from([100, 200]), st.integers(0, 50)),
)
ops_st = st.lists(
    st.tuples(st.sampled_from(["add", "remove"]), request_st, st.booleans(), st.integers(0, 50)),
    max_size=40,
)


def _run(ops: list, policy: Policy) -> tuple[Ledger, Kubelet, list]:  # type: ignore[type-arg]
    led = ledger(3, policy, memory_mib=81920)
    k = Kubelet(led)
    live = []
    outcomes = []
    for op, (core, mem), core_first, pick in ops:
        if op == "add":
            order = [CORE, MEM] if core_first else [MEM, CORE]
            c = spec(core, mem)
            try:
                p = k.admit(c, [r for r in order if c.request.units(r)])
            except (InsufficientCapacity, InvalidRequest) as exc:
                outcomes.append(type(exc).__name__)
                continue
            live.append(p)
            outcomes.append(led.cards[p.cards[0]].index)
        elif live:
            k.remove(live.pop(pick % len(live)))
            outcomes.append("removed")
    return led, k, outcomes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_st, policy=st.sampled_from(list(Policy)))
def test_property_never_overcommits_and_stays_coherent(ops: list, policy: Policy) -> None:  # type: ignore[type-arg]
    led, k, _ = _run(ops, policy)
    for usage in led.usages():
        assert usage.core_used <= 100
        assert usage.memory_used_units <= usage.card.memory_units(UNIT)
        on_card = led.placements_on(usage.card.uuid)
        if usage.exclusive:
            assert len(on_card) == 1
    for p in led.placements.values():
        if not p.whole:
            assert len(p.cards) == 1
        id_cards = {led.lookup(d)[0] for d in p.all_ids()}  # type: ignore[index]
        assert id_cards <= set(p.cards)
    # The ledger and the kubelet agree on every held ID.
    assert led.held_ids() == frozenset(k.held)


@settings(max_examples=100, deadline=None)
@given(ops=ops_st)
def test_property_release_restores_state(ops: list) -> None:  # type: ignore[type-arg]
    led, _k, _ = _run(ops, Policy.BINPACK)
    for key in list(led.placements):
        led.release(key)
    assert led.held_ids() == frozenset()
    assert all(u.empty and u.core_used == 0 for u in led.usages())


@settings(max_examples=60, deadline=None)
@given(ops=ops_st, policy=st.sampled_from(list(Policy)))
def test_property_deterministic(ops: list, policy: Policy) -> None:  # type: ignore[type-arg]
    assert _run(ops, policy)[2] == _run(ops, policy)[2]


def test_pod_reaching_the_cache_between_the_two_calls_keeps_one_card() -> None:
    led = ledger(2, Policy.SPREAD)
    k = Kubelet(led)
    k.admit(spec(50, 100))  # card 0 is the fuller one now
    late = spec(10, 20)
    # First resource without pod information (fallback), second one with it.
    ids, _ = led.preferred(CORE, k.available(CORE), [], 10, [])
    first = led.allocate(CORE, ids, [])
    k.held |= set(ids)
    mem, _ = led.preferred(MEM, k.available(MEM), [], 20, [late])
    placement = led.allocate(MEM, mem, [late])
    assert placement.key == first.key and len(placement.cards) == 1
    assert placement.owner == late.owner()
    assert placement.memory_mib == 20 * UNIT


def test_stale_in_flight_container_does_not_capture_the_next_one() -> None:
    led = ledger(2)
    k = Kubelet(led)
    # A container placed without pod information whose other resource never came.
    ids, _ = led.preferred(CORE, k.available(CORE), [], 20, [])
    stale = led.allocate(CORE, ids, [])
    k.held |= set(ids)
    nxt = spec(10, 20)  # asks a different core size: not the in-flight container
    mem, _ = led.preferred(MEM, k.available(MEM), [], 20, [nxt])
    placement = led.allocate(MEM, mem, [nxt])
    assert placement.key != stale.key


def test_the_kubelet_can_name_the_in_flight_container() -> None:
    led = ledger(2)
    k = Kubelet(led)
    ids, _ = led.preferred(CORE, k.available(CORE), [], 10, [])
    led.allocate(CORE, ids, [])
    k.held |= set(ids)
    assert led.unattributed_pending() == frozenset(ids)
    owner = spec(10, 20)
    led.attribute_pending(owner.namespace, owner.pod, owner.container, [owner])
    assert led.unattributed_pending() == frozenset()
    mem, _ = led.preferred(MEM, k.available(MEM), [], 20, [owner])
    placement = led.allocate(MEM, mem, [owner])
    assert len(placement.cards) == 1 and placement.owner == owner.owner()


def test_reconcile_releases_a_stale_in_flight_placement() -> None:
    # Placed without pod information and its pod deleted before the kubelet
    # listed it: kept while its other resource may come, then released.
    led = ledger(1)
    card = next(iter(led.cards))
    p = led.allocate(CORE, [format_device_id(led.cards[card], CORE, i) for i in range(5)], now_s=0)
    assert led.reconcile(frozenset(), now_s=10) == []
    assert [r.key for r in led.reconcile(frozenset(), now_s=40)] == [p.key]
    assert led.blind_pending_key() is None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.sampled_from(["admit", "remove", "sick", "well"]), st.integers(0, 10**6)),
        min_size=1,
        max_size=40,
    )
)
def test_the_kept_free_ids_answer_as_the_walk_over_every_offered_id(
    steps: list[tuple[str, int]],
) -> None:
    """Issue 30: an offer equal to the IDs no placement holds is answered from
    what the ledger keeps, without walking the offer. Whatever happened before,
    that is exactly what the kubelet offers, and the answer is the one the walk
    over every offered ID gives (forced here by a legacy ID held elsewhere)."""
    import copy

    from vgpu.core.model import DeviceId

    ledger = Ledger(cards(3), memory_unit_mib=UNIT, policy=Policy.BINPACK)
    kubelet = Kubelet(ledger)
    live = []
    shapes = [(5, 4), (30, 100), (100, 0), (0, 40), (60, 200)]
    for action, n in steps:
        if action == "admit":
            core, mem = shapes[n % len(shapes)]
            try:
                live.append(kubelet.admit(spec(core, mem)))
            except Exception:
                pass
        elif action == "remove" and live:
            kubelet.remove(live.pop(n % len(live)))
        else:
            uuid = list(ledger.cards)[n % 3]
            ledger.set_cards(
                [
                    replace(c, healthy=action == "well") if c.uuid == uuid else c
                    for c in ledger.cards.values()
                ]
            )
        for resource in Resource:
            assert ledger._free[resource] == set(kubelet.available(resource))
            counts = {c: k for c, k in ledger._free_counts[resource].items() if k}
            want: dict[CardUuid, int] = {}
            for d in kubelet.available(resource):
                card = ledger.lookup(d)
                assert card is not None
                want[card[0]] = want.get(card[0], 0) + 1
            assert counts == want
    for resource, size in ((Resource.CORE, 5), (Resource.MEMORY, 4), (Resource.CORE, 100)):
        walk = copy.deepcopy(ledger)
        walk._legacy = {DeviceId("9c0.zzzz"): DeviceId("GPU-none-c0")}  # forces the walk
        offer = kubelet.available(resource)
        try:
            fast = ledger.preferred(resource, offer, [], size)
        except Exception as exc:
            with pytest.raises(type(exc)):
                walk.preferred(resource, offer, [], size)
            continue
        assert fast == walk.preferred(resource, offer, [], size)
