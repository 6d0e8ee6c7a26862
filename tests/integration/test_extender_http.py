"""`vgpu extender` as a subprocess, over real HTTP, against the fake API server
(through the official kubernetes client): the wire format kube-scheduler
speaks, both nodeCacheCapable forms, bind, bad input, and an API outage."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vgpu.core.annotations import format_inventory
from vgpu.core.model import Card, CardUuid, Policy
from vgpu.sim.apiserver import FakeApiServer, make_node, make_pod
from vgpu.sim.cluster import extender_command, free_port
from vgpu.sim.harness import wait_until

pytestmark = pytest.mark.timeout(60)

CORE, MEM = "vendor.io/vcuda-core", "vendor.io/vcuda-memory"
RESULT_KEYS = {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}


def _cards(prefix: str, n: int) -> list[Card]:
    return [
        Card(
            CardUuid(f"GPU-{prefix}{i:04d}-0000-4000-8000-000000000000"),
            i,
            "NVIDIA H200",
            143771,
            i,
            numa_node=0,
        )
        for i in range(n)
    ]


def _inventory(cards: list[Card]) -> dict[str, str]:
    return {"vendor.io/vgpu-node": format_inventory(cards, 256, Policy.BINPACK)}


def _pod(name: str, core: int, mem: int, **kw: Any) -> dict[str, Any]:
    limits = {k: str(v) for k, v in ((CORE, core), (MEM, mem)) if v}
    return make_pod(name, containers=[{"name": "main", "resources": {"limits": limits}}], **kw)


class Extender:
    def __init__(self, api: FakeApiServer, root: Path, *extra: str) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        kubeconfig = root / "kubeconfig"
        api.write_kubeconfig(kubeconfig)
        self.log = root / f"extender-{self.port}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                extender_command(
                    kubeconfig,
                    self.port,
                    "--metrics-address",
                    f"127.0.0.1:{self.metrics_port}",
                    "--bind-timeout-s",
                    "1",
                    *extra,
                ),
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        port: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", port or self.port, timeout=10)
        try:
            conn.request(
                method, path, body, {"Content-Type": "application/json", **(headers or {})}
            )
            reply = conn.getresponse()
            return reply.status, reply.read()
        finally:
            conn.close()

    def post(self, verb: str, args: Any) -> Any:
        status, data = self.request("POST", f"/{verb}", json.dumps(args).encode())
        assert status == 200, data
        return json.loads(data)

    def ready(self) -> bool:
        try:
            return self.request("GET", "/readyz")[0] == 200
        except OSError:
            return False

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(10)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer(bookmark_interval_s=60.0)
    server.start()
    free, full = _cards("free", 2), _cards("full", 1)
    server.add_node(make_node("n-free", annotations=_inventory(free)))
    server.add_node(make_node("n-full", annotations=_inventory(full)))
    server.add_node(make_node("n-cpu"))
    placements = json.dumps({"main": {"cards": [full[0].uuid], "core": 80, "memory_mib": 1024}})
    server.add_pod(
        _pod(
            "busy",
            80,
            4,
            node="n-full",
            phase="Running",
            annotations={"vendor.io/vgpu-placements": placements},
        )
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def ext(api: FakeApiServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Extender]:
    extender = Extender(api, tmp_path_factory.mktemp("ext"))
    try:
        assert wait_until(extender.ready, 20), extender.text()
        yield extender
    finally:
        rc = extender.stop()
        text = extender.text()
        assert rc == 0, text
        assert "Traceback" not in text, text


def _bind(pod: dict[str, Any], node: str) -> dict[str, str]:
    meta = pod["metadata"]
    return {
        "PodName": meta["name"],
        "PodNamespace": meta["namespace"],
        "PodUID": meta["uid"],
        "Node": node,
    }


def _args(pod: dict[str, Any], names: list[str] | None = None, nodes: Any = None) -> dict[str, Any]:
    return {"Pod": pod, "NodeNames": names, "Nodes": nodes}


def test_filter_with_node_names_answers_with_the_go_field_names(ext: Extender) -> None:
    pod = _pod("p", 30, 40, node=None)
    pod["metadata"]["uid"] = "uid-p"
    result = ext.post("filter", _args(pod, ["n-free", "n-full", "n-cpu"]))
    assert set(result) == RESULT_KEYS
    assert result["NodeNames"] == ["n-free"] and result["Nodes"] is None and result["Error"] == ""
    # A node picked: the others are left out, without reasons (kube-scheduler
    # reads the reasons only when no node passes).
    assert result["FailedNodes"] == {} and result["FailedAndUnresolvableNodes"] == {}
    # No node fits: every node's reason.
    result = ext.post("filter", _args(pod, ["n-full", "n-cpu"]))
    assert set(result) == RESULT_KEYS and result["NodeNames"] == [] and result["Error"] == ""
    assert result["FailedNodes"]["n-full"].startswith("vgpu: no card fits vendor.io/vcuda-core=30")
    assert "has 20 core" in result["FailedNodes"]["n-full"]
    assert "no vendor.io/vgpu-node annotation" in result["FailedAndUnresolvableNodes"]["n-cpu"]


def test_filter_with_full_node_objects_returns_the_passing_objects(
    ext: Extender, api: FakeApiServer
) -> None:
    pod = _pod("p", 30, 40, node=None)
    pod["metadata"]["uid"] = "uid-p"
    nodes = {"metadata": {}, "items": api.nodes()}
    result = ext.post("filter", _args(pod, None, nodes))
    assert result["NodeNames"] is None
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["n-free"]
    assert result["Nodes"]["items"][0] == api.get_node("n-free")


def test_prioritize_answers_a_host_priority_list(ext: Extender) -> None:
    pod = _pod("p", 10, 10, node=None)
    pod["metadata"]["uid"] = "uid-p"
    result = ext.post("prioritize", _args(pod, ["n-free", "n-full"]))
    assert [sorted(entry) for entry in result] == [["Host", "Score"], ["Host", "Score"]]
    scores = {e["Host"]: e["Score"] for e in result}
    assert scores["n-full"] > scores["n-free"]  # binpack: the fuller node
    assert all(0 <= s <= 10 for s in scores.values())


@pytest.mark.parametrize(
    ("verb", "body", "message"),
    [
        ("filter", b"{not json", "not JSON"),
        ("filter", b"[]", "must be a JSON object"),
        ("filter", b'{"NodeNames": ["n"]}', "ExtenderArgs.Pod must be a Pod object"),
        (
            "filter",
            b'{"Pod": {"metadata": {"name": "p", "namespace": "d"}, "spec": {}}, "NodeNames": []}',
            "metadata.uid",
        ),
        (
            "filter",
            b'{"Pod": {"metadata": {"name": "p", "namespace": "d", "uid": "u"},'
            b' "spec": {"containers": 5}}, "NodeNames": []}',
            "spec.containers",
        ),
        (
            "prioritize",
            b'{"Pod": {"metadata": {"name": "p", "namespace": "d", "uid": "u"},'
            b' "spec": {}}, "NodeNames": "n1"}',
            "NodeNames must be a list",
        ),
        (
            "filter",
            b'{"Pod": {"metadata": {"name": "p", "namespace": "d", "uid": "u"}, "spec": {}}}',
            "needs NodeNames",
        ),
        (
            "bind",
            b'{"PodName": "p", "PodNamespace": "d", "PodUID": "u"}',
            "ExtenderBindingArgs.Node",
        ),
    ],
    ids=["not-json", "array", "no-pod", "no-uid", "containers", "names", "no-nodes", "bind-node"],
)
def test_malformed_requests_get_400_with_a_message(
    ext: Extender, verb: str, body: bytes, message: str
) -> None:
    status, data = ext.request("POST", f"/{verb}", body)
    assert status == 400 and message in data.decode()
    assert ext.request("GET", "/healthz") == (200, b"ok\n")  # still serving


def test_unknown_paths_and_missing_length(ext: Extender) -> None:
    assert ext.request("POST", "/preempt", b"{}")[0] == 404
    assert ext.request("GET", "/nothing")[0] == 404
    with socket.create_connection(("127.0.0.1", ext.port), timeout=5) as sock:
        sock.sendall(
            b"POST /filter HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        )
        assert sock.recv(100).startswith(b"HTTP/1.1 411")
    status, data = ext.request("GET", "/metrics", port=ext.metrics_port)
    assert status == 200 and b'vgpu_extender_requests_total{outcome="bad_request"' in data


def _exchange(port: int, raw: bytes) -> bytes:
    """Send raw bytes, read until the server closes the connection (or 5 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(raw)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass  # a server closing with unread input resets: what came before counts
        return out


@pytest.mark.parametrize(
    ("raw", "status", "message"),
    [
        pytest.param(b"GARBAGE\r\n\r\n", b"400", b"bad request line", id="no-version"),
        pytest.param(b"GET /healthz HTTP/2.0\r\n\r\n", b"400", b"bad request line", id="http2"),
        pytest.param(
            b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", b"414", b"too long", id="long-line"
        ),
        pytest.param(
            b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n",
            b"431",
            b"too long",
            id="long-header",
        ),
        pytest.param(
            b"GET /healthz HTTP/1.1\r\n" + b"X-A: 1\r\n" * 101 + b"\r\n",
            b"431",
            b"more than 100 headers",
            id="many-headers",
        ),
        pytest.param(
            b"GET /healthz HTTP/1.1\r\nno colon here\r\n\r\n", b"400", b"malformed", id="no-colon"
        ),
        pytest.param(
            b"GET /healthz HTTP/1.1\r\nHost : x\r\n\r\n", b"400", b"malformed", id="space-name"
        ),
        pytest.param(
            b"POST /bind HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
            b"400",
            b"conflicting Content-Length",
            id="two-lengths",
        ),
        pytest.param(
            b"DELETE /filter HTTP/1.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            b"501",
            b"not supported",
            id="method",
        ),
    ],
)
def test_malformed_http_gets_a_clear_status_and_a_closed_connection(
    ext: Extender, raw: bytes, status: bytes, message: bytes
) -> None:
    answer = _exchange(ext.port, raw)
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:200]
    assert message in answer and b"\r\nDate: " in answer
    assert ext.request("GET", "/healthz") == (200, b"ok\n")  # still serving


def test_kept_alive_connection_serves_many_requests_each_in_one_answer(ext: Extender) -> None:
    healthz = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    last = b"GET /healthz HTTP/1.1\r\nhost: x\r\nCONNECTION: Close\r\n\r\n"
    answer = _exchange(ext.port, healthz * 3 + last)
    assert answer.count(b"HTTP/1.1 200 OK\r\n") == 4, answer
    assert answer.count(b"Connection: close") == 1 and answer.endswith(b"ok\n")
    # HTTP/1.0 without keep-alive: one answer, then the server closes.
    answer = _exchange(ext.port, b"GET /healthz HTTP/1.0\r\n\r\n" + healthz)
    assert answer.count(b"HTTP/1.1 200") == 1 and b"Connection: close" in answer
    # A client that waits for 100 Continue (curl with a large body) gets it.
    body = json.dumps({"PodName": "x"}).encode()
    answer = _exchange(
        ext.port,
        b"POST /bind HTTP/1.1\r\nExpect: 100-continue\r\nConnection: close\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body,
    )
    assert answer.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 400"), answer


def test_bind_is_one_binding_carrying_the_assignment(ext: Extender, api: FakeApiServer) -> None:
    pod = api.add_pod(_pod("to-bind", 30, 40, node=None))
    uid = pod["metadata"]["uid"]
    args = {"PodName": "to-bind", "PodNamespace": "default", "PodUID": uid, "Node": "n-free"}
    seen = len(api.requests())
    assert ext.post("bind", args) == {"Error": ""}
    writes = [(m, p) for m, p in api.requests()[seen:] if m != "GET"]
    assert writes == [("POST", "/api/v1/namespaces/default/pods/to-bind/binding")]
    stored = api.get_pod("default", "to-bind")
    assert stored is not None and stored["spec"]["nodeName"] == "n-free"
    assignment = json.loads(stored["metadata"]["annotations"]["vendor.io/vgpu-assignment"])
    assert assignment == {"node": "n-free", "containers": {"main": [_cards("free", 1)[0].uuid]}}
    again = ext.post("bind", args)["Error"]
    assert "already bound to node n-free" in again or "already assigned" in again


def test_a_bind_that_no_longer_fits_is_refused_and_writes_nothing(
    ext: Extender, api: FakeApiServer
) -> None:
    pod = api.add_pod(_pod("too-big", 30, 40, node=None))
    args = _bind(pod, "n-full")
    error = ext.post("bind", args)["Error"]
    assert "no longer fits on node n-full" in error
    stored = api.get_pod("default", "too-big") or {}
    assert "nodeName" not in stored["spec"] and not stored["metadata"].get("annotations")


def test_api_outage_answers_from_the_cache_and_fails_binds_clearly(
    ext: Extender, api: FakeApiServer
) -> None:
    pod = api.add_pod(_pod("in-outage", 30, 10, node=None))
    assert wait_until(lambda: ext.post("filter", _args(pod, ["n-free"]))["NodeNames"], 5)
    api.set_down(True)
    try:
        assert ext.post("filter", _args(pod, ["n-free", "n-full"]))["NodeNames"] == ["n-free"]
        args = _bind(pod, "n-free")
        error = ext.post("bind", args)["Error"]
        # The bind fails at its write, or (when the pod watch had not brought
        # the pod before the outage) at the read of the pod before it.
        assert ("failed" in error or "cannot bind" in error) and "HTTP 503" in error, error
    finally:
        api.set_down(False)
    # The failed bind holds nothing: the same room is offered again.
    assert ext.post("bind", args) == {"Error": ""}


def test_before_the_first_sync_filter_answers_an_error(tmp_path: Path) -> None:
    server = FakeApiServer()
    server.start()
    server.set_down(True)
    extender = Extender(server, tmp_path)
    try:
        assert wait_until(
            lambda: (
                extender.request("GET", "/healthz")[0] == 200
                if _listening(extender.port)
                else False
            ),
            20,
        )
        pod = _pod("p", 10, 10, node=None)
        pod["metadata"]["uid"] = "u"
        result = extender.post("filter", _args(pod, ["n"]))
        assert result["NodeNames"] is None and "not synced" in result["Error"]
        server.set_down(False)
        assert wait_until(extender.ready, 20)
    finally:
        assert extender.stop() == 0
        server.stop()


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_a_slow_api_server_fails_the_bind_at_its_timeout(ext: Extender, api: FakeApiServer) -> None:
    pod = api.add_pod(_pod("slow", 10, 10, node=None))
    assert wait_until(lambda: ext.post("filter", _args(pod, ["n-free"]))["NodeNames"], 5)
    api.set_delay(1.5)  # over the extender's --bind-timeout-s 1
    try:
        started = time.monotonic()
        assert ext.post("filter", _args(pod, ["n-free"]))["NodeNames"] == ["n-free"]
        assert time.monotonic() - started < 1.0  # answered from the cache
        args = _bind(pod, "n-free")
        error = ext.post("bind", args)["Error"]
        assert "binding pod default/slow to n-free: API server" in error, error
    finally:
        api.set_delay(0.0)

    # The timed-out Binding still lands late, as on a real server: with its
    # assignment, in one write, so the pod is never bound without it.
    def landed() -> bool:
        stored = api.get_pod("default", "slow")
        return bool(stored and (stored.get("spec") or {}).get("nodeName"))

    assert wait_until(landed, 5)
    stored = api.get_pod("default", "slow")
    assert stored and stored["spec"]["nodeName"] == "n-free"
    assert "vendor.io/vgpu-assignment" in stored["metadata"]["annotations"]
    again = ext.post("bind", args)["Error"]
    assert "already bound to node n-free" in again or "already assigned" in again, again


def test_a_pod_asking_no_vgpu_resource_passes_everywhere(ext: Extender) -> None:
    # Without managedResources kube-scheduler sends every pod: leave them alone.
    pod = make_pod("plain", node=None)
    pod["metadata"]["uid"] = "uid-plain"
    result = ext.post("filter", _args(pod, ["n-free", "n-full", "n-cpu"]))
    assert result["NodeNames"] == ["n-free", "n-full", "n-cpu"]
    assert not result["FailedNodes"] and not result["FailedAndUnresolvableNodes"]
    assert {e["Score"] for e in ext.post("prioritize", _args(pod, ["n-free", "n-cpu"]))} == {0}


def _picked(ext: Extender) -> float:
    status, data = ext.request("GET", "/metrics", port=ext.metrics_port)
    assert status == 200
    line = next(x for x in data.decode().splitlines() if x.startswith("vgpu_extender_picked_pods "))
    return float(line.split()[1])


def test_filter_answers_the_one_node_it_picks_and_holds_its_room(ext: Extender) -> None:
    # 10 % fits both vgpu nodes: binpack picks the fuller, and holds the room
    # there until the bind (kube-scheduler, seeing one node, skips prioritize).
    pod = _pod("small", 10, 10, node=None)
    pod["metadata"]["uid"] = "uid-small"
    before = _picked(ext)
    result = ext.post("filter", _args(pod, ["n-free", "n-full", "n-cpu"]))
    assert result["NodeNames"] == ["n-full"]
    # The nodes left out (n-free fits, n-cpu has no vgpu) are neither failed nor
    # unresolvable: the answer is one name, whatever the cluster's size.
    assert not result["FailedAndUnresolvableNodes"] and not result["FailedNodes"]
    assert _picked(ext) == before + 1
    # Filtered again (a new scheduling attempt): the same answer, one pick.
    assert ext.post("filter", _args(pod, ["n-free", "n-full"]))["NodeNames"] == ["n-full"]
    assert _picked(ext) == before + 1


def test_node_choice_scheduler_answers_every_node_that_fits(
    api: FakeApiServer, tmp_path: Path
) -> None:
    other = Extender(api, tmp_path, "--node-choice", "scheduler")
    try:
        assert wait_until(other.ready, 20), other.text()
        pod = _pod("small2", 10, 10, node=None)
        pod["metadata"]["uid"] = "uid-small2"
        result = other.post("filter", _args(pod, ["n-free", "n-full", "n-cpu"]))
        assert result["NodeNames"] == ["n-free", "n-full"]
        assert _picked(other) == 0
        assert "'node_choice': 'scheduler'" in other.text()
    finally:
        assert other.stop() == 0
