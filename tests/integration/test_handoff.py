"""Issue 29: a rolling update hands the node from the old daemon to the new one
without an admission failing. The two run at once (the DaemonSet's surge pod);
the kubelet simulator behaves as kubelet 1.36.2 does when a replaced
registration's stream ends (it disconnects the current one), so a handover
that let the old streams end would fail these tests."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.integration.conftest_placement import (
    CORE,
    MEM,
    NodeMaker,
    pl_tmp,
    sim_node,
    status,
)
from vgpu.sim.apiserver import make_node, make_pod
from vgpu.sim.harness import SimNode, stop_process, wait_until
from vgpu.sim.kubelet import Admission

__all__ = ["pl_tmp", "sim_node"]

NAMESPACE = "vgpu-system"
OWNER = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "vgpu", "uid": "ds-uid-1"}


@pytest.fixture(autouse=True)
def no_daemon_left() -> Iterator[None]:
    """A handed-over daemon idles until signalled: whatever a test leaves
    running (a failure midway) is killed here, after the node fixtures'
    own checks."""
    yield
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if "serve" in child.cmdline() and child.is_running():
                child.kill()
                child.wait(5)


class Burst:
    """Slice pods submitted one after another until stopped, as a busy node
    sees them; the oldest are deleted so that at most `live` run at once (a
    slow handover must not fill the cards)."""

    def __init__(self, node: SimNode, gap_s: float = 0.01, live: int = 30) -> None:
        self.node = node
        self.gap_s = gap_s
        self.live = live
        self.results: list[Admission] = []
        self.alive: list[Admission] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            pod = self.node.pod(f"burst-{i:03d}", {CORE: 2, MEM: 2})
            result = self.node.submit(pod)
            self.results.append(result)
            if result.ok:
                self.alive.append(result)
            if len(self.alive) > self.live:
                self.node.delete(self.alive.pop(0).pod)
            i += 1
            time.sleep(self.gap_s)

    @contextlib.contextmanager
    def running(self) -> Iterator[Burst]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(30)

    def failures(self) -> list[str]:
        return [f"{r.pod.name}: {r.error}" for r in self.results if not r.ok]


def start_second_daemon(
    node: SimNode, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Another `vgpu serve` on the same node (state dir, sockets), logging into
    the node's log like the first."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_")}
    full.pop("KUBERNETES_SERVICE_HOST", None)
    full.update(env or {})
    with open(node.log_path, "ab") as log:
        return subprocess.Popen(
            node.daemon_command(), stdout=log, stderr=subprocess.STDOUT, env=full
        )


def adopt(node: SimNode, proc: subprocess.Popen[bytes]) -> None:
    """Make `proc` the node's daemon, so the fixtures stop and check it."""
    node.proc = proc
    node._log_fh = None


def daemon_pod(name: str, node: str, created: str) -> dict[str, Any]:
    pod = make_pod(
        name, node=node, namespace=NAMESPACE, phase="Running", creation_timestamp=created
    )
    pod["metadata"]["ownerReferences"] = [{**OWNER, "controller": True}]
    return pod


def assert_served_by_the_new_daemon(node: SimNode, suffix: str = ".2") -> None:
    """The kubelet's registrations point at the new daemon's sockets (the old
    daemon's files are gone), and a pod admitted now gets its answer."""
    other = "" if suffix else ".2"
    for resource in ("vcuda-core", "vcuda-memory"):
        assert not (node.plugin_dir / f"vgpu-{resource}{other}.sock").exists()
    for name in (f"vgpu-vcuda-core{suffix}.sock", f"vgpu-vcuda-memory{suffix}.sock"):
        assert (node.plugin_dir / name).is_socket(), sorted(
            p.name for p in node.plugin_dir.iterdir()
        )
    result = node.submit(node.pod(f"after{suffix}", {CORE: 3, MEM: 3}))
    assert result.ok, (result.error, node.log()[-3000:])


@pytest.mark.timeout(90)
def test_a_new_daemon_takes_the_node_over_with_no_failed_admission(sim_node: NodeMaker) -> None:
    node = sim_node(api=True)
    before = [node.submit(node.pod(f"before-{i}", {CORE: 10, MEM: 8})) for i in range(3)]
    assert all(r.ok for r in before)
    first = node.proc
    assert first is not None
    with Burst(node).running() as burst:
        time.sleep(0.3)
        second = start_second_daemon(node)
        assert wait_until(lambda: "took this node over" in node.log(), 30), node.log()[-4000:]
        assert wait_until(lambda: "handed this node over" in node.log(), 10), node.log()[-4000:]
        time.sleep(0.5)  # admissions keep coming after the handover
    assert len(burst.results) >= 10, len(burst.results)
    assert not burst.failures(), (burst.failures(), node.log()[-4000:])
    # The old daemon idles until it is stopped, then exits 0 without ending
    # the kubelet's streams: the new daemon's registrations stay connected.
    assert first.poll() is None
    first.send_signal(signal.SIGTERM)
    assert first.wait(10) == 0
    time.sleep(0.5)
    assert node.kubelet.connected(CORE) and node.kubelet.connected(MEM)
    assert node.kubelet.allocatable(CORE) > 0
    assert_served_by_the_new_daemon(node)
    # Every placement made by either daemon is the new daemon's now.
    keys = {c["pod"] for c in status(node)["containers"]}
    admitted = {r.pod.name for r in [*before, *burst.alive]} | {"after.2"}
    assert admitted <= keys, admitted - keys
    # The next upgrade takes the first names again.
    third = start_second_daemon(node)
    assert wait_until(lambda: node.log().count("took this node over") == 2, 30), node.log()[-3000:]
    second.send_signal(signal.SIGTERM)
    assert second.wait(10) == 0
    time.sleep(0.5)
    assert_served_by_the_new_daemon(node, suffix="")
    adopt(node, third)


@pytest.mark.timeout(90)
def test_an_owner_stopped_while_its_successor_starts_serves_until_it_asks(
    sim_node: NodeMaker,
) -> None:
    """The DaemonSet controller may stop the old pod before the new daemon
    asked for the node: the old one sees its successor's pod in the API server
    and serves on until the handover, instead of leaving the node bare."""
    env = {"POD_NAME": "vgpu-old", "POD_NAMESPACE": NAMESPACE}
    node = sim_node(api=True, env=env)
    assert node.api is not None
    node.api.add_pod(daemon_pod("vgpu-old", node.node, "2026-12-04T10:00:00Z"))
    node.api.add_pod(daemon_pod("vgpu-new", node.node, "2026-12-04T10:05:00Z"))
    first = node.proc
    assert first is not None
    with Burst(node).running() as burst:
        time.sleep(1.0)  # the pod cache has both daemon pods
        first.send_signal(signal.SIGTERM)
        assert wait_until(lambda: "vgpu-new will take over this node" in node.log(), 10), (
            node.log()[-3000:]
        )
        time.sleep(0.5)  # the owner still serves while it waits
        second = start_second_daemon(node, {"POD_NAME": "vgpu-new", "POD_NAMESPACE": NAMESPACE})
        assert wait_until(lambda: "took this node over" in node.log(), 30), node.log()[-4000:]
        assert first.wait(10) == 0  # already signalled: it leaves once handed over
        time.sleep(0.5)
    assert not burst.failures(), (burst.failures(), node.log()[-4000:])
    assert_served_by_the_new_daemon(node)
    adopt(node, second)


@pytest.mark.timeout(60)
def test_an_owner_alone_stops_at_once(sim_node: NodeMaker) -> None:
    """No successor pod: SIGTERM stops the daemon without waiting, its
    streams end and its sockets go."""
    node = sim_node(api=True, env={"POD_NAME": "vgpu-old", "POD_NAMESPACE": NAMESPACE})
    assert node.api is not None
    node.api.add_pod(daemon_pod("vgpu-old", node.node, "2026-12-04T10:00:00Z"))
    time.sleep(0.5)
    started = time.monotonic()
    assert node.stop_daemon(signal.SIGTERM) == 0
    assert time.monotonic() - started < 3.0
    assert "will take over this node" not in node.log()
    assert not (node.plugin_dir / "vgpu-vcuda-core.sock").exists()
    assert wait_until(lambda: not node.kubelet.connected(CORE), 5)


@pytest.mark.timeout(60)
def test_a_lock_holder_that_does_not_answer_is_waited_for(sim_node: NodeMaker) -> None:
    """A daemon that owns the node but cannot be asked (it predates the
    handover, or hangs) is waited for: the newcomer takes the node once the
    lock is free, never while it is held."""
    node = sim_node(api=True, start=False)
    node.state_dir.mkdir(parents=True, exist_ok=True)
    holder = os.open(node.state_dir / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        # SimNode.start() without its daemon, which would wait for a registration.
        assert node.api is not None
        node.api.start()
        node.api.write_kubeconfig(node.kubeconfig)
        node.api.add_node(make_node(node.node, labels={f"{node.domain}/vgpu": "true"}))
        node.kubelet.start()
        proc = start_second_daemon(node)
        assert wait_until(lambda: "waiting for it to stop" in node.log(), 20), node.log()[-3000:]
        time.sleep(1.0)
        assert node.registrations() == 0  # nothing served while the lock is held
    finally:
        os.close(holder)
    assert wait_until(lambda: "took this node over" in node.log(), 10), node.log()[-3000:]
    assert node.kubelet.wait_for(lambda: node.registrations() == 1, 10), node.log()[-3000:]
    adopt(node, proc)
    assert stop_process(proc, None, signal.SIGTERM, 10) == 0
    node.proc = None


def test_handover_sockets_are_not_left_behind(sim_node: NodeMaker, pl_tmp: Path) -> None:
    """A daemon that stops on its own removes its handover socket; the lock
    file stays (it is only ever locked, never read)."""
    node = sim_node(api=False)
    assert (node.state_dir / "handoff.sock").is_socket()
    assert node.stop_daemon(signal.SIGTERM) == 0
    assert not (node.state_dir / "handoff.sock").exists()
    assert (node.state_dir / "daemon.lock").is_file()
