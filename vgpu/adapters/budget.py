"""The hook's per-container budget file, host side: the only Python code that
knows its layout (hooks/vgpu_shared.h; tests/hooks/test_layout.py ties the two).

The daemon creates each container's file itself, at its one fixed size with its
blocks allocated, before the container starts, and mounts only that file into
the container. The container can write it, so every host-side read treats it as
hostile: opened without following links or blocking, checked to be a regular
file of the expected size, magic and version, read in one bounded amount.
Anything else is "usage unknown" (None) for that one container.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from vgpu.core.contract import BUDGET_FILE_NAME

FILE_NAME = BUDGET_FILE_NAME
FILE_BYTES = 163840  # VGPU_SHARED_FILE_BYTES
MAGIC = 0x76475055
# 3: the compute arbiter's words after limit_bytes; 4: the hooks' poller after the slots;
# 5: the host pids the daemon tells, after the poller
VERSION = 5
MAX_DEVICES = 16
MAX_SLOTS = 1024
UUID_BYTES = 48
SLOT_LOCK_BASE = 4096  # OFD lock byte of slot i: SLOT_LOCK_BASE + i, held while its process lives
# struct vgpu_shared: 8 uint32 (magic, version, file_bytes, slot_count, slot_hwm,
# device_count, lock, flags), uint64 limit_bytes, uint64 used[16], char devices[16][48],
# then the slots {int32 pid, uint32 host_pid, uint64 used[16]}.
HEADER = struct.Struct("<8IQ")
# v3: uint64 arbiter (seq << 16 | allowed share in 1/100 %), uint32 guarantee_centi,
# cap_centi, achieved_centi (written by the node daemon only), throttle_waits (the
# hooks count launches that waited for tokens).
ARBITER = struct.Struct("<Q4I")
ARBITER_AT = HEADER.size
ARBITER_SEQ_SHIFT = 16
ARBITER_SHARE_MASK = 0xFFFF
USED_AT = ARBITER_AT + ARBITER.size
DEVICES_AT = USED_AT + 8 * MAX_DEVICES
SLOTS_AT = DEVICES_AT + UUID_BYTES * MAX_DEVICES
SLOT = struct.Struct(f"<iI{MAX_DEVICES}Q")
# v4: after the slots, the hooks' utilisation poller (hooks only; the daemon reads
# NVML itself): uint32 poll_seq, poll_rc, uint64 poll_at_ns, uint32 container centi,
# reserved, uint16 per-slot centi[MAX_SLOTS].
POLL_AT = SLOTS_AT + SLOT.size * MAX_SLOTS
# v5: after the poller, written by the node daemon: uint64 teller_at_ns (its
# heartbeat, CLOCK_MONOTONIC) and uint64 told[MAX_SLOTS] (slot pid << 32 | host pid).
# Then uint32 awaiting[MAX_SLOTS] (a hook asks for its context's memory on device
# entry - 1) and uint64 measured[MAX_SLOTS] (the daemon's answer: slot pid << 32 |
# entry + 1 << 24 | MiB).
TELLER_AT = POLL_AT + 24 + 2 * MAX_SLOTS
TOLD_AT = TELLER_AT + 8
AWAITING_AT = TOLD_AT + 8 * MAX_SLOTS
MEASURED_AT = AWAITING_AT + 4 * MAX_SLOTS
# POSIX lock byte of slot i: PID_LOCK_BASE + i, held by its process (the host's
# /proc/locks names that process's host pid).
PID_LOCK_BASE = SLOT_LOCK_BASE + MAX_SLOTS
_FLOCK = "hhqqi4x"  # struct flock on Linux x86_64 / aarch64
# Version 1 files (before the file had one fixed size) belong to containers that
# still run the old hook, which maps exactly this size: never resize them.
V1_SIZES = frozenset({139464, 139472})  # x86_64, aarch64 (the pthread mutex differs)
# Versions 2-4 shared one fixed size, smaller than version 5's: a container still
# running such a hook maps exactly that size, so its file is never resized either.
OLD_FIXED_BYTES = 143360
OLD_FIXED_VERSIONS = frozenset({2, 3, 4})
_MIB = 1024 * 1024
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def ensure(path: Path) -> str | None:
    """Make `path` this container's budget file: create it (zero-filled, fixed size,
    blocks allocated, mode 0666 so every user of the container can share it), or
    keep a good one (it holds live usage). Something else planted there (a link,
    a FIFO, a directory) is replaced; a file that grew is cut back. Returns what
    was repaired, for the caller to log, or None. OSError (e.g. ENOSPC) when the
    file cannot be made: the container must not start without it.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        _create(path)
        return None
    if not stat.S_ISREG(st.st_mode):
        kind = "directory" if stat.S_ISDIR(st.st_mode) else "non-regular file"
        if stat.S_ISDIR(st.st_mode):
            os.rmdir(path)  # only an empty one; anything else fails loudly
        else:
            os.unlink(path)
        _create(path)
        return f"replaced a {kind} at {path}"
    if st.st_size != FILE_BYTES:
        return cut_back(path)
    opened = _open_regular(path, os.O_RDWR)
    if opened is not None:  # blocks a hole-punching tenant freed come back
        try:
            os.posix_fallocate(opened[0], 0, FILE_BYTES)
        finally:
            os.close(opened[0])
    return None


def _older_version(fd: int, size: int) -> int | None:
    """The format version of an older release's file at the size its hooks map,
    or None."""
    head = os.pread(fd, 8, 0) if size in V1_SIZES or size == OLD_FIXED_BYTES else b""
    if len(head) != 8:
        return None
    magic, version = struct.unpack("<II", head)
    if magic != MAGIC:
        return None
    if size in V1_SIZES:
        return version if version == 1 else None
    return version if version in OLD_FIXED_VERSIONS else None


def _create(path: Path) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o666)
    try:
        os.fchmod(fd, 0o666)  # whatever the umask: processes of other users join
        os.posix_fallocate(fd, 0, FILE_BYTES)  # a full disk fails here, never as a SIGBUS
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    os.close(fd)


def _open_regular(path: Path, mode: int) -> tuple[int, int] | None:
    """(fd, size) of a regular file opened without following a link or blocking."""
    try:
        fd = os.open(path, mode | _OPEN_FLAGS)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd, st.st_size


def cut_back(path: Path) -> str | None:
    """A budget file of another size is an incident: cut it back (or fill it up)
    to the fixed size, keeping its contents. Returns what was done, or None."""
    opened = _open_regular(path, os.O_RDWR)
    if opened is None:
        return None
    fd, size = opened
    try:
        if size == FILE_BYTES or _older_version(fd, size) is not None:
            return None
        if size > FILE_BYTES:
            os.ftruncate(fd, FILE_BYTES)
        else:
            os.posix_fallocate(fd, 0, FILE_BYTES)
        return f"{path} was {size} bytes, not {FILE_BYTES}: cut back to size"
    except OSError as exc:
        return f"{path} is {exc.strerror or exc} and could not be cut back"
    finally:
        os.close(fd)


def _slot_alive(fd: int, slot: int) -> bool:
    """Does a live process hold this slot's liveness lock? (F_OFD_GETLK: takes nothing.)"""
    probe = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, SLOT_LOCK_BASE + slot, 1, 0)
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, probe)
    return bool(struct.unpack(_FLOCK, answer)[0] != fcntl.F_UNLCK)


def usage_mib(path: Path) -> int | None:
    """Memory the container's live processes hold, as the hook records it.

    Sums the slots of processes that still hold their liveness lock, so a process
    that exited or was killed no longer counts even before the hook reclaims its
    slot. None when the file is missing, not a regular file, of another size,
    layout or version, or unreadable: never follows a link, never blocks.
    """
    opened = _open_regular(path, os.O_RDONLY)
    if opened is None:
        return None
    fd, size = opened
    try:
        if size != FILE_BYTES:
            return None
        data = os.pread(fd, FILE_BYTES, 0)
        if len(data) != FILE_BYTES:
            return None
        magic, version, file_bytes, slot_count, slot_hwm, *_ = HEADER.unpack_from(data, 0)
        if magic == 0:
            return 0  # pre-created, no process has used it yet
        if (magic, version, file_bytes, slot_count) != (MAGIC, VERSION, FILE_BYTES, MAX_SLOTS):
            return None
        total = 0
        for i in range(min(slot_hwm, MAX_SLOTS)):
            pid, _host_pid, *used = SLOT.unpack_from(data, SLOTS_AT + i * SLOT.size)
            if pid and _slot_alive(fd, i):
                total += sum(used)
        return total // _MIB
    except OSError:
        return None
    finally:
        os.close(fd)


class OldFormat(Exception):
    """The file is another format version: never misread, never written."""

    def __init__(self, path: Path, found: int) -> None:
        super().__init__(
            f"{path} is budget file format version {found}, this daemon speaks version "
            f"{VERSION}: its container runs another vgpu release's hook; the arbiter leaves it "
            "alone (the hook keeps its guarantee as a fixed cap) until the pod is restarted"
        )
        self.found = found


def _check_format(path: Path, fd: int, size: int) -> bool:
    """True for a current-version file (or a pre-created zero one), OldFormat for another
    version, False for anything else (wrong size, garbage)."""
    if size != FILE_BYTES:
        older = _older_version(fd, size)
        if older is not None:
            raise OldFormat(path, older)
        return False
    head = os.pread(fd, 8, 0)
    if len(head) != 8:
        return False
    magic, version = struct.unpack("<II", head)
    if magic == 0:
        return True
    if magic != MAGIC:
        return False
    if version != VERSION:
        raise OldFormat(path, version)
    return True


def write_arbiter(
    path: Path,
    seq: int,
    allowed_centi: int,
    guarantee_centi: int,
    cap_centi: int,
    achieved_centi: int,
) -> bool:
    """The arbiter's words for one container: its allowed share (with the
    heartbeat sequence the hook watches) and, for `vgpu status`, its guarantee,
    cap and achieved share. False when the file is missing or unusable;
    OldFormat for a file of another version (never written)."""
    opened = _open_regular(path, os.O_RDWR)
    if opened is None:
        return False
    fd, size = opened
    try:
        if not _check_format(path, fd, size):
            return False
        allowed = max(0, min(10000, allowed_centi))
        word = ((seq & ((1 << 48) - 1)) << ARBITER_SEQ_SHIFT) | allowed
        info = struct.pack("<3I", guarantee_centi, cap_centi, achieved_centi)
        os.pwrite(fd, info, ARBITER_AT + 8)  # not throttle_waits: the hooks' counter
        os.pwrite(fd, struct.pack("<Q", word), ARBITER_AT)  # one aligned 8-byte store
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


@dataclass(frozen=True)
class ArbiterView:
    """What the arbiter last wrote into a container's file (percent)."""

    seq: int
    allowed_percent: float
    guarantee_percent: float
    cap_percent: float
    achieved_percent: float
    throttle_waits: int  # the hooks' wrapping count of launches that waited


def read_arbiter(path: Path) -> ArbiterView | None:
    """The arbiter's words of one container's file; None when the file is not a
    current-version budget file or no arbiter wrote it yet."""
    opened = _open_regular(path, os.O_RDONLY)
    if opened is None:
        return None
    fd, size = opened
    try:
        if not _check_format(path, fd, size):
            return None
        data = os.pread(fd, ARBITER.size, ARBITER_AT)
    except (OSError, OldFormat):
        return None
    finally:
        os.close(fd)
    if len(data) != ARBITER.size:
        return None
    word, guarantee, cap, achieved, waits = ARBITER.unpack(data)
    if word >> ARBITER_SEQ_SHIFT == 0:
        return None
    return ArbiterView(
        seq=word >> ARBITER_SEQ_SHIFT,
        allowed_percent=min(10000, word & ARBITER_SHARE_MASK) / 100,
        guarantee_percent=min(10000, guarantee) / 100,
        cap_percent=min(10000, cap) / 100,
        achieved_percent=min(10000, achieved) / 100,
        throttle_waits=waits,
    )


def throttle_waits(path: Path) -> int | None:
    """The hooks' wrapping count of launches that waited for tokens; None when the
    file is not a usable current-version budget file."""
    opened = _open_regular(path, os.O_RDONLY)
    if opened is None:
        return None
    fd, size = opened
    try:
        if not _check_format(path, fd, size):
            return None
        data = os.pread(fd, 4, ARBITER_AT + 20)
    except (OSError, OldFormat):
        return None
    finally:
        os.close(fd)
    return int(struct.unpack("<I", data)[0]) if len(data) == 4 else None


@contextlib.contextmanager
def _current_slots(
    path: Path,
) -> Iterator[tuple[int, tuple[int, ...], int, bytes, bytes] | None]:
    """(fd, header, slots ever used, their bytes, their told words) of a
    current-version file opened read-only, or None; OldFormat for another
    version, OSError from reading."""
    opened = _open_regular(path, os.O_RDONLY)
    if opened is None:
        yield None
        return
    fd, size = opened
    try:
        slots = _slots(fd) if _check_format(path, fd, size) else None
        yield None if slots is None else (fd, *slots)
    finally:
        os.close(fd)


def _slots(fd: int) -> tuple[tuple[int, ...], int, bytes, bytes] | None:
    """The header, how many slots were ever used (slot_hwm), their bytes and
    their told words; None where the file is short."""
    head = os.pread(fd, HEADER.size, 0)
    if len(head) != HEADER.size:
        return None
    header = HEADER.unpack_from(head, 0)
    used_slots = min(header[4], MAX_SLOTS)  # only the slots ever used
    data = os.pread(fd, used_slots * SLOT.size, SLOTS_AT)
    told = os.pread(fd, 8 * used_slots, TOLD_AT)
    if len(data) != used_slots * SLOT.size or len(told) != 8 * used_slots:
        return None
    return header, used_slots, data, told


def live_host_pids(path: Path) -> frozenset[int] | None:
    """Host pids (as NVML reports them) of the container's live processes; None
    when the file is not a usable current-version budget file."""
    try:
        with _current_slots(path) as slots:
            if slots is None:
                return None
            fd, _, used_slots, data, told = slots
            pids = set()
            for i in range(used_slots):
                pid, host_pid = struct.unpack_from("<iI", data, i * SLOT.size)
                if pid and not host_pid:  # told, not adopted yet (its hook has no reason to ask)
                    host_pid = _told_host_pid(struct.unpack_from("<Q", told, 8 * i)[0], pid)
                if pid and host_pid and _slot_alive(fd, i):
                    pids.add(host_pid)
            return frozenset(pids)
    except (OSError, OldFormat):
        return None


def _told_host_pid(word: int, pid: int) -> int:
    """The host pid a told word gives the slot's process (0: none, or meant for
    the slot's previous process)."""
    return word & 0xFFFFFFFF if word >> 32 == pid & 0xFFFFFFFF else 0


@dataclass(frozen=True)
class Asked:
    """A told process waiting for its context's memory on one card."""

    pid: int  # in its container
    host_pid: int
    entry: int  # device entry of the budget file
    card: str  # that entry's card UUID
    own_bytes: int  # what the process holds there by its own allocations (its slot)


@dataclass(frozen=True)
class TellView:
    """What the node daemon's teller needs of one budget file."""

    untold: dict[int, int]  # slot -> pid: live processes without a host pid
    asked: dict[int, Asked]  # slot -> what it waits to have measured


def tell_view(path: Path) -> TellView | None:
    """The slots to tell and to measure; None when the file is not a usable
    current-version budget file."""
    try:
        with _current_slots(path) as slots:
            if slots is None:
                return None
            fd, header, used_slots, data, told = slots
            devices = min(header[5], MAX_DEVICES)
            awaiting = os.pread(fd, 4 * used_slots, AWAITING_AT)
            uuids = os.pread(fd, UUID_BYTES * MAX_DEVICES, DEVICES_AT)
            if len(awaiting) != 4 * used_slots or len(uuids) != UUID_BYTES * MAX_DEVICES:
                return None
            untold, asked = {}, {}
            for i in range(used_slots):
                pid, host_pid = struct.unpack_from("<iI", data, i * SLOT.size)
                if pid <= 0:
                    continue
                host_pid = host_pid or _told_host_pid(struct.unpack_from("<Q", told, 8 * i)[0], pid)
                if not host_pid:
                    untold[i] = pid
                    continue
                (entry,) = struct.unpack_from("<I", awaiting, 4 * i)
                if 1 <= entry <= devices:
                    raw = uuids[(entry - 1) * UUID_BYTES : entry * UUID_BYTES]
                    card = raw.split(b"\0", 1)[0].decode("ascii", "replace")
                    if card:
                        own = struct.unpack_from("<Q", data, i * SLOT.size + 8 + 8 * (entry - 1))[0]
                        asked[i] = Asked(pid, host_pid, entry - 1, card, own)
            return TellView(untold, asked)
    except (OSError, OldFormat):
        return None


def tell(
    path: Path,
    told: Mapping[int, tuple[int, int]],
    now_ns: int | None,
    measured: Mapping[int, tuple[int, int, int]] | None = None,
) -> int:
    """Writes the node daemon's words: for each slot -> (its pid, its host pid)
    the told word; for each slot -> (its pid, device entry, bytes) the measured
    word (in MiB, rounded up); then its heartbeat `now_ns` (CLOCK_MONOTONIC;
    None: none, so that the hooks soon find their own pids).
    Each is one aligned 8-byte store, as the hooks read them. The number of
    slots told; 0 (nothing written) when the file is not a usable
    current-version budget file."""
    opened = _open_regular(path, os.O_RDWR)
    if opened is None:
        return 0
    fd, size = opened
    try:
        if not _check_format(path, fd, size):
            return 0
        for slot, (pid, host_pid) in told.items():
            if 0 <= slot < MAX_SLOTS and 0 < pid <= 0xFFFFFFFF and 0 < host_pid <= 0xFFFFFFFF:
                os.pwrite(fd, struct.pack("<Q", pid << 32 | host_pid), TOLD_AT + 8 * slot)
        for slot, (pid, entry, used) in (measured or {}).items():
            mib = min(-(-used // _MIB), 0xFFFFFF)
            if 0 <= slot < MAX_SLOTS and 0 < pid <= 0xFFFFFFFF and 0 <= entry < MAX_DEVICES:
                word = pid << 32 | (entry + 1) << 24 | max(mib, 0)
                os.pwrite(fd, struct.pack("<Q", word), MEASURED_AT + 8 * slot)
        if now_ns is not None:
            os.pwrite(fd, struct.pack("<Q", now_ns), TELLER_AT)
        return len(told)
    except (OSError, OldFormat):
        return 0
    finally:
        os.close(fd)
