"""The NVML backend against an injected stand-in for the pynvml module.

The stand-in is passed through the constructor (`Nvml(module=fake)`), never
patched in. One test runs `vgpu serve --backend nvml` for real: on a machine
without libnvidia-ml.so.1 it must exit 3 with a hint, not a traceback.
"""

from __future__ import annotations

import ctypes
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pynvml
import pytest

from vgpu.adapters.gpus import BackendError, CardReading
from vgpu.adapters.nvml import MIB, Nvml, NvmlBackend
from vgpu.core.health import HealthEvent
from vgpu.core.model import Card
from vgpu.sim.harness import wait_until

pytestmark = pytest.mark.timeout(10)

UUID0 = "GPU-11111111-2222-3333-4444-555555555555"
UUID1 = "GPU-66666666-7777-8888-9999-000000000000"


class FakeNVMLError(Exception):
    """Like pynvml.NVMLError: carries the NVML return code in .value."""

    NAMES: ClassVar[dict[int, str]] = {
        3: "Not Supported",
        10: "Timeout",
        12: "NVML Shared Library Not Found",
        15: "GPU is lost",
        999: "Unknown Error",
    }

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self.NAMES.get(self.value, f"error {self.value}")


@dataclass
class FakeDevice:
    uuid: str | bytes
    name: str | bytes
    total_bytes: int
    minor: int
    numa: int | None  # None: nvmlDeviceGetNumaNodeId is "Not Supported"
    used_bytes: int = 0
    lost: bool = False
    utilization: int = 0


_BASE_ADDRESS = 0x7F00_0000


def handle(index: int) -> Any:
    """A device handle of pynvml's own type (a ctypes pointer), as a fresh object
    each time: pynvml builds a new one for every event, so identity never matches."""
    return ctypes.cast(ctypes.c_void_p(_BASE_ADDRESS + index), pynvml.c_nvmlDevice_t)


def handle_index(handle: Any) -> int:
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0) - _BASE_ADDRESS


class FakePynvml:
    """The subset of pynvml the backend uses, with knobs for faults."""

    NVMLError = FakeNVMLError
    NVML_ERROR_TIMEOUT = 10
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, devices: list[FakeDevice], init_error: int | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.init_calls = 0
        self.events: queue.Queue[Any] = queue.Queue()
        self.registered: list[int] = []
        self.probes = 0
        self.freed = threading.Event()

    def _dev(self, handle: Any) -> FakeDevice:
        index = handle_index(handle)
        if not 0 <= index < len(self.devices):
            raise FakeNVMLError(999)
        dev = self.devices[index]
        if dev.lost:
            raise FakeNVMLError(15)
        return dev

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return handle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes) -> Any:
        self.probes += 1
        for i, dev in enumerate(self.devices):
            raw = dev.uuid if isinstance(dev.uuid, bytes) else dev.uuid.encode()
            if raw == uuid:
                if dev.lost:
                    raise FakeNVMLError(15)
                return handle(i)
        raise FakeNVMLError(999)

    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes:
        return self._dev(handle).uuid

    def nvmlDeviceGetName(self, handle: Any) -> str | bytes:
        return self._dev(handle).name

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> SimpleNamespace:
        dev = self._dev(handle)
        return SimpleNamespace(total=dev.total_bytes, used=dev.used_bytes, free=0)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> SimpleNamespace:
        return SimpleNamespace(gpu=self._dev(handle).utilization, memory=0)

    def nvmlDeviceGetMinorNumber(self, handle: Any) -> int:
        return self._dev(handle).minor

    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        numa = self._dev(handle).numa
        if numa is None:
            raise FakeNVMLError(3)
        return numa

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, handle: Any, types: int, event_set: str) -> None:
        assert types == self.nvmlEventTypeXidCriticalError
        self.registered.append(handle_index(handle))

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        try:
            item = self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise FakeNVMLError(self.NVML_ERROR_TIMEOUT) from None
        if isinstance(item, FakeNVMLError):
            raise item
        return item

    def nvmlEventSetFree(self, event_set: str) -> None:
        self.freed.set()

    # helpers for tests
    def xid(self, index: int, xid: int) -> None:
        self.events.put(SimpleNamespace(eventData=xid, device=handle(index)))


def two_cards() -> list[FakeDevice]:
    return [
        FakeDevice(UUID0.encode(), b"NVIDIA H200", 143771 * MIB + 4096, minor=3, numa=1),
        FakeDevice(UUID1, "NVIDIA H100 80GB HBM3", 81559 * MIB, minor=0, numa=None),
    ]


# ---------------------------------------------------------------- enumeration


def test_enumerates_cards_and_decodes_bytes() -> None:
    fake = FakePynvml(two_cards())
    got = NvmlBackend(nvml=Nvml(module=fake)).cards()
    assert got == [
        Card(uuid=UUID0, index=0, name="NVIDIA H200", memory_mib=143771, minor=3, numa_node=1),  # type: ignore[arg-type]
        Card(
            uuid=UUID1,  # type: ignore[arg-type]
            index=1,
            name="NVIDIA H100 80GB HBM3",
            memory_mib=81559,
            minor=0,
            numa_node=None,
        ),
    ]
    assert all(isinstance(c.uuid, str) and isinstance(c.name, str) for c in got)


class OldPynvml(FakePynvml):
    """A pynvml from before nvmlDeviceGetNumaNodeId existed."""

    nvmlDeviceGetNumaNodeId = None  # type: ignore[assignment]


def test_negative_or_missing_numa_means_no_topology() -> None:
    fake = FakePynvml([FakeDevice(UUID0, "x", 1024 * MIB, minor=0, numa=-1)])
    assert NvmlBackend(nvml=Nvml(module=fake)).cards()[0].numa_node is None
    old = OldPynvml([FakeDevice(UUID0, "x", 1024 * MIB, minor=0, numa=0)])
    assert NvmlBackend(nvml=Nvml(module=old)).cards()[0].numa_node is None


def test_initialises_once_and_reports_real_usage() -> None:
    fake = FakePynvml(two_cards())
    fake.devices[0].used_bytes = 2048 * MIB
    fake.devices[0].utilization = 37
    backend = NvmlBackend(nvml=Nvml(module=fake))
    backend.cards()
    backend.cards()
    assert backend.readings() == {
        UUID0: CardReading(memory_used_mib=2048, utilization_percent=37),
        UUID1: CardReading(memory_used_mib=0, utilization_percent=0),
    }
    fake.devices[1].lost = True  # a card that stops answering has no reading
    assert UUID1 not in backend.readings()
    assert fake.init_calls == 1


def test_missing_driver_gives_a_hint_not_an_nvml_error() -> None:
    fake = FakePynvml([], init_error=12)
    with pytest.raises(BackendError) as info:
        NvmlBackend(nvml=Nvml(module=fake)).cards()
    message = str(info.value)
    assert "NVML Shared Library Not Found" in message
    assert "driver" in message
    assert "--backend mock" in message


def test_a_failing_call_names_the_call() -> None:
    fake = FakePynvml(two_cards())
    fake.devices[1].lost = True
    with pytest.raises(BackendError, match="nvmlDeviceGetUUID failed: GPU is lost"):
        NvmlBackend(nvml=Nvml(module=fake)).cards()


# ------------------------------------------------------------------ XID events


class Watching:
    def __init__(self, fake: FakePynvml, **kwargs: Any) -> None:
        self.fake = fake
        self.backend = NvmlBackend(nvml=Nvml(module=fake), wait_ms=10, **kwargs)
        self.cards = self.backend.cards()
        self.stop = threading.Event()
        self.events: list[HealthEvent] = []
        self.thread = threading.Thread(
            target=self.backend.watch,
            args=(self.stop, self._no_cards, self.events.append),
            daemon=True,
        )
        self.thread.start()

    @staticmethod
    def _no_cards(cards: list[Card]) -> None:
        raise AssertionError("the NVML backend reports events, not card lists")

    def wait_events(self, n: int, timeout_s: float = 3.0) -> bool:
        return wait_until(lambda: len(self.events) >= n, timeout_s, interval_s=0.005)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(3.0)
        assert not self.thread.is_alive(), "watch() did not return after stop"
        assert self.fake.freed.is_set(), "the event set was not freed"


@pytest.fixture
def fake() -> FakePynvml:
    return FakePynvml(two_cards())


def test_critical_xid_is_reported_and_application_xid_is_not(fake: FakePynvml) -> None:
    w = Watching(fake)
    try:
        assert fake.registered == [0, 1]
        fake.xid(0, 13)  # application error: ignored
        fake.xid(1, 79)  # fallen off the bus
        assert w.wait_events(1)
        assert w.events == [HealthEvent(UUID1, xid=79)]  # type: ignore[arg-type]
    finally:
        w.close()
    assert w.events == [HealthEvent(UUID1, xid=79)]  # type: ignore[arg-type]


def test_custom_ignored_xids(fake: FakePynvml) -> None:
    w = Watching(fake, ignored_xids=[79])
    try:
        fake.xid(0, 79)
        fake.xid(1, 13)  # no longer ignored
        assert w.wait_events(1)
    finally:
        w.close()
    assert w.events == [HealthEvent(UUID1, xid=13)]  # type: ignore[arg-type]


def test_wait_timeouts_and_transient_errors_are_tolerated(fake: FakePynvml) -> None:
    w = Watching(fake)
    try:
        # Many 10 ms timeouts pass before anything happens; then a failed wait.
        assert wait_until(lambda: fake.events.empty(), 1.0)
        fake.events.put(FakeNVMLError(999))
        fake.xid(0, 48)
        assert w.wait_events(1)
        assert w.thread.is_alive()
    finally:
        w.close()
    assert w.events == [HealthEvent(UUID0, xid=48)]  # type: ignore[arg-type]


def test_event_on_an_unknown_handle_marks_every_card(fake: FakePynvml) -> None:
    w = Watching(fake)
    try:
        fake.events.put(SimpleNamespace(eventData=79, device=handle(99)))
        assert w.wait_events(2)
    finally:
        w.close()
    assert sorted(e.card for e in w.events) == sorted([UUID0, UUID1])
    assert {e.xid for e in w.events} == {79}


def test_card_recovers_after_the_hold_once_nvml_answers(fake: FakePynvml) -> None:
    w = Watching(fake, recovery_hold_s=0.05, probe_interval_s=0.01)
    try:
        fake.devices[0].lost = True
        fake.xid(0, 79)
        assert w.wait_events(1)
        probes = fake.probes
        # While the card does not answer, the probes fail and nothing changes.
        assert wait_until(lambda: fake.probes >= probes + 3, 3.0)
        assert len(w.events) == 1
        fake.devices[0].lost = False
        assert w.wait_events(2)
    finally:
        w.close()
    assert w.events == [
        HealthEvent(UUID0, xid=79),  # type: ignore[arg-type]
        HealthEvent(UUID0, healthy=True),  # type: ignore[arg-type]
    ]


def test_no_recovery_before_the_hold(fake: FakePynvml) -> None:
    w = Watching(fake, recovery_hold_s=60.0, probe_interval_s=0.01)
    try:
        fake.xid(1, 79)
        assert w.wait_events(1)
        # Probe rounds run (the timer fires) but the hold keeps the card out.
        assert not w.wait_events(2, timeout_s=0.3)
    finally:
        w.close()
    assert fake.probes == 0


# ------------------------------------------------------- the real thing, no GPU


def _nvml_loadable() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.mark.timeout(30)
@pytest.mark.skipif(_nvml_loadable(), reason="this machine has the NVIDIA driver")
def test_serve_with_nvml_and_no_driver_exits_3_with_a_hint(short_tmp: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vgpu",
            "serve",
            "--backend",
            "nvml",
            "--device-plugin-dir",
            str(short_tmp / "dp"),
            "--state-dir",
            str(short_tmp / "state"),
            "--pod-resources-socket",
            str(short_tmp / "pr.sock"),
        ],
        capture_output=True,
        text=True,
        timeout=20,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr
    hint = [line for line in proc.stderr.splitlines() if line.startswith("vgpu: NVML")]
    assert len(hint) == 1, proc.stderr
    assert "driver" in hint[0] and "--backend mock" in hint[0]
    assert not list((short_tmp / "dp").glob("*.sock")) if (short_tmp / "dp").exists() else True
