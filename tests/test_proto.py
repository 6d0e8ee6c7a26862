"""The committed gRPC stubs: fresh from proto/, and wire-compatible with the kubelet.

A stale stub (proto edited, `make proto` not run) fails the first test; a
field renumbered or renamed away from the public kubelet API fails the table.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor
from grpc_tools import protoc  # type: ignore[import-untyped]

from vgpu.pb import deviceplugin_v1beta1_pb2 as dp
from vgpu.pb import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from vgpu.pb import dra_v1_pb2 as dra
from vgpu.pb import dra_v1_pb2_grpc as dra_grpc
from vgpu.pb import drahealth_v1alpha1_pb2 as health
from vgpu.pb import drahealth_v1alpha1_pb2_grpc as health_grpc
from vgpu.pb import pluginregistration_v1_pb2 as reg
from vgpu.pb import pluginregistration_v1_pb2_grpc as reg_grpc
from vgpu.pb import podresources_v1_pb2 as pr
from vgpu.pb import podresources_v1_pb2_grpc as pr_grpc

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
PROTOS = {
    "vgpu/pb/deviceplugin_v1beta1.proto": dp,
    "vgpu/pb/podresources_v1.proto": pr,
    "vgpu/pb/dra_v1.proto": dra,
    "vgpu/pb/pluginregistration_v1.proto": reg,
    "vgpu/pb/drahealth_v1alpha1.proto": health,
}


def _serialized_file(stub: Path) -> bytes:
    """The FileDescriptorProto bytes a generated _pb2.py registers."""
    for node in ast.walk(ast.parse(stub.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "AddSerializedFile"
        ):
            value = ast.literal_eval(node.args[0])
            assert isinstance(value, bytes)
            return value
    raise AssertionError(f"{stub}: no AddSerializedFile call")


def test_committed_stubs_match_the_protos(short_tmp: Path) -> None:
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={short_tmp}",
            f"--grpc_python_out={short_tmp}",
            *(str(ROOT / "proto" / name) for name in PROTOS),
        ]
    )
    assert rc == 0, "protoc failed on proto/vgpu/pb/*.proto"
    for name, module in PROTOS.items():
        stem = name.removesuffix(".proto")
        fresh_bytes = _serialized_file(short_tmp / f"{stem}_pb2.py")
        fresh = descriptor_pb2.FileDescriptorProto.FromString(fresh_bytes)
        committed = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        assert committed.name == name  # distinct paths: both upstream files are api.proto
        assert committed == fresh, f"{name}: stale stub; run `make proto` and commit vgpu/pb/"
        assert module.DESCRIPTOR.serialized_pb == fresh_bytes
        # The committed file registers the same bytes it was generated with.
        assert _serialized_file(ROOT / f"{stem}_pb2.py") == fresh_bytes
        assert (short_tmp / f"{stem}_pb2_grpc.py").exists()


def test_packages() -> None:
    assert dp.DESCRIPTOR.package == "v1beta1"
    assert pr.DESCRIPTOR.package == "v1"
    assert dra.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1"
    assert reg.DESCRIPTOR.package == "pluginregistration"
    assert health.DESCRIPTOR.package == "v1alpha1"  # upstream's, for the method path


# ------------------------------------------------------------ method paths


class RecordingChannel:
    """Enough of a grpc.Channel for a generated stub's constructor: records paths."""

    def __init__(self) -> None:
        self.paths: dict[str, str] = {}

    def _record(self, kind: str) -> Any:
        def method(path: str, *args: object, **kwargs: object) -> object:
            self.paths[path] = kind
            return object()

        return method

    def __getattr__(self, name: str) -> Any:
        if name in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            return self._record(name)
        raise AttributeError(name)


METHODS = {
    "/v1beta1.Registration/Register": "unary_unary",
    "/v1beta1.DevicePlugin/GetDevicePluginOptions": "unary_unary",
    "/v1beta1.DevicePlugin/ListAndWatch": "unary_stream",
    "/v1beta1.DevicePlugin/GetPreferredAllocation": "unary_unary",
    "/v1beta1.DevicePlugin/Allocate": "unary_unary",
    "/v1beta1.DevicePlugin/PreStartContainer": "unary_unary",
    "/v1.PodResourcesLister/List": "unary_unary",
    "/v1.PodResourcesLister/GetAllocatableResources": "unary_unary",
    "/v1.PodResourcesLister/Get": "unary_unary",
    "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources": "unary_unary",
    "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources": "unary_unary",
    "/pluginregistration.Registration/GetInfo": "unary_unary",
    "/pluginregistration.Registration/NotifyRegistrationStatus": "unary_unary",
    "/v1alpha1.DRAResourceHealth/NodeWatchResources": "unary_stream",
}


def test_method_paths_in_descriptors_and_stubs() -> None:
    from_descriptors = {
        f"/{service.full_name}/{method.name}"
        for module in (dp, pr, dra, reg, health)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    assert from_descriptors == set(METHODS)
    channel = RecordingChannel()
    dp_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
    dp_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
    pr_grpc.PodResourcesListerStub(channel)  # type: ignore[no-untyped-call]
    dra_grpc.DRAPluginStub(channel)  # type: ignore[no-untyped-call]
    reg_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
    health_grpc.DRAResourceHealthStub(channel)  # type: ignore[no-untyped-call]
    assert channel.paths == METHODS


# ------------------------------------------------------------- field table

# From the public kubelet API (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1 and
# .../podresources/v1 api.proto): message -> {field name: number}.
DEVICE_PLUGIN: dict[str, dict[str, int]] = {
    "DevicePluginOptions": {"pre_start_required": 1, "get_preferred_allocation_available": 2},
    "RegisterRequest": {"version": 1, "endpoint": 2, "resource_name": 3, "options": 4},
    "Empty": {},
    "ListAndWatchResponse": {"devices": 1},
    "TopologyInfo": {"nodes": 1},
    "NUMANode": {"ID": 1},
    "Device": {"ID": 1, "health": 2, "topology": 3},
    "PreStartContainerRequest": {"devices_ids": 1},
    "PreStartContainerResponse": {},
    "PreferredAllocationRequest": {"container_requests": 1},
    "ContainerPreferredAllocationRequest": {
        "available_deviceIDs": 1,
        "must_include_deviceIDs": 2,
        "allocation_size": 3,
    },
    "PreferredAllocationResponse": {"container_responses": 1},
    "ContainerPreferredAllocationResponse": {"deviceIDs": 1},
    "AllocateRequest": {"container_requests": 1},
    "ContainerAllocateRequest": {"devices_ids": 1},
    "CDIDevice": {"name": 1},
    "AllocateResponse": {"container_responses": 1},
    "ContainerAllocateResponse": {
        "envs": 1,
        "mounts": 2,
        "devices": 3,
        "annotations": 4,
        "cdi_devices": 5,
    },
    "Mount": {"container_path": 1, "host_path": 2, "read_only": 3},
    "DeviceSpec": {"container_path": 1, "host_path": 2, "permissions": 3},
}

POD_RESOURCES: dict[str, dict[str, int]] = {
    "AllocatableResourcesRequest": {},
    "AllocatableResourcesResponse": {"devices": 1, "cpu_ids": 2, "memory": 3},
    "ListPodResourcesRequest": {},
    "ListPodResourcesResponse": {"pod_resources": 1},
    "PodResources": {"name": 1, "namespace": 2, "containers": 3},
    "ContainerResources": {
        "name": 1,
        "devices": 2,
        "cpu_ids": 3,
        "memory": 4,
        "dynamic_resources": 5,
    },
    "ContainerMemory": {"memory_type": 1, "size": 2, "topology": 3},
    "ContainerDevices": {"resource_name": 1, "device_ids": 2, "topology": 3},
    "TopologyInfo": {"nodes": 1},
    "NUMANode": {"ID": 1},
    "DynamicResource": {
        "class_name": 1,
        "claim_name": 2,
        "claim_namespace": 3,
        "claim_resources": 4,
    },
    "ClaimResource": {"cdi_devices": 1, "driver_name": 2, "pool_name": 3, "device_name": 4},
    "CDIDevice": {"name": 1},
    "GetPodResourcesRequest": {"pod_name": 1, "pod_namespace": 2},
    "GetPodResourcesResponse": {"pod_resources": 1},
}

# k8s.io/kubelet/pkg/apis/dra/v1 and .../pluginregistration/v1 (the wire facts).
DRA: dict[str, dict[str, int]] = {
    "NodePrepareResourcesRequest": {"claims": 1},
    "NodePrepareResourcesResponse": {"claims": 1},
    "NodePrepareResourceResponse": {"devices": 1, "error": 2},
    "Device": {
        "request_names": 1,
        "pool_name": 2,
        "device_name": 3,
        "cdi_device_ids": 4,
        "share_id": 5,
    },
    "NodeUnprepareResourcesRequest": {"claims": 1},
    "NodeUnprepareResourcesResponse": {"claims": 1},
    "NodeUnprepareResourceResponse": {"error": 1},
    "Claim": {"namespace": 1, "uid": 2, "name": 3},
}

REGISTRATION: dict[str, dict[str, int]] = {
    "PluginInfo": {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4},
    "RegistrationStatus": {"plugin_registered": 1, "error": 2},
    "RegistrationStatusResponse": {},
    "InfoRequest": {},
}


@pytest.mark.parametrize(
    "module, table",
    [(dp, DEVICE_PLUGIN), (pr, POD_RESOURCES), (dra, DRA), (reg, REGISTRATION)],
    ids=["deviceplugin-v1beta1", "podresources-v1", "dra-v1", "pluginregistration"],
)
def test_every_message_field_name_and_number(
    module: ModuleType, table: dict[str, dict[str, int]]
) -> None:
    messages = module.DESCRIPTOR.message_types_by_name
    assert set(messages) == set(table)
    for name, fields in table.items():
        got = {f.name: f.number for f in messages[name].fields}
        assert got == fields, name


@pytest.mark.parametrize(
    "message, field, type_, repeated",
    [
        (dp.NUMANode, "ID", FieldDescriptor.TYPE_INT64, False),
        (
            dp.ContainerPreferredAllocationRequest,
            "allocation_size",
            FieldDescriptor.TYPE_INT32,
            False,
        ),
        (
            dp.ContainerPreferredAllocationRequest,
            "available_deviceIDs",
            FieldDescriptor.TYPE_STRING,
            True,
        ),
        (dp.ContainerAllocateRequest, "devices_ids", FieldDescriptor.TYPE_STRING, True),
        (dp.Device, "health", FieldDescriptor.TYPE_STRING, False),
        (dp.Mount, "read_only", FieldDescriptor.TYPE_BOOL, False),
        (pr.ContainerDevices, "device_ids", FieldDescriptor.TYPE_STRING, True),
        (pr.ContainerMemory, "size", FieldDescriptor.TYPE_UINT64, False),
        (pr.NUMANode, "ID", FieldDescriptor.TYPE_INT64, False),
        (dra.Device, "cdi_device_ids", FieldDescriptor.TYPE_STRING, True),
        (dra.Device, "request_names", FieldDescriptor.TYPE_STRING, True),
        (dra.Device, "share_id", FieldDescriptor.TYPE_STRING, False),
        (dra.Claim, "uid", FieldDescriptor.TYPE_STRING, False),
        (dra.NodePrepareResourceResponse, "error", FieldDescriptor.TYPE_STRING, False),
        (reg.PluginInfo, "supported_versions", FieldDescriptor.TYPE_STRING, True),
        (reg.RegistrationStatus, "plugin_registered", FieldDescriptor.TYPE_BOOL, False),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_wire_types(message: Any, field: str, type_: int, repeated: bool) -> None:
    descriptor = message.DESCRIPTOR.fields_by_name[field]
    assert descriptor.type == type_
    assert descriptor.is_repeated is repeated


def test_maps_are_string_to_string() -> None:
    fields = dp.ContainerAllocateResponse.DESCRIPTOR.fields_by_name
    for name in ("envs", "annotations"):
        entry = fields[name].message_type
        assert entry is not None
        assert entry.GetOptions().map_entry
        assert {f.name: f.type for f in entry.fields} == {
            "key": FieldDescriptor.TYPE_STRING,
            "value": FieldDescriptor.TYPE_STRING,
        }


def test_share_id_is_optional_with_presence() -> None:
    field = dra.Device.DESCRIPTOR.fields_by_name["share_id"]
    assert field.has_presence
    assert not dra.Device().HasField("share_id")
    assert dra.Device(share_id="").HasField("share_id")


@pytest.mark.parametrize(
    "message, value",
    [
        (dra.NodePrepareResourcesResponse, dra.NodePrepareResourceResponse),
        (dra.NodeUnprepareResourcesResponse, dra.NodeUnprepareResourceResponse),
    ],
    ids=["prepare", "unprepare"],
)
def test_dra_answers_are_maps_keyed_by_claim_uid(message: Any, value: Any) -> None:
    entry = message.DESCRIPTOR.fields_by_name["claims"].message_type
    assert entry.GetOptions().map_entry
    fields = entry.fields_by_name
    assert fields["key"].type == FieldDescriptor.TYPE_STRING
    assert fields["value"].message_type.full_name == value.DESCRIPTOR.full_name
