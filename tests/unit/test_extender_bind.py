"""The extender's bind: one API call, outside any lock; binds to one node run
at once and never give the same room twice; a failed bind holds nothing.

The Binder port is a small fake injected through the constructor (its real
adapter, one Binding carrying the assignment, is tested against the fake API
server in tests/integration/test_extender_http.py)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.test_scheduling import inventory, pod
from vgpu.adapters.extender_http import BindRequest, PodRequest
from vgpu.adapters.kube_cluster import BindError
from vgpu.core.annotations import parse_assignment
from vgpu.core.model import Policy
from vgpu.core.scheduling import PodInfo
from vgpu.daemon.extender_service import UNSURE_HOLD_S, ExtenderService

DOMAIN = "vendor.io"


class GateBinder:
    """Holds every bind until `release` is set; counts how many were in flight at once."""

    def __init__(self, fail: set[str] | None = None) -> None:
        self.release = threading.Event()
        self.fail = fail or set()
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most_at_once = 0
        self.calls: list[tuple[str, str, str]] = []  # (uid, node, assignment)

    def bind(self, namespace: str, name: str, uid: str, node: str, assignment: str) -> None:
        with self.lock:
            self.in_flight += 1
            self.most_at_once = max(self.most_at_once, self.in_flight)
            self.calls.append((uid, node, assignment))
        try:
            assert self.release.wait(10)
            if uid in self.fail:
                raise BindError("binding: HTTP 500: injected")
        finally:
            with self.lock:
                self.in_flight -= 1

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return None


def service(binder: GateBinder, pods: list[PodInfo], cards: int = 2) -> ExtenderService:
    svc = ExtenderService(DOMAIN, Policy.BINPACK, binder)
    svc.nodes_listed({"n": (inventory(cards), "")})
    svc.pods_listed(pods)
    svc.synced("nodes", True)
    svc.synced("pods", True)
    return svc


def bind_all(
    svc: ExtenderService, pods: list[PodInfo]
) -> tuple[dict[str, str], list[threading.Thread]]:
    answers: dict[str, str] = {}

    def one(p: PodInfo) -> None:
        answers[p.uid] = svc.bind(BindRequest(p.namespace, p.name, p.uid, "n"))

    threads = [threading.Thread(target=one, args=(p,)) for p in pods]
    for t in threads:
        t.start()
    return answers, threads


def join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(15)
        assert not t.is_alive()


def per_card(binder: GateBinder, ok: set[str], pods: dict[str, PodInfo]) -> Counter[str]:
    """Core percent per card over the successful binds' assignments."""
    used: Counter[str] = Counter()
    for uid, _, assignment in binder.calls:
        if uid not in ok:
            continue
        containers = json.loads(assignment)["containers"]
        for spec in pods[uid].specs:
            for card in containers[spec.container]:
                used[card] += spec.request.core_percent
    return used


@pytest.mark.timeout(30)
def test_binds_to_one_node_run_at_once_and_share_no_room() -> None:
    pods = [pod((40, 20)) for _ in range(8)]  # two cards hold four 40% pods
    binder = GateBinder()
    svc = service(binder, pods)
    answers, threads = bind_all(svc, pods)
    # Four binds fit: all four reach the API at once (no lock across the call),
    # the other four are refused from memory while those are still in flight.
    deadline = threading.Event()
    for _ in range(200):
        if binder.in_flight == 4 and len(answers) == 4:
            break
        deadline.wait(0.02)
    assert binder.in_flight == 4, (binder.in_flight, answers)
    assert all("no longer fits on node n" in e for e in answers.values()), answers
    binder.release.set()
    join(threads)
    ok = {u for u, e in answers.items() if not e}
    assert len(ok) == 4 and binder.most_at_once == 4
    used = per_card(binder, ok, {p.uid: p for p in pods})
    assert all(v <= 100 for v in used.values()), used


@pytest.mark.timeout(30)
def test_a_failed_bind_releases_its_assumption() -> None:
    first, second = pod((60, 20)), pod((60, 20))
    binder = GateBinder(fail={first.uid})
    svc = service(binder, [first, second], cards=1)
    binder.release.set()
    error = svc.bind(BindRequest(first.namespace, first.name, first.uid, "n"))
    assert "injected" in error and "binding pod" in error
    assert svc.counts()["assumed"] == 0
    # The room it held is free again for the next pod.
    assert svc.bind(BindRequest(second.namespace, second.name, second.uid, "n")) == ""
    assert svc.counts()["assumed"] == 1


class UnsureBinder(GateBinder):
    """Every Binding is sent, and no answer comes back in time."""

    def bind(self, namespace: str, name: str, uid: str, node: str, assignment: str) -> None:
        self.calls.append((uid, node, assignment))
        raise BindError("binding: timed out; the scheduler retries the pod", maybe_landed=True)


def test_a_bind_that_may_still_land_keeps_its_room_until_the_cache_shows_the_pod() -> None:
    """Seen on the real kube-scheduler under load: binds timed out, their room was
    given to other pods, then the Bindings landed with their assignments, and
    cards were overcommitted. A Binding sent and not answered keeps its room."""
    now = [100.0]
    first, second = pod((60, 20)), pod((60, 20))
    binder = UnsureBinder()
    svc = ExtenderService(DOMAIN, Policy.BINPACK, binder, clock=lambda: now[0])
    svc.nodes_listed({"n": (inventory(1), "")})
    svc.pods_listed([first, second])
    svc.synced("nodes", True)
    svc.synced("pods", True)
    error = svc.bind(BindRequest(first.namespace, first.name, first.uid, "n"))
    assert "timed out" in error
    assert svc.counts()["assumed"] == 1  # the room stays held
    # The other pod cannot have that card meanwhile; the same pod is not placed anew.
    assert "no longer fits" in svc.bind(BindRequest(second.namespace, second.name, second.uid, "n"))
    held = svc.filter(request(first), ["n"])
    assert isinstance(held, str) and "may still land" in held
    assert "may still land" in svc.bind(BindRequest(first.namespace, first.name, first.uid, "n"))
    # The Binding did land: the watch shows the pod bound with its assignment.
    _, _, text = binder.calls[0]
    assignment = parse_assignment(text)
    echo = replace(first, node="n", assignment=assignment)
    echo = replace(
        echo,
        specs=tuple(replace(c, assigned=assignment.containers[c.container]) for c in echo.specs),
    )
    svc.pod_changed(echo)
    assert svc.counts()["assumed"] == 0 and not isinstance(svc.filter(request(first), ["n"]), str)
    # One that never lands is given back after UNSURE_HOLD_S.
    third = pod((60, 20))
    svc.pod_deleted(first.uid)
    svc.pod_changed(third)
    assert "timed out" in svc.bind(BindRequest(third.namespace, third.name, third.uid, "n"))
    assert "no longer fits" in svc.bind(BindRequest(second.namespace, second.name, second.uid, "n"))
    now[0] += UNSURE_HOLD_S + 1
    assert svc.counts()["assumed"] == 0
    binder.calls.clear()
    assert "timed out" in svc.bind(BindRequest(second.namespace, second.name, second.uid, "n"))
    assert binder.calls and binder.calls[0][0] == second.uid  # its room was free again


def request(p: PodInfo) -> PodRequest:
    return PodRequest(p.uid, p.namespace, p.name, p.specs)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.sampled_from([10, 25, 40, 60, 100]), st.booleans()), min_size=1, max_size=10
    )
)
def test_concurrent_binds_never_overcommit_a_card(
    shapes: list[tuple[int, bool]],
) -> None:
    pods = [pod((core, 8)) for core, _ in shapes]
    fail = {p.uid for p, (_, bad) in zip(pods, shapes, strict=True) if bad}
    binder = GateBinder(fail=fail)
    svc = service(binder, pods)
    binder.release.set()
    answers, threads = bind_all(svc, pods)
    join(threads)
    ok = {u for u, e in answers.items() if not e}
    assert not ok & fail
    used = per_card(binder, ok, {p.uid: p for p in pods})
    assert all(v <= 100 for v in used.values()), used
    # Exactly the successful binds are still assumed (until the cache sees them bound).
    assert svc.counts()["assumed"] == len(ok)
