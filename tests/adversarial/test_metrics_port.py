"""Issue 13, item 5: no client of the metrics port can affect admissions.

~1,000 half-sent requests once took every file descriptor of the daemon
(a thread and a descriptor each, no timeout): Allocate failed with INTERNAL
and /healthz timed out. The server is now bounded; tenant names stay off the
unauthenticated endpoint by default.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import NodeFactory
from tests.integration.conftest_placement import CORE, MEM, assert_admitted_ok, status
from vgpu.sim.faults import open_file_limit
from vgpu.sim.harness import SimNode, wait_until

HALF_OPEN = 1000
DAEMON_FILE_LIMIT = 512  # a common container limit is 1024; tighter here


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metrics_node(make_node: NodeFactory, *extra: str) -> tuple[SimNode, str]:
    port = free_port()
    node = make_node(
        "preset:1xH200", daemon_args=("--metrics-address", f"127.0.0.1:{port}", *extra)
    )
    return node, f"http://127.0.0.1:{port}"


def samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    body = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    return [
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(body)
        for s in family.samples
    ]


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.timeout(90)
def test_a_thousand_half_open_connections_change_nothing(make_node: NodeFactory) -> None:
    node, url = metrics_node(make_node)
    assert node.proc is not None
    port = int(url.rsplit(":", 1)[1])
    with open_file_limit(node.proc.pid, DAEMON_FILE_LIMIT), contextlib.ExitStack() as stack:
        peak = [fds(node.proc.pid)]
        flooding = threading.Event()
        flooding.set()

        def sample_peak() -> None:
            while flooding.is_set():
                with contextlib.suppress(OSError):
                    peak[0] = max(peak[0], fds(node.proc.pid))

        sampler = threading.Thread(target=sample_peak, daemon=True)
        sampler.start()
        opened = 0
        for _ in range(HALF_OPEN):
            try:
                conn = stack.enter_context(socket.create_connection(("127.0.0.1", port), 2))
                conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
                opened += 1
            except OSError:
                pass  # refused or reset by the server: fine, it protects itself
        flooding.clear()
        sampler.join()
        assert opened >= HALF_OPEN // 2
        # Connections accepted but not yet admitted hold descriptors too: the
        # flood never gets near the limit (it reached it when asyncio accepted
        # 128 at a time).
        assert peak[0] < DAEMON_FILE_LIMIT // 4, peak
        # Admissions go on, and the liveness probe is answered at once.
        for i in range(3):
            assert_admitted_ok(node.submit(node.pod(f"p{i}", {CORE: 10, MEM: 10})))
        health = urllib.request.urlopen(url + "/healthz", timeout=3)
        assert health.status == 200
        assert fds(node.proc.pid) < DAEMON_FILE_LIMIT // 2
        dropped = {
            labels["reason"]: value
            for name, labels, value in samples(url)
            if name == "vgpu_metrics_http_dropped_connections_total"
        }
        assert dropped["evicted"] > 0
    assert node.proc.poll() is None
    assert "Traceback" not in node.log()


@pytest.mark.timeout(60)
def test_tenant_names_stay_off_the_endpoint_by_default(make_node: NodeFactory) -> None:
    node, url = metrics_node(make_node)
    assert_admitted_ok(node.submit(node.pod("secret-project", {CORE: 10, MEM: 10})))
    # The daemon knows the owner (from the kubelet) ...
    assert wait_until(
        lambda: [c["pod"] for c in status(node)["containers"]] == ["secret-project"], 10
    )
    series = [s for s in samples(url) if s[0].startswith("vgpu_container_")]
    assert series
    for _, labels, _ in series:
        assert set(labels) == {"key", "uuid"}, labels
    # ... and the unauthenticated endpoint does not tell.
    body = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    assert "secret-project" not in body


@pytest.mark.timeout(60)
def test_slow_and_oversized_requests_are_cut(make_node: NodeFactory) -> None:
    _, url = metrics_node(make_node)
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), 2) as big:
        big.sendall(b"GET /metrics HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 20_000 + b"\r\n\r\n")
        answer = big.recv(4096)
        assert answer.startswith(b"HTTP/1.1 431"), answer[:80]
    with socket.create_connection(("127.0.0.1", port), 2) as post:
        post.sendall(b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        assert post.recv(4096).startswith(b"HTTP/1.1 405")
