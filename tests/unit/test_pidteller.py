"""vgpu/daemon/pidteller.py and the budget file's told words: the node daemon
tells each hook process its host pid from the kernel's /proc/locks."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vgpu.adapters import budget
from vgpu.daemon.pidteller import HostPidTeller

# Holds slot argv[2]'s liveness (OFD) lock and pid (POSIX) lock, as a hook
# process does; says its pid and waits for EOF.
HOOK_LIKE = (
    "import fcntl, os, struct, sys; fd = os.open(sys.argv[1], os.O_RDWR); i = int(sys.argv[2]); "
    "fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack('hhqqi4x', fcntl.F_WRLCK, 0, "
    f"{budget.SLOT_LOCK_BASE} + i, 1, 0)); "
    f"fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, {budget.PID_LOCK_BASE} + i, 0); "
    "print(os.getpid(), flush=True); sys.stdin.read()"
)


def _file(tmp_path: Path, slots: dict[int, tuple[int, int]]) -> Path:
    """A current-version budget file whose slots hold (pid, host pid)."""
    path = tmp_path / budget.FILE_NAME
    budget.ensure(path)
    with path.open("r+b") as fh:
        hwm = max(slots) + 1 if slots else 0
        fh.write(
            budget.HEADER.pack(
                budget.MAGIC, budget.VERSION, budget.FILE_BYTES, budget.MAX_SLOTS, hwm, 0, 0, 0, 0
            )
        )
        for i, (pid, host) in slots.items():
            fh.seek(budget.SLOTS_AT + i * budget.SLOT.size)
            fh.write(struct.pack("<iI", pid, host))
    return path


def _told(path: Path, slot: int) -> tuple[int, int]:
    data = path.read_bytes()
    (word,) = struct.unpack_from("<Q", data, budget.TOLD_AT + 8 * slot)
    return word >> 32, word & 0xFFFFFFFF


def _beat(path: Path) -> int:
    return int(struct.unpack_from("<Q", path.read_bytes(), budget.TELLER_AT)[0])


class _Hooks:
    """Processes holding slots' locks, as hook processes do."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.procs: dict[int, subprocess.Popen[str]] = {}

    def hold(self, slot: int) -> int:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOOK_LIKE, str(self.path), str(slot)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        self.procs[slot] = proc
        return int(proc.stdout.readline())

    def end(self, slot: int) -> None:
        self.procs.pop(slot).communicate("")

    def close(self) -> None:
        for slot in list(self.procs):
            self.end(slot)


Hooks = Callable[[Path], _Hooks]


@pytest.fixture
def hooks() -> Iterator[Hooks]:
    made: list[_Hooks] = []

    def make(path: Path) -> _Hooks:
        made.append(_Hooks(path))
        return made[-1]

    yield make
    for h in made:
        h.close()


def test_each_untold_slot_is_told_its_holders_pid_with_its_own_pid(
    tmp_path: Path, hooks: Hooks
) -> None:
    path = _file(tmp_path, {0: (7, 0), 1: (8, 555), 2: (9, 0), 3: (10, 0)})
    h = hooks(path)
    p0, p1, p3 = h.hold(0), h.hold(1), h.hold(3)
    teller = HostPidTeller(Path("/proc"), clock_ns=lambda: 123_456)
    assert teller.tell([path]) == 2
    assert _told(path, 0) == (7, p0)
    assert _told(path, 1) == (0, 0)  # its hook already knows its host pid
    assert _told(path, 2) == (0, 0)  # nobody holds its pid byte
    assert _told(path, 3) == (10, p3)
    assert _beat(path) == 123_456
    # told and not yet adopted: the arbiter counts them already
    assert budget.live_host_pids(path) == frozenset({p0, 555, p3})
    view = budget.tell_view(path)
    assert view is not None and view.untold == {2: 9}
    assert teller.tell([path]) == 0  # nothing new
    assert p1 > 0


def test_a_word_meant_for_a_slots_previous_process_is_not_its_answer(
    tmp_path: Path, hooks: Hooks
) -> None:
    path = _file(tmp_path, {0: (7, 0)})
    h = hooks(path)
    first = h.hold(0)
    HostPidTeller(Path("/proc")).tell([path])
    assert _told(path, 0) == (7, first)
    # the process ends; another one takes the slot (pid 11 in its namespace)
    h.end(0)
    with path.open("r+b") as fh:
        fh.seek(budget.SLOTS_AT)
        fh.write(struct.pack("<iI", 11, 0))
    view = budget.tell_view(path)
    assert view is not None and view.untold == {0: 11}
    second = h.hold(0)
    assert HostPidTeller(Path("/proc")).tell([path]) == 1
    assert _told(path, 0) == (11, second)


def test_the_stand_ins_namespaces_are_translated(tmp_path: Path, hooks: Hooks) -> None:
    path = _file(tmp_path, {4: (12, 0)})
    pid = hooks(path).hold(4)
    teller = HostPidTeller(Path("/proc"), translate=lambda p, host: host + 100_000)
    teller.tell([path])
    assert _told(path, 4) == (12, pid + 100_000)


def test_old_or_foreign_files_are_never_written(tmp_path: Path) -> None:
    old = tmp_path / "old.shm"
    old.write_bytes(struct.pack("<II", budget.MAGIC, 4) + bytes(143360 - 8))
    garbage = tmp_path / "garbage.shm"
    garbage.write_bytes(b"\xff" * budget.FILE_BYTES)
    link = tmp_path / "link.shm"
    link.symlink_to(garbage)
    before = {p: p.read_bytes() for p in (old, garbage)}
    assert HostPidTeller(Path("/proc")).tell([old, garbage, link, tmp_path / "none"]) == 0
    assert {p: p.read_bytes() for p in (old, garbage)} == before


def test_without_the_hosts_proc_nothing_is_told_and_no_heartbeat_written(
    tmp_path: Path, hooks: Hooks
) -> None:
    path = _file(tmp_path, {0: (7, 0)})
    hooks(path).hold(0)
    teller = HostPidTeller(tmp_path / "no-proc")
    assert teller.tell([path]) == 0
    assert _beat(path) == 0 and _told(path, 0) == (0, 0)  # the hooks find their own
    assert HostPidTeller.for_node(tmp_path / "no-proc") is None
    assert HostPidTeller.for_node(Path("/proc")) is not None


def test_a_file_with_nothing_untold_still_gets_the_heartbeat(tmp_path: Path) -> None:
    path = _file(tmp_path, {})
    HostPidTeller(Path("/proc"), clock_ns=lambda: 99).tell([path])
    assert _beat(path) == 99
    assert os.path.getsize(path) == budget.FILE_BYTES


def _ask(path: Path, slot: int, card: str, own_mib: int) -> None:
    """The slot's process asks for its context's memory on entry 0 (`card`)."""
    with path.open("r+b") as fh:
        fh.seek(20)  # header word 5: device_count
        fh.write(struct.pack("<I", 1))
        fh.seek(budget.DEVICES_AT)
        fh.write(card.encode().ljust(budget.UUID_BYTES, b"\0"))
        fh.seek(budget.SLOTS_AT + slot * budget.SLOT.size + 8)
        fh.write(struct.pack("<Q", own_mib << 20))
        fh.seek(budget.AWAITING_AT + 4 * slot)
        fh.write(struct.pack("<I", 1))


def _measured(path: Path, slot: int) -> tuple[int, int, int]:
    (word,) = struct.unpack_from("<Q", path.read_bytes(), budget.MEASURED_AT + 8 * slot)
    return word >> 32, (word >> 24) & 0xFF, word & 0xFFFFFF


def test_a_told_process_gets_its_context_memory_once_two_periods_agree(
    tmp_path: Path, hooks: Hooks
) -> None:
    path = _file(tmp_path, {0: (7, 0)})
    host = hooks(path).hold(0)
    card = "GPU-00000000-0000-4000-8000-000000000000"
    _ask(path, 0, card, own_mib=100)
    nvml = {card: {host: 400 << 20}}
    calls: list[str] = []

    def memory(uuid: str) -> dict[int, int] | None:
        calls.append(uuid)
        return nvml.get(uuid)

    teller = HostPidTeller(Path("/proc"), memory=memory)
    teller.tell([path])  # told; the ask counts once its host pid is known
    teller.tell([path])  # first figure: 400 - 100
    assert _measured(path, 0) == (0, 0, 0)
    nvml[card] = {host: 500 << 20}  # an allocation in flight: another figure
    teller.tell([path])
    assert _measured(path, 0) == (0, 0, 0)
    teller.tell([path])  # two periods agree: written, in MiB, with the pid and entry + 1
    assert _measured(path, 0) == (7, 1, 400)
    assert set(calls) == {card}


def test_one_list_per_card_per_period_serves_every_file(tmp_path: Path, hooks: Hooks) -> None:
    card = "GPU-00000000-0000-4000-8000-000000000001"
    files = []
    for c in range(3):
        (tmp_path / f"c{c}").mkdir()
        path = _file(tmp_path / f"c{c}", {0: (7, 0)})
        hooks(path).hold(0)
        _ask(path, 0, card, own_mib=0)
        files.append(path)
    calls: list[str] = []

    def memory(uuid: str) -> dict[int, int] | None:
        calls.append(uuid)
        return {}

    teller = HostPidTeller(Path("/proc"), memory=memory)
    teller.tell(files)  # told
    calls.clear()
    teller.tell(files)
    assert calls == [card]


def test_a_flood_of_locks_is_read_rarely_and_stops_the_heartbeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant can take locks on its own files until /proc/locks is longer than
    the teller reads: it reads it at most every BACKOFF_S then, and stops
    beating, so that new hooks find their own pids rather than wait."""
    from vgpu.adapters import proclocks

    path = _file(tmp_path, {0: (7, 0)})  # untold, and nobody holds its byte: it stays so
    proc = tmp_path / "proc"
    proc.mkdir()
    flood = "".join(f"{i}: POSIX  ADVISORY  WRITE {1000 + i} 00:2e:{i} 0 0\n" for i in range(400))
    (proc / "locks").write_text(flood)
    monkeypatch.setattr(proclocks, "MAX_BYTES", 1024)  # the flood is ~18 KB
    now = [10**9]
    reads: list[int] = []
    real = proclocks.read_bounded

    def counting(root: Path) -> tuple[list[proclocks.LockOwner], bool]:
        reads.append(now[0])
        return real(root)

    monkeypatch.setattr(proclocks, "read_bounded", counting)
    teller = HostPidTeller(proc, clock_ns=lambda: now[0])
    teller.tell([path])
    assert _beat(path) == 0
    for _ in range(10):  # a second of periods: no more reads
        now[0] += 100_000_000
        teller.tell([path])
    assert len(reads) == 1 and _beat(path) == 0
    now[0] += 1_100_000_000
    teller.tell([path])
    assert len(reads) == 2
    # the flood ends: the next read finds the file short again, and beats
    (proc / "locks").write_text("")
    now[0] += 2_000_000_000
    teller.tell([path])
    assert len(reads) == 3 and _beat(path) == now[0]
