"""Shared pieces of the benchmarks: targets, percentiles, the machine description."""

from __future__ import annotations

import math
import os
import platform
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
