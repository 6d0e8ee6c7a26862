"""Three simulated nodes (the real `vgpu serve` each, with a kubelet simulator
admitting the pods bound to it), one fake API server, the real `vgpu extender`
and a kube-scheduler stand-in calling it over HTTP.

One cluster serves the whole module; every test deletes its pods and checks
the invariants at the end: every pod the extender bound is admitted on the
card(s) its assignment names, none fails admission, no card is overcommitted.
"""

from __future__ import annotations

import io
import json
import random
import signal
import threading
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest_placement import write_mock
from vgpu.cli.main import main
from vgpu.cli.status import collect
from vgpu.cli.status_cluster import collect_cluster
from vgpu.core.slicing import parse_device_id
from vgpu.sim.apiserver import make_pod
from vgpu.sim.cluster import SimCluster

pytestmark = pytest.mark.timeout(120)

NODES = {"node-a": 2, "node-b": 2, "node-c": 1}
ASSIGNMENT = "vendor.io/vgpu-assignment"


def _card(node: str, i: int, **extra: Any) -> dict[str, Any]:
    return {
        "uuid": f"GPU-{node[-1]}{i:07d}-0000-4000-8000-000000000000",
        "name": "NVIDIA H200",
        "memory_mib": 143771,
        "numa_node": 0,
        **extra,
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimCluster]:
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="vc", dir="/tmp"))
    files = {
        name: write_mock(root / f"{name}.json", [_card(name, i) for i in range(n)])
        for name, n in NODES.items()
    }
    cl = SimCluster({n: str(f) for n, f in files.items()}, root / "c")
    cl.start()
    try:
        yield cl
    finally:
        cl.scheduler.stop()
        rc = cl.stop_extender()
        codes = {name: node.stop_daemon() for name, node in cl.nodes.items()}
        logs = {name: node.log() for name, node in cl.nodes.items()}
        text = cl.extender_text()
        cl.close()
        assert rc == 0, text
        assert "Traceback" not in text, text
        assert all(code == 0 for code in codes.values()), codes
        for name, log in logs.items():
            assert "Traceback" not in log, f"{name}:\n{log[-3000:]}"


C, M = "vendor.io/vcuda-core", "vendor.io/vcuda-memory"


def check_invariants(cl: SimCluster) -> None:
    """Every pod the extender bound is admitted on its assigned card(s); no card is
    overcommitted, in the kubelets' records and in the cluster view."""
    for pod in cl.api.pods():
        meta, spec = pod["metadata"], pod["spec"]
        text = (meta.get("annotations") or {}).get(ASSIGNMENT)
        if text is None or not spec.get("nodeName"):
            continue
        assignment = json.loads(text)
        assert assignment["node"] == spec["nodeName"], meta["name"]
        status = pod.get("status") or {}
        assert status.get("phase") != "Failed", (meta["name"], status.get("message"))
        admission = cl.nodes[spec["nodeName"]].admissions.get(meta["uid"])
        if admission is None:
            continue  # not admitted yet
        assert admission.ok, admission.error
        for container in admission.containers:
            got = container.envs.get("NVIDIA_VISIBLE_DEVICES", "")
            assert set(got.split(",")) == set(assignment["containers"][container.name]), (
                meta["name"],
                container.name,
            )
    for node in cl.nodes.values():
        held: dict[str, set[str]] = {}  # card -> core IDs (an app reusing init IDs holds them too)
        for containers in node.kubelet.allocated().values():
            for per_resource in containers.values():
                for device in per_resource.get(C, []):
                    ref = parse_device_id(device)
                    card = ref.card_uuid or f"{ref.card_index}.{ref.card_digest}"
                    held.setdefault(card, set()).add(device)
        assert all(len(ids) <= 100 for ids in held.values()), held
    for node in collect_cluster(cl.kubeconfig)["nodes"]:
        for card in node["cards"]:
            assert 0 <= card["core_allocated"] <= 100, card
            assert 0 <= card["memory_allocated_mib"] <= card["memory_mib"], card


def running(cl: SimCluster, *names: str, timeout_s: float = 20.0) -> None:
    ok = cl.wait(lambda: all(cl.phase(n) == "Running" for n in names), timeout_s)
    assert ok, {n: (cl.phase(n), cl.condition(n)) for n in names}


def cleanup(cl: SimCluster, *names: str) -> None:
    """Delete the pods; return once every kubelet dropped them and every daemon
    released their records (about 2 s later: the second sighting)."""
    for name in names:
        cl.delete(name)
    gone = set(names)
    assert cl.wait(
        lambda: not any(p.name in gone for n in cl.nodes.values() for p in n.kubelet.active_pods())
    )
    assert cl.wait(
        lambda: (
            not any(
                c["pod"] in gone
                for n in cl.nodes.values()
                for c in collect(n.state_dir)["containers"]
            )
        )
    )


def _message(cl: SimCluster, name: str) -> str:
    return str(((cl.get_pod(name) or {}).get("status") or {}).get("message", ""))


def node_of(cl: SimCluster, name: str) -> str:
    return str((cl.get_pod(name) or {}).get("spec", {}).get("nodeName", ""))


# ------------------------------------------------------------------ tests


def test_inventory_is_published_at_start_and_on_change_only(cluster: SimCluster) -> None:
    def patches(node: str) -> int:
        return sum(
            1
            for method, path in cluster.api.requests()
            if method == "PATCH" and path.startswith(f"/api/v1/nodes/{node}")
        )

    for name, n in NODES.items():
        node = cluster.api.get_node(name) or {}
        inventory = json.loads(node["metadata"]["annotations"]["vendor.io/vgpu-node"])
        assert inventory["version"] == 1 and inventory["memory_unit_mib"] == 256
        assert [c["uuid"] for c in inventory["cards"]] == [_card(name, i)["uuid"] for i in range(n)]
        assert inventory["cards"][0] == {
            "uuid": _card(name, 0)["uuid"],
            "index": 0,
            "model": "NVIDIA H200",
            "memory_mib": 143771,
            "memory_units": 561,
            "numa_node": 0,
            "healthy": True,
        }
        assert patches(name) == 1
    mock = Path(cluster.nodes["node-b"].gpus)
    write_mock(mock, [_card("node-b", 0), _card("node-b", 1, healthy=False)])
    try:
        assert cluster.wait(lambda: patches("node-b") == 2, 10)
        cards = json.loads(
            cluster.api.get_node("node-b")["metadata"]["annotations"]["vendor.io/vgpu-node"]  # type: ignore[index]
        )["cards"]
        assert [c["healthy"] for c in cards] == [True, False]
        # A pod the extender assigned to the card that turned unhealthy since is refused
        # at admission, naming the card.
        uuid = _card("node-b", 1)["uuid"]
        annotation = json.dumps({"node": "node-b", "containers": {"main": [uuid]}})
        limits = {C: "30", M: "40"}
        cluster.api.add_pod(
            make_pod(
                "stale",
                node="node-b",
                annotations={ASSIGNMENT: annotation},
                containers=[{"name": "main", "resources": {"limits": limits}}],
            )
        )
        assert cluster.wait(lambda: cluster.phase("stale") == "Failed")
        message = (cluster.get_pod("stale") or {})["status"]["message"]
        assert f"card 1 ({uuid})" in message and "turned unhealthy" in message, message
        cluster.delete("stale")
    finally:
        write_mock(mock, [_card("node-b", 0), _card("node-b", 1)])
    assert cluster.wait(lambda: patches("node-b") == 3, 10)
    assert not cluster.wait(lambda: patches("node-b") > 3, 1.5)  # no timer


def test_a_pod_that_fits_a_node_total_but_no_card_goes_where_a_card_fits(
    cluster: SimCluster,
) -> None:
    for name, node, share in (
        ("a1", "node-a", 60),
        ("a2", "node-a", 60),
        ("b1", "node-b", 70),
        ("b2", "node-b", 70),
    ):
        cluster.pod(name, {C: share, M: 40}, node=node)
    running(cluster, "a1", "a2", "b1", "b2")
    cluster.pod("steered", {C: 50, M: 40})
    running(cluster, "steered")
    assert node_of(cluster, "steered") == "node-c"
    # Pending, with the extender's reasons in the PodScheduled condition.
    cluster.pod("nowhere", {C: 60, M: 40})
    assert cluster.wait(lambda: "vgpu: no card fits" in cluster.condition("nowhere"), 10)
    message = cluster.condition("nowhere")
    assert message.startswith("0/3 nodes are available: ")
    assert "nearest card" in message and cluster.phase("nowhere") == "Pending"
    assert node_of(cluster, "nowhere") == ""
    check_invariants(cluster)
    # Room appears (a1 ends): the pending pod is placed there, on a1's card.
    cluster.delete("a1")
    running(cluster, "nowhere")
    assert node_of(cluster, "nowhere") == "node-a"
    check_invariants(cluster)
    cleanup(cluster, "a2", "b1", "b2", "steered", "nowhere")


def test_parallel_binds_to_one_node_never_give_the_same_room_twice(cluster: SimCluster) -> None:
    """Twelve binds of 40% pods to node-a at once: its two cards hold four."""
    import http.client

    names = [f"par-{i}" for i in range(12)]
    cluster.scheduler.stop()  # the binds below come from us, all at once
    try:
        uids = {}
        for name in names:
            pod = cluster.pod(name, {C: 40, M: 20})
            uids[name] = pod["metadata"]["uid"]
        answers: dict[str, str] = {}

        def bind(name: str) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", cluster.extender_port, timeout=10)
            args = {
                "PodName": name,
                "PodNamespace": "default",
                "PodUID": uids[name],
                "Node": "node-a",
            }
            conn.request("POST", "/bind", json.dumps(args), {"Content-Type": "application/json"})
            answers[name] = json.loads(conn.getresponse().read())["Error"]
            conn.close()

        threads = [threading.Thread(target=bind, args=(n,)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        bound = sorted(n for n, error in answers.items() if not error)
        refused = [e for e in answers.values() if e]
        assert len(bound) == 4, answers
        assert all("no longer fits on node node-a" in e for e in refused), refused
        running(cluster, *bound)
        check_invariants(cluster)
    finally:
        for name in names:
            cluster.delete(name)
        cluster.scheduler = type(cluster.scheduler)(
            cluster.api,
            cluster.extender_url,
            scheduler_name="vgpu-scheduler",
            managed_resources=(C, M),
            seed=1,
        )
        cluster.scheduler.start()
    cleanup(cluster, *names)


def test_extender_restart_in_the_middle_of_a_burst_loses_nothing(cluster: SimCluster) -> None:
    names = [f"burst-{i}" for i in range(10)]
    for name in names:
        cluster.pod(name, {C: 20, M: 30})
    assert cluster.wait(lambda: sum(node_of(cluster, n) != "" for n in names) >= 3, 20)
    assert cluster.stop_extender(signal.SIGKILL) == -signal.SIGKILL
    cluster.start_extender()
    running(cluster, *names, timeout_s=40)
    check_invariants(cluster)
    cleanup(cluster, *names)


def test_randomized_churn_keeps_every_pod_on_its_assigned_card(cluster: SimCluster) -> None:
    rng = random.Random(11)
    shapes = [
        {C: 10, M: 20},
        {C: 30, M: 100},
        {C: 50, M: 40},
        {M: 64},
        {C: 100},
        {"init": {C: 20, M: 20}, "main": {C: 40, M: 20}},
        {"a": {C: 20, M: 10}, "b": {C: 30, M: 10}},
    ]
    live: list[str] = []
    created: list[str] = []
    for step in range(28):
        # Delete admitted pods only: a pod deleted while its node admits it can lose
        # its place to another pending pod (see the README's known limits).
        admitted = [n for n in live if cluster.phase(n) == "Running"]
        if admitted and rng.random() < 0.35:
            name = rng.choice(admitted)
            live.remove(name)
            cluster.delete(name)
            continue
        shape = rng.choice(shapes)
        name = f"churn-{step}"
        if "init" in shape:
            cluster.pod(name, {"main": shape["main"]}, init={"init": shape["init"]})
        elif "a" in shape:
            cluster.pod(name, {"a": shape["a"], "b": shape["b"]})
        else:
            cluster.pod(name, shape)
        live.append(name)
        created.append(name)
        if step % 4 == 3:
            check_invariants(cluster)
    # Settle: every live pod is either running on its card or pending with a reason.
    assert cluster.wait(
        lambda: all(
            cluster.phase(n) == "Running"
            or (cluster.phase(n) == "Pending" and cluster.condition(n).startswith("0/3 nodes"))
            for n in live
        ),
        40,
    ), {n: (cluster.phase(n), cluster.condition(n), _message(cluster, n)) for n in live}
    check_invariants(cluster)
    assert sum(cluster.phase(n) == "Running" for n in live) >= len(live) // 2
    cleanup(cluster, *created)


def test_status_cluster_lists_every_card_and_pod(cluster: SimCluster) -> None:
    cluster.pod("seen", {C: 30, M: 40})
    running(cluster, "seen")
    out = io.StringIO()
    with redirect_stdout(out):
        assert (
            main(["status", "--cluster", "--kubeconfig", str(cluster.kubeconfig), "-o", "json"])
            == 0
        )
    data = json.loads(out.getvalue())
    assert [n["name"] for n in data["nodes"]] == list(NODES)
    cards = [c for n in data["nodes"] for c in n["cards"]]
    assert len(cards) == sum(NODES.values())
    (holder,) = [c for c in cards if "default/seen/main" in c["pods"]]
    assert holder["core_allocated"] == 30 and holder["memory_allocated_mib"] == 40 * 256
    assert holder["core_free"] == 70 and holder["health"] == "Healthy"
    table = io.StringIO()
    with redirect_stdout(table):
        assert main(["status", "--cluster", "--kubeconfig", str(cluster.kubeconfig)]) == 0
    assert "default/seen/main" in table.getvalue() and "30%/70%" in table.getvalue()
    cleanup(cluster, "seen")


def test_a_cluster_that_fails_to_start_leaves_nothing_running(tmp_path: Path) -> None:
    # The extender refuses its configuration (exit 2): start fails at once,
    # naming it, and the node daemon it had started is stopped, not leaked
    # behind the failed test.
    mock = write_mock(tmp_path / "n.json", [_card("node-z", 0)])
    cl = SimCluster({"node-z": str(mock)}, tmp_path / "c", extender_args=["--policy", "bogus"])
    node = cl.nodes["node-z"]
    with pytest.raises(RuntimeError, match="the extender did not get ready") as err:
        cl.start(timeout_s=60)
    assert "invalid choice: 'bogus'" in str(err.value)
    assert node.proc is None and cl.extender is None
