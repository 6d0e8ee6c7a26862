"""The node daemon's /readyz says when the API server has been unreachable
longer than api_unready_after_s, and why, while the daemon keeps serving the
kubelet; every API error it logs names the address, the error and what to
check. The daemon runs as a real process; the fake API server is stopped."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from vgpu.sim.harness import SimNode, wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def readyz(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.fixture
def node() -> Iterator[tuple[SimNode, str]]:
    port = _free_port()
    sim = SimNode(
        daemon_args=["--metrics-address", f"127.0.0.1:{port}"],
        env={"VGPU_API_UNREADY_AFTER_S": "5"},
    )
    sim.start()
    try:
        yield sim, f"http://127.0.0.1:{port}"
    finally:
        sim.close()


@pytest.mark.timeout(180)
def test_readyz_reports_an_unreachable_api_server(node: tuple[SimNode, str]) -> None:
    sim, url = node
    assert sim.api is not None
    api_url = sim.api.url
    assert wait_until(lambda: readyz(url)[0] == 200, 10)

    sim.api.stop()  # connection refused from now on
    try:
        assert wait_until(lambda: readyz(url)[0] == 503, 30, interval_s=0.2)
        status, text = readyz(url)
        assert status == 503
        assert f"API server {api_url} unreachable" in text, text
        assert "ECONNREFUSED" in text and "api_unready_after_s=5" in text, text
        # Liveness stays fine, and the kubelet is still served (fallback rule).
        with urllib.request.urlopen(f"{url}/healthz", timeout=5) as reply:
            assert reply.status == 200
        pod = sim.pod("during-outage", {sim.core: 100})
        assert sim.admit(pod).ok
        assert sim.proc is not None and sim.proc.poll() is None
        log = sim.log()
        assert f"API server {api_url} unreachable: ECONNREFUSED" in log, log[-2000:]
        assert "check that the API server is up" in log
        assert "API server error 0" not in log
    finally:
        sim.api.start()  # same port, same objects
    assert wait_until(lambda: readyz(url)[0] == 200, 60, interval_s=0.2)


@pytest.mark.timeout(120)
def test_readyz_reports_http_errors_too(node: tuple[SimNode, str]) -> None:
    sim, url = node
    assert sim.api is not None
    assert wait_until(lambda: readyz(url)[0] == 200, 10)
    sim.api.set_down(True)  # every request answers 503
    try:
        assert wait_until(lambda: readyz(url)[0] == 503, 30, interval_s=0.2)
        text = readyz(url)[1]
        assert "HTTP 503" in text and "check its health" in text, text
    finally:
        sim.api.set_down(False)
    assert wait_until(lambda: readyz(url)[0] == 200, 60, interval_s=0.2)


@pytest.mark.timeout(180)
def test_dra_mode_readyz_follows_the_claim_watch() -> None:
    from vgpu.sim.draharness import DraSimNode

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with DraSimNode(
        daemon_args=["--metrics-address", f"127.0.0.1:{port}"],
        env={"VGPU_API_UNREADY_AFTER_S": "5"},
    ) as sim:
        api_url = sim.api.url
        assert wait_until(lambda: readyz(url)[0] == 200, 20)
        sim.api.stop()
        try:
            assert wait_until(lambda: readyz(url)[0] == 503, 30, interval_s=0.2)
            text = readyz(url)[1]
            assert f"API server {api_url} unreachable: ECONNREFUSED" in text, text
            assert "claim watch: API server" in sim.log()
        finally:
            sim.api.start()
        assert wait_until(lambda: readyz(url)[0] == 200, 60, interval_s=0.2)
