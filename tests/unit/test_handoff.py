"""The handover's pieces: the node lock, the request and its answer, the
kubelet connections passed along, and who counts as a successor pod."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from vgpu.adapters.handoff import (
    HandoffError,
    HandoffServer,
    NodeLock,
    Outcome,
    accepted_fds,
    close_all,
    peers_gone,
    request_handoff,
)
from vgpu.adapters.kube import successor_pod
from vgpu.sim.harness import wait_until


def test_one_owner_at_a_time(short_tmp: Path) -> None:
    first, second = NodeLock(short_tmp), NodeLock(short_tmp)
    assert first.try_acquire()
    assert not second.try_acquire()
    first.release()
    assert second.try_acquire()
    second.release()


def test_waiting_for_the_lock_ends_with_stop(short_tmp: Path) -> None:
    owner, waiter = NodeLock(short_tmp), NodeLock(short_tmp)
    assert owner.try_acquire()
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    assert not waiter.acquire(stop, lambda waited_s: None)
    owner.release()
    assert waiter.acquire(threading.Event(), lambda waited_s: None)
    waiter.release()


class Owner:
    """A HandoffServer whose hand_off passes one end of a socket pair along."""

    def __init__(self, state_dir: Path, refuse: str | None = None) -> None:
        self.refuse = refuse
        self.asked: list[list[str]] = []
        self.handed: list[list[str]] = []
        self.kept, self.passed = socket.socketpair()
        self.server = HandoffServer(state_dir, self.hand_off, self.handed.append)

    def hand_off(self, names: list[str]) -> Outcome:
        self.asked.append(names)
        if self.refuse:
            return self.refuse, []
        return None, [os.dup(self.passed.fileno())]


def test_a_handover_passes_the_connections_along(short_tmp: Path) -> None:
    owner = Owner(short_tmp)
    owner.server.start()
    names = ["vgpu-vcuda-core.2.sock", "vgpu-vcuda-memory.2.sock"]
    fds = request_handoff(short_tmp, names, 5.0)
    assert owner.asked == [names]
    # handed() runs once the answer is sent, on the server's thread.
    assert wait_until(lambda: owner.handed == [names], 5.0)
    assert owner.server.done.is_set()
    assert len(fds) == 1
    # The descriptor received is the same connection: the peer sees it open,
    # and its close once every copy is closed.
    owner.passed.close()
    assert peers_gone(fds) == []
    owner.kept.close()
    assert peers_gone(fds) == fds
    close_all(fds)
    owner.server.close()
    # A done handover leaves the socket path to the successor.
    assert (short_tmp / "handoff.sock").exists()


def test_a_refusal_names_the_reason(short_tmp: Path) -> None:
    owner = Owner(short_tmp, refuse="the daemon is stopping")
    owner.server.start()
    with pytest.raises(HandoffError, match="the daemon is stopping"):
        request_handoff(short_tmp, ["a.sock", "b.sock"], 5.0)
    assert not owner.server.done.is_set()
    owner.server.close()
    assert not (short_tmp / "handoff.sock").exists()


@pytest.mark.parametrize("names", [["../kubelet.sock", "b.sock"], ["a.txt", "b.sock"], []])
def test_a_request_with_bad_names_is_refused_untouched(short_tmp: Path, names: list[str]) -> None:
    owner = Owner(short_tmp)
    owner.server.start()
    with pytest.raises(HandoffError, match="socket names"):
        request_handoff(short_tmp, names, 5.0)
    assert owner.asked == []
    owner.server.close()


def test_no_owner_listening_is_a_handoff_error(short_tmp: Path) -> None:
    with pytest.raises(HandoffError, match="cannot ask the running daemon"):
        request_handoff(short_tmp, ["a.sock", "b.sock"], 1.0)


def test_accepted_connections_leave_the_listener_out(short_tmp: Path) -> None:
    path = short_tmp / "x.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    assert accepted_fds([path]) == []
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(str(path))
    conn, _ = listener.accept()
    assert accepted_fds([path]) == [conn.fileno()]
    for s in (conn, client, listener):
        s.close()


def pod(name: str, created: str, owner: str | None = "ds-1", **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "vgpu-system", "creationTimestamp": created}
    if owner:
        meta["ownerReferences"] = [{"uid": owner, "controller": True, "kind": "DaemonSet"}]
    meta.update(extra.pop("meta", {}))
    return {"metadata": meta, "status": {"phase": extra.get("phase", "Running")}}


OLD = pod("vgpu-a", "2026-12-04T10:00:00Z")


@pytest.mark.parametrize(
    ("other", "expected"),
    [
        (pod("vgpu-b", "2026-12-04T10:05:00Z"), "vgpu-b"),
        (pod("vgpu-b", "2026-12-04T10:00:00Z"), "vgpu-b"),  # the same second counts
        (pod("vgpu-b", "2026-12-04T09:55:00Z"), None),  # older: not a successor
        (pod("vgpu-b", "2026-12-04T10:05:00Z", owner="ds-2"), None),  # another DaemonSet
        (pod("vgpu-b", "2026-12-04T10:05:00Z", owner=None), None),
        (pod("vgpu-b", "2026-12-04T10:05:00Z", phase="Failed"), None),
        (pod("vgpu-b", "2026-12-04T10:05:00Z", meta={"deletionTimestamp": "x"}), None),
        (pod("vgpu-b", "2026-12-04T10:05:00Z", meta={"namespace": "other"}), None),
    ],
)
def test_a_successor_is_a_newer_live_pod_of_the_same_controller(
    other: dict[str, Any], expected: str | None
) -> None:
    assert successor_pod([OLD, other], "vgpu-system", "vgpu-a") == expected


def test_no_successor_without_the_own_pod_or_its_controller() -> None:
    newer = pod("vgpu-b", "2026-12-04T10:05:00Z")
    assert successor_pod([newer], "vgpu-system", "vgpu-a") is None
    orphan = pod("vgpu-a", "2026-12-04T10:00:00Z", owner=None)
    assert successor_pod([orphan, newer], "vgpu-system", "vgpu-a") is None
