"""vgpu/adapters/proclocks.py: the host's /proc/locks, parsed and matched to a
budget file's pid bytes; and the kernel's own file, read for real."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vgpu.adapters import budget, proclocks

SAMPLE = """\
1: POSIX  ADVISORY  WRITE 31978 fe:00:2146759 5120 5120
1: -> POSIX  ADVISORY  WRITE 4000 fe:00:2146759 5120 5120
2: OFDLCK ADVISORY  WRITE -1 fe:00:2146759 4096 4096
3: FLOCK  ADVISORY  WRITE 812 00:1a:77 0 EOF
4: POSIX  ADVISORY  READ 900 fe:00:2146759 5121 5121
5: POSIX  ADVISORY  WRITE 901 fe:00:2146759 5122 5130
6: POSIX  ADVISORY  WRITE 902 fe:00:2146759 5123 5123
7: POSIX  ADVISORY  WRITE 0 fe:00:2146759 5124 5124
8: POSIX  ADVISORY  WRITE 903 zz:00:2146759 5125 5125
garbage line
9: POSIX  ADVISORY  WRITE 904 08:10:55 5126 5126
"""


def test_only_one_byte_posix_write_locks_of_visible_owners_are_kept() -> None:
    owners = proclocks.parse(SAMPLE)
    assert [(o.pid, o.offset) for o in owners] == [(31978, 5120), (902, 5123), (904, 5126)]
    assert (owners[0].major, owners[0].minor, owners[0].inode) == (0xFE, 0, 2146759)
    assert (owners[2].major, owners[2].minor) == (8, 16)  # hex


def _stat(dev: int, ino: int) -> os.stat_result:
    return os.stat_result((0o100644, ino, dev, 1, 0, 0, 0, 0, 0, 0))


def test_owners_are_matched_by_device_and_inode_within_the_pid_bytes() -> None:
    owners = proclocks.parse(SAMPLE)
    st = _stat(os.makedev(0xFE, 0), 2146759)
    assert proclocks.owners_in(owners, st, 5120, 4) == {0: 31978, 3: 902}
    assert proclocks.owners_in(owners, st, 5121, 2) == {}  # 5123 is outside [5121, 5123)
    assert proclocks.owners_in(owners, _stat(os.makedev(0xFE, 0), 1), 5120, 4) == {}


def test_an_inode_on_one_other_device_is_taken_but_not_on_several() -> None:
    # btrfs: stat() shows the subvolume's device, /proc/locks the filesystem's
    one = proclocks.parse("1: POSIX  ADVISORY  WRITE 77 00:2e:99 5121 5121\n")
    st = _stat(os.makedev(0, 0x31), 99)
    assert proclocks.owners_in(one, st, 5120, 8) == {1: 77}
    two = proclocks.parse(
        "1: POSIX  ADVISORY  WRITE 77 00:2e:99 5121 5121\n"
        "2: POSIX  ADVISORY  WRITE 78 00:2f:99 5122 5122\n"
    )
    assert proclocks.owners_in(two, st, 5120, 8) == {}


def test_an_unreadable_proc_is_an_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        proclocks.read(tmp_path)


# Holds a POSIX write lock on byte argv[2] of argv[1], says its pid, waits for EOF.
HOLD = (
    "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
    "fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, int(sys.argv[2]), 0); "
    "print(os.getpid(), flush=True); sys.stdin.read()"
)


def _holder(path: Path, offset: int) -> subprocess.Popen[str]:
    """A process holding a POSIX write lock on one byte of `path`."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path), str(offset)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip()
    return proc


def test_the_kernel_names_the_holder_of_a_pid_byte(tmp_path: Path) -> None:
    path = tmp_path / budget.FILE_NAME
    budget.ensure(path)
    proc = _holder(path, budget.PID_LOCK_BASE + 5)
    try:
        owners = proclocks.owners_in(
            proclocks.read(Path("/proc")), os.stat(path), budget.PID_LOCK_BASE, budget.MAX_SLOTS
        )
        assert owners == {5: proc.pid}
    finally:
        proc.communicate("")
    # gone with its process
    assert (
        proclocks.owners_in(
            proclocks.read(Path("/proc")), os.stat(path), budget.PID_LOCK_BASE, budget.MAX_SLOTS
        )
        == {}
    )


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-Urpf", "--mount-proc", "true"], capture_output=True, timeout=10
    )
    return probe.returncode == 0


def test_a_holder_in_its_own_pid_namespace_is_named_by_its_outer_pid(tmp_path: Path) -> None:
    """What a container looks like to the node daemon: inside, the process is
    pid 1; the /proc/locks of the outer procfs names it by its outer pid."""
    if not _unshare_works():
        pytest.skip("unshare -Urpf (user and PID namespaces) is not allowed on this machine")
    path = tmp_path / budget.FILE_NAME
    budget.ensure(path)
    proc = subprocess.Popen(
        ["unshare", "-Urpf", "--mount-proc", sys.executable, "-c", HOLD, str(path), "5127"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        inner = int(proc.stdout.readline())
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        outer = int(children[0])
        assert inner == 1 and outer != inner
        owners = proclocks.owners_in(
            proclocks.read(Path("/proc")), os.stat(path), budget.PID_LOCK_BASE, budget.MAX_SLOTS
        )
        assert owners == {5127 - budget.PID_LOCK_BASE: outer}
    finally:
        proc.communicate("")
