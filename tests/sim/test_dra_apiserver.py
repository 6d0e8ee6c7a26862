"""The fake API server's resource.k8s.io/v1 group, through the official client,
and the scheduler stand-in that allocates claims by consumable capacity."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from vgpu.adapters.gpus import preset_cards
from vgpu.core.dra import resource_slice, slice_devices
from vgpu.sim.allocator import Allocator, Unschedulable, claim_body, device_class_body
from vgpu.sim.apiserver import FakeApiServer

pytestmark = pytest.mark.timeout(30)
DRIVER = "vgpu.vendor.io"


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[FakeApiServer, Any]]:
    server = FakeApiServer(bookmark_interval_s=60.0)
    server.start()
    kubeconfig = tmp_path / "kubeconfig"
    server.write_kubeconfig(kubeconfig)
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    api_client = client.ApiClient(cfg)
    try:
        yield server, api_client
    finally:
        api_client.close()
        server.stop()


def _slice(node: str = "n1", generation: int = 1, gpus: str = "preset:2xH200") -> dict[str, Any]:
    return resource_slice(node, DRIVER, slice_devices(preset_cards(gpus), 256), generation)


def _raw(reply: Any) -> Any:
    return json.loads(reply.data)


def test_discovery_lists_the_group_and_its_resources(api: tuple[FakeApiServer, Any]) -> None:
    _, api_client = api
    groups = client.ApisApi(api_client).get_api_versions()
    (group,) = [g for g in groups.groups if g.name == "resource.k8s.io"]
    assert group.preferred_version.group_version == "resource.k8s.io/v1"
    resources = client.ResourceV1Api(api_client).get_api_resources()
    names = {r.name: r for r in resources.resources}
    assert {"deviceclasses", "resourceslices", "resourceclaims", "resourceclaims/status"} <= set(
        names
    )
    assert names["resourceclaims"].namespaced and not names["resourceslices"].namespaced


def test_slices_create_list_by_field_update_with_conflicts_delete(
    api: tuple[FakeApiServer, Any],
) -> None:
    _, api_client = api
    v1 = client.ResourceV1Api(api_client)
    created = v1.create_resource_slice(_slice("n1"))  # typed answer: the client parses it
    assert created.spec.pool.resource_slice_count == 1
    assert created.spec.devices[0].allow_multiple_allocations is True
    v1.create_resource_slice(_slice("n2"))
    for selector, names in [
        ("spec.nodeName=n1", ["n1-vgpu.vendor.io"]),
        (f"spec.driver={DRIVER}", ["n1-vgpu.vendor.io", "n2-vgpu.vendor.io"]),
        ("spec.pool.name=n2,spec.driver=other", []),
    ]:
        listed = v1.list_resource_slice(field_selector=selector)
        assert [s.metadata.name for s in listed.items] == names, selector
    with pytest.raises(ApiException) as bad_field:
        v1.list_resource_slice(field_selector="spec.devices=x")
    assert bad_field.value.status == 400
    with pytest.raises(ApiException) as exists:
        v1.create_resource_slice(_slice("n1"))
    assert exists.value.status == 409

    body = _slice("n1", generation=2)
    body["metadata"]["resourceVersion"] = created.metadata.resource_version
    updated = _raw(v1.replace_resource_slice("n1-vgpu.vendor.io", body, _preload_content=False))
    assert updated["spec"]["pool"]["generation"] == 2
    with pytest.raises(ApiException) as stale:  # the same (now old) resourceVersion again
        v1.replace_resource_slice("n1-vgpu.vendor.io", body)
    assert stale.value.status == 409

    v1.delete_resource_slice("n1-vgpu.vendor.io")
    with pytest.raises(ApiException) as gone:
        v1.read_resource_slice("n1-vgpu.vendor.io")
    assert gone.value.status == 404
    v1.delete_collection_resource_slice(field_selector="spec.nodeName=n2")
    assert v1.list_resource_slice().items == []


@pytest.mark.parametrize(
    "path, value, words",
    [
        (("requestPolicy", "default"), "1000Mi", "default must be min plus a multiple of step"),
        (("requestPolicy", "validRange", "max"), "143600Mi", "max must be min plus"),
        (("value",), "100Mi", "need 0 <= min <= max <= value"),
        (("requestPolicy", "validRange", "step"), "0", "step must be positive"),
    ],
    ids=["default-off-grid", "max-off-grid", "value-below-max", "zero-step"],
)
def test_the_server_rejects_bad_request_policies(
    api: tuple[FakeApiServer, Any], path: tuple[str, ...], value: str, words: str
) -> None:
    _, api_client = api
    body = _slice()
    target = body["spec"]["devices"][0]["capacity"]["memory"]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ApiException) as info:
        client.ResourceV1Api(api_client).create_resource_slice(body, _preload_content=False)
    assert info.value.status == 422
    assert words in json.loads(info.value.body)["message"]


def test_slice_watch_by_node(api: tuple[FakeApiServer, Any]) -> None:
    server, api_client = api
    v1 = client.ResourceV1Api(api_client)
    events: queue.Queue[tuple[str, str]] = queue.Queue()
    w = watch.Watch()

    def run() -> None:
        try:
            for event in w.stream(
                v1.list_resource_slice, field_selector="spec.nodeName=n1", timeout_seconds=5
            ):
                events.put((event["type"], event["object"].metadata.name))
        except Exception:  # the server stops under the stream at teardown
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    v1.create_resource_slice(_slice("n2"))
    v1.create_resource_slice(_slice("n1"))
    assert events.get(timeout=5) == ("ADDED", "n1-vgpu.vendor.io")
    server.delete_object("resourceslices", "n1-vgpu.vendor.io")
    assert events.get(timeout=5) == ("DELETED", "n1-vgpu.vendor.io")
    w.stop()


def test_claim_status_is_written_through_the_subresource_only(
    api: tuple[FakeApiServer, Any],
) -> None:
    _, api_client = api
    v1 = client.ResourceV1Api(api_client)
    body = claim_body("c1", capacity={"cores": "30"})
    body["status"] = {"reservedFor": [{"resource": "pods", "name": "x", "uid": "y"}]}
    created = _raw(v1.create_namespaced_resource_claim("default", body, _preload_content=False))
    assert "status" not in created  # ignored on create
    allocation = {
        "devices": {
            "results": [{"request": "gpu", "driver": DRIVER, "pool": "n1", "device": "gpu-0"}]
        }
    }
    status = {**created, "status": {"allocation": allocation}}
    written = _raw(
        v1.replace_namespaced_resource_claim_status("c1", "default", status, _preload_content=False)
    )
    assert written["status"]["allocation"] == allocation
    # a plain update keeps the status, whatever the body says
    plain = {**written, "status": None}
    kept = _raw(
        v1.replace_namespaced_resource_claim("c1", "default", plain, _preload_content=False)
    )
    assert kept["status"]["allocation"] == allocation
    patched = _raw(
        v1.patch_namespaced_resource_claim_status(
            "c1",
            "default",
            {"status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]}},
            _preload_content=False,
        )
    )
    assert patched["status"]["reservedFor"][0]["name"] == "p"
    listed = v1.list_resource_claim_for_all_namespaces()
    assert [c.metadata.name for c in listed.items] == ["c1"]
    assert listed.items[0].status.allocation.devices.results[0].device == "gpu-0"
    v1.delete_namespaced_resource_claim("c1", "default")
    assert v1.list_namespaced_resource_claim("default").items == []


def test_device_class_round_trip(api: tuple[FakeApiServer, Any]) -> None:
    _, api_client = api
    v1 = client.ResourceV1Api(api_client)
    v1.create_device_class(device_class_body(DRIVER))
    read = v1.read_device_class(DRIVER)
    assert read.spec.selectors[0].cel.expression == f'device.driver == "{DRIVER}"'


# ------------------------------------------------------------------ allocator


@pytest.fixture
def cluster() -> Iterator[tuple[FakeApiServer, Allocator]]:
    server = FakeApiServer()
    server.add_object("deviceclasses", device_class_body(DRIVER))
    yield server, Allocator(server)


def _claim(server: FakeApiServer, name: str, **kwargs: Any) -> None:
    server.add_object("resourceclaims", claim_body(name, **kwargs))


def _results(status: dict[str, Any]) -> list[tuple[str, Any]]:
    return [
        (r["device"], r.get("consumedCapacity")) for r in status["allocation"]["devices"]["results"]
    ]


def test_allocator_shares_a_card_by_capacity(cluster: tuple[FakeApiServer, Allocator]) -> None:
    server, allocator = cluster
    server.add_object("resourceslices", _slice("n1", gpus="preset:1xH200"))
    _claim(server, "a", capacity={"cores": "30", "memory": "10Gi"})
    _claim(server, "b", capacity={"cores": "60", "memory": "300Mi"})
    _claim(server, "c", capacity={"cores": "11", "memory": "1Gi"})
    _claim(server, "d", capacity={"cores": "10", "memory": "1Gi"})
    a = allocator.allocate("default", "a", pod=("p", "u"))
    assert _results(a) == [("gpu-0", {"cores": "30", "memory": "10Gi"})]
    assert a["reservedFor"] == [{"resource": "pods", "name": "p", "uid": "u"}]
    assert a["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [
        "n1"
    ]
    assert _results(allocator.allocate("default", "b")) == [
        ("gpu-0", {"cores": "60", "memory": "512Mi"})
    ]
    with pytest.raises(Unschedulable):  # 30 + 60 + 11 > 100
        allocator.allocate("default", "c")
    assert _results(allocator.allocate("default", "d"))[0][1] == {"cores": "10", "memory": "1Gi"}
    shares = {
        r["shareID"]
        for c in server.objects("resourceclaims")
        for r in (c.get("status") or {}).get("allocation", {}).get("devices", {}).get("results", [])
    }
    assert len(shares) == 3


def test_allocator_defaults_take_the_whole_card(cluster: tuple[FakeApiServer, Allocator]) -> None:
    server, allocator = cluster
    server.add_object("resourceslices", _slice("n1", gpus="preset:2xH200"))
    _claim(server, "whole")
    _claim(server, "cores-only", capacity={"cores": "20"})
    _claim(server, "small", capacity={"cores": "1", "memory": "256Mi"})
    assert _results(allocator.allocate("default", "whole")) == [
        ("gpu-0", {"cores": "0", "memory": "143616Mi"})  # asked nothing: the card whole
    ]
    assert _results(allocator.allocate("default", "cores-only")) == [
        ("gpu-1", {"cores": "20", "memory": "143616Mi"})
    ]
    with pytest.raises(Unschedulable):
        allocator.allocate("default", "small")
    allocator.deallocate("default", "whole")
    assert _results(allocator.allocate("default", "small"))[0][0] == "gpu-0"


def test_allocator_uses_complete_pools_at_their_newest_generation(
    cluster: tuple[FakeApiServer, Allocator],
) -> None:
    server, allocator = cluster
    old = _slice("n1", generation=1, gpus="preset:2xH200")
    old["metadata"]["name"] = "old"
    new = _slice("n1", generation=2, gpus="preset:1xH200")
    server.add_object("resourceslices", old)
    server.add_object("resourceslices", new)
    assert [d.data["name"] for d in allocator.devices()] == ["gpu-0"]
    torn = _slice("n2", generation=1)
    torn["spec"]["pool"]["resourceSliceCount"] = 2  # one of two slices missing
    server.add_object("resourceslices", torn)
    assert {d.node for d in allocator.devices()} == {"n1"}


def test_allocator_applies_cel_selectors(cluster: tuple[FakeApiServer, Allocator]) -> None:
    server, allocator = cluster
    server.add_object("resourceslices", _slice("n1", gpus="preset:1xH100"))
    server.add_object("resourceslices", _slice("n2", gpus="preset:1xH200"))
    model = f'device.attributes["{DRIVER}"].model == "NVIDIA H200"'
    _claim(server, "h200", capacity={"cores": "10", "memory": "1Gi"}, selectors=[model])
    _claim(server, "missing", selectors=[f'device.attributes["{DRIVER}"].nope == 1'])
    _claim(server, "broken", selectors=["device.driver =="])
    assert (
        allocator.allocate("default", "h200")["allocation"]["devices"]["results"][0]["pool"] == "n2"
    )
    with pytest.raises(Unschedulable):
        allocator.allocate("default", "missing")
    with pytest.raises(Unschedulable, match="does not compile"):
        allocator.allocate("default", "broken")


def test_allocator_keeps_exclusive_devices_exclusive(
    cluster: tuple[FakeApiServer, Allocator],
) -> None:
    server, allocator = cluster
    body = _slice("n1", gpus="preset:1xH200")
    del body["spec"]["devices"][0]["allowMultipleAllocations"]
    server.add_object("resourceslices", body)
    _claim(server, "a", capacity={"cores": "10"})
    _claim(server, "b", capacity={"cores": "10"})
    assert _results(allocator.allocate("default", "a")) == [("gpu-0", None)]
    with pytest.raises(Unschedulable):
        allocator.allocate("default", "b")
    _claim(server, "class-missing", device_class="nope.example.com")
    with pytest.raises(Unschedulable, match="DeviceClass"):
        allocator.allocate("default", "class-missing")


def test_allocator_copies_class_then_claim_config_with_their_source(
    cluster: tuple[FakeApiServer, Allocator],
) -> None:
    server, allocator = cluster
    server.add_object("resourceslices", _slice("n1", gpus="preset:2xH200"))
    params = {"apiVersion": f"{DRIVER}/v1", "kind": "SliceConfig"}
    klass = device_class_body(DRIVER)
    klass["metadata"]["name"] = "with-config"
    klass["spec"]["config"] = [
        {"opaque": {"driver": DRIVER, "parameters": {**params, "coreLimit": 50}}}
    ]
    server.add_object("deviceclasses", klass)
    body = claim_body("a", device_class="with-config", capacity={"cores": "30"})
    body["spec"]["devices"]["config"] = [
        {
            "requests": ["gpu"],
            "opaque": {"driver": DRIVER, "parameters": {**params, "coreLimit": 80}},
        }
    ]
    server.add_object("resourceclaims", body)
    config = allocator.allocate("default", "a")["allocation"]["devices"]["config"]
    assert [
        (c["source"], c.get("requests"), c["opaque"]["parameters"]["coreLimit"]) for c in config
    ] == [
        ("FromClass", ["gpu"], 50),
        ("FromClaim", ["gpu"], 80),
    ]
    _claim(server, "b", capacity={"cores": "10"})  # no config anywhere: none allocated
    assert "config" not in allocator.allocate("default", "b")["allocation"]["devices"]
