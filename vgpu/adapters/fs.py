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
import errno
import hashlib
import itertools
import json
import logging
import os
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vgpu.adapters import budget
from vgpu.core.contract import preload_file_name, preload_file_text
from vgpu.core.model import CardUuid, DeviceId, Owner, Placement, Resource

log = logging.getLogger(__name__)

CONFIG_SCHEMA_VERSION = 1


def atomic_write(path: Path, data: bytes, mode: int = 0o644, durable: bool = True) -> None:
    """Write, fsync, rename, fsync the directory: all or nothing after a crash.

    `durable` False skips both fsyncs (still all or nothing after a process
    crash): for a record that a durable write replaces moments later."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fchmod(fh.fileno(), mode)
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if not durable:
        return
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
        self.sweeper = TrashSweeper(self.root)

    def paths(self, key: str) -> ContainerPaths:
        config_dir = self.root / key
        return ContainerPaths(config_dir, config_dir / "config.json", config_dir / "shared")

    def prepare(self) -> None:
        """Create the records directory and start removing leftovers in the background.

        Nothing here waits on the trash: a tree of millions of files left by a
        tenant must not hold start-up past the startup probe.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        self.sweeper.start()

    def write(self, placement: Placement, durable: bool = True) -> ContainerPaths:
        """Write a placement's directory and record; `durable` False leaves the
        fsync to the write that completes the container (one per container)."""
        paths = self.paths(placement.key)
        paths.shared_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        # The budget file exists, at its size, before the container starts: only
        # it is mounted, so the container has nothing else to write on the host.
        repaired = budget.ensure(paths.budget_file)
        if repaired:
            log.warning("budget file of %s: %s", placement.key, repaired)
        body = json.dumps(placement_record(placement, self.memory_unit_mib), indent=1).encode()
        atomic_write(paths.config_file, body, durable=durable)
        return paths

    def discard(self, key: str) -> OSError | None:
        """Move a record out of the way at once; the files go in the background.

        The rename is one syscall, so it can run on the admission path; a dot
        name is never a record key, and the sweeper removes it (and any
        leftover of an earlier run) without following links or recursing.
        Returns the error when the directory is still in place (e.g. a
        read-only disk); it is tried again at the next reconcile.
        """
        source = self.paths(key).config_dir
        trash = self.root / f"{TRASH_PREFIX}{key}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(source, trash)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning(
                "cannot move %s out of the way (%s); it stays until the disk allows it",
                source,
                os.strerror(exc.errno or 0),
            )
            return exc
        self.sweeper.wake()
        return None

    def close(self) -> None:
        self.sweeper.stop()

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


TRASH_PREFIX = ".trash-"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True)
class Removal:
    """What one bounded pass of remove_tree did."""

    done: bool  # the tree is gone
    removed: int  # entries unlinked or rmdir'ed in this pass
    stuck: int  # entries that could not be removed (permissions, immutable files)
    error: str = ""  # the first such error, for the log


_fresh = itertools.count()


def remove_tree(path: Path, deadline_s: float | None = None) -> Removal:
    """Remove a tenant-written tree: iterative, never follows a link, bounded in time.

    Every directory is opened with O_NOFOLLOW | O_DIRECTORY relative to its
    parent's descriptor and every entry is removed with unlinkat/rmdir on that
    descriptor, so a symlink (or one swapped in during the walk) is removed,
    never followed. There is no recursion and no descriptor per level: the
    sub-directories of each directory are renamed up into the tree's root and
    handled there, so a 100,000-level tree costs two descriptors and constant
    memory. With `deadline_s` (time.monotonic()), the pass stops there and
    reports done=False; the next pass resumes from what is left on disk.
    """
    try:
        parent_fd = os.open(path.parent, _DIR_FLAGS)
    except FileNotFoundError:
        return Removal(True, 0, 0)
    except OSError as exc:
        return Removal(False, 0, 1, f"{path.parent}: {os.strerror(exc.errno or 0)}")
    try:
        return _remove_in(parent_fd, path.name, deadline_s)
    finally:
        os.close(parent_fd)


def _remove_in(parent_fd: int, name: str, deadline_s: float | None) -> Removal:
    try:
        root_fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return Removal(True, 0, 0)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            return Removal(False, 0, 1, f"{name}: {os.strerror(exc.errno or 0)}")
        try:  # a file, a link, a FIFO: remove the name itself
            os.unlink(name, dir_fd=parent_fd)
        except FileNotFoundError:
            pass
        except OSError as err:
            return Removal(False, 0, 1, f"{name}: {os.strerror(err.errno or 0)}")
        return Removal(True, 1, 0)
    walk = _Walk(root_fd, deadline_s)
    try:
        while True:
            progress = walk.removed
            walk.stuck, walk.error = 0, ""
            if not walk.pass_over_root():
                return Removal(False, walk.removed, walk.stuck, walk.error)
            try:
                os.rmdir(name, dir_fd=parent_fd)
                return Removal(True, walk.removed + 1, 0)
            except FileNotFoundError:
                return Removal(True, walk.removed, 0)
            except OSError as exc:
                if exc.errno != errno.ENOTEMPTY or walk.removed == progress:
                    # No progress in a whole pass: what is left cannot be removed.
                    return Removal(
                        False,
                        walk.removed,
                        max(walk.stuck, 1),
                        walk.error or f"{name}: {os.strerror(exc.errno or 0)}",
                    )
    finally:
        os.close(root_fd)


class _Walk:
    """One tree being flattened into its root directory and removed."""

    def __init__(self, root_fd: int, deadline_s: float | None) -> None:
        self.root_fd = root_fd
        self.deadline_s = deadline_s
        self.removed = 0
        self.stuck = 0
        self.error = ""
        self._ticks = 0

    def _past_deadline(self) -> bool:
        return self.deadline_s is not None and time.monotonic() >= self.deadline_s

    def _late(self) -> bool:
        """The deadline check, every 64 entries (a clock read costs more than an unlink)."""
        self._ticks += 1
        return self._ticks % 64 == 0 and self._past_deadline()

    def _fail(self, what: str, exc: OSError) -> None:
        self.stuck += 1
        if not self.error:
            self.error = f"{what}: {os.strerror(exc.errno or 0)}"

    def pass_over_root(self) -> bool:
        """Empty and remove every directory now in the root; False when out of time."""
        for entry in _entries(self.root_fd):
            if self._late():
                return False
            if _is_dir(entry):
                if not self._empty(entry.name) and self._past_deadline():
                    return False
            else:
                self._unlink(self.root_fd, entry.name)
        return True

    def _unlink(self, dir_fd: int, name: str) -> None:
        try:
            os.unlink(name, dir_fd=dir_fd)
            self.removed += 1
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            pass  # swapped for a directory meanwhile: the next pass sees it
        except OSError as exc:
            self._fail(name, exc)

    def _empty(self, name: str) -> bool:
        """Move the directory's sub-directories up to the root, unlink the rest,
        then remove it. True when it is gone."""
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self.root_fd)
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                self._unlink(self.root_fd, name)  # swapped for a link or a file
                return True
            self._fail(name, exc)
            return False
        try:
            for entry in _entries(fd):
                if self._late():
                    return False
                if _is_dir(entry):
                    self._lift(fd, entry.name)
                else:
                    self._unlink(fd, entry.name)
        finally:
            os.close(fd)
        try:
            os.rmdir(name, dir_fd=self.root_fd)
            self.removed += 1
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:
                self._fail(name, exc)
            return False

    def _lift(self, dir_fd: int, name: str) -> None:
        for _ in range(8):
            target = f".rm{os.getpid()}-{next(_fresh)}"
            try:
                os.rename(name, target, src_dir_fd=dir_fd, dst_dir_fd=self.root_fd)
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    continue  # a leftover of an earlier run has that name
                self._fail(name, exc)
                return


def _entries(dir_fd: int) -> list[os.DirEntry[str]]:
    """Up to 4096 entries of a directory (the rest comes in the next pass), so a
    directory of millions of names never sits in memory at once."""
    out: list[os.DirEntry[str]] = []
    try:
        with os.scandir(dir_fd) as it:
            for entry in it:
                out.append(entry)
                if len(out) >= 4096:
                    break
    except OSError:
        pass
    return out


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


class TrashSweeper:
    """Removes `.trash-*` directories under a records root in the background.

    Works in passes of at most PASS_S, pausing PAUSE_S between them so that
    admissions keep their share of the CPU; a directory that cannot be removed
    (permissions, immutable files) is retried after RETRY_S and at every
    start. Nothing it finds can end the thread or the daemon.
    """

    PASS_S = 0.5
    PAUSE_S = 0.05
    RETRY_S = 600.0

    def __init__(self, root: Path) -> None:
        self.root = root
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stuck: dict[str, float] = {}  # name -> monotonic time of the next retry
        self.removed = 0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trash-sweeper", daemon=True)
            self._thread.start()
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def pending(self) -> list[str]:
        """Names of trash directories still on disk."""
        try:
            with os.scandir(self.root) as it:
                return sorted(e.name for e in it if e.name.startswith(TRASH_PREFIX))
        except OSError:
            return []

    def stuck(self) -> list[str]:
        return sorted(self._stuck)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(60.0)
            self._wake.clear()
            try:
                while not self._stop.is_set() and self.sweep_once():
                    self._stop.wait(self.PAUSE_S)
            except Exception:  # never let a surprise end the sweeper
                log.exception("removing old records failed; retrying later")
                self._stop.wait(1.0)

    def sweep_once(self) -> bool:
        """One bounded pass over the trash; True when more work is left now."""
        deadline = time.monotonic() + self.PASS_S
        now = time.monotonic()
        more = False
        for name in self.pending():
            if self._stuck.get(name, 0.0) > now:
                continue
            if time.monotonic() >= deadline:
                return True
            result = remove_tree(self.root / name, deadline)
            self.removed += result.removed
            if result.done:
                self._stuck.pop(name, None)
            elif result.stuck:
                if name not in self._stuck:
                    log.warning(
                        "cannot remove %s: %d entr%s left (%s); retrying every %d s; "
                        "remove it by hand if it stays",
                        self.root / name,
                        result.stuck,
                        "y" if result.stuck == 1 else "ies",
                        result.error,
                        int(self.RETRY_S),
                    )
                self._stuck[name] = time.monotonic() + self.RETRY_S
            else:
                more = True  # out of time for this pass
        return more


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
    install_preload_file(target)
    return target


def install_preload_file(hook: Path) -> Path:
    """Write, next to the installed hook, the file a container sees as its
    read-only /etc/ld.so.preload (hook_injection ld-so-preload). Atomic, and only
    when missing or different: containers have it mounted."""
    target = hook.parent / preload_file_name(str(hook))
    text = preload_file_text(str(hook)).encode()
    try:
        current = target.read_bytes()
    except FileNotFoundError:
        current = None
    if current != text:
        atomic_write(target, text, mode=0o644)
    return target


def socket_identity(path: Path) -> tuple[int, int] | None:
    """(inode, change time in ns) of a Unix socket file, None when `path` is not
    one: a server that re-creates its socket (a restarted kubelet) changes it."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode):
        return None
    return (st.st_ino, st.st_ctime_ns)


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
        return socket_identity(self.plugin_dir / "kubelet.sock")

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
