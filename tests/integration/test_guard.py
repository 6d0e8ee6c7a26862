"""Issue 17 (4): the guard against containers that escaped allocation.

The kubelet simulator admits a pod without calling the plugin (as a real
kubelet does when the Node still shows capacity from before the plugin
registered); the daemon, comparing the API server's running pods with the
kubelet's pod-resources record, posts a Warning Event on the pod, counts it,
and with unallocated_policy evict evicts it through the Eviction API.
"""

from __future__ import annotations

import socket
import urllib.request

import pytest

from tests.conftest import NodeFactory
from vgpu.sim.harness import SimNode, wait_until

pytestmark = pytest.mark.timeout(60)

CORE = "vendor.io/vcuda-core"
MEM = "vendor.io/vcuda-memory"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _warnings(node: SimNode, pod: str) -> list[dict[str, object]]:
    assert node.api is not None
    return [
        e
        for e in node.api.events("default")
        if e["involvedObject"]["name"] == pod and e["reason"] == "UnallocatedVgpuContainer"
    ]


@pytest.mark.parametrize("policy", ["warn", "evict"])
def test_a_container_admitted_without_allocate_is_reported(
    make_node: NodeFactory, policy: str
) -> None:
    port = _free_port()
    node = make_node(
        api=True,
        daemon_args=[
            "--unallocated-policy",
            policy,
            "--reconcile-interval-s",
            "1",
            "--metrics-address",
            f"127.0.0.1:{port}",
        ],
    )
    assert node.api is not None
    # A well-behaved pod, allocated as usual, and one the kubelet admitted blind.
    good = node.pod("good", {CORE: 30, MEM: 16})
    assert node.submit(good).ok
    blind = node.pod("blind", {CORE: 30, MEM: 16})
    node.create(blind)
    node.kubelet.admit_without_plugin(blind)
    for pod in (good, blind):
        node.api.set_pod_phase("default", pod.name, "Running")
    blind_uid = node.api.get_pod("default", "blind")["metadata"]["uid"]  # type: ignore[index]

    assert wait_until(lambda: len(_warnings(node, "blind")) == 1, 15), node.log()[-3000:]
    (event,) = _warnings(node, "blind")
    assert event["type"] == "Warning"
    assert event["involvedObject"]["uid"] == blind_uid
    assert "vendor.io/vcuda-core=30" in str(event["message"])
    assert "unallocated container default/blind/main" in node.log()
    assert _warnings(node, "good") == []
    assert _metric(port, 'vgpu_events_total{kind="unallocated_container"}') == 1.0
    if policy == "evict":
        assert wait_until(lambda: node.api.evictions == [("default", "blind")], 10)  # type: ignore[union-attr]
        assert node.api.get_pod("default", "blind") is None
        assert node.api.get_pod("default", "good") is not None
    else:
        # Reported once, never evicted.
        assert not wait_until(lambda: len(_warnings(node, "blind")) > 1, 3)
        assert node.api.evictions == []
        assert node.api.get_pod("default", "blind") is not None
