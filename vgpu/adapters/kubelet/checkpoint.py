"""The kubelet device manager's checkpoint file: read only, for recovery.

``kubelet_internal_checkpoint`` (JSON, in the device-plugin directory) holds
every registered device ID of every resource plus, per container and
resource, the IDs it holds (by NUMA node) and its Allocate response (the
protobuf bytes, base64 as Go's encoding/json writes a []byte). That saved
answer is what the kubelet hands the runtime on every container start, so it
names the config directory a running container has mounted: adoption after
a loss of state re-creates the record exactly there, never under a new key.

Layout (pkg/kubelet/cm/devicemanager/checkpoint): ``{"Data": {
"PodDeviceEntries": [{"PodUID", "ContainerName", "ResourceName", "DeviceIDs":
{"<numa>": [ids]}, "AllocResp": "<base64>"}], "RegisteredDevices": {resource:
[ids]}}, "Checksum": <uint32>}``.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from vgpu.adapters.bounded import read_bounded
from vgpu.core.contract import CONFIG_MOUNT
from vgpu.pb import deviceplugin_v1beta1_pb2 as pb

CHECKPOINT_NAME = "kubelet_internal_checkpoint"
MAX_CHECKPOINT_BYTES = 256 * 1024 * 1024  # far above any real node's (MBs at most)
_KEY = re.compile(r"p[0-9a-f]{20}")


@dataclass(frozen=True)
class Entry:
    """One container's devices of one resource."""

    pod_uid: str
    container: str
    resource: str
    device_ids: Mapping[int, Sequence[str]]  # NUMA node (-1: none) -> IDs
    alloc_resp: bytes

    def ids(self) -> frozenset[str]:
        return frozenset(d for ids in self.device_ids.values() for d in ids)


def decode(raw: bytes) -> tuple[list[Entry], dict[str, list[str]]]:
    """Entries and registered devices of a checkpoint; ValueError if malformed."""
    try:
        doc: Any = json.loads(raw)
        data = doc["Data"]
        entries = [
            Entry(
                pod_uid=str(e["PodUID"]),
                container=str(e["ContainerName"]),
                resource=str(e["ResourceName"]),
                device_ids={int(n): [str(i) for i in ids] for n, ids in e["DeviceIDs"].items()},
                alloc_resp=base64.b64decode(e.get("AllocResp") or ""),
            )
            for e in data.get("PodDeviceEntries") or []
        ]
        registered = {
            str(r): [str(i) for i in ids]
            for r, ids in (data.get("RegisteredDevices") or {}).items()
        }
    except (KeyError, TypeError, AttributeError, binascii.Error) as exc:
        raise ValueError(f"not a kubelet device checkpoint: {exc!r}") from None
    return entries, registered


def read(path: Path) -> list[Entry]:
    """The checkpoint's entries: opened without following a link or blocking,
    read in bounded amounts. OSError when it cannot be read, ValueError when
    it is not a checkpoint."""
    raw, more = read_bounded(path, MAX_CHECKPOINT_BYTES, 1 << 20)
    if more:
        raise ValueError(f"{path} is over {MAX_CHECKPOINT_BYTES} bytes")
    return decode(raw)[0]


def mounted_key(entries: Sequence[Entry], ids: Collection[str], state_root: Path) -> str | None:
    """The placement key whose config directory the kubelet's saved answer mounts
    for the container holding `ids`: from the /etc/vgpu mount (envvar and
    volume-mounts deliveries) or the CDI device name (cdi). None if no entry
    holds them or no answer names one of ours."""
    wanted = set(ids)
    holders = {(e.pod_uid, e.container) for e in entries if e.ids() & wanted}
    for entry in entries:
        if (entry.pod_uid, entry.container) not in holders or not entry.alloc_resp:
            continue
        answer = pb.ContainerAllocateResponse()
        try:
            answer.ParseFromString(entry.alloc_resp)
        except DecodeError:
            continue
        for mount in answer.mounts:
            path = Path(mount.host_path)
            ours = mount.container_path == CONFIG_MOUNT and path.parent == state_root
            if ours and _KEY.fullmatch(path.name):
                return path.name
        for device in answer.cdi_devices:
            name = device.name.rpartition("=")[2]
            if _KEY.fullmatch(name):
                return name
    return None
