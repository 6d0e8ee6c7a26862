"""The extender's HTTP edge without a socket: it decodes a pod once per (uid,
resourceVersion) (kube-scheduler sends the same pod to filter, then to
prioritize; a changed pod, a pod without one, or a different pod is decoded
afresh), and its directly written HostPriorityList is the JSON json.dumps
would write. Last, over a socket: a connection's thread is kept for the next."""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from vgpu.adapters.extender_http import (
    BadRequest,
    BindRequest,
    ExtenderHttp,
    PodRequest,
    _pod,
    _PodCache,
)
from vgpu.adapters.kube_cluster import pod_info
from vgpu.core.scheduling import FilterVerdict
from vgpu.sim.harness import wait_until

CORE, MEM = "vendor.io/vcuda-core", "vendor.io/vcuda-memory"


def _args(uid: str, version: str | None, core: int, name: str = "p") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "default", "uid": uid}
    if version is not None:
        meta["resourceVersion"] = version
    limits = {CORE: str(core), MEM: "4"}
    spec = {"containers": [{"name": "main", "resources": {"limits": limits}}]}
    return {"Pod": {"metadata": meta, "spec": spec}}


def _core(args: dict[str, Any], cache: _PodCache) -> int:
    return _pod(args, "vendor.io", cache).specs[0].request.core_percent


def test_same_uid_and_version_is_decoded_once() -> None:
    cache = _PodCache()
    first = _pod(_args("u1", "7", 30), "vendor.io", cache)
    assert _pod(_args("u1", "7", 30), "vendor.io", cache) is first


@pytest.mark.parametrize(
    ("second", "core"),
    [
        pytest.param(_args("u1", "8", 60), 60, id="new-resource-version"),
        pytest.param(_args("u2", "7", 60), 60, id="other-uid"),
        pytest.param(_args("u1", None, 60), 60, id="no-resource-version"),
        pytest.param(_args("u1", "7", 60, name="q"), 60, id="other-name-same-key"),
    ],
)
def test_a_different_pod_is_decoded_afresh(second: dict[str, Any], core: int) -> None:
    cache = _PodCache()
    assert _core(_args("u1", "7", 30), cache) == 30
    assert _core(second, cache) == core


def test_the_cache_is_bounded_and_bad_input_is_still_refused() -> None:
    cache = _PodCache(size=4)
    for i in range(10):
        _pod(_args(f"u{i}", "1", 10), "vendor.io", cache)
    assert len(cache._pods) <= 4
    with pytest.raises(BadRequest, match=r"metadata\.uid"):
        _pod(_args("", "1", 10), "vendor.io", cache)


class _Scores:
    """A port that scores each node by its position."""

    def __init__(self) -> None:
        self.pods: list[PodRequest] = []

    def filter(self, pod: PodRequest, nodes: Sequence[str]) -> FilterVerdict | str:
        return FilterVerdict(list(nodes), {}, {})

    def prioritize(self, pod: PodRequest, nodes: Sequence[str]) -> list[tuple[str, int]]:
        self.pods.append(pod)
        return [(n, i % 11) for i, n in enumerate(nodes)]

    def bind(self, request: BindRequest) -> str:
        return ""

    def ready(self) -> bool:
        return True


def test_the_written_host_priority_list_is_what_json_dumps_writes() -> None:
    port = _Scores()
    edge = ExtenderHttp(port, "vendor.io", "127.0.0.1:0")
    try:
        names = ["node-a", 'we"ird\\name', "nöde-ü", "\u2603", ""]
        args = {**_args("u1", "3", 30), "NodeNames": names}
        body = edge.handle_bytes("prioritize", args)
        expected = [{"Host": n, "Score": i % 11} for i, n in enumerate(names)]
        assert body == json.dumps(expected, separators=(",", ":")).encode()
        assert json.loads(body) == expected
        edge.handle_bytes("prioritize", args)
        assert port.pods[0] is port.pods[1]  # decoded once
        with pytest.raises(BadRequest, match="NodeNames"):
            edge.handle_bytes("prioritize", {**args, "NodeNames": [1]})
    finally:
        edge.close()


def test_a_pending_pod_the_watch_decoded_is_not_decoded_again() -> None:
    port = _Scores()
    edge = ExtenderHttp(port, "vendor.io", "127.0.0.1:0")
    try:
        seen = pod_info(_args("u1", "5", 30)["Pod"], "vendor.io")
        edge.pod_seen("5", seen)
        # Same uid and resourceVersion: the same pod, taken as the watch decoded
        # it (this request's 90 would show if it were decoded again).
        edge.handle_bytes("prioritize", {**_args("u1", "5", 90), "NodeNames": ["n"]})
        assert port.pods[-1].specs == seen.specs
        assert port.pods[-1].specs[0].request.core_percent == 30
        # A bound pod, or one with an assignment, is not kept: filter decodes it.
        bound = pod_info({**_args("u2", "6", 30)["Pod"]}, "vendor.io")
        edge.pod_seen("6", replace(bound, node="n"))
        edge.handle_bytes("prioritize", {**_args("u2", "6", 90), "NodeNames": ["n"]})
        assert port.pods[-1].specs[0].request.core_percent == 90
        edge.pod_seen("", pod_info(_args("u3", "1", 30)["Pod"], "vendor.io"))  # no version
        edge.handle_bytes("prioritize", {**_args("u3", "1", 90), "NodeNames": ["n"]})
        assert port.pods[-1].specs[0].request.core_percent == 90
    finally:
        edge.close()


def _threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "extender-conn")


def _get(port: int, close: bool) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/healthz", headers={"Connection": "close"} if close else {})
        return conn.getresponse().status
    finally:
        conn.close()


def test_a_connection_thread_is_kept_for_the_next_connection() -> None:
    """kube-scheduler opens a connection for most binds of a burst (Go keeps two
    idle): the thread that served one serves the next, none is started anew."""
    edge = ExtenderHttp(_Scores(), "vendor.io", "127.0.0.1:0")
    edge.start()
    before = _threads()
    try:
        port = edge.address[1]
        for _ in range(5):
            assert _get(port, close=True) == 200
            # The thread goes back to wait once the socket is shut.
            assert wait_until(lambda: len(edge._server._idle) == 1, 5)
        assert _threads() - before == 1
        # Connections open at once get a thread each, kept after.
        held = [socket.create_connection(edge.address, timeout=5) for _ in range(3)]
        assert wait_until(lambda: _threads() - before == 3, 5)
        for sock in held:
            sock.close()
        assert wait_until(lambda: len(edge._server._idle) == 3, 5)
        assert _get(port, close=False) == 200
        assert _threads() - before == 3
    finally:
        edge.close()
    # Closed: the waiting threads end.
    assert wait_until(lambda: _threads() == before, 5)
