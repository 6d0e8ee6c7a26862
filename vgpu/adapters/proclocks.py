"""The host's /proc/locks: who holds each hook's pid byte, by host pid.

Every hook process with a budget-file slot holds a classic POSIX write lock on
byte PID_LOCK_BASE + slot of its container's file (hooks/vgpu_shared.h). The
kernel lists POSIX lock owners in /proc/locks by their pid in the PID namespace
that procfs instance belongs to: read through the host's procfs (mounted at
/host/proc, or /proc with hostPID), that is the host pid NVML reports, whatever
namespace the container runs in. No ptrace access is needed: /proc/locks is
world-readable, unlike /proc/<pid>/ns or /proc/<pid>/fd.

Lines look like
    ``1: POSIX  ADVISORY  WRITE 31978 fe:00:2146759 5120 5120``
(id, class, mode, access, pid, major:minor:inode with major and minor in hex,
first byte, last byte); a lock's waiters follow it as ``1: -> POSIX ...``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from vgpu.adapters import bounded

# About 70,000 locks. Tenants can take locks on files in their containers and so
# lengthen the file: what lies beyond this is not read (see `read`).
MAX_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class LockOwner:
    major: int
    minor: int
    inode: int
    offset: int  # the one byte locked
    pid: int


def parse(text: str) -> list[LockOwner]:
    """The one-byte POSIX write locks held (waiters and other kinds left out)."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 8 or parts[1] != "POSIX" or parts[3] != "WRITE":
            continue
        try:
            pid, (major, minor, inode), start, end = (
                int(parts[4]),
                parts[5].split(":"),
                int(parts[6]),
                int(parts[7]),
            )
            owner = LockOwner(int(major, 16), int(minor, 16), int(inode), start, pid)
        except ValueError:
            continue
        if start == end and pid > 0:
            out.append(owner)
    return out


def read(proc_root: Path) -> list[LockOwner]:
    """The locks of `proc_root`/locks (its first MAX_BYTES); OSError where it
    cannot be read."""
    return read_bounded(proc_root)[0]


def read_bounded(proc_root: Path) -> tuple[list[LockOwner], bool]:
    """The locks of `proc_root`/locks and whether the file went past MAX_BYTES."""
    text, truncated = bounded.read_bounded(proc_root / "locks", MAX_BYTES, follow=True)
    if truncated:  # the last line may be cut: drop it
        text = text[: text.rfind(b"\n") + 1]
    return parse(text.decode("ascii", "replace")), truncated


def owners_in(
    locks: Iterable[LockOwner], st: os.stat_result, first: int, count: int
) -> dict[int, int]:
    """byte index (0..count-1, from `first`) -> owner pid, for the file `st`.

    The inode is matched with its device. Where the device stat() shows is not
    the one /proc/locks shows (btrfs subvolumes report their own), a lock on the
    same inode of a single other device is taken, and none where several devices
    have that inode."""
    exact: dict[int, int] = {}
    loose: dict[tuple[int, int], dict[int, int]] = {}
    want = (os.major(st.st_dev), os.minor(st.st_dev))
    for lock in locks:
        if lock.inode != st.st_ino or not first <= lock.offset < first + count:
            continue
        if (lock.major, lock.minor) == want:
            exact[lock.offset - first] = lock.pid
        else:
            loose.setdefault((lock.major, lock.minor), {})[lock.offset - first] = lock.pid
    if exact or len(loose) != 1:
        return exact
    return next(iter(loose.values()))
