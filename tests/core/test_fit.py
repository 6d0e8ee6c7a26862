"""The fit rules shared by the node's Ledger and the scheduler extender."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.helpers import UNIT, Kubelet, cards, spec
from vgpu.core import fit
from vgpu.core.errors import InsufficientCapacity, InvalidRequest
from vgpu.core.fit import CardUsage, NoRoom
from vgpu.core.model import Card, CardUuid, ContainerSpec, Policy, Request
from vgpu.core.packing import Ledger

DOMAIN = "vendor.io"
H200_UNITS = 143771 // UNIT  # 561


def usages(n: int, used: list[tuple[int, int]] | None = None, **kw: object) -> list[CardUsage]:
    out = []
    for i, card in enumerate(cards(n, **kw)):  # type: ignore[arg-type]
        core, mem = (used or [])[i] if used and i < len(used) else (0, 0)
        out.append(CardUsage(card, core, mem, core >= 100, int(bool(core or mem))))
    return out


def c(name: str, core: int = 0, mem: int = 0, init: bool = False, order: int = 0) -> ContainerSpec:
    return ContainerSpec("uid", "ns", "pod", name, Request(core, mem), 0.0, init=init, order=order)


def place(specs: list[ContainerSpec], u: list[CardUsage], policy: Policy = Policy.BINPACK):
    return fit.place_pod(specs, u, UNIT, policy, DOMAIN)


def index_of(u: list[CardUsage], uuid: CardUuid) -> int:
    return next(x.card.index for x in u if x.card.uuid == uuid)


# ------------------------------------------------------------------ tables


@pytest.mark.parametrize(
    ("used", "core", "mem", "policy", "expected"),
    [
        ([(50, 100), (0, 0)], 30, 40, Policy.BINPACK, 0),
        ([(50, 100), (0, 0)], 30, 40, Policy.SPREAD, 1),
        ([(80, 100), (0, 0)], 30, 40, Policy.BINPACK, 1),  # card 0 lacks core
        ([(10, 550), (0, 0)], 30, 40, Policy.BINPACK, 1),  # card 0 lacks memory
        ([(0, 0), (0, 0)], 0, 40, Policy.BINPACK, 0),  # memory only: lowest index on a tie
        ([(100, 0), (0, 0)], 0, 8, Policy.BINPACK, 1),  # a whole card takes nothing
    ],
    ids=["binpack-fullest", "spread-emptiest", "core-short", "memory-short", "tie", "whole"],
)
def test_choose_fractional(
    used: list[tuple[int, int]], core: int, mem: int, policy: Policy, expected: int
) -> None:
    u = usages(2, used)
    chosen = fit.choose_fractional(Request(core, mem), u, UNIT, policy)
    assert index_of(u, chosen) == expected


def test_nothing_fits_names_the_nearest_card() -> None:
    u = usages(2, [(90, 500), (40, 300)])
    with pytest.raises(NoRoom, match="no single card"):
        fit.choose_fractional(Request(70, 300), u, UNIT, Policy.BINPACK)
    text = fit.nearest_room(Request(70, 300), u, UNIT)
    assert text.startswith(f"nearest card 1 ({u[1].card.uuid}) has 60 core and 261 memory units")


def test_unhealthy_cards_take_nothing() -> None:
    u = usages(2)
    sick = [replace(x, card=replace(x.card, healthy=False)) for x in u]
    with pytest.raises(NoRoom):
        fit.choose_fractional(Request(10, 10), sick, UNIT, Policy.BINPACK)
    assert fit.nearest_room(Request(10, 10), sick, UNIT) == "every card is unhealthy"


@pytest.mark.parametrize(
    ("numa", "count", "expected"),
    [([0, 1, 1, 0], 2, {0, 3}), ([0, 1, 2, 3], 2, {0, 1}), ([0, 1, 1, 0], 1, {0})],
    ids=["same-numa-pair", "no-pair-lowest-index", "one"],
)
def test_choose_whole_prefers_one_numa_node(
    numa: list[int], count: int, expected: set[int]
) -> None:
    u = usages(4, numa=numa)
    chosen = fit.choose_whole(Request(count * 100), u, UNIT, DOMAIN)
    assert {index_of(u, x) for x in chosen} == expected


def test_whole_needs_entirely_free_cards_and_memory_that_fits() -> None:
    u = usages(2, [(1, 0), (0, 0)])
    with pytest.raises(NoRoom, match="only 1 card"):
        fit.choose_whole(Request(200), u, UNIT, DOMAIN)
    with pytest.raises(InvalidRequest, match="does not fit"):
        fit.choose_whole(Request(100, H200_UNITS + 1), usages(2), UNIT, DOMAIN)


@pytest.mark.parametrize(
    ("request_", "message"),
    [(Request(150, 10), "neither a fraction"), (Request(30, 0), "must come with")],
    ids=["not-whole", "core-without-memory"],
)
def test_invalid_requests(request_: Request, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        place([c("main", request_.core_percent, request_.memory_units)], usages(2))


# ------------------------------------------------------------ whole pods


def test_two_containers_share_or_split_by_room() -> None:
    u = usages(2, [(50, 0), (0, 0)])
    plan = place([c("a", 40, 40, order=1), c("b", 40, 40, order=2)], u)
    assert index_of(u, plan.cards["a"][0]) == 0  # binpack: the fuller card
    assert index_of(u, plan.cards["b"][0]) == 1  # card 0 has only 10 core left
    assert [x.core_used for x in plan.usages] == [90, 40]


def test_init_container_ids_are_reused_like_the_kubelet() -> None:
    u = usages(2, [(0, 0), (50, 0)])
    plan = place([c("init", 30, 40, init=True, order=1), c("app", 50, 40, order=2)], u)
    # The app reuses the init's 30 core and 40 memory and needs 20 more core there.
    assert plan.cards["app"] == plan.cards["init"]
    card = plan.usages[index_of(u, plan.cards["init"][0])]
    assert (card.core_used, card.memory_used_units) == (50 + 50, 40)


def test_app_reusing_init_ids_must_find_the_rest_on_that_card() -> None:
    u = usages(2, [(0, 0), (60, 0)])
    with pytest.raises(NoRoom, match="lacks room"):
        place([c("init", 30, 40, init=True, order=1), c("app", 50, 40, order=2)], u)


def test_fixed_cards_are_counted_not_checked() -> None:
    u = usages(2)
    plan = fit.place_pod(
        [c("main", 100, 0)], u, UNIT, Policy.BINPACK, DOMAIN, fixed={"main": (u[1].card.uuid,)}
    )
    assert plan.usages[1].exclusive and plan.usages[1].core_used == 100
    assert plan.holds[u[1].card.uuid].whole


# -------------------------------------------------------------- properties

requests = st.one_of(
    st.tuples(st.integers(1, 99), st.integers(1, 600)),
    st.tuples(st.just(0), st.integers(1, 600)),
    st.tuples(st.sampled_from([100, 200]), st.integers(0, 200)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(requests, st.booleans()),
        min_size=1,
        max_size=5,
    ),
    st.lists(st.tuples(st.integers(0, 100), st.integers(0, H200_UNITS)), min_size=3, max_size=3),
    st.sampled_from(list(Policy)),
)
def test_place_pod_never_overcommits(
    containers: list[tuple[tuple[int, int], bool]],
    used: list[tuple[int, int]],
    policy: Policy,
) -> None:
    u = usages(3, used)
    specs = [c(f"c{i}", core, mem, init, i) for i, ((core, mem), init) in enumerate(containers)]
    try:
        plan = place(specs, u, policy)
    except (NoRoom, InvalidRequest):
        return
    for before, after in zip(u, plan.usages, strict=True):
        assert after.core_used <= 100
        assert after.memory_used_units <= after.card.memory_units(UNIT)
        if after.exclusive and not before.exclusive:
            assert before.empty  # only an empty card is taken whole
    for spec_ in specs:
        whole = spec_.request.whole_cards
        assert len(plan.cards[spec_.container]) == (whole or 1)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(requests, min_size=0, max_size=8),
    requests,
    st.sampled_from(list(Policy)),
    st.lists(st.booleans(), min_size=3, max_size=3),
)
def test_fit_and_the_ledger_agree(
    running: list[tuple[int, int]],
    new: tuple[int, int],
    policy: Policy,
    health: list[bool],
) -> None:
    """Whatever the node admits, place_pod predicts: same verdict, same card."""
    card_list = [replace(card, healthy=h) for card, h in zip(cards(3), health, strict=True)]
    led = Ledger(card_list, memory_unit_mib=UNIT, policy=policy)
    kubelet = Kubelet(led)
    for core, mem in running:
        try:
            kubelet.admit(spec(core, mem))
        except (InsufficientCapacity, InvalidRequest):
            pass
    before = led.usages()
    container = spec(*new)
    try:
        predicted = fit.place_pod([container], before, UNIT, policy, DOMAIN)
    except (NoRoom, InvalidRequest):
        predicted = None
    try:
        placement = kubelet.admit(container)
    except (InsufficientCapacity, InvalidRequest):
        placement = None
    assert (predicted is None) == (placement is None), (new, [str(u) for u in before])
    if predicted is not None and placement is not None:
        assert tuple(sorted(placement.cards)) == tuple(sorted(predicted.cards["main"]))
        after = {u.card.uuid: (u.core_used, u.memory_used_units) for u in led.usages()}
        assert after == {u.card.uuid: (u.core_used, u.memory_used_units) for u in predicted.usages}


def test_card_usage_fullness() -> None:
    card = Card(CardUuid("GPU-x"), 0, "H200", 256 * 100, 0)
    assert CardUsage(card, 50, 25, False, 1).fullness(256) == pytest.approx(0.75)
