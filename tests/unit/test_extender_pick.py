"""node_choice "extender": filter answers the one node the policy picks and
holds the pod's room there until the bind, so the pods kube-scheduler
schedules before that bind see the room taken; node_choice "scheduler"
answers every node that fits and holds nothing.

The Binder port is the small fake of tests/unit/test_extender_bind.py."""

from __future__ import annotations

import json

import pytest

from tests.core.test_scheduling import inventory, pod
from tests.unit.test_extender_bind import GateBinder
from vgpu.adapters.extender_http import BindRequest, PodRequest
from vgpu.core.model import Policy
from vgpu.core.scheduling import PodInfo
from vgpu.daemon.extender_service import PICK_HOLD_S, ExtenderService

DOMAIN = "vendor.io"


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def service(
    pods: list[PodInfo],
    nodes: dict[str, int],
    *,
    pick: bool = True,
    fail: set[str] | None = None,
    policy: Policy = Policy.BINPACK,
) -> tuple[ExtenderService, GateBinder, Clock]:
    binder, clock = GateBinder(fail), Clock()
    binder.release.set()
    svc = ExtenderService(DOMAIN, policy, binder, pick_node=pick, clock=clock)
    svc.nodes_listed({name: (inventory(cards), "") for name, cards in nodes.items()})
    svc.pods_listed(pods)
    svc.synced("nodes", True)
    svc.synced("pods", True)
    return svc, binder, clock


def request(p: PodInfo) -> PodRequest:
    return PodRequest(p.uid, p.namespace, p.name, p.specs)


def passed(svc: ExtenderService, p: PodInfo, nodes: list[str]) -> list[str]:
    verdict = svc.filter(request(p), nodes)
    assert not isinstance(verdict, str), verdict
    return list(verdict.passed)


def bind(svc: ExtenderService, p: PodInfo, node: str) -> str:
    return svc.bind(BindRequest(p.namespace, p.name, p.uid, node))


def test_filter_answers_one_node_and_the_next_pod_sees_its_room_taken() -> None:
    # Two one-card nodes; a 60 % pod fits either, but only one per card.
    first, second, third = pod((60, 20)), pod((60, 20)), pod((60, 20))
    svc, _, _ = service([first, second, third], {"a": 1, "b": 1})
    assert passed(svc, first, ["a", "b"]) == ["a"]
    # Before the first pod's bind: "a" is held, so the second goes to "b".
    assert passed(svc, second, ["a", "b"]) == ["b"]
    verdict = svc.filter(request(third), ["a", "b"])
    assert not isinstance(verdict, str) and verdict.passed == []
    assert set(verdict.failed) == {"a", "b"}
    assert svc.counts()["picked"] == 2 and svc.counts()["assumed"] == 0


def test_without_picks_both_pods_would_have_been_sent_to_one_card() -> None:
    first, second = pod((60, 20)), pod((60, 20))
    svc, _, _ = service([first, second], {"a": 1, "b": 1}, pick=False)
    assert passed(svc, first, ["a", "b"]) == ["a", "b"]
    assert passed(svc, second, ["a", "b"]) == ["a", "b"]
    assert svc.counts()["picked"] == 0 and svc.counts()["assumed"] == 0


def test_the_bind_takes_over_the_pick_with_the_same_cards() -> None:
    pods = [pod((30, 20)) for _ in range(5)]
    svc, binder, _ = service(pods, {"a": 2, "b": 2})
    chosen = [passed(svc, p, ["a", "b"])[0] for p in pods]
    assert chosen == ["a"] * 5  # binpack: the fullest node that fits, every time
    held = {p.uid: svc.book.holds_cards(p.uid, "a") for p in pods}
    for p in pods:
        assert bind(svc, p, "a") == ""
    for uid, _, assignment in binder.calls:
        assert json.loads(assignment)["containers"] == {
            c: list(v) for c, v in (held[uid] or {}).items()
        }
    used: dict[str, int] = {}
    for _, _, assignment in binder.calls:
        for cards in json.loads(assignment)["containers"].values():
            for card in cards:
                used[card] = used.get(card, 0) + 30
    assert sorted(used.values()) == [60, 90]  # three on one card, two on the other
    assert svc.counts() == {"nodes": 2, "pods": 5, "assumed": 5, "picked": 0}


def test_a_bind_elsewhere_gives_the_picks_room_back() -> None:
    first, second = pod((60, 20)), pod((60, 20))
    svc, _, _ = service([first, second], {"a": 1, "b": 1})
    assert passed(svc, first, ["a", "b"]) == ["a"]
    assert bind(svc, first, "b") == ""  # kube-scheduler chose otherwise (another plugin)
    assert passed(svc, second, ["a", "b"]) == ["a"]  # "a" is free again


def test_a_failed_bind_gives_the_picks_room_back() -> None:
    first, second = pod((60, 20)), pod((60, 20))
    svc, _, _ = service([first, second], {"a": 1}, fail={first.uid})
    assert passed(svc, first, ["a"]) == ["a"]
    assert "injected" in bind(svc, first, "a")
    assert svc.counts()["picked"] == 0 and svc.counts()["assumed"] == 0
    assert passed(svc, second, ["a"]) == ["a"]


def test_a_pod_filtered_again_does_not_block_itself() -> None:
    alone = pod((60, 20))
    svc, _, _ = service([alone], {"a": 1})
    assert passed(svc, alone, ["a"]) == ["a"]
    assert passed(svc, alone, ["a"]) == ["a"]  # its first pick was given back first
    assert svc.counts()["picked"] == 1


def test_a_pick_no_bind_came_for_expires() -> None:
    first, second = pod((60, 20)), pod((60, 20))
    svc, _, clock = service([first, second], {"a": 1})
    assert passed(svc, first, ["a"]) == ["a"]
    assert passed(svc, second, ["a"]) == []
    clock.now_s += PICK_HOLD_S + 0.1
    assert svc.counts()["picked"] == 0  # the gauge does not wait for the next filter
    assert passed(svc, second, ["a"]) == ["a"]
    assert svc.counts()["picked"] == 1
    # The first pod's late bind plans afresh, and the room is the second's now.
    assert "no longer fits on node a" in bind(svc, first, "a")


def test_a_deleted_pod_gives_its_pick_back() -> None:
    first, second = pod((60, 20)), pod((60, 20))
    svc, _, _ = service([first, second], {"a": 1})
    assert passed(svc, first, ["a"]) == ["a"]
    svc.pod_deleted(first.uid)
    assert passed(svc, second, ["a"]) == ["a"]


def test_the_cache_showing_the_pod_bound_ends_the_hold_as_placed() -> None:
    first = pod((60, 20))
    svc, binder, _ = service([first], {"a": 1, "b": 1})
    assert passed(svc, first, ["a", "b"]) == ["a"]
    assert bind(svc, first, "a") == ""
    cards = json.loads(binder.calls[0][2])["containers"]
    svc.pod_changed(
        PodInfo(
            uid=first.uid,
            namespace=first.namespace,
            name=first.name,
            node="a",
            active=True,
            specs=first.specs,
            assignment=None,
            placements={c: tuple(v) for c, v in cards.items()},
        )
    )
    assert svc.counts() == {"nodes": 2, "pods": 1, "assumed": 0, "picked": 0}


@pytest.mark.parametrize("policy", [Policy.BINPACK, Policy.SPREAD])
def test_the_policy_decides_the_pick(policy: Policy) -> None:
    busy = pod((50, 20), node="a", placements={"c0": (inventory(1).cards[0].uuid,)})
    new = pod((20, 20))
    svc, _, _ = service([busy, new], {"a": 1, "b": 1}, policy=policy)
    assert passed(svc, new, ["a", "b"]) == (["a"] if policy is Policy.BINPACK else ["b"])
