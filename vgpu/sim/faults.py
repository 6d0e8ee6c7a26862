"""Real file-system faults for tests and the soak: a small disk that fills up
or turns read-only, and a process's open-file limit lowered under it.

The small disk is a tmpfs mounted over a directory (root with CAP_SYS_ADMIN,
as in CI's container); full means ENOSPC from the kernel and read-only means
EROFS, exactly what a node's disk gives. Nothing here fakes an error.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import subprocess
from collections.abc import Iterator
from pathlib import Path

FILLER = ".vgpu-test-filler"


class FaultUnavailable(RuntimeError):
    """This machine does not allow the fault (e.g. no permission to mount)."""


def _run(*cmd: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise FaultUnavailable(
            f"{' '.join(cmd)} failed: {result.stderr.strip() or result.returncode}; disk "
            "faults need root with CAP_SYS_ADMIN (mount), as in the CI container"
        )


class SmallDisk:
    """A tmpfs of `size_mib` mounted at `path` (created if missing)."""

    def __init__(self, path: Path, size_mib: int = 8) -> None:
        self.path = path
        self.size_mib = size_mib
        self.mounted = False

    def mount(self) -> SmallDisk:
        self.path.mkdir(parents=True, exist_ok=True)
        _run(
            "mount",
            "-t",
            "tmpfs",
            "-o",
            f"size={self.size_mib}m,mode=0755",
            "tmpfs",
            str(self.path),
        )
        self.mounted = True
        return self

    def fill(self) -> int:
        """Take every free byte; returns how many were written. The next write
        anyone makes there fails with ENOSPC."""
        written = 0
        fd = os.open(self.path / FILLER, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for chunk in (1 << 20, 1 << 12, 1):
                block = b"\0" * chunk
                while True:
                    try:
                        written += os.write(fd, block)
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        break
        finally:
            os.close(fd)
        return written

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.path / FILLER).unlink()

    def read_only(self, on: bool) -> None:
        _run("mount", "-o", f"remount,{'ro' if on else 'rw'}", str(self.path))

    def unmount(self) -> None:
        if self.mounted:
            _run("umount", "-l", str(self.path))
            self.mounted = False

    def __enter__(self) -> SmallDisk:
        return self.mount()

    def __exit__(self, *exc: object) -> None:
        self.unmount()


@contextlib.contextmanager
def open_file_limit(pid: int, soft: int | None = None) -> Iterator[int]:
    """Lower a running process's soft RLIMIT_NOFILE (by default below the number
    of descriptors it holds now, so that its next opens fail with EMFILE even if
    a few close meanwhile); restored on exit."""
    before = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    held = len(os.listdir(f"/proc/{pid}/fd"))
    limit = max(3, held - 8) if soft is None else soft
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, before[1]))
    try:
        yield limit
    finally:
        with contextlib.suppress(ProcessLookupError):
            resource.prlimit(pid, resource.RLIMIT_NOFILE, before)
