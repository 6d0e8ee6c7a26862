"""CDI spec files: how a container runtime learns what a prepared claim's
container gets.

One file per claim in the CDI directory (`<domain>-vgpu_<claim uid>.json`),
written atomically; one CDI device per allocated (claim, request, device).
Each device's containerEdits are the limit contract (vgpu.core.contract)
translated field by field, whatever envs, mounts and device nodes it lists.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from vgpu.adapters.fs import atomic_write
from vgpu.core.contract import ContainerEdits

CDI_VERSION = "0.5.0"  # env, deviceNodes and mounts; containerd 1.7+, CRI-O 1.28+


def container_edits_json(edits: ContainerEdits) -> dict[str, Any]:
    """The CDI containerEdits of one contract."""
    return {
        "env": [f"{key}={value}" for key, value in sorted(edits.envs.items())],
        "deviceNodes": [
            {"path": d.container_path, "hostPath": d.host_path, "permissions": d.permissions}
            for d in edits.devices
        ],
        "mounts": [
            {
                "hostPath": m.host_path,
                "containerPath": m.container_path,
                "options": ["ro" if m.read_only else "rw", "nosuid", "nodev", "bind"],
            }
            for m in edits.mounts
        ],
    }


def spec_document(kind: str, devices: dict[str, ContainerEdits]) -> dict[str, Any]:
    """A CDI spec: cdiVersion, kind and one device per name."""
    return {
        "cdiVersion": CDI_VERSION,
        "kind": kind,
        "devices": [
            {"name": name, "containerEdits": container_edits_json(edits)}
            for name, edits in devices.items()
        ],
    }


class CdiDir:
    """The CDI spec directory (e.g. /var/run/cdi), vgpu's files only."""

    def __init__(self, directory: Path, domain: str) -> None:
        self.directory = directory
        self.kind = f"{domain}/vgpu"
        self.prefix = f"{domain}-vgpu_"

    def file_name(self, claim_uid: str) -> str:
        return f"{self.prefix}{claim_uid}.json"

    def qualified(self, device: str) -> str:
        """The fully qualified CDI device ID the kubelet passes to the runtime."""
        return f"{self.kind}={device}"

    def write(self, name: str, document: dict[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        atomic_write(self.directory / name, json.dumps(document, indent=1).encode())

    def read(self, name: str) -> Any:
        """The spec as written, or None when missing or unreadable."""
        try:
            return json.loads((self.directory / name).read_text())
        except (OSError, ValueError):
            return None

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.directory / name)

    def names(self) -> list[str]:
        """vgpu's spec files present now."""
        try:
            return sorted(
                entry.name
                for entry in self.directory.iterdir()
                if entry.name.startswith(self.prefix) and entry.name.endswith(".json")
            )
        except FileNotFoundError:
            return []
