"""The filesystem: per-container config directories (which double as the
durable placement state), atomic writes, the hook library install, and the
watch on the kubelet's device-plugin directory.

Layout under --state-dir (must survive node reboots: the kubelet replays the
saved Allocate answer, which points here, without calling Allocate again):

    <state>/containers/<key>/config.json      limits + placement record (read-only in the container)
    <state>/containers/<key>/shared/vgpu.shm  the hook budget file (mounted alone, read-write)
    <state>/containers/.spare-*/              directories made ahead of need (SparePool)
    <state>/placements.journal                the durable copy of every record (journal.py)

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
from vgpu.adapters.journal import FILE_NAME as JOURNAL_FILE
from vgpu.adapters.journal import PlacementJournal
from vgpu.core.contract import preload_file_name, preload_file_text
from vgpu.core.model import CardUuid, DeviceId, Owner, Placement, Resource

log = logging.getLogger(__name__)

CONFIG_SCHEMA_VERSION = 1
FRESH_S = 5.0  # a directory made this recently is not checked again (ContainerStore.write)


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
        # Directories made ahead of need, off the Allocate path (started by recover()).
        self.spares = SparePool(self.root, self.discard_path)
        # Started by recover() (the daemon that holds the node); read-only
        # users (`vgpu status`) never open it.
        self.journal = PlacementJournal(state_dir / JOURNAL_FILE)
        # Keys whose directory and budget file this store made or checked, when
        # (monotonic): a write moments later skips both (see _write_files).
        self._made: dict[str, float] = {}
        self._blank: set[str] = set()  # keys whose config.json no container has read yet

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

    def write(
        self, placement: Placement, durable: bool = True, complete: bool = True
    ) -> ContainerPaths:
        """Write a placement's directory and record; `durable`: on disk before
        this returns.

        With the journal started, its entry is what is made durable (one
        fdatasync, vgpu.adapters.journal), and config.json is written without
        an fsync. Without the journal, config.json itself is fsync'ed, only
        once the record is also `complete` (a container's second resource
        replaces the record of its first moments later; lost to a power cut
        in between, it is rebuilt from the kubelet's record)."""
        body = json.dumps(placement_record(placement, self.memory_unit_mib)).encode()
        if self.journal.active:
            # First: a config.json is never newer than what the journal holds.
            self.journal.put(placement.key, body, durable)
            return self._write_files(placement.key, body, False, True, complete)
        return self._write_files(placement.key, body, durable and complete, False)

    def _write_files(
        self, key: str, body: bytes, durable: bool, journaled: bool, complete: bool = True
    ) -> ContainerPaths:
        try:
            return self._write_dir(key, body, durable, journaled, complete)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                self.spares.drain()  # the spares' space goes to the records
            raise

    def _write_dir(
        self, key: str, body: bytes, durable: bool, journaled: bool, complete: bool
    ) -> ContainerPaths:
        paths = self.paths(key)
        now = time.monotonic()
        made = self._made.get(key)
        if made is None or now - made > FRESH_S or not paths.budget_file.is_file():
            # (Made moments ago, for the container's other resource: nothing has
            # started since that could have touched its budget file.)
            if made is None and self.spares.take(paths.config_dir):
                # A directory made ahead: one rename instead of two mkdirs, two
                # creates and a fallocate of 160 KiB (~0.5 ms on ext4 here).
                self._blank.add(key)
            else:
                paths.shared_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
                # The budget file exists, at its size, before the container
                # starts: only it is mounted, so the container has nothing else
                # to write on the host.
                repaired = budget.ensure(paths.budget_file)
                if repaired:
                    log.warning("budget file of %s: %s", key, repaired)
            self._made[key] = now
        if journaled and key in self._blank:
            # The spare's own config.json, which no container has read yet (it
            # starts after its last Allocate): written in place, no new inode,
            # no rename. A crash half-way leaves a record the journal, written
            # first, restores at start-up. Atomically from then on.
            if complete:
                self._blank.discard(key)
            fd = os.open(paths.config_file, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.write(fd, body)
            finally:
                os.close(fd)
            return paths
        self._blank.discard(key)
        atomic_write(paths.config_file, body, durable=durable)
        return paths

    def recover(self) -> tuple[list[Placement], list[str]]:
        """The daemon's start-up: every record (load_all()), with those the
        journal holds and the disk lost (a power cut before the filesystem
        committed them) written back into their directories; then the journal
        is rewritten with them all and kept open, and spare directories are
        made in the background. A journal the disk refuses stays closed:
        records are then fsync'ed one by one, as before it."""
        good, bad = self.load_all()
        try:
            journaled = self.journal.load()
        except OSError as exc:
            log.warning("placement journal %s unreadable (%s)", self.journal.path, exc)
            journaled = {}
        by_key = {p.key: p for p in good}
        for key, record in journaled.items():
            have = by_key.get(key)
            if have is not None and placement_record(have, self.memory_unit_mib) == record:
                continue
            try:
                placement = placement_from_record(record)
                if placement.key != key or not key or key.startswith(".") or "/" in key:
                    raise ValueError(f"names key {placement.key}")
                body = json.dumps(placement_record(placement, self.memory_unit_mib)).encode()
                self._write_files(key, body, False, False)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("journal record %s not restored (%s)", key, exc)
                continue
            log.warning(
                "record %s restored from the placement journal (%s)",
                key,
                "its record was missing or unreadable" if have is None else "it was older",
            )
            by_key[key] = placement
        placements = sorted(by_key.values(), key=lambda p: p.key)
        bad = [k for k in bad if k not in by_key]
        try:
            self.journal.start(
                {
                    p.key: json.dumps(placement_record(p, self.memory_unit_mib)).encode()
                    for p in placements
                }
            )
        except OSError as exc:
            log.warning(
                "placement journal %s unusable (%s); fsync'ing each record instead",
                self.journal.path,
                os.strerror(exc.errno or 0),
            )
        self.spares.start()
        return placements, bad

    def discard(self, key: str) -> OSError | None:
        """Move a record out of the way at once; the files go in the background.

        The rename is one syscall, so it can run on the admission path; a dot
        name is never a record key, and the sweeper removes it (and any
        leftover of an earlier run) without following links or recursing.
        Returns the error when the directory is still in place (e.g. a
        read-only disk); it is tried again at the next reconcile.
        """
        source = self.root / key
        self._made.pop(key, None)
        self._blank.discard(key)
        if os.path.lexists(source):  # (a new placement's key has none: one lstat)
            try:
                os.rename(source, self.root / f"{TRASH_PREFIX}{key}-{uuid.uuid4().hex[:8]}")
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning(
                    "cannot move %s out of the way (%s); it stays until the disk allows it",
                    source,
                    os.strerror(exc.errno or 0),
                )
                return exc
            else:
                self.sweeper.wake()
        if self.journal.active:
            self._forget_journaled(key)
        return None

    def _forget_journaled(self, key: str) -> None:
        try:
            self.journal.forget(key)
        except OSError as exc:  # at worst the record comes back at start-up, and is checked
            log.warning("placement journal: %s not marked released (%s)", key, exc)

    def discard_path(self, path: Path) -> None:
        """Move any directory under the records root to the trash (a bad spare)."""
        with contextlib.suppress(OSError):
            name = f"{TRASH_PREFIX}{path.name.lstrip('.')}-{uuid.uuid4().hex[:8]}"
            os.rename(path, self.root / name)
            self.sweeper.wake()

    def close(self) -> None:
        self.sweeper.stop()
        self.spares.stop()
        self.journal.close()

    def record_keys(self) -> list[str]:
        try:
            return sorted(
                p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")
            )
        except FileNotFoundError:
            return []

    def load_all(self) -> tuple[list[Placement], list[str]]:
        """Every readable record, and the keys whose record is missing or corrupt.

        An empty config.json is a record being written in place (a directory
        made ahead; the journal has the record): it is neither."""
        good: list[Placement] = []
        bad: list[str] = []
        for key in self.record_keys():
            try:
                text = self.paths(key).config_file.read_text()
                if not text:
                    log.debug("state record %s is still being written", key)
                    continue
                data = json.loads(text)
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


SPARE_PREFIX = ".spare-"


class SparePool:
    """Container directories made ahead of need, each with `shared/`, a fresh
    budget file and an empty config.json in it, by a background thread: a new
    placement takes one by renaming it to its key (one syscall on the Allocate
    path, instead of two mkdirs, two creates and a fallocate of 160 KiB: ~0.5 ms
    on ext4 here).

    The pool is topped up only once no spare was taken for `IDLE_S`: the
    filesystem commits its metadata for everyone at once, so making directories
    while the kubelet admits would lengthen the kubelet's own checkpoint fsync
    (a burst larger than the pool makes the rest of its directories inline).
    `COUNT` spares hold 10 MiB of budget files: 40 admissions at once on 2
    H200s took 32 and made 8 directories inline, at ~0.5 ms more each.

    A spare is a dot name, so it is never a record key, and no container ever
    saw it: its budget file is the zero-filled file `budget.ensure` made, its
    config.json an empty file the record is written into in place. Spares
    left by an earlier run are taken again when intact, trashed otherwise.
    """

    COUNT = 64
    IDLE_S = 1.0
    MIN_FREE_BYTES = 64 << 20  # no spare is made with less left (nor 10 % of the disk)

    def __init__(self, root: Path, trash: Callable[[Path], None]) -> None:
        self.root = root
        self.trash = trash
        self._lock = threading.Lock()
        self._ready: list[str] = []
        self._taken_at = 0.0  # monotonic
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="spare-dirs", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def ready(self) -> int:
        with self._lock:
            return len(self._ready)

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait (bounded) until the pool is full: at start-up, before the daemon
        registers, so the first admissions find spares and the pool's own
        metadata is not made while they run. True when full."""
        deadline = time.monotonic() + timeout_s
        while self.ready() < self.COUNT:
            if self._thread is None or self._stop.is_set() or time.monotonic() >= deadline:
                return False
            self._stop.wait(0.005)
        return True

    def take(self, target: Path) -> bool:
        """Rename a spare to `target` (which must not exist); False when none
        is ready (or the rename failed: the caller makes the directory)."""
        with self._lock:
            name = self._ready.pop() if self._ready else None
            self._taken_at = time.monotonic()
        self._wake.set()
        if name is None:
            return False
        try:
            os.rename(self.root / name, target)
        except OSError:
            with self._lock:
                self._ready.append(name)  # e.g. target exists: the spare stays
            return False
        return True

    def _idle_for(self) -> float:
        """How long to wait until no spare was taken for IDLE_S (0: now)."""
        with self._lock:
            return max(0.0, self._taken_at + self.IDLE_S - time.monotonic())

    def _run(self) -> None:
        try:
            self._adopt_leftovers()
        except Exception:  # never let a surprise end the pool: Allocate makes directories
            log.exception("checking spare directories failed")
        while not self._stop.is_set():
            try:
                while not self._stop.is_set() and self.ready() < self.COUNT:
                    wait_s = self._idle_for()
                    if wait_s > 0:
                        self._stop.wait(wait_s)
                        continue
                    self._make()
            except Exception as exc:  # a full or read-only disk: Allocate will say so
                log.debug("making a spare directory failed: %s", exc)
                self._stop.wait(5.0)
            self._wake.wait(60.0)
            self._wake.clear()

    def drain(self) -> None:
        """The disk is full: give the spares' space back to the records."""
        with self._lock:
            names, self._ready = self._ready, []
        for name in names:
            self.trash(self.root / name)

    def _room(self) -> bool:
        """Is there room for one more spare, and plenty left for records?"""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return False
        free = st.f_bavail * st.f_frsize
        return free - budget.FILE_BYTES >= max(self.MIN_FREE_BYTES, st.f_blocks * st.f_frsize // 10)

    def _make(self) -> None:
        if not self._room():
            raise OSError(errno.ENOSPC, "keeping the last space for records")
        path = self.root / f"{SPARE_PREFIX}{uuid.uuid4().hex[:12]}"
        (path / "shared").mkdir(mode=0o755, parents=True)
        try:
            budget.ensure(path / "shared" / budget.FILE_NAME)
            os.close(os.open(path / "config.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except BaseException:
            self.trash(path)
            raise
        with self._lock:
            self._ready.append(path.name)

    def _adopt_leftovers(self) -> None:
        try:
            names = [e.name for e in os.scandir(self.root) if e.name.startswith(SPARE_PREFIX)]
        except OSError:
            return
        for name in names:
            path = self.root / name
            try:
                shm = os.lstat(path / "shared" / budget.FILE_NAME)
                config = os.lstat(path / "config.json")
                entries = set(os.listdir(path))
                # Made whole (a crash half-way leaves something else), never
                # handed out: nothing but this daemon writes under the root.
                good = (
                    stat.S_ISREG(shm.st_mode)
                    and shm.st_size == budget.FILE_BYTES
                    and shm.st_blocks * 512 >= budget.FILE_BYTES
                    and stat.S_ISREG(config.st_mode)
                    and config.st_size == 0
                    and entries == {"shared", "config.json"}
                    and os.listdir(path / "shared") == [budget.FILE_NAME]
                )
            except OSError:
                good = False
            if good and self.ready() < self.COUNT:
                with self._lock:
                    self._ready.append(name)
            else:
                self.trash(path)


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
