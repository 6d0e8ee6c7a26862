"""Shared pieces of the benchmarks: targets, percentiles, the machine description."""

from __future__ import annotations

import math
import os
import platform
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

Json = dict[str, Any]


@dataclass(frozen=True)
class Target:
    """One target: ``value`` must be at most ``limit`` (both in ``unit``)."""

    name: str
    value: float
    limit: float
    unit: str

    @property
    def passed(self) -> bool:
        return self.value <= self.limit

    def to_json(self) -> Json:
        return {**asdict(self), "passed": self.passed}


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0-100) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def machine() -> Json:
    """What the numbers were measured on."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kib = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count() or 0,
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "memory_gib": round(mem_kib / 2**20, 1),
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def ram_dir() -> str | None:
    """A directory in memory (tmpfs) for the stand-in card's state and budget files,
    as on a node (/run is tmpfs), or None (the default temporary directory).

    Hundreds of storm processes were seen sitting for 20-30 s in the kernel
    (D state: folio_wait_bit_common, __folio_lock, __mmap_region) on the shared
    development VM, with or without the hook; a disk-backed file adds page
    writeback to that. tmpfs removes the disk from the measurement; it did not
    remove the stalls (BENCHMARKS.md, issue 20 follow-up).
    """
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


class RunQueueWait:
    """How long one process's threads have waited on a CPU run-queue (ready to
    run, not running): what the rest of the machine costs it. Read from
    /proc/PID/task/TID/schedstat (the second field, ns); a thread that ended
    keeps what it added. On a kernel without schedstat every read is None."""

    def __init__(self, pid: int, proc: Path = Path("/proc")) -> None:
        self._tasks = proc / str(pid) / "task"
        self._seen: dict[str, int] = {}

    def read_s(self) -> float | None:
        """Seconds waited since the last read (the first read: since the start)."""
        added, found = 0, False
        try:
            tids = [entry.name for entry in self._tasks.iterdir()]
        except OSError:  # gone (reaped), or no /proc
            return 0.0 if self._seen else None
        for tid in tids:
            try:
                waited = int((self._tasks / tid / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):  # a thread that just ended
                continue
            found = True
            added += max(0, waited - self._seen.get(tid, 0))
            self._seen[tid] = waited
        if not found:
            return 0.0 if self._seen else None
        return added / 1e9


class WaitWatch:
    """A process's RunQueueWait read every `every_s` by a thread of its own until
    stop(): `samples` holds (time.monotonic(), seconds waited so far). A thread
    of the process that ends between two reads takes what it waited since the
    last one with it. On a kernel without schedstat there are no samples."""

    def __init__(self, pid: int, every_s: float = 0.005) -> None:
        self.samples: list[tuple[float, float]] = []
        self._waits = RunQueueWait(pid)
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        total = 0.0
        while (read := self._waits.read_s()) is not None:
            total += read
            self.samples.append((time.monotonic(), total))
            if self._stop.wait(self._every_s):
                return

    def stop(self) -> float | None:
        """Seconds waited in all, None where the kernel cannot tell."""
        self._stop.set()
        self._thread.join()
        return self.samples[-1][1] if self.samples else None

    def by(self, at: float) -> float:
        """Seconds waited by `at` (time.monotonic()), as last read before it."""
        return max((total for when, total in self.samples if when <= at), default=0.0)
