"""The guard against containers that escaped allocation (pure).

A kubelet can admit a pod that asks for vgpu resources without calling the
plugin at all: a pod bound while the plugin had not registered yet with a
(re-created) node whose Node object still showed capacity. Such a container
runs with no limit, no config and no hook. It shows as a running container
that asks for vcuda resources (the API server's pod spec) while the kubelet's
pod-resources record gives it no vgpu device.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from vgpu.core.model import ContainerSpec

POLICIES = ("warn", "evict")


@dataclass(frozen=True)
class Escapee:
    namespace: str
    pod: str
    container: str
    pod_uid: str
    core_percent: int
    memory_units: int

    def message(self, domain: str) -> str:
        asked = ", ".join(
            f"{domain}/{name}={n}"
            for name, n in (("vcuda-core", self.core_percent), ("vcuda-memory", self.memory_units))
            if n
        )
        return (
            f"container {self.container} asks {asked} but the kubelet allocated it no vgpu "
            "device: it runs without vgpu's limits (admitted before the device plugin "
            "registered with this kubelet?); delete the pod so that it is admitted again"
        )


def escaped(
    running: Iterable[ContainerSpec], holding: Collection[tuple[str, str, str]]
) -> list[Escapee]:
    """App containers of running pods that ask vcuda resources yet hold no vgpu
    device; `holding` are the (namespace, pod, container) the kubelet lists
    with at least one vgpu device ID."""
    out = []
    for spec in running:
        if spec.init or not spec.request.resources:
            continue
        if (spec.namespace, spec.pod, spec.container) in holding:
            continue
        out.append(
            Escapee(
                spec.namespace,
                spec.pod,
                spec.container,
                spec.pod_uid,
                spec.request.core_percent,
                spec.request.memory_units,
            )
        )
    return sorted(out, key=lambda e: (e.namespace, e.pod, e.container))
