"""Reading a file the daemon does not control: in bounded amounts, without
blocking on a FIFO, and (unless told otherwise) without following a link."""

from __future__ import annotations

import os
from pathlib import Path


def read_bounded(
    path: Path, max_bytes: int, chunk_bytes: int = 1 << 16, follow: bool = False
) -> tuple[bytes, bool]:
    """At most `max_bytes` of `path`, and whether the file went on past them.
    OSError where it cannot be opened or read."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        chunks: list[bytes] = []
        size = 0
        while size < max_bytes:
            chunk = os.read(fd, min(chunk_bytes, max_bytes - size))
            if not chunk:
                return b"".join(chunks), False
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks), bool(os.read(fd, 1))
    finally:
        os.close(fd)
