"""The kubelet device manager's checkpoint file, as the kubelet writes it.

``kubelet_internal_checkpoint`` (JSON, in the device-plugin directory) holds
every registered device ID of every resource plus, per container and
resource, the IDs it holds (by NUMA node) and its Allocate response (the
protobuf bytes, base64 as Go's encoding/json writes a []byte). The kubelet
rewrites the whole file after every allocation, so its size, and the time to
write it, grow with the number and length of device IDs and responses.

Layout (pkg/kubelet/cm/devicemanager/checkpoint): ``{"Data": {
"PodDeviceEntries": [{"PodUID", "ContainerName", "ResourceName", "DeviceIDs":
{"<numa>": [ids]}, "AllocResp": "<base64>"}], "RegisteredDevices": {resource:
[ids]}}, "Checksum": <uint32>}``. The checksum here is FNV-32a of the Data
JSON (the kubelet hashes its Go value the same way in spirit; nothing reads
it but this module).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from vgpu.adapters.kubelet.checkpoint import CHECKPOINT_NAME, Entry, decode

__all__ = ["CHECKPOINT_NAME", "Entry", "decode", "encode", "write"]


def _fnv32a(data: bytes) -> int:
    value = 0x811C9DC5
    for byte in data:
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return value


def encode(entries: Sequence[Entry], registered: Mapping[str, Sequence[str]]) -> bytes:
    data = {
        "PodDeviceEntries": [
            {
                "PodUID": e.pod_uid,
                "ContainerName": e.container,
                "ResourceName": e.resource,
                "DeviceIDs": {str(n): list(ids) for n, ids in sorted(e.device_ids.items())},
                "AllocResp": base64.b64encode(e.alloc_resp).decode(),
            }
            for e in entries
        ],
        "RegisteredDevices": {r: list(ids) for r, ids in sorted(registered.items())},
    }
    body = json.dumps(data, separators=(",", ":")).encode()
    # The checksum over a bounded prefix: enough to detect a torn file here,
    # and cheap (pure-Python FNV over megabytes would dominate the write).
    checksum = _fnv32a(body[:4096]) ^ len(body)
    return b'{"Data":' + body + b',"Checksum":' + str(checksum).encode() + b"}"


def write(path: Path, payload: bytes, fsync: bool = True) -> None:
    """Write atomically, as the kubelet's file store does (temp file, fsync, rename)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
