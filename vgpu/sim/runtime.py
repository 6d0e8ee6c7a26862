"""A container runtime stand-in: what a container sees once the runtime applied
the kubelet's merged Allocate answers and resolved their CDI device names.

It follows what containerd and CRI-O do, as far as vgpu's contract goes:

* CDI devices are looked up by fully qualified name (`vendor/class=name`) in
  the spec files of the CDI directories (`*.json`, `*.yaml`); an unknown name
  fails the container (`unresolvable CDI devices`);
* each device's containerEdits are applied in order: `env` entries set
  variables (a later one of the same name wins, as in the OCI spec), mounts
  and device nodes are added; a device node whose host path does not exist
  fails the container (`failed to stat CDI host device`), as does one named by
  the Allocate answer (`lstat /dev/nvidia0: no such file or directory`).

Paths of device nodes are checked under `host_dev_dir`, the test's stand-in
for the host's /dev.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vgpu.sim.kubelet import ContainerResult


class ContainerCreateError(Exception):
    """The runtime refuses to create the container (CreateContainerError)."""


@dataclass
class ContainerView:
    envs: dict[str, str] = field(default_factory=dict)
    mounts: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)  # dst -> src
    devices: dict[str, str] = field(default_factory=dict)  # container path -> host path


def load_cdi_devices(cdi_dirs: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """Every device of every spec: qualified name -> containerEdits."""
    out: dict[str, dict[str, Any]] = {}
    for directory in cdi_dirs:
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            if path.name.startswith(".") or path.suffix not in (".json", ".yaml"):
                continue
            text = path.read_text()
            spec = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
            for device in spec.get("devices", []):
                name = f"{spec['kind']}={device['name']}"
                if name in out:
                    raise ContainerCreateError(f"CDI device {name} defined twice")
                out[name] = device.get("containerEdits", {})
    return out


def _host_node(host_dev_dir: Path, path: str) -> Path:
    return host_dev_dir / path.removeprefix("/dev/")


def container_view(
    result: ContainerResult, cdi_dirs: Sequence[Path], host_dev_dir: Path
) -> ContainerView:
    """The env, mounts and device nodes of the container the runtime creates."""
    view = ContainerView(envs=dict(result.envs))
    for mount in result.mounts:
        view.mounts[mount.container_path] = (
            mount.host_path,
            ("ro",) if mount.read_only else ("rw",),
        )
    for dev in result.devices:
        if not _host_node(host_dev_dir, dev.host_path).exists():
            raise ContainerCreateError(f"lstat {dev.host_path}: no such file or directory")
        view.devices[dev.container_path] = dev.host_path
    if result.cdi_devices:
        known = load_cdi_devices(cdi_dirs)
        missing = [n for n in result.cdi_devices if n not in known]
        if missing:
            raise ContainerCreateError(f"unresolvable CDI devices {', '.join(missing)}")
        for name in result.cdi_devices:
            edits = known[name]
            for entry in edits.get("env", []):
                key, _, value = entry.partition("=")
                view.envs[key] = value
            for mount in edits.get("mounts", []):
                view.mounts[mount["containerPath"]] = (
                    mount["hostPath"],
                    tuple(mount.get("options", [])),
                )
            for node in edits.get("deviceNodes", []):
                host = node.get("hostPath") or node["path"]
                if not _host_node(host_dev_dir, host).exists():
                    raise ContainerCreateError(
                        f'CDI device injection failed: failed to stat CDI host device "{host}"'
                    )
                view.devices[node["path"]] = host
    return view
