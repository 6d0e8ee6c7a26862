"""The arbiter's allocation math and burst-cap parsing (pure)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vgpu.core.arbiter import (
    RECHECK_PERIODS,
    Settled,
    Tenant,
    allowed_percent,
    arbitrate_period,
    burst_cap,
    estimate_demand,
    share_out,
)

T = Tenant

SHARE_CASES = [
    ("alone-at-guarantee", [T(30, 30, 100)], [30]),
    ("alone-capped-100-light", [T(30, 100, 35)], [35]),
    ("alone-capped-100-greedy", [T(30, 100, 100)], [100]),
    ("10-90-greedy", [T(10, 10, 100), T(90, 90, 100)], [10, 90]),
    ("30-60-default-caps", [T(30, 30, 100), T(60, 60, 100)], [30, 60]),
    ("30-60-caps-100", [T(30, 100, 100), T(60, 100, 100)], [100 / 3, 200 / 3]),
    ("noisy-neighbour", [T(10, 100, 100), T(50, 50, 100)], [50, 50]),
    ("noisy-neighbour-idle", [T(10, 100, 100), T(50, 50, 5)], [95, 5]),
    ("guarantee-before-burst", [T(10, 100, 100), T(90, 90, 100)], [10, 90]),
    ("cap-stops-burst", [T(20, 40, 100), T(20, 100, 10)], [40, 10]),
    ("spill-over-from-capped", [T(20, 25, 100), T(20, 100, 100), T(20, 30, 100)], [25, 45, 30]),
    ("nobody-wants", [T(30, 100, 0), T(60, 100, 0)], [0, 0]),
    ("best-effort-weighs-one", [T(0, 100, 100), T(49, 100, 100)], [1.02, 98.98]),
    ("overcommitted-guarantees", [T(60, 60, 100), T(60, 60, 100)], [50, 50]),
    ("no-tenants", [], []),
]


@pytest.mark.parametrize(
    ("tenants", "want"), [c[1:] for c in SHARE_CASES], ids=[c[0] for c in SHARE_CASES]
)
def test_share_out(tenants: list[Tenant], want: list[float]) -> None:
    assert share_out(tenants) == pytest.approx(want, abs=1e-6)


DEMAND_CASES = [
    # id, achieved, allowed, share, guarantee, cap, want
    ("presses-its-allowance", 29, 30, 30, 30, 100, 100),
    ("presses-cap-only-cap", 50, 50, 50, 50, 50, 50),
    ("light-program-below-guarantee-no-headroom", 20, 50, 25, 50, 100, 20),
    ("light-program-above-guarantee-headroom", 20, 50, 25, 10, 100, 25),
    ("idle-holds-nothing-back", 0, 30, 5, 30, 100, 0),
    ("woke-up-squeezed", 6, 50, 5, 50, 50, 50),
    ("uses-its-share-wants-step", 40, 100, 40, 30, 100, 45),
    ("achieved-above-100-clamped", 250, 100, 100, 10, 100, 100),
]


@pytest.mark.parametrize(
    ("achieved", "allowed", "share", "guarantee", "cap", "want"),
    [c[1:] for c in DEMAND_CASES],
    ids=[c[0] for c in DEMAND_CASES],
)
def test_estimate_demand(
    achieved: float, allowed: float, share: float, guarantee: float, cap: float, want: float
) -> None:
    assert estimate_demand(achieved, allowed, share, guarantee, cap) == pytest.approx(want)


def test_allowed_never_below_guarantee_nor_above_cap() -> None:
    assert allowed_percent(5, 30, 100) == 30
    assert allowed_percent(70, 30, 100) == 70
    assert allowed_percent(70, 30, 50) == 50


def arbitrate(*args: Any) -> tuple[list[float], list[float]]:
    """One period without memory of past levels: (shares, allowances)."""
    period = arbitrate_period(*args)
    return period.shares, period.allowed


def test_arbitrate_converges_for_a_greedy_neighbour() -> None:
    """A greedy tenant (guarantee 10, cap 100) beside a 50 % one: after the
    neighbour leaves, the greedy one gets the card; when it comes back, its
    guarantee is restored on the first period that sees it."""
    g, c = [10.0, 50.0], [100.0, 50.0]
    allowed, share = [10.0, 50.0], [10.0, 50.0]
    for achieved in ([10, 50], [50, 50], [50, 50]):
        share, allowed = arbitrate(g, c, [float(a) for a in achieved], allowed, share)
    assert share == pytest.approx([50, 50])
    for _ in range(3):  # the neighbour is idle
        share, allowed = arbitrate(g, c, [allowed[0], 0.0], allowed, share)
    assert share[0] >= 94 and allowed[1] == 50
    share, allowed = arbitrate(g, c, [90.0, 8.0], allowed, share)  # it is back, squeezed
    assert share == pytest.approx([50, 50])


def test_below_its_share_on_a_full_card_it_keeps_its_share() -> None:
    """A newcomer (guarantee 50) squeezed by two neighbours whose throttles have not
    yet come down to their new allowances: the card is full, so it is not judged
    to want only what it got, and the neighbours do not ramp back up into its share."""
    assert estimate_demand(34, 50, 50, 50, 100, False, saturated=True) == pytest.approx(50)
    assert estimate_demand(34, 50, 50, 50, 100, False, saturated=False) == pytest.approx(34)
    g, c = [20.0, 30.0, 50.0], [100.0, 100.0, 100.0]
    share, _ = arbitrate(
        g, c, [33.0, 33.0, 34.0], [20.0, 30.0, 50.0], [20.0, 30.0, 50.0], [False] * 3
    )
    assert share == pytest.approx([20, 30, 50])
    # not full (a light program beside an idle-ish neighbour): judged by what it used
    share, _ = arbitrate(g, c, [10.0, 30.0, 34.0], [20.0, 30.0, 50.0], [20.0, 30.0, 50.0])
    assert share[2] < 45


def test_a_light_tenant_is_probed_once_not_every_other_period() -> None:
    """A notebook using 5 % (guarantee 50) beside a greedy tenant (guarantee 10, cap
    100). Once it has had room on the card and used 5, it is its own limit: the
    greedy tenant keeps ~95, and 90 on a recheck every RECHECK_PERIODS. Without
    that memory it was offered its guarantee again every other period, and the
    greedy tenant's allowance went 95, 50, 95, 50 (a card ~75 % busy)."""
    g, c = [10.0, 50.0], [100.0, 50.0]
    allowed, share = [10.0, 50.0], [10.0, 50.0]
    settled: list[Settled | None] = [None, None]
    greedy_allowed = []
    for _ in range(3 * RECHECK_PERIODS):
        light = 5.0
        greedy = min(allowed[0], 100.0 - light)  # it presses whatever it is allowed
        p = arbitrate_period(g, c, [greedy, light], allowed, share, [True, False], settled)
        share, allowed, settled = p.shares, p.allowed, p.settled
        greedy_allowed.append(allowed[0])
    steady = greedy_allowed[3:]
    assert min(steady) >= 89 and sum(steady) / len(steady) >= 94, greedy_allowed
    assert settled[1] is not None and settled[1].level_percent == pytest.approx(5)
    # it goes idle: forgotten; it comes back squeezed (8 % of a full card): its
    # guarantee is restored on the first period that sees it
    p = arbitrate_period(g, c, [95.0, 0.0], allowed, share, [True, False], settled)
    assert p.settled[1] is None
    p = arbitrate_period(g, c, [92.0, 8.0], p.allowed, p.shares, [True, False], p.settled)
    assert p.shares == pytest.approx([50, 50])


def test_a_settled_tenant_that_wants_more_is_offered_its_guarantee_again() -> None:
    g, c = [10.0, 50.0], [100.0, 50.0]
    # it was its own limit at 5; now it uses 20 of a full card: forgotten, and probed
    p = arbitrate_period(
        g, c, [80.0, 20.0], [80.0, 50.0], [80.0, 20.0], [True, False], [None, Settled(5.0)]
    )
    assert p.settled[1] is None
    assert p.shares == pytest.approx([50, 50])


def test_a_tenant_that_only_looked_self_limited_gets_its_guarantee_back() -> None:
    """A greedy tenant (guarantee 50) starved of CPU for a moment used 15 % of a
    card that had room: it looks self-limited, its neighbours get the rest, and
    on a full FIFO card they then squeeze it to exactly that level. The recheck
    offers it a step more; it grows into it and gets its guarantee back."""
    g, c = [20.0, 30.0, 50.0], [100.0, 100.0, 100.0]
    allowed, share = [20.0, 30.0, 50.0], [20.0, 30.0, 50.0]
    p = arbitrate_period(g, c, [20.0, 30.0, 15.0], allowed, share, [True, True, False])
    assert p.settled[2] == Settled(15.0)
    share, allowed, settled = p.shares, p.allowed, p.settled
    got = []
    for _ in range(RECHECK_PERIODS + 4):
        neighbours = [min(allowed[0], 100.0), min(allowed[1], 100.0)]
        squeezed = max(0.0, 100.0 - sum(neighbours))  # it wants the card; it gets what is left
        a = [*neighbours[:2], squeezed]
        if sum(a) > 100:
            a = [x * 100 / sum(a) for x in a]
        p = arbitrate_period(g, c, a, allowed, share, [True, True, False], settled)
        share, allowed, settled = p.shares, p.allowed, p.settled
        got.append(round(a[2], 1))
    assert got[-1] >= 49, got


tenant = st.builds(
    lambda g, extra, d: Tenant(g, min(100.0, g + extra), d),
    st.floats(0, 100),
    st.floats(0, 100),
    st.floats(0, 100),
)


def _fits(tenants: list[Tenant]) -> list[Tenant]:
    """Guarantees as placement makes them: never more than the card."""
    total = sum(t.guarantee_percent for t in tenants)
    if total <= 100:
        return tenants
    return [
        Tenant(t.guarantee_percent * 100 / total, t.cap_percent, t.demand_percent) for t in tenants
    ]


@settings(max_examples=300, deadline=None)
@given(st.lists(tenant, max_size=12))
def test_share_out_properties(raw: list[Tenant]) -> None:
    tenants = _fits(raw)
    shares = share_out(tenants)
    assert sum(shares) <= 100 + 1e-6
    for t, s in zip(tenants, shares, strict=True):
        assert s >= min(t.guarantee_percent, t.demand_percent) - 1e-6
        assert s <= t.cap_percent + 1e-6
        assert s <= t.demand_percent + 1e-6
    # work-conserving: idle capacity only if everyone has all it wants (up to its cap)
    if sum(shares) < 100 - 1e-6:
        for t, s in zip(tenants, shares, strict=True):
            assert s == pytest.approx(min(t.cap_percent, t.demand_percent), abs=1e-6)


@settings(max_examples=200, deadline=None)
@given(st.lists(tenant, min_size=1, max_size=8))
def test_share_out_is_deterministic_and_order_free(raw: list[Tenant]) -> None:
    tenants = _fits(raw)
    shares = share_out(tenants)
    assert share_out(tenants) == shares
    assert share_out(tenants[::-1]) == pytest.approx(shares[::-1], abs=1e-6)


DOMAIN = "vgpu.io"
CAP_CASES = [
    # id, annotations, guarantee, default, want cap, problem substrings
    ("none-equals-guarantee", {}, 30, None, 30, []),
    ("cluster-default", {}, 30, 80, 80, []),
    ("default-below-guarantee", {}, 30, 20, 30, []),
    ("pod-annotation", {f"{DOMAIN}/vcuda-core-limit": "90"}, 30, None, 90, []),
    ("percent-sign", {f"{DOMAIN}/vcuda-core-limit": " 90% "}, 30, None, 90, []),
    (
        "container-wins",
        {f"{DOMAIN}/vcuda-core-limit": "90", f"{DOMAIN}/vcuda-core-limit.main": "60"},
        30,
        None,
        60,
        [],
    ),
    (
        "bad-container-falls-to-pod",
        {f"{DOMAIN}/vcuda-core-limit": "90", f"{DOMAIN}/vcuda-core-limit.main": "lots"},
        30,
        None,
        90,
        ["vcuda-core-limit.main", "not a whole percent"],
    ),
    ("below-guarantee", {f"{DOMAIN}/vcuda-core-limit": "10"}, 30, None, 30, ["outside 30-100"]),
    ("above-100", {f"{DOMAIN}/vcuda-core-limit": "101"}, 30, 50, 50, ["outside 30-100"]),
    ("negative", {f"{DOMAIN}/vcuda-core-limit": "-5"}, 30, None, 30, ["not a whole percent"]),
    ("fraction", {f"{DOMAIN}/vcuda-core-limit": "50.5"}, 30, None, 30, ["not a whole percent"]),
    ("huge", {f"{DOMAIN}/vcuda-core-limit": "9" * 5000}, 30, None, 30, ["not a whole percent"]),
    ("other-container", {f"{DOMAIN}/vcuda-core-limit.side": "90"}, 30, None, 30, []),
]


@pytest.mark.parametrize(
    ("annotations", "guarantee", "default", "want", "problems"),
    [c[1:] for c in CAP_CASES],
    ids=[c[0] for c in CAP_CASES],
)
def test_burst_cap(
    annotations: dict[str, str],
    guarantee: int,
    default: int | None,
    want: int,
    problems: list[str],
) -> None:
    choice = burst_cap(annotations, DOMAIN, "main", guarantee, default)
    assert choice.cap_percent == want
    text = " ".join(choice.problems)
    for part in problems:
        assert part in text
    assert bool(choice.problems) == bool(problems)
    assert all(len(p) < 200 for p in choice.problems)
