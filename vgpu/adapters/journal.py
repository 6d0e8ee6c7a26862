"""The placement journal: the durable copy of every placement record, made
durable on the Allocate path by one `fdatasync` of data written in place.

Why: a record made durable the way `atomic_write` does it (a new file, fsync,
rename, fsync of the directory) commits the filesystem's metadata journal:
0.45-0.6 ms on ext4 here, the larger part of an Allocate (issue 30). Data
written in place into blocks that are already allocated and written (this
file is zero-filled and fsync'ed when it is made) needs no metadata commit:
`fdatasync` flushes the data alone, about 0.1 ms. So each record is appended
here (synced once per container, before its last Allocate answers), and the
container's `config.json` (what the container and `vgpu status` read) is
written beside it without an fsync. After a power cut the
start-up writes every record the journal holds and the disk lost back into
its directory, before the daemon registers with the kubelet (and so before
the kubelet can start any container that mounts it).

Layout: a 16-byte header (magic, version), then entries of `<u32 length,
u32 crc32>` + the record's JSON (`{"forget": key}` for a released one); a
zero length ends them. A bad entry (a torn write) ends the replay. The file
is rewritten (atomically, durably) with the live records at start-up and
when it is full.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import tempfile
import threading
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FILE_NAME = "placements.journal"
MAGIC = b"VGPUJNL\x00"
VERSION = 1
HEADER = struct.Struct("<8sII")  # magic, version, reserved
ENTRY = struct.Struct("<II")  # payload length, crc32 of the payload
MIN_BYTES = 1 << 20  # ~1,500 records (three per container) between rewrites
MAX_ENTRY_BYTES = 1 << 20


def _entry(payload: bytes) -> bytes:
    return ENTRY.pack(len(payload), zlib.crc32(payload)) + payload


def replay(data: bytes) -> tuple[dict[str, dict[str, Any]], int, bool]:
    """The live records (key -> record) in a journal's bytes, the offset after
    the last good entry, and whether the entries ended cleanly (False: a torn
    or damaged entry, or not a journal at all)."""
    live: dict[str, dict[str, Any]] = {}
    if len(data) < HEADER.size:
        return live, HEADER.size, not data
    magic, version, _ = HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        return live, HEADER.size, False
    offset = HEADER.size
    while offset + ENTRY.size <= len(data):
        length, crc = ENTRY.unpack_from(data, offset)
        if length == 0:
            return live, offset, True
        start, end = offset + ENTRY.size, offset + ENTRY.size + length
        if length > MAX_ENTRY_BYTES or end > len(data):
            return live, offset, False
        payload = data[start:end]
        if zlib.crc32(payload) != crc:
            return live, offset, False
        try:
            record = json.loads(payload)
        except ValueError:
            return live, offset, False
        if not isinstance(record, dict):
            return live, offset, False
        if "forget" in record:
            live.pop(str(record["forget"]), None)
        elif isinstance(record.get("key"), str):
            live[record["key"]] = record
        offset = end
    return live, offset, True


class PlacementJournal:
    """Append-only, preallocated, one writer (the daemon that holds the node).

    Inactive until `start()`; a caller then falls back to a durable
    `atomic_write` of the record itself (also after `close()`, e.g. once the
    node was handed over)."""

    def __init__(self, path: Path, min_bytes: int = MIN_BYTES) -> None:
        self.path = path
        self.min_bytes = min_bytes
        self._lock = threading.Lock()
        self._active = False
        self._offset = 0
        self._size = 0
        self._live: dict[str, bytes] = {}  # key -> its last payload
        self.rewrites = 0

    @property
    def active(self) -> bool:
        return self._active

    def load(self) -> dict[str, dict[str, Any]]:
        """The records the journal on disk holds (read-only; {} when there is none)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        live, _, clean = replay(data)
        if not clean:
            log.warning(
                "placement journal %s ends in a damaged entry (a torn write?); "
                "using the %d record(s) before it",
                self.path,
                len(live),
            )
        return live

    def start(self, records: Mapping[str, bytes]) -> None:
        """Rewrite the journal with these records (key -> record JSON), durably,
        and keep it open for appending. OSError when the disk refuses."""
        with self._lock:
            self._rewrite(dict(records))

    def put(self, key: str, payload: bytes, durable: bool = True) -> None:
        """Append one record; durable: on disk (fdatasync) before it returns."""
        with self._lock:
            self._append(_entry(payload), durable, key, payload)

    def forget(self, key: str) -> None:
        """A released record: appended without a sync (like the directory's
        rename to the trash; at worst a power cut brings the record back, and
        the start-up's checks with the kubelet release it again)."""
        with self._lock:
            if key not in self._live:
                return
            payload = json.dumps({"forget": key}).encode()
            self._append(_entry(payload), False, key, None)

    def close(self) -> None:
        with self._lock:
            self._active = False

    # ------------------------------------------------------------------ inside

    def _append(self, entry: bytes, durable: bool, key: str, payload: bytes | None) -> None:
        if not self._active:
            raise RuntimeError("the placement journal is not open")
        if self._offset + len(entry) + ENTRY.size > self._size:
            live = dict(self._live)
            if payload is None:
                live.pop(key, None)
            else:
                live[key] = payload
            self._rewrite(live)  # durable, with this record in it
            return
        # Opened per write: no descriptor open for writing is held between
        # calls (a disk can be remounted read-only under the daemon).
        fd = os.open(self.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.pwrite(fd, entry, self._offset)
            if durable:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        self._offset += len(entry)
        if payload is None:
            self._live.pop(key, None)
        else:
            self._live[key] = payload

    def _rewrite(self, live: dict[str, bytes]) -> None:
        body = HEADER.pack(MAGIC, VERSION, 0) + b"".join(_entry(p) for p in live.values())
        size = self.min_bytes
        while size < 4 * (len(body) + ENTRY.size):
            size *= 2
        # Zero-filled to its full size (written, not fallocate'd: blocks the
        # filesystem holds as unwritten would need a metadata commit when
        # first written), fsync'ed, renamed over the old one, directory fsync'ed.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            os.fchmod(fd, 0o600)
            os.pwrite(fd, body + bytes(size - len(body)), 0)
            os.fsync(fd)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        dir_fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self._active = True
        self._offset, self._size, self._live = len(body), size, live
        self.rewrites += 1
