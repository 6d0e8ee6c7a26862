"""The extender's book: per-card use from annotations and assumptions; filter,
prioritize and bind choices with the node's fit rules."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.core.helpers import UNIT, cards
from vgpu.core import annotations as ann
from vgpu.core.annotations import Assignment, NodeInventory
from vgpu.core.errors import InvalidRequest
from vgpu.core.fit import NoRoom
from vgpu.core.model import CardUuid, ContainerSpec, Policy, Request
from vgpu.core.scheduling import ClusterBook, NodeUnusable, PodInfo

DOMAIN = "vendor.io"
_uids = itertools.count()


def inventory(n: int = 2, healthy: bool = True, policy: Policy = Policy.BINPACK) -> NodeInventory:
    return NodeInventory(UNIT, policy, tuple(replace(c, healthy=healthy) for c in cards(n)))


def uuid(i: int) -> CardUuid:
    return cards(i + 1)[i].uuid


def specs(*requests: tuple[int, int], uid: str = "u") -> tuple[ContainerSpec, ...]:
    return tuple(
        ContainerSpec(uid, "ns", f"p-{uid}", f"c{i}", Request(core, mem), 0.0, order=i)
        for i, (core, mem) in enumerate(requests)
    )


def pod(
    *requests: tuple[int, int],
    node: str = "",
    placements: dict[str, tuple[CardUuid, ...]] | None = None,
    assignment: Assignment | None = None,
    active: bool = True,
) -> PodInfo:
    uid = f"uid-{next(_uids)}"
    return PodInfo(
        uid=uid,
        namespace="ns",
        name=f"p-{uid}",
        node=node,
        active=active,
        specs=specs(*requests, uid=uid),
        assignment=assignment,
        placements=placements or {},
    )


def book(*nodes: str, n: int = 2) -> ClusterBook:
    b = ClusterBook(DOMAIN)
    for name in nodes:
        b.set_node(name, inventory(n))
    return b


def core_used(b: ClusterBook, node: str) -> list[int]:
    return [u.core_used for u in b.nodes[node].usages()]


# ------------------------------------------------------------ annotations


def test_inventory_round_trip_and_strictness() -> None:
    inv = inventory(2)
    text = ann.format_inventory(inv.cards, UNIT, Policy.SPREAD)
    parsed = ann.parse_inventory(text)
    assert parsed.policy is Policy.SPREAD and parsed.memory_unit_mib == UNIT
    assert [c.uuid for c in parsed.cards] == [c.uuid for c in inv.cards]
    assert parsed.cards[0].memory_mib == inv.cards[0].memory_mib
    with pytest.raises(ValueError, match="version"):
        ann.parse_inventory(text.replace('"version":1', '"version":2'))
    with pytest.raises(ValueError, match="memory_units"):
        ann.parse_inventory(text.replace('"memory_units":561', '"memory_units":9999', 1))
    with pytest.raises(ValueError, match="not JSON"):
        ann.parse_inventory("{")
    with pytest.raises(ValueError, match="over"):
        ann.parse_inventory(" " * (ann.MAX_ANNOTATION_CHARS + 1))


def test_assignment_round_trip_and_strictness() -> None:
    text = ann.format_assignment("n1", {"main": [uuid(0)], "side": [uuid(0), uuid(1)]})
    assert text == (
        '{"containers":{"main":["' + uuid(0) + '"],"side":["' + uuid(0) + '","' + uuid(1) + '"]},'
        '"node":"n1"}'
    )
    parsed = ann.parse_assignment(text)
    assert parsed.node == "n1" and parsed.containers["side"] == (uuid(0), uuid(1))
    for bad in ('{"node": "n1", "containers": {"a": []}}', '{"containers": {}}', "[]"):
        with pytest.raises(ValueError):
            ann.parse_assignment(bad)


# ------------------------------------------------------------------ filter


def test_filter_passes_only_nodes_where_one_card_fits() -> None:
    b = book("full", "free")
    # "full": 70 core used on each card, so 60 fits the node's total but no card.
    for i in range(2):
        b.set_pod(pod((70, 10), node="full", placements={"c0": (uuid(i),)}))
    verdict = b.filter(specs((60, 40)), ["full", "free"])
    assert verdict.passed == ["free"]
    reason = verdict.failed["full"]
    assert reason.startswith("vgpu: no card fits vendor.io/vcuda-core=60")
    assert "nearest card 0" in reason and "30 core" in reason
    assert not verdict.unresolvable


def test_filter_reasons_for_nodes_that_can_never_take_the_pod() -> None:
    b = book("gpu")
    b.set_node("sick", inventory(2, healthy=False))
    b.set_node("broken", None, "unreadable vgpu-node annotation: not JSON")
    verdict = b.filter(specs((10, 800)), ["gpu", "sick", "broken", "cpu-only"])
    assert verdict.passed == []
    assert "even with every card free" in verdict.unresolvable["gpu"]
    assert verdict.unresolvable["sick"] == "vgpu: no healthy vgpu card on this node"
    assert "not JSON" in verdict.unresolvable["broken"]
    assert "no vendor.io/vgpu-node annotation" in verdict.unresolvable["cpu-only"]
    invalid = b.filter(specs((30, 0)), ["gpu"])
    assert "must come with vendor.io/vcuda-memory" in invalid.unresolvable["gpu"]


def test_whole_card_pods() -> None:
    b = book("n", n=2)
    b.set_pod(pod((10, 10), node="n", placements={"c0": (uuid(0),)}))
    assert b.filter(specs((100, 0)), ["n"]).passed == ["n"]
    assert "1 of 2 card(s) entirely free, 2 needed" in b.filter(specs((200, 0)), ["n"]).failed["n"]
    assert b.plan(specs((100, 0)), "n").cards["c0"] == (uuid(1),)


# ------------------------------------------------------- sources of truth


def test_placements_win_over_the_assignment_and_finished_pods_hold_nothing() -> None:
    b = book("n")
    assigned = Assignment("n", {"c0": (uuid(0),)})
    p = pod((30, 10), node="n", assignment=assigned)
    b.set_pod(p)
    assert core_used(b, "n") == [30, 0]
    b.set_pod(replace(p, placements={"c0": (uuid(1),)}))
    assert core_used(b, "n") == [0, 30]
    b.set_pod(replace(p, active=False))
    assert core_used(b, "n") == [0, 0]


def test_assignment_for_another_node_is_not_trusted() -> None:
    b = book("n")
    b.set_pod(pod((30, 10), node="n", assignment=Assignment("other", {"c0": (uuid(1),)})))
    # Placed where the node's own policy would put it (binpack on empty cards: card 0).
    assert core_used(b, "n") == [30, 0]


def test_forged_card_lists_count_no_more_than_the_pods_own_request() -> None:
    """Pod annotations are writable by the pod's owner: a slice or one whole
    card that claims to sit on every card must not make the node look full."""
    b = book("n", n=4)
    everywhere = tuple(uuid(i) for i in range(4))
    b.set_pod(pod((100, 0), node="n", placements={"c0": everywhere}))
    b.set_pod(pod((30, 10), node="n", assignment=Assignment("n", {"c0": everywhere})))
    assert sum(core_used(b, "n")) == 130  # one whole card and one slice, nothing more
    assert b.filter(specs((200, 0)), ["n"]).passed == ["n"]  # two cards are still free


def test_a_pod_bound_before_its_node_is_known_is_counted_when_it_appears() -> None:
    b = ClusterBook(DOMAIN)
    b.set_pod(pod((40, 10), node="late", placements={"c0": (uuid(1),)}))
    b.set_node("late", inventory(2))
    assert core_used(b, "late") == [0, 40]
    b.set_node("late", replace(inventory(2), policy=Policy.SPREAD))
    assert core_used(b, "late") == [0, 40]


# ------------------------------------------------------------ assumptions


def test_assumption_holds_room_until_the_cache_shows_the_pod_bound() -> None:
    b = book("n", n=1)
    p = pod((60, 10))
    b.set_pod(p)  # pending, unbound: holds nothing
    plan = b.plan(p.specs, "n")
    b.assume(p.uid, "n", p.specs, plan)
    assert core_used(b, "n") == [60]
    assert b.filter(specs((50, 10)), ["n"]).passed == []
    # The watch shows it bound, with the assignment written at bind: counted once.
    bound = replace(p, node="n", assignment=Assignment("n", dict(plan.cards)))
    b.set_pod(bound)
    assert p.uid not in b.assumed and core_used(b, "n") == [60]
    b.remove_pod(p.uid)
    assert core_used(b, "n") == [0]


def test_the_echo_of_our_own_bind_keeps_the_assumed_holds_and_a_differing_one_is_replaced() -> None:
    b = book("n", n=2)
    p = pod((60, 10))
    b.set_pod(p)
    plan = b.plan(p.specs, "n")
    b.assume(p.uid, "n", p.specs, plan)
    holds = b.nodes["n"].holds[p.uid]
    b.nodes["n"].memo[1] = "kept"  # an answer computed with the assumption counted
    # The echo as the watch decodes it: its specs carry the assignment's cards.
    echo = tuple(replace(c, assigned=plan.cards[c.container]) for c in p.specs)
    b.set_pod(replace(p, node="n", assignment=Assignment("n", dict(plan.cards)), specs=echo))
    # Confirmed as it was assumed: the same holds object, the node's memo still valid.
    assert p.uid not in b.assumed and b.nodes["n"].holds[p.uid] is holds
    assert b.nodes["n"].memo == {1: "kept"} and core_used(b, "n") == [60, 0]
    # The node placed another pod's container on a card other than the assumed one:
    # the assumption is dropped and the pod counted where the node says.
    q = pod((30, 10))
    b.set_pod(q)
    qplan = b.plan(q.specs, "n")
    b.assume(q.uid, "n", q.specs, qplan)
    assert qplan.cards == {"c0": (uuid(0),)}  # binpack: next to p
    b.set_pod(replace(q, node="n", placements={"c0": (uuid(1),)}))
    assert q.uid not in b.assumed and b.nodes["n"].cards_of[q.uid] == {"c0": (uuid(1),)}
    assert core_used(b, "n") == [60, 30]


def test_a_failed_bind_gives_the_room_back() -> None:
    b = book("n", n=1)
    p = pod((60, 10))
    b.set_pod(p)
    b.assume(p.uid, "n", p.specs, b.plan(p.specs, "n"))
    b.forget(p.uid)
    assert core_used(b, "n") == [0] and not b.assumed


def test_a_relist_drops_pods_and_assumptions_that_are_gone() -> None:
    b = book("n", n=1)
    kept, gone = pod((20, 10), node="n"), pod((30, 10))
    b.set_pod(kept)
    b.set_pod(gone)
    b.assume(gone.uid, "n", gone.specs, b.plan(gone.specs, "n"))
    assert core_used(b, "n") == [50]
    b.replace_pods([kept])
    assert core_used(b, "n") == [20] and not b.assumed


def test_an_assumption_keeps_its_cards_when_the_node_changes() -> None:
    b = book("n", n=2)
    p = pod((60, 10))
    b.set_pod(p)
    b.assume(p.uid, "n", p.specs, b.plan(p.specs, "n"))
    b.set_node("n", replace(inventory(2), policy=Policy.SPREAD))
    assert core_used(b, "n") == [60, 0]


# -------------------------------------------------------------- prioritize


def test_prioritize_by_policy() -> None:
    b = book("busy", "idle")
    b.set_pod(pod((50, 200), node="busy", placements={"c0": (uuid(0),)}))
    binpack = dict(b.prioritize(specs((20, 20)), ["busy", "idle", "nowhere"], Policy.BINPACK))
    spread = dict(b.prioritize(specs((20, 20)), ["busy", "idle", "nowhere"], Policy.SPREAD))
    assert binpack["busy"] > binpack["idle"] and spread["busy"] < spread["idle"]
    assert binpack["nowhere"] == 0 and all(0 <= s <= 10 for s in binpack.values())


def test_pick_takes_the_policys_node_exactly() -> None:
    b = book("a", "b", "c", "empty")
    # a: 49 % of one card used, b: 51 %, c: 51 % (b's twin, later in the list).
    b.set_pod(pod((49, 100), node="a", placements={"c0": (uuid(0),)}))
    b.set_pod(pod((51, 100), node="b", placements={"c0": (uuid(0),)}))
    b.set_pod(pod((51, 100), node="c", placements={"c0": (uuid(0),)}))
    asked = specs((10, 20))
    scores = dict(b.prioritize(asked, ["a", "b"], Policy.BINPACK))
    assert scores["a"] == scores["b"]  # prioritize's 0-10 cannot tell them apart
    assert b.pick(asked, ["a", "b", "c", "empty"], Policy.BINPACK) == "b"  # fullest, first
    assert b.pick(asked, ["c", "b", "a", "empty"], Policy.BINPACK) == "c"  # ties: list order
    assert b.pick(asked, ["a", "b", "c", "empty"], Policy.SPREAD) == "empty"
    assert b.pick(asked, ["nowhere", "a"], Policy.BINPACK) == "a"  # unknown nodes never win
    assert b.pick(asked, ["only"], Policy.BINPACK) == "only"
    assert b.pick(asked, [], Policy.BINPACK) == ""


def test_pick_follows_the_book_as_it_changes() -> None:
    b = book("a", "b")
    asked = specs((30, 20))
    first = pod((60, 100), node="a", placements={"c0": (uuid(0),)})
    b.set_pod(first)
    assert b.pick(asked, ["b", "a"], Policy.BINPACK) == "a"
    b.remove_pod(first.uid)  # the memo of "a" is stale now: the answer must follow
    b.set_pod(pod((60, 100), node="b", placements={"c0": (uuid(0),)}))
    assert b.pick(asked, ["a", "b"], Policy.BINPACK) == "b"


# -------------------------------------------------------------- properties

slices = st.tuples(st.integers(1, 99), st.integers(1, 561)) | st.tuples(
    st.just(0), st.integers(1, 561)
)
wholes = st.tuples(st.sampled_from([100, 200, 300]), st.integers(0, 1200))


def _check_fast_paths(
    running: list[tuple[tuple[int, int], int]],
    pod_specs: tuple[ContainerSpec, ...],
    policy: Policy,
) -> None:
    """On a node holding `running` (placed by the rules; the int chooses whether
    the placements annotation or the node's policy names the card), the room
    index answers exactly what place_pod answers, in filter and in prioritize."""
    b = ClusterBook(DOMAIN)
    b.set_node("n", inventory(3, policy=policy))
    for request, card in running:
        try:
            plan = b.plan(specs(request), "n")
        except (NoRoom, InvalidRequest):
            continue
        b.set_pod(pod(request, node="n", placements=dict(plan.cards) if card else None))
    try:
        b.plan(pod_specs, "n")
        fits = True
    except (NoRoom, InvalidRequest):
        fits = False
    verdict = b.filter(pod_specs, ["n"])
    assert (verdict.passed == ["n"]) is fits
    node = b.nodes["n"]
    fast = b._fullness_after(node, pod_specs, fast=True)
    general = b._fullness_after(node, pod_specs, fast=False)
    assert (fast is None) is (general is None) is (not fits)
    if fast is not None and general is not None:
        assert fast == pytest.approx(general)
    # Asked again, the node's memo answers the same.
    assert b.filter(pod_specs, ["n"]) == verdict


running_pods = st.lists(st.tuples(slices | wholes, st.integers(0, 2)), max_size=10)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(running_pods, slices | wholes, st.sampled_from(list(Policy)))
def test_fast_paths_agree_with_the_fit_rules(
    running: list[tuple[tuple[int, int], int]], new: tuple[int, int], policy: Policy
) -> None:
    _check_fast_paths(running, specs(new), policy)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(running_pods, st.lists(slices, min_size=2, max_size=4), st.sampled_from(list(Policy)))
# Two cards equally full by integer amounts but not by a float sum of steps: the
# tie must go to the lowest index, as in fit.choose_fractional.
@example([((0, 1), 0), ((0, 479), 0), ((0, 315), 0)], [(0, 165), (0, 1)], Policy.BINPACK)
def test_the_fast_path_places_several_slices_as_place_pod_does(
    running: list[tuple[tuple[int, int], int]], new: list[tuple[int, int]], policy: Policy
) -> None:
    _check_fast_paths(running, specs(*new), policy)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(running_pods, min_size=1, max_size=4),
    st.lists(slices, min_size=1, max_size=3) | st.tuples(wholes),
    st.sampled_from(list(Policy)),
    st.randoms(use_true_random=False),
)
def test_choose_is_filter_then_pick_in_one_pass(
    per_node: list[list[tuple[tuple[int, int], int]]],
    new: list[tuple[int, int]] | tuple[tuple[int, int]],
    policy: Policy,
    rng: random.Random,
) -> None:
    """The picking filter's one pass chooses the node that filter, then pick over
    the nodes that passed, would choose (or None where none passes), in any
    node order, with the memo cold or warm."""
    b = ClusterBook(DOMAIN)
    names = [f"n{i}" for i in range(len(per_node))] + ["nowhere"]
    for name, running in zip(names, per_node, strict=False):
        b.set_node(name, inventory(2))
        for request, card in running:
            try:
                plan = b.plan(specs(request), name)
            except (NoRoom, InvalidRequest):
                continue
            b.set_pod(pod(request, node=name, placements=dict(plan.cards) if card else None))
    rng.shuffle(names)
    asked = specs(*new)
    for _ in range(3):  # cold, from the ranks, and after the chosen node changed
        chosen = b.choose(asked, names, policy)
        passed = b.filter(asked, names).passed
        assert chosen == (b.pick(asked, passed, policy) if passed else None)
        assert chosen == b.choose(asked, names, policy)  # asked again: the same
        if chosen is not None:  # the pod takes its room there, as a pick does
            b.assume(f"held-{rng.random()}", chosen, asked, b.plan(asked, chosen))


def test_the_memo_forgets_when_the_node_changes() -> None:
    b = book("n", n=1)
    assert b.filter(specs((60, 10)), ["n"]).passed == ["n"]
    b.set_pod(pod((50, 10), node="n", placements={"c0": (uuid(0),)}))
    assert b.filter(specs((60, 10)), ["n"]).passed == []
    before = dict(b.prioritize(specs((10, 10)), ["n"], Policy.BINPACK))
    b.set_pod(pod((40, 10), node="n", placements={"c0": (uuid(0),)}))
    assert dict(b.prioritize(specs((10, 10)), ["n"], Policy.BINPACK))["n"] > before["n"]


def test_plan_raises_for_unknown_nodes() -> None:
    with pytest.raises(NodeUnusable):
        ClusterBook(DOMAIN).plan(specs((10, 10)), "nope")


def test_node_cards_lists_pods_per_card() -> None:
    b = book("n")
    p = pod((30, 10), (0, 5), node="n", placements={"c0": (uuid(0),), "c1": (uuid(1),)})
    b.set_pod(p)
    views = b.node_cards("n")
    assert views[0].pods == (("ns", p.name, "c0"),)
    assert views[1].pods == (("ns", p.name, "c1"),)
    assert views[1].usage.memory_used_units == 5
