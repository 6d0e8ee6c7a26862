"""The filesystem: per-container config directories (which double as the
durable placement state), atomic writes, the hook library install, and the
watch on the kubelet's device-plugin directory.

Layout under --state-dir (must survive node reboots: the kubelet replays the
saved Allocate answer, which points here, without calling Allocate again):

    <state>/containers/<key>/config.json      limits + placement record (read-only in the container)
    <state>/containers/<key>/shared/vgpu.shm  the hook budget file (mounted alone, read-write)

<key> is derived from the device IDs, never from a guessed pod.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vgpu.adapters import budget
from vgpu.core.model import CardUuid, DeviceId, Owner, Placement, Resource

log = logging.getLogger(__name__)

CONFIG_SCHEMA_VERSION = 1


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write, fsync, rename, fsync the directory: all or nothing after a crash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fchmod(fh.fileno(), mode)
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def placement_record(placement: Placement, memory_unit_mib: int) -> dict[str, Any]:
    """The JSON the hook and `vgpu status` read; also our durable state."""
    owner = placement.owner
    return {
        "version": CONFIG_SCHEMA_VERSION,
        "key": placement.key,
        "cards": list(placement.cards),
        "core_percent": placement.core_percent if 0 < placement.core_percent < 100 else None,
        "core_units": placement.core_percent,
        "memory_limit_mib": placement.memory_mib or None,
        "memory_unit_mib": memory_unit_mib,
        "whole_cards": placement.whole,
        "device_ids": {r.value: sorted(ids) for r, ids in placement.ids.items()},
        "pod": (
            {"namespace": owner.namespace, "name": owner.pod, "uid": owner.pod_uid}
            if owner
            else None
        ),
        "container": owner.container if owner else None,
        "created_s": placement.created_s,
    }


def placement_from_record(data: Any) -> Placement:
    """Inverse of placement_record; ValueError on anything malformed."""
    if not isinstance(data, dict) or data.get("version") != CONFIG_SCHEMA_VERSION:
        raise ValueError("not a vgpu placement record of a known version")
    ids = {
        Resource(name): frozenset(DeviceId(str(d)) for d in values)
        for name, values in dict(data["device_ids"]).items()
    }
    pod = data.get("pod")
    owner = (
        Owner(str(pod["namespace"]), str(pod["name"]), str(data["container"]), str(pod["uid"]))
        if pod and data.get("container")
        else None
    )
    return Placement(
        key=str(data["key"]),
        cards=tuple(CardUuid(str(c)) for c in data["cards"]),
        ids=ids,
        core_percent=int(data["core_units"]),
        memory_mib=int(data["memory_limit_mib"] or 0),
        owner=owner,
        created_s=float(data["created_s"]),
    )


@dataclass(frozen=True)
class ContainerPaths:
    config_dir: Path
    config_file: Path
    shared_dir: Path

    @property
    def budget_file(self) -> Path:
        return self.shared_dir / budget.FILE_NAME


class ContainerStore:
    """Per-container directories under <state>/containers."""

    def __init__(self, state_dir: Path, memory_unit_mib: int) -> None:
        self.root = state_dir / "containers"
        self.memory_unit_mib = memory_unit_mib

    def paths(self, key: str) -> ContainerPaths:
        config_dir = self.root / key
        return ContainerPaths(config_dir, config_dir / "config.json", config_dir / "shared")

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.sweep_trash()

    def write(self, placement: Placement) -> ContainerPaths:
        paths = self.paths(placement.key)
        paths.shared_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        # The budget file exists, at its size, before the container starts: only
        # it is mounted, so the container has nothing else to write on the host.
        repaired = budget.ensure(paths.budget_file)
        if repaired:
            log.warning("budget file of %s: %s", placement.key, repaired)
        body = json.dumps(placement_record(placement, self.memory_unit_mib), indent=1).encode()
        atomic_write(paths.config_file, body)
        return paths

    def remove(self, key: str) -> None:
        shutil.rmtree(self.paths(key).config_dir, ignore_errors=True)

    def discard(self, key: str) -> None:
        """Move a record out of the way at once; the files go in the background.

        The rename is one syscall, so it can run on the admission path; a dot
        name is never a record key, and leftovers are swept at start-up.
        """
        source = self.paths(key).config_dir
        trash = self.root / f".trash-{key}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(source, trash)
        except FileNotFoundError:
            return
        except OSError:
            self.remove(key)
            return
        threading.Thread(
            target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True}, daemon=True
        ).start()

    def sweep_trash(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            for entry in self.root.iterdir():
                if entry.name.startswith(".trash-"):
                    shutil.rmtree(entry, ignore_errors=True)

    def record_keys(self) -> list[str]:
        try:
            return sorted(
                p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")
            )
        except FileNotFoundError:
            return []

    def load_all(self) -> tuple[list[Placement], list[str]]:
        """Every readable record, and the keys whose record is missing or corrupt."""
        good: list[Placement] = []
        bad: list[str] = []
        for key in self.record_keys():
            try:
                data = json.loads(self.paths(key).config_file.read_text())
                placement = placement_from_record(data)
                if placement.key != key:
                    raise ValueError(f"record names key {placement.key}")
                good.append(placement)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning(
                    "state record %s is unreadable (%s); rebuilding it from the kubelet", key, exc
                )
                bad.append(key)
        return good, bad


def install_hook(library: Path, hook_dir: Path, version: str) -> Path:
    """Copy the hook library to the host under a versioned, content-addressed name.

    An existing file is never overwritten: running containers may have it
    loaded, and replacing a mapped .so in place crashes them.
    """
    data = library.read_bytes()
    digest = hashlib.sha256(data).hexdigest()[:12]
    target = hook_dir / f"libvgpu-{version}-{digest}.so"
    if not target.exists():
        atomic_write(target, data, mode=0o755)
    return target


class PluginDirWatcher:
    """Notices a kubelet restart: kubelet.sock recreated or one of our sockets gone.

    Polls two stat() calls every `interval_s` (default 0.25 s): cheap, and it
    works on every filesystem, where inotify does not (hostPath over overlay).
    """

    def __init__(
        self,
        plugin_dir: Path,
        our_sockets: Callable[[], list[Path]],
        on_restart: Callable[[str], None],
        interval_s: float = 0.25,
    ) -> None:
        self.plugin_dir = plugin_dir
        self.our_sockets = our_sockets
        self.on_restart = on_restart
        self.interval_s = interval_s

    def kubelet_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.plugin_dir / "kubelet.sock")
        except OSError:
            return None
        if not stat.S_ISSOCK(st.st_mode):
            return None
        return (st.st_ino, st.st_ctime_ns)

    def run(
        self, stop: threading.Event, registered_with: Callable[[], tuple[int, int] | None]
    ) -> None:
        while not stop.wait(self.interval_s):
            current = self.kubelet_identity()
            if current is None:
                continue  # no kubelet (yet): nothing to register with
            if current != registered_with():
                self.on_restart("kubelet.sock appeared or was recreated")
            elif any(not p.exists() for p in self.our_sockets()):
                self.on_restart("our socket was removed")
