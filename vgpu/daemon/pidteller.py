"""The node daemon tells each hook process its host pid.

A hook in a container sees only its own PID namespace, yet NVML names processes
by host pid. Left alone, each new process lists the card's processes before and
after creating its context and diffs the two; when hundreds start at once the
diff is ambiguous and each falls back to marker allocations, and the lists
alone are most of a start-up storm's added time (BENCHMARKS.md, issue 20).

The daemon can see the answer instead. Each hook process holds a POSIX lock on
its slot's pid byte of the budget file, and the host's /proc/locks names every
lock's owner by host pid (vgpu/adapters/proclocks.py). Once per arbiter period
the teller reads /proc/locks (only when some slot is untold), writes each untold
slot's host pid into the file's `told` word, and refreshes its heartbeat. While
the heartbeat is fresh, a new context lists nothing: the hook's controller
adopts the told pid at its next period (hooks/device.c).

Under a memory limit the hook also charges its context's memory, which only
NVML can measure: a told process asks for it (`awaiting`), and the teller
answers from one list of that card's processes per period (`measured`),
instead of each process of a storm listing the card itself. The context's
memory is what NVML shows for the host pid less what the process allocated
itself (its slot); an allocation in flight while the card is listed would
skew that, so a figure is written only once two consecutive periods agree.

Where the host's /proc is not mounted (the daemon without /host/proc), the
teller is off and the hooks find their host pids themselves, as before.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from vgpu.adapters import budget, proclocks

log = logging.getLogger(__name__)

# The stand-in driver fakes PID namespaces by an offset per container
# (FAKE_PIDNS_OFFSET); on a node the kernel translates and this is the identity.
Translate = Callable[[Path, int], int]
# Per card UUID: host pid -> bytes it uses there (NVML's compute processes), or
# None where the card cannot tell.
ProcessMemory = Callable[[str], Mapping[int, int] | None]
BACKOFF_S = 2.0


class HostPidTeller:
    def __init__(
        self,
        proc_root: Path,
        translate: Translate | None = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        memory: ProcessMemory | None = None,
    ) -> None:
        self.proc_root = proc_root
        self._translate = translate
        self._memory = memory
        self._clock_ns = clock_ns
        self._failed = False
        self._truncated = False
        self._next_ns = 0  # no /proc/locks read before (a flood's back-off)
        # (file, slot, pid, entry) -> the overhead seen last period, awaiting a second
        self._seen: dict[tuple[Path, int, int, int], int] = {}

    @classmethod
    def for_node(cls, proc_root: Path, memory: ProcessMemory | None = None) -> HostPidTeller | None:
        """A teller reading `proc_root`/locks, or None (logged) where it cannot."""
        try:
            proclocks.read(proc_root)
        except OSError as exc:
            log.info(
                "host pid teller off: cannot read %s (%s); mount the host's /proc there "
                "(the chart does) so hooks need not list the card's processes at start",
                proc_root / "locks",
                exc.strerror or exc,
            )
            return None
        return cls(proc_root, memory=memory)

    def tell(self, files: Sequence[Path]) -> int:
        """One pass over these budget files; the number of slots told."""
        views = {path: budget.tell_view(path) for path in files}
        locks: list[proclocks.LockOwner] = []
        now_ns = self._clock_ns()
        if any(v is not None and v.untold for v in views.values()) and now_ns >= self._next_ns:
            try:
                locks, truncated = proclocks.read_bounded(self.proc_root)
                self._failed = False
            except OSError as exc:
                if not self._failed:
                    log.warning("host pid teller: cannot read %s: %s", self.proc_root, exc)
                self._failed = True
                return 0  # no heartbeat either: the hooks find their pids themselves
            if truncated:
                # Someone holds more locks than MAX_BYTES lists (tenants can take
                # locks on their own files): read it at most every BACKOFF_S, so
                # that a flood costs little CPU, and beat no more, so that new
                # processes find their own pids while it lasts.
                self._next_ns = now_ns + int(BACKOFF_S * 1e9)
                if not self._truncated:
                    log.warning(
                        "host pid teller: %s lists more than %d bytes of locks; read at most "
                        "every %g s from now on",
                        self.proc_root / "locks",
                        proclocks.MAX_BYTES,
                        BACKOFF_S,
                    )
            self._truncated = truncated
        lists: dict[str, Mapping[int, int] | None] = {}  # one NVML list per card per pass
        seen: dict[tuple[Path, int, int, int], int] = {}
        told = 0
        for path, view in views.items():
            if view is None:
                continue  # not a usable current-version file: never written
            words: dict[int, tuple[int, int]] = {}
            if view.untold:
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                owners = proclocks.owners_in(locks, st, budget.PID_LOCK_BASE, budget.MAX_SLOTS)
                for slot, pid in view.untold.items():
                    host = owners.get(slot)
                    if host:
                        words[slot] = (pid, self._host(path, host))
            measured: dict[int, tuple[int, int, int]] = {}
            for slot, asked in view.asked.items() if self._memory is not None else ():
                if asked.card not in lists:
                    lists[asked.card] = self._list(asked.card)
                used = (lists[asked.card] or {}).get(asked.host_pid)
                if used is None:
                    continue
                key = (path, slot, asked.pid, asked.entry)
                overhead = max(0, used - asked.own_bytes)
                if self._seen.get(key) == overhead:
                    measured[slot] = (asked.pid, asked.entry, overhead)
                seen[key] = overhead
            beat = None if self._truncated else now_ns
            told += budget.tell(path, words, beat, measured)
        self._seen = seen
        return told

    def _host(self, path: Path, pid: int) -> int:
        return self._translate(path, pid) if self._translate else pid

    def _list(self, card: str) -> Mapping[int, int] | None:
        assert self._memory is not None
        try:
            return self._memory(card)
        except Exception as exc:  # NVML trouble: the hooks list the card themselves
            log.debug("host pid teller: no process list of %s: %s", card, exc)
            return None
