"""The Binding's own wire: one write on a connection of the official client's
urllib3 pool, and a bounded read of the answer (vgpu/adapters/httpwire.py).

Driven over real sockets: against the fake API server, and against a small
raw server where the test needs TLS, a bearer token, a path prefix, chunked
answers, closed connections or silence."""

from __future__ import annotations

import base64
import io
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from vgpu.adapters.certs import make_bundle
from vgpu.adapters.httpwire import WireError, read_response, request_bytes
from vgpu.adapters.kube_cluster import BIND_CONNECTIONS, BindError, KubeBinder
from vgpu.sim.apiserver import FakeApiServer, make_pod

DOMAIN = "vendor.io"
KEY = f"{DOMAIN}/vgpu-assignment"

# ------------------------------------------------------------------ the parser


def parse(raw: bytes, limit: int = 1024) -> tuple[int, dict[str, str], bytes, bool]:
    return read_response(io.BufferedReader(io.BytesIO(raw)), limit)


def test_content_length_chunked_and_close_delimited_bodies() -> None:
    status, headers, body, close = parse(
        b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    )
    assert (status, headers["content-type"], body, close) == (201, "application/json", b"{}", False)
    status, _, body, close = parse(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nX-Trailer: 1\r\n\r\n"
    )
    assert (status, body, close) == (200, b"abcde", False)
    status, _, body, close = parse(b"HTTP/1.0 500 Oops\r\n\r\nall of it")
    assert (status, body, close) == (500, b"all of it", True)
    assert parse(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")[2:] == (b"", True)


@pytest.mark.parametrize(
    ("raw", "error", "words"),
    [
        (b"", ConnectionError, "before answering"),
        (b"SMTP ready\r\n\r\n", WireError, "bad status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", WireError, "malformed header"),
        (b"HTTP/1.1 200 OK\r\nHost : x\r\n\r\n", WireError, "malformed header"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
            WireError,
            "conflicting Content-Length",
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n", ConnectionError, "mid-answer"),
        (b"HTTP/1.1 200 OK\r\n" + b"A: b\r\n" * 101 + b"\r\n", WireError, "more than 100"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5000\r\n\r\n", WireError, "longer than 1024"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", ConnectionError, "mid-answer"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", WireError, "bad Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", WireError, "chunk size"),
        (b"HTTP/1.1 200 OK\r\n" + b"X: " + b"y" * 70000 + b"\r\n\r\n", WireError, "longer than"),
    ],
)
def test_malformed_or_oversized_answers_are_named(
    raw: bytes, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        parse(raw)


def test_a_request_is_one_buffer_and_refuses_header_injection() -> None:
    out = request_bytes("POST", "/x", "h:1", {"A": "b"}, b"{}")
    assert out == b"POST /x HTTP/1.1\r\nHost: h:1\r\nA: b\r\nContent-Length: 2\r\n\r\n{}"
    with pytest.raises(ValueError, match="line break"):
        request_bytes("POST", "/x", "h", {"A": "b\r\nEvil: 1"}, b"")


# --------------------------------------------------- against the fake API server


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[FakeApiServer, Path]]:
    server = FakeApiServer()
    server.start()
    kubeconfig = tmp_path / "kubeconfig"
    server.write_kubeconfig(kubeconfig)
    try:
        yield server, kubeconfig
    finally:
        server.stop()


def test_binds_on_kept_alive_connections_carry_the_assignment(
    api: tuple[FakeApiServer, Path],
) -> None:
    server, kubeconfig = api
    uids = [server.add_pod(make_pod(f"p{i}", node=None))["metadata"]["uid"] for i in range(5)]
    binder = KubeBinder(kubeconfig, DOMAIN, 5.0)
    for i, uid in enumerate(uids):
        binder.bind("default", f"p{i}", uid, "n1", f'{{"node":"n1","i":{i}}}')
    pods = {p["metadata"]["name"]: p for p in server.pods()}
    for i in range(5):
        assert pods[f"p{i}"]["spec"]["nodeName"] == "n1"
        assert json.loads(pods[f"p{i}"]["metadata"]["annotations"][KEY])["i"] == i
    target = binder._pool_target
    pool = target.pool if target is not None else None
    assert pool is not None and pool.num_connections == 1  # one connection, reused


def test_a_burst_of_concurrent_binds_keeps_its_connections(
    api: tuple[FakeApiServer, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """32 binds at once (kube-scheduler runs binding cycles concurrently): each
    connection goes back to the pool for the next bind, none is discarded (at
    the client's default of 5 per CPU, urllib3 dropped and logged the rest)."""
    server, kubeconfig = api
    server.set_delay(0.02)  # so that the binds overlap
    uids = [server.add_pod(make_pod(f"p{i}", node=None))["metadata"]["uid"] for i in range(32)]
    binder = KubeBinder(kubeconfig, DOMAIN, 5.0)
    threads = [
        threading.Thread(target=binder.bind, args=("default", f"p{i}", uid, "n1", "{}"))
        for i, uid in enumerate(uids)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(p["spec"].get("nodeName") == "n1" for p in server.pods())
    assert not [r for r in caplog.records if "pool is full" in r.getMessage()]
    target = binder._pool_target
    pool = target.pool if target is not None else None
    kept = [c for c in list(pool.pool.queue) if c is not None] if pool is not None else []
    assert pool is not None and len(kept) == pool.num_connections  # every one came back


def test_binds_beyond_the_pools_size_wait_for_a_connection(
    api: tuple[FakeApiServer, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """More binds at once than connections kept (the real kube-scheduler had 287
    in flight): the rest wait for a connection instead of opening (and shaking
    hands on) one each that is then discarded."""
    server, kubeconfig = api
    server.set_delay(0.02)
    # Fewer connections than the default 64, so that a loaded test box's accept
    # backlog is not what is tested; the default is checked below.
    assert KubeBinder(kubeconfig, DOMAIN, 5.0).connections == BIND_CONNECTIONS
    connections, count = 8, 40
    uids = [server.add_pod(make_pod(f"w{i}", node=None))["metadata"]["uid"] for i in range(count)]
    binder = KubeBinder(kubeconfig, DOMAIN, 5.0, connections=connections)
    threads = [
        threading.Thread(target=binder.bind, args=("default", f"w{i}", uid, "n1", "{}"))
        for i, uid in enumerate(uids)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(1 for p in server.pods() if p["spec"].get("nodeName") == "n1") == count
    assert not [r for r in caplog.records if "pool is full" in r.getMessage()]
    target = binder._pool_target
    assert target is not None and target.pool.num_connections <= connections


def test_api_errors_name_the_status_and_the_servers_message(
    api: tuple[FakeApiServer, Path],
) -> None:
    server, kubeconfig = api
    uid = server.add_pod(make_pod("p", node=None))["metadata"]["uid"]
    binder = KubeBinder(kubeconfig, DOMAIN, 5.0)
    with pytest.raises(BindError, match=r"binding pod default/gone to n1: HTTP 404: .*gone"):
        binder.bind("default", "gone", "x", "n1", "{}")
    binder.bind("default", "p", uid, "n1", "{}")
    with pytest.raises(BindError, match=r"HTTP 409: .*already"):
        binder.bind("default", "p", uid, "n2", "{}")
    server.set_down(True)
    with pytest.raises(BindError, match="HTTP 503") as refused:
        binder.bind("default", "p", uid, "n2", "{}")
    assert not refused.value.maybe_landed  # unavailable: not taken


def test_a_bind_says_whether_its_binding_may_still_land(tmp_path: Path) -> None:
    """Sent and unanswered (a timeout, a connection closed before the answer)
    may land later; an answer of 4xx, or a server never reached, did not."""
    with RawServer(created) as server:
        server.silent = True
        with pytest.raises(BindError) as timed_out:
            binder_for(tmp_path, server, timeout_s=0.5).bind("default", "p", "u", "n1", "{}")
    assert timed_out.value.maybe_landed
    with RawServer(lambda *_: None) as server, pytest.raises(BindError) as hung_up:
        binder_for(tmp_path, server).bind("default", "p", "u", "n1", "{}")
    assert hung_up.value.maybe_landed
    conflict = b'{"kind":"Status","code":409,"message":"already assigned"}'
    answer = (
        b"HTTP/1.1 409 Conflict\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(conflict)}\r\n\r\n".encode()
        + conflict
    )
    with RawServer(lambda *_: answer) as server, pytest.raises(BindError) as refused:
        binder_for(tmp_path, server).bind("default", "p", "u", "n1", "{}")
    assert not refused.value.maybe_landed
    late = b'{"kind":"Status","code":504,"message":"Timeout: request did not complete"}'
    answer = (
        b"HTTP/1.1 504 Gateway Timeout\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(late)}\r\n\r\n".encode()
        + late
    )
    with RawServer(lambda *_: answer) as server, pytest.raises(BindError) as timed_out:
        binder_for(tmp_path, server).bind("default", "p", "u", "n1", "{}")
    assert timed_out.value.maybe_landed  # the API server may go on with the write
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens: never sent
    kubeconfig = kubeconfig_for(tmp_path / "kc2", f"http://127.0.0.1:{port}")
    with pytest.raises(BindError) as unreachable:
        KubeBinder(kubeconfig, DOMAIN, 1.0).bind("default", "p", "u", "n1", "{}")
    assert not unreachable.value.maybe_landed


# ------------------------------------------------------------ a raw server


Handler = Callable[[str, str, dict[str, str], bytes], bytes | None]  # None: hang up


class RawServer:
    """HTTP/1.1 on a thread; `answer` builds each response; optionally TLS, and
    optionally closing every connection after one answer (without saying so)."""

    def __init__(self, answer: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.answer = answer
        self.tls = tls
        self.close_after_each = False
        self.silent = False
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            reader = conn.makefile("rb")
            while True:
                line = reader.readline()
                if not line:
                    return
                method, target, _ = line.decode().split(" ", 2)
                headers: dict[str, str] = {}
                while (raw := reader.readline()) not in (b"\r\n", b""):
                    name, _, value = raw.decode().partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = reader.read(int(headers.get("content-length", "0")))
                self.requests.append((method, target, headers, body))
                if self.silent:
                    time.sleep(10)
                    return
                out = self.answer(method, target, headers, body)
                if out is None:
                    return  # hang up without an answer
                conn.sendall(out)
                if self.close_after_each:
                    return
        except (OSError, ValueError):
            return
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def binder_for(tmp_path: Path, server: RawServer, timeout_s: float = 5.0) -> KubeBinder:
    """A binder for `server` over plain HTTP, no credentials."""
    kubeconfig = kubeconfig_for(tmp_path / "kc", f"http://127.0.0.1:{server.port}")
    return KubeBinder(kubeconfig, DOMAIN, timeout_s)


def created(*_: object) -> bytes:
    status = b'{"kind":"Status","apiVersion":"v1","status":"Success","code":201}'
    return (
        b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
        + f"{len(status):x}\r\n".encode()
        + status
        + b"\r\n0\r\n\r\n"
    )


def kubeconfig_for(path: Path, server: str, token: str = "", ca: bytes = b"") -> Path:
    cluster: dict[str, Any] = {"server": server}
    if ca:
        cluster["certificate-authority-data"] = base64.b64encode(ca).decode()
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "u", "user": {"token": token} if token else {}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


def test_tls_token_path_prefix_and_one_write_per_binding(tmp_path: Path) -> None:
    bundle = make_bundle(["127.0.0.1"], 3600, time.time())
    (tmp_path / "tls.crt").write_bytes(bundle.tls_crt)
    (tmp_path / "tls.key").write_bytes(bundle.tls_key)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    server = RawServer(created, tls)
    try:
        kubeconfig = kubeconfig_for(
            tmp_path / "kc",
            f"https://127.0.0.1:{server.port}/k8s/clusters/c-1",
            token="s3cret",
            ca=bundle.ca_crt,
        )
        binder = KubeBinder(kubeconfig, DOMAIN, 5.0)
        binder.bind("team-a", "p", "uid-1", "n1", '{"node":"n1"}')
        binder.bind("team-a", "q", "uid-2", "n2", '{"node":"n2"}')
    finally:
        server.close()
    assert server.connections == 1  # the TLS session is kept for the next bind
    method, target, headers, body = server.requests[0]
    assert (method, target) == ("POST", "/k8s/clusters/c-1/api/v1/namespaces/team-a/pods/p/binding")
    assert headers["authorization"] == "Bearer s3cret"
    assert headers["host"] == f"127.0.0.1:{server.port}"
    binding = json.loads(body)
    assert binding["kind"] == "Binding" and binding["target"]["name"] == "n1"
    assert binding["metadata"]["uid"] == "uid-1"
    assert binding["metadata"]["annotations"] == {KEY: '{"node":"n1"}'}


def test_the_auth_headers_are_asked_of_the_client_once_a_second_and_after_a_401(
    tmp_path: Path,
) -> None:
    refused = b'{"kind":"Status","code":401,"message":"Unauthorized"}'

    def answer(method: str, target: str, headers: dict[str, str], body: bytes) -> bytes:
        if "/pods/stale/" in target:
            return (
                b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(refused)}\r\n\r\n".encode()
                + refused
            )
        return created()

    with RawServer(answer) as server:
        kubeconfig = kubeconfig_for(
            tmp_path / "kc", f"http://127.0.0.1:{server.port}", token="s3cret"
        )
        binder = KubeBinder(kubeconfig, DOMAIN, 5.0)
        client = binder._client().api_client
        asked: list[int] = []
        update = client.update_params_for_auth

        def counted(*args: Any, **kwargs: Any) -> Any:
            asked.append(1)
            return update(*args, **kwargs)

        client.update_params_for_auth = counted
        binder.bind("default", "p", "u1", "n1", "{}")
        binder.bind("default", "q", "u2", "n1", "{}")
        assert len(asked) == 1  # within the second: the same headers
        with pytest.raises(BindError, match="HTTP 401: Unauthorized"):
            binder.bind("default", "stale", "u3", "n1", "{}")
        binder.bind("default", "r", "u4", "n1", "{}")
        assert len(asked) == 2  # a 401 makes the next bind ask again
    assert all(h["authorization"] == "Bearer s3cret" for _, _, h, _ in server.requests)


def test_a_connection_the_server_closed_is_never_reused(tmp_path: Path) -> None:
    with RawServer(created) as server:
        server.close_after_each = True
        binder = binder_for(tmp_path, server)
        for i in range(4):
            binder.bind("default", f"p{i}", f"u{i}", "n1", "{}")
    assert len(server.requests) == 4  # each bind written exactly once
    assert server.connections == 4


def test_a_silent_server_fails_the_bind_at_its_timeout(tmp_path: Path) -> None:
    with RawServer(created) as server:
        server.silent = True
        binder = binder_for(tmp_path, server, timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(BindError, match=r"binding pod default/p to n1: .*retries the pod"):
            binder.bind("default", "p", "u", "n1", "{}")
        assert time.monotonic() - started < 3.0


def test_a_malformed_answer_fails_the_bind_with_its_reason(tmp_path: Path) -> None:
    answer = b"HTTP/1.1 201 Created\r\nContent-Length: 99999999\r\n\r\n"
    with RawServer(lambda *_: answer) as server, pytest.raises(BindError, match="longer than"):
        binder_for(tmp_path, server).bind("default", "p", "u", "n1", "{}")


def pod_json(node: str, uid: str, annotations: dict[str, str]) -> bytes:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "default", "uid": uid, "annotations": annotations},
        "spec": {"nodeName": node, "containers": []},
    }
    data = json.dumps(pod).encode()
    head = (
        f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def conflict(*_: object) -> bytes:
    data = b'{"kind":"Status","code":409,"message":"pod p is already assigned to node \\"n1\\""}'
    head = f"HTTP/1.1 409 Conflict\r\nContent-Length: {len(data)}\r\n\r\n"
    return head.encode() + data


@pytest.mark.parametrize(
    ("bound_to", "annotation", "landed"),
    [("n1", '{"node":"n1"}', True), ("n2", '{"node":"n2"}', False), ("n1", "other", False)],
)
def test_a_binding_resent_after_a_lost_answer_counts_only_if_it_landed(
    tmp_path: Path, bound_to: str, annotation: str, landed: bool
) -> None:
    """The first bind opens the connection; the second, on the kept connection,
    is acted on (bound) but the server hangs up before answering: the binder
    sends it once more on a new connection, gets 409, and reads the pod: the
    bind succeeded only if the pod is bound as it asked."""
    posts: list[str] = []

    def answer(method: str, target: str, headers: dict[str, str], body: bytes) -> bytes | None:
        if method == "GET":
            return pod_json(bound_to, "u2", {KEY: annotation})
        posts.append(target)
        if len(posts) == 1:
            return created()
        return None if len(posts) == 2 else conflict()

    with RawServer(answer) as server:
        binder = binder_for(tmp_path, server)
        binder.bind("default", "first", "u1", "n1", "{}")
        if landed:
            binder.bind("default", "p", "u2", "n1", '{"node":"n1"}')
        else:
            with pytest.raises(BindError, match="HTTP 409: pod p is already assigned"):
                binder.bind("default", "p", "u2", "n1", '{"node":"n1"}')
    assert len(posts) == 3  # the first bind, then the second one twice
    assert [r[0] for r in server.requests].count("GET") == 1


def test_a_new_connection_that_ends_unanswered_is_not_resent(tmp_path: Path) -> None:
    with RawServer(lambda *_: None) as server, pytest.raises(BindError, match="before answering"):
        binder_for(tmp_path, server).bind("default", "p", "u", "n1", "{}")
    assert len(server.requests) == 1
