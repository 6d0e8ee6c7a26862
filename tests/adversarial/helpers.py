"""What the attack tests share: where a container's files are, and the checks
that no tenant ever sees another's files or limits."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vgpu.sim.kubelet import ContainerResult

MARKER = b"planted by the previous tenant\n"
CONFIG_MOUNT = "/etc/vgpu"


def config_dir(c: ContainerResult) -> Path:
    return Path(next(m.host_path for m in c.mounts if m.container_path == CONFIG_MOUNT))


def config(c: ContainerResult) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((config_dir(c) / "config.json").read_text())
    return data


def writable_mounts(c: ContainerResult) -> list[Path]:
    """The host paths a container may write: a directory or a single file."""
    return [Path(m.host_path) for m in c.mounts if not m.read_only]


def plant(c: ContainerResult) -> None:
    """What a hostile tenant leaves behind in everything it can write."""
    for path in writable_mounts(c):
        if path.is_dir():
            (path / "vgpu.shm").write_bytes(MARKER)
            (path / "leftover").write_bytes(MARKER)
        else:
            with open(path, "r+b") as fh:
                fh.write(MARKER)


def sees_planted(c: ContainerResult) -> list[str]:
    """Planted bytes anywhere this container can read or write through its mounts."""
    found = []
    for path in [*writable_mounts(c), config_dir(c)]:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for file in files:
            fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                if MARKER in os.read(fd, 1 << 16):
                    found.append(str(file))
            finally:
                os.close(fd)
    return found
