"""pods/binding and the field-selector watch semantics a scheduler relies on,
through the official ``kubernetes`` client against the fake API server."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from kubernetes import client

from tests.sim import test_apiserver as base
from tests.sim.test_apiserver import _Watcher
from vgpu.sim.apiserver import FakeApiServer, make_node, make_pod

CORE = "vendor.io/vcuda-core"

# The fake API server and client fixtures of the main API server tests.
server = base.server
v1 = base.v1


def _binding(name: str, node: str, uid: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "default"}
    if uid is not None:
        meta["uid"] = uid
    return {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": meta,
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }


def _bind(v1: client.CoreV1Api, name: str, node: str, uid: str | None = None) -> Any:
    # The real server answers a Status, not a Binding: read the raw answer.
    return v1.create_namespaced_pod_binding(
        name, "default", _binding(name, node, uid), _preload_content=False
    )


@pytest.mark.timeout(20)
def test_binding_sets_the_node_once(server: FakeApiServer, v1: client.CoreV1Api) -> None:
    uid = server.add_pod(make_pod("p", node=None, scheduler_name="vgpu-scheduler"))["metadata"][
        "uid"
    ]
    reply = _bind(v1, "p", "node-1", uid)
    assert reply.status == 201
    assert json.loads(reply.data)["status"] == "Success"
    pod = server.get_pod("default", "p")
    assert pod is not None and pod["spec"]["nodeName"] == "node-1"
    assert {"type": "PodScheduled", "status": "True"}.items() <= pod["status"]["conditions"][
        0
    ].items()
    with pytest.raises(client.ApiException) as err:
        _bind(v1, "p", "node-2")
    message = json.loads(err.value.body)["message"]
    assert err.value.status == 409 and 'already assigned to node "node-1"' in message


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("name", "body_change", "status", "text"),
    [
        ("missing", {}, 404, "not found"),
        ("p", {"metadata": {"name": "p", "namespace": "default", "uid": "other"}}, 409, "UID"),
        ("p", {"target": {"kind": "Node"}}, 422, "target.name"),
        ("p", {"metadata": {"name": "q"}}, 400, "does not match"),
    ],
    ids=["no-such-pod", "uid-precondition", "no-target", "name-mismatch"],
)
def test_binding_errors(
    server: FakeApiServer,
    v1: client.CoreV1Api,
    name: str,
    body_change: dict[str, Any],
    status: int,
    text: str,
) -> None:
    server.add_pod(make_pod("p", node=None))
    body = {**_binding(name, "node-1"), **body_change}
    with pytest.raises(client.ApiException) as err:
        v1.create_namespaced_pod_binding(name, "default", body, _preload_content=False)
    assert err.value.status == status and text in err.value.body
    assert "nodeName" not in (server.get_pod("default", "p") or {}).get("spec", {})


@pytest.mark.timeout(20)
def test_a_pod_bound_to_a_node_appears_in_that_nodes_watch(
    server: FakeApiServer, v1: client.CoreV1Api
) -> None:
    server.add_pod(make_pod("p", node=None, containers=[{"name": "main"}]))
    on_node = _Watcher(
        v1.list_pod_for_all_namespaces, field_selector="spec.nodeName=node-1", timeout_seconds=5
    )
    active = _Watcher(
        v1.list_pod_for_all_namespaces,
        field_selector="status.phase!=Succeeded,status.phase!=Failed",
        timeout_seconds=5,
    )
    assert active.take(1) == [("ADDED", "p")]
    _bind(v1, "p", "node-1")
    assert on_node.take(1) == [("ADDED", "p")]  # it starts matching: ADDED, not MODIFIED
    assert active.take(1) == [("MODIFIED", "p")]
    server.set_pod_phase("default", "p", "Succeeded")
    assert active.take(1) == [("DELETED", "p")]  # it stops matching: DELETED
    assert on_node.take(1) == [("MODIFIED", "p")]
    on_node.watch.stop()
    active.watch.stop()


@pytest.mark.timeout(20)
def test_node_helpers_and_change_waits(server: FakeApiServer) -> None:
    rv = server.resource_version
    assert server.wait_for_change(rv, 0.05) == rv  # nothing changed: the timeout
    server.add_node(make_node("n1", allocatable={CORE: "200"}))
    assert server.wait_for_change(rv, 1.0) > rv
    server.update_node("n1", lambda n: n["metadata"].setdefault("annotations", {}).update(a="b"))
    assert [n["metadata"]["annotations"] for n in server.nodes()] == [{"a": "b"}]
    assert server.get_node("n1")["status"]["allocatable"] == {CORE: "200"}  # type: ignore[index]
    server.delete_node("n1")
    assert server.nodes() == []


@pytest.mark.timeout(20)
def test_binding_merges_its_annotations_and_labels_in_the_same_write(
    server: FakeApiServer, v1: client.CoreV1Api
) -> None:
    pod = make_pod("m", node=None, annotations={"keep": "me", "over": "old"})
    uid = server.add_pod(pod)["metadata"]["uid"]
    before = server.resource_version
    body = _binding("m", "node-1", uid)
    body["metadata"]["annotations"] = {"vendor.io/vgpu-assignment": '{"a": 1}', "over": "new"}
    body["metadata"]["labels"] = {"topology.example/zone": "z1"}
    reply = v1.create_namespaced_pod_binding("m", "default", body, _preload_content=False)
    assert reply.status == 201
    stored = server.get_pod("default", "m")
    assert stored is not None and stored["spec"]["nodeName"] == "node-1"
    assert stored["metadata"]["annotations"] == {
        "keep": "me",
        "over": "new",
        "vendor.io/vgpu-assignment": '{"a": 1}',
    }
    assert stored["metadata"]["labels"]["topology.example/zone"] == "z1"
    # One write: the node, the annotations and the labels share one resourceVersion.
    assert server.resource_version == before + 1
    assert stored["metadata"]["resourceVersion"] == str(before + 1)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "field_name, value",
    [("annotations", {"k": 1}), ("annotations", ["x"]), ("labels", {"": "v"})],
    ids=["annotation-not-string", "annotations-not-map", "label-empty-key"],
)
def test_binding_with_bad_metadata_is_refused_and_binds_nothing(
    server: FakeApiServer, v1: client.CoreV1Api, field_name: str, value: Any
) -> None:
    uid = server.add_pod(make_pod("bad", node=None))["metadata"]["uid"]
    body = _binding("bad", "node-1", uid)
    body["metadata"][field_name] = value
    # Raw HTTP: the client would refuse to send such a body at all.
    request = urllib.request.Request(
        f"{server.url}/api/v1/namespaces/default/pods/bad/binding",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=5)
    assert err.value.code == 422
    assert f"metadata.{field_name}" in json.loads(err.value.read())["message"]
    stored = server.get_pod("default", "bad")
    assert stored is not None and not (stored.get("spec") or {}).get("nodeName")
