"""The fake API server's resource.k8s.io/v1 group, through the official client,
and the scheduler stand-in that allocates claims by consumable capacity."""

from __future__ import annotations

import json
import queue
import threading
import urllib.error
import urllib.request
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


def _put_status(server: FakeApiServer, name: str, body: dict[str, Any]) -> tuple[int, Any]:
    """PUT .../resourceclaims/NAME/status as raw JSON (the client's models would
    refuse some of these bodies before they are sent)."""
    request = urllib.request.Request(
        f"{server.url}/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{name}/status",
        data=json.dumps(body).encode(),
        method="PUT",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


SHARE = "b92979d6-b9b4-4755-845b-55dfce4383b0"
ENTRY = {"driver": DRIVER, "pool": "n1", "device": "gpu-0", "shareID": SHARE, "data": {"a": 1}}
READY = {
    "type": "Ready",
    "status": "True",
    "reason": "Prepared",
    "message": "m",
    "lastTransitionTime": "2026-12-04T22:52:23Z",
}


def _allocated_claim(server: FakeApiServer, name: str = "c1", node: str = "n1") -> dict[str, Any]:
    server.add_object("resourceclaims", claim_body(name, capacity={"cores": "30"}))
    result = {"request": "gpu", "driver": DRIVER, "pool": "n1", "device": "gpu-0", "shareID": SHARE}
    selector = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}

    def allocate(obj: dict[str, Any]) -> None:
        obj["status"] = {
            "allocation": {
                "devices": {"results": [result]},
                "nodeSelector": {"nodeSelectorTerms": [selector]},
            }
        }

    return server.update_object("resourceclaims", name, allocate, "default")


# What kube-apiserver 1.36.2 answered to these status.devices (../shared/realk8s,
# issue 29), and the message it gave (after `is invalid: `).
_DEVICES = [
    pytest.param([ENTRY], 200, "", id="an-allocated-device"),
    pytest.param([{**ENTRY, "conditions": [READY]}], 200, "", id="with-a-ready-condition"),
    pytest.param([{**ENTRY, "data": {"limit": None}}], 200, "", id="null-inside-data"),
    pytest.param(
        [{k: v for k, v in ENTRY.items() if k != "shareID"}],
        422,
        'status.devices[0]: Invalid value: {"Driver":"vgpu.vendor.io","Pool":"n1",'
        '"Device":"gpu-0","ShareID":""}: must be an allocated device in the claim',
        id="shared-card-without-its-shareID",
    ),
    pytest.param(
        [{**ENTRY, "device": "gpu-9"}],
        422,
        "status.devices[0]: Invalid value: {"
        f'"Driver":"vgpu.vendor.io","Pool":"n1","Device":"gpu-9","ShareID":"{SHARE}"'
        "}: must be an allocated device in the claim",
        id="a-device-not-allocated",
    ),
    pytest.param(
        [ENTRY, ENTRY],
        422,
        "status.devices[1]: Duplicate value: {"
        f'"Driver":"vgpu.vendor.io","Pool":"n1","Device":"gpu-0","ShareID":"{SHARE}"' + "}",
        id="twice",
    ),
    pytest.param(
        [{**ENTRY, "data": [1, 2]}],
        422,
        'status.devices[0].data: Invalid value: "<value omitted>": must be a valid JSON object',
        id="data-a-list",
    ),
    pytest.param(
        [{**ENTRY, "conditions": [{"type": "Ready", "status": "True"}]}],
        422,
        "[status.devices[0].conditions[0].lastTransitionTime: Required value, "
        "status.devices[0].conditions[0].reason: Required value]",
        id="condition-without-time-and-reason",
    ),
    pytest.param(
        [{**ENTRY, "conditions": [{k: v for k, v in READY.items() if k != "reason"}]}],
        422,
        "status.devices[0].conditions[0].reason: Required value",
        id="condition-without-reason",
    ),
]


@pytest.mark.parametrize(("devices", "code", "message"), _DEVICES)
def test_claim_status_devices_are_validated_as_the_real_server_does(
    api: tuple[FakeApiServer, Any], devices: list[dict[str, Any]], code: int, message: str
) -> None:
    server, _ = api
    claim = _allocated_claim(server)
    claim["status"]["devices"] = devices
    got, reply = _put_status(server, "c1", claim)
    assert got == code, reply
    stored = server.get_object("resourceclaims", "c1", "default")
    if code == 200:
        assert stored["status"]["devices"] == devices  # type: ignore[index]
    else:
        assert reply["message"] == f'ResourceClaim.resource.k8s.io "c1" is invalid: {message}'
        assert reply["reason"] == "Invalid"
        assert "devices" not in stored["status"]  # type: ignore[index]


def test_a_condition_time_is_stored_as_metav1_time_writes_it(
    api: tuple[FakeApiServer, Any],
) -> None:
    """The kubernetes client sends `+00:00`; the API server stores `Z`."""
    server, api_client = api
    claim = _allocated_claim(server)
    claim["status"]["devices"] = [
        {**ENTRY, "conditions": [{**READY, "lastTransitionTime": "2026-12-04T23:52:23+01:00"}]}
    ]
    client.ResourceV1Api(api_client).replace_namespaced_resource_claim_status(
        "c1", "default", claim, _preload_content=False
    )
    stored = server.get_object("resourceclaims", "c1", "default")
    (cond,) = stored["status"]["devices"][0]["conditions"]  # type: ignore[index]
    assert cond["lastTransitionTime"] == "2026-12-04T22:52:23Z"


_DRIVER_RULE = {
    "apiGroups": ["resource.k8s.io"],
    "resources": ["resourceclaims/driver"],
    "resourceNames": [DRIVER],
    "verbs": ["associated-node:update"],
}
_STATUS_RULE = {
    "apiGroups": ["resource.k8s.io"],
    "resources": ["resourceclaims/status"],
    "verbs": ["update"],
}
_FORBIDDEN = (
    'status.devices: Forbidden: changing status.devices requires resource="resourceclaims/'
    'driver", verb="[{verbs}]" permission: resourceclaims.resource.k8s.io "vgpu.vendor.io" is '
    'forbidden: User "system:serviceaccount:vgpu-system:vgpu" cannot {first} resource '
    '"resourceclaims/driver" in API group "resource.k8s.io" in the namespace "default"'
)


@pytest.mark.parametrize(
    ("rules", "token_node", "verbs"),
    [
        pytest.param([_STATUS_RULE], "n1", "", id="status-update-alone"),  # the chart before
        pytest.param([_STATUS_RULE], None, "arbitrary-node:update", id="unbound-token"),
        pytest.param([_STATUS_RULE, _DRIVER_RULE], None, "", id="driver-rule-unbound-token"),
        pytest.param([_STATUS_RULE, _DRIVER_RULE], "n2", "", id="driver-rule-other-node"),
        pytest.param([_STATUS_RULE, _DRIVER_RULE], "n1", None, id="driver-rule-own-node"),
        pytest.param(
            [_STATUS_RULE, {**_DRIVER_RULE, "resourceNames": ["other.example.com"]}],
            "n1",
            "",
            id="another-drivers-name",
        ),
    ],
)
def test_changing_status_devices_needs_the_drivers_permission_since_1_36(
    api: tuple[FakeApiServer, Any],
    rules: list[dict[str, Any]],
    token_node: str | None,
    verbs: str | None,
) -> None:
    """kube-apiserver 1.36.2 (issue 29): the refusal names the verbs it tried,
    associated-node first for a token bound to the claim's node."""
    server, _ = api
    server.set_driver_status_access(rules, node=token_node)
    claim = _allocated_claim(server)
    claim["status"]["devices"] = [ENTRY]
    got, reply = _put_status(server, "c1", claim)
    if verbs is None:
        assert got == 200, reply
        cleared = server.get_object("resourceclaims", "c1", "default")
        cleared["status"].pop("devices")  # type: ignore[index]
        assert _put_status(server, "c1", cleared)[0] == 200  # removing ours: the same rule
        return
    tried = verbs or (
        "associated-node:update arbitrary-node:update"
        if token_node == "n1"
        else "arbitrary-node:update"
    )
    assert got == 422, reply
    assert reply["message"] == 'ResourceClaim.resource.k8s.io "c1" is invalid: ' + (
        _FORBIDDEN.format(verbs=tried, first=tried.split()[0])
    )
    # a status write that leaves status.devices alone needs no more than before
    unchanged = server.get_object("resourceclaims", "c1", "default")
    unchanged["status"]["reservedFor"] = [{"resource": "pods", "name": "p", "uid": "u"}]  # type: ignore[index]
    assert _put_status(server, "c1", unchanged)[0] == 200


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
