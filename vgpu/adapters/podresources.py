"""Client of the kubelet's pod-resources API (v1.PodResourcesLister/List).

It is the kubelet's own record of which device IDs each live container holds,
so it is the truth for recovery and for learning who owns a placement.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from vgpu.adapters.fs import socket_identity
from vgpu.core.model import DeviceId
from vgpu.core.reuse import KubeletListing
from vgpu.pb import podresources_v1_pb2 as pr
from vgpu.pb import podresources_v1_pb2_grpc as pr_grpc


@dataclass(frozen=True)
class ContainerDevices:
    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


class PodResourcesUnavailable(Exception):
    pass


def _devices(reply: pr.ListPodResourcesResponse, resources: set[str]) -> list[ContainerDevices]:
    out = []
    for pod in reply.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if devices.resource_name in resources:
                    out.append(
                        ContainerDevices(
                            pod.namespace,
                            pod.name,
                            container.name,
                            devices.resource_name,
                            tuple(devices.device_ids),
                        )
                    )
    return out


class PodResourcesClient:
    def __init__(self, socket_path: Path, timeout_s: float = 2.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._channel: grpc.Channel | None = None
        # (inode, ctime ns) of the socket the last answer came from: a new
        # kubelet re-creates the socket, so a change means it restarted.
        self.last_identity: tuple[int, int] | None = None

    def _stub(self) -> pr_grpc.PodResourcesListerStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(
                f"unix://{self.socket_path}",
                options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)],
            )
        return pr_grpc.PodResourcesListerStub(self._channel)  # type: ignore[no-untyped-call]

    def _list(self) -> pr.ListPodResourcesResponse:
        identity = socket_identity(self.socket_path)
        if identity is None:
            raise PodResourcesUnavailable(f"{self.socket_path} does not exist")
        if identity != self.last_identity and self._channel is not None:
            self.close()  # a new kubelet: dial its socket afresh
        self.last_identity = identity
        try:
            reply: pr.ListPodResourcesResponse = self._stub().List(
                pr.ListPodResourcesRequest(), timeout=self.timeout_s
            )
        except grpc.RpcError as exc:
            self.close()
            raise PodResourcesUnavailable(f"List failed: {exc.code().name}") from exc
        except ValueError as exc:  # the channel was closed by another thread's failure
            raise PodResourcesUnavailable(f"List failed: {exc}") from exc
        return reply

    def snapshot(self, resources: set[str]) -> KubeletListing:
        """Every active pod with its app containers, and who holds which of our IDs."""
        reply = self._list()
        pods = {
            (pod.namespace, pod.name): frozenset(c.name for c in pod.containers)
            for pod in reply.pod_resources
        }
        held = {
            DeviceId(device_id): (item.namespace, item.pod, item.container)
            for item in _devices(reply, resources)
            for device_id in item.device_ids
        }
        return KubeletListing(pods, held)

    def list(self, resources: set[str]) -> list[ContainerDevices]:
        """Every live container's IDs of the given resources."""
        return _devices(self._list(), resources)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
