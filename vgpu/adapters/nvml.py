"""The NVML backend: real cards through pynvml (nvidia-ml-py).

Every NVML call goes through `Nvml.call`, which initialises the library once,
turns NVML errors into BackendError with a hint, and decodes bytes. The
pynvml module is injected so unit tests can pass a stand-in.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from types import ModuleType
from typing import Any

from vgpu.adapters.gpus import BackendError, CardReading, CardsCallback, EventCallback
from vgpu.core.health import DEFAULT_IGNORED_XIDS, HealthEvent, describe_xid
from vgpu.core.model import Card, CardUuid
from vgpu.core.slicing import check_card_uuid

log = logging.getLogger(__name__)

MIB = 1024 * 1024
NO_DRIVER_HINT = (
    "NVML is not available: {detail}. Is the NVIDIA driver installed on this node, and does "
    "the vgpu container run with the NVIDIA runtime (or mount libnvidia-ml.so.1 and "
    "/dev/nvidia*)? On a machine without GPUs use --backend mock --mock-gpus FILE."
)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _handle_key(handle: Any) -> Hashable:
    """A key equal for equal device handles.

    pynvml builds a fresh ctypes pointer object for every event, so identity
    never matches the handle kept from enumeration: compare the address.
    """
    if isinstance(handle, ctypes._Pointer):
        return ("nvmlDevice", ctypes.cast(handle, ctypes.c_void_p).value)
    if isinstance(handle, Hashable):
        return handle
    return ("id", id(handle))


class Nvml:
    """One place for NVML calls: lazy init, errors with hints, bytes decoding."""

    def __init__(self, module: ModuleType | Any | None = None) -> None:
        self._module = module
        self._lock = threading.Lock()
        self._ready = False

    @property
    def lib(self) -> Any:
        if self._module is None:
            try:
                import pynvml
            except ImportError as exc:  # pragma: no cover - dependency of the package
                raise BackendError(NO_DRIVER_HINT.format(detail=f"pynvml missing ({exc})")) from exc
            self._module = pynvml
        return self._module

    def init(self) -> None:
        with self._lock:
            if self._ready:
                return
            try:
                self.lib.nvmlInit()
            except self.lib.NVMLError as exc:
                raise BackendError(NO_DRIVER_HINT.format(detail=str(exc))) from exc
            self._ready = True

    def call(self, name: str, *args: Any) -> Any:
        self.init()
        fn: Callable[..., Any] = getattr(self.lib, name)
        try:
            return fn(*args)
        except self.lib.NVMLError as exc:
            raise BackendError(f"NVML {name} failed: {exc}") from exc

    def shutdown(self) -> None:
        with self._lock:
            if self._ready:
                try:
                    self.lib.nvmlShutdown()
                except self.lib.NVMLError:
                    pass
                self._ready = False


class NvmlBackend:
    """Enumerates cards and watches XID events through NVML."""

    name = "nvml"

    def __init__(
        self,
        nvml: Nvml | None = None,
        ignored_xids: Iterable[int] = DEFAULT_IGNORED_XIDS,
        wait_ms: int = 500,
        recovery_hold_s: float = 60.0,
        probe_interval_s: float = 5.0,
    ) -> None:
        self.nvml = nvml or Nvml()
        self.ignored_xids = frozenset(ignored_xids)
        self.wait_ms = wait_ms
        self.recovery_hold_s = recovery_hold_s
        self.probe_interval_s = probe_interval_s
        self._handles: dict[CardUuid, Any] = {}
        self._broken_since: dict[CardUuid, float] = {}
        self._util_seen: dict[CardUuid, int] = {}  # newest sample timestamp read, per card

    def cards(self) -> list[Card]:
        count = self.nvml.call("nvmlDeviceGetCount")
        cards = []
        for index in range(count):
            handle = self.nvml.call("nvmlDeviceGetHandleByIndex", index)
            uuid = check_card_uuid(_text(self.nvml.call("nvmlDeviceGetUUID", handle)))
            memory = self.nvml.call("nvmlDeviceGetMemoryInfo", handle)
            minor = int(self.nvml.call("nvmlDeviceGetMinorNumber", handle))
            cards.append(
                Card(
                    uuid=uuid,
                    index=index,
                    name=_text(self.nvml.call("nvmlDeviceGetName", handle)),
                    memory_mib=int(memory.total) // MIB,
                    minor=minor,
                    numa_node=self._numa(handle),
                )
            )
            self._handles[uuid] = handle
        return cards

    def _numa(self, handle: Any) -> int | None:
        getter = getattr(self.nvml.lib, "nvmlDeviceGetNumaNodeId", None)
        if getter is None:
            return None
        try:
            node = int(self.nvml.call("nvmlDeviceGetNumaNodeId", handle))
        except BackendError:
            return None
        return node if node >= 0 else None

    def readings(self) -> dict[CardUuid, CardReading]:
        out = {}
        for uuid, handle in self._handles.items():
            try:
                used: int | None = (
                    int(self.nvml.call("nvmlDeviceGetMemoryInfo", handle).used) // MIB
                )
            except BackendError:
                used = None
            try:
                rates = self.nvml.call("nvmlDeviceGetUtilizationRates", handle)
                util: int | None = int(rates.gpu)
            except (BackendError, AttributeError):
                util = None
            if used is not None or util is not None:
                out[uuid] = CardReading(used, util)
        return out

    def process_utilization(self, uuid: CardUuid) -> dict[int, float] | None:
        """SM utilisation (percent) per host pid on one card since the last call,
        as NVML samples it; {} when there is no new sample, None when the card
        cannot tell (unknown card, per-process utilisation unsupported, e.g. MIG)."""
        handle = self._handles.get(uuid)
        if handle is None:
            return None
        lib = self.nvml.lib
        try:
            self.nvml.init()
            samples = lib.nvmlDeviceGetProcessUtilization(handle, self._util_seen.get(uuid, 0))
        except lib.NVMLError as exc:
            if exc.value == getattr(lib, "NVML_ERROR_NOT_FOUND", 6):
                return {}  # no sample newer than the last one
            return None
        per_pid: dict[int, list[int]] = {}
        for sample in samples:
            stamp = int(sample.timeStamp)
            if stamp > self._util_seen.get(uuid, 0):
                self._util_seen[uuid] = stamp
            per_pid.setdefault(int(sample.pid), []).append(int(sample.smUtil))
        return {pid: min(100.0, sum(v) / len(v)) for pid, v in per_pid.items()}

    def process_memory(self, uuid: str) -> dict[int, int] | None:
        """Bytes each compute process (host pid) uses on one card, from NVML's
        running-process list; None when the card is unknown or cannot list them
        (a process without a usedGpuMemory figure is left out)."""
        handle = self._handles.get(CardUuid(uuid))
        if handle is None:
            wanted = uuid.lower()
            handle = next((h for u, h in self._handles.items() if u.lower() == wanted), None)
        if handle is None:
            return None
        lib = self.nvml.lib
        try:
            self.nvml.init()
            procs = lib.nvmlDeviceGetComputeRunningProcesses(handle)
        except lib.NVMLError:
            return None
        out = {}
        for proc in procs:
            used = getattr(proc, "usedGpuMemory", None)
            if isinstance(used, int) and 0 <= used < 2**62:  # not NVML_VALUE_NOT_AVAILABLE
                out[int(proc.pid)] = used
        return out

    def watch(
        self, stop: threading.Event, on_cards: CardsCallback, on_event: EventCallback
    ) -> None:
        lib = self.nvml.lib
        try:
            event_set = self.nvml.call("nvmlEventSetCreate")
        except BackendError as exc:
            log.error("XID watching is off, cards stay as enumerated: %s", exc)
            stop.wait()
            return
        for uuid, handle in self._handles.items():
            try:
                self.nvml.call(
                    "nvmlDeviceRegisterEvents", handle, lib.nvmlEventTypeXidCriticalError, event_set
                )
            except BackendError as exc:
                log.warning("card %s: XID events not supported, health not watched: %s", uuid, exc)
        by_handle = {_handle_key(h): u for u, h in self._handles.items()}
        next_probe = time.monotonic() + self.probe_interval_s
        try:
            while not stop.is_set():
                event = self._wait(event_set)
                if event is not None:
                    self._on_xid(event, by_handle, on_event)
                if time.monotonic() >= next_probe:
                    next_probe = time.monotonic() + self.probe_interval_s
                    self._probe(on_event)
        finally:
            try:
                self.nvml.call("nvmlEventSetFree", event_set)
            except BackendError:
                pass

    def _wait(self, event_set: Any) -> Any | None:
        lib = self.nvml.lib
        try:
            return lib.nvmlEventSetWait_v2(event_set, self.wait_ms)
        except lib.NVMLError as exc:
            if exc.value == getattr(lib, "NVML_ERROR_TIMEOUT", 10):
                return None
            log.warning("NVML event wait failed, retrying: %s", exc)
            time.sleep(self.wait_ms / 1000)
            return None

    def _on_xid(
        self, event: Any, by_handle: dict[Hashable, CardUuid], on_event: EventCallback
    ) -> None:
        xid = int(event.eventData)
        uuid = by_handle.get(_handle_key(event.device))
        if uuid is None:
            try:
                uuid = CardUuid(_text(self.nvml.call("nvmlDeviceGetUUID", event.device)))
            except BackendError:
                log.warning("XID %d on an unknown card: marking every card unhealthy", xid)
                for card in self._handles:
                    self._mark(card, xid, on_event)
                return
        self._mark(uuid, xid, on_event)

    def _mark(self, uuid: CardUuid, xid: int, on_event: EventCallback) -> None:
        if xid in self.ignored_xids:
            log.info("card %s: XID %d (application error) ignored", uuid, xid)
            return
        log.error("card %s: XID %d (%s), taking it out of service", uuid, xid, describe_xid(xid))
        self._broken_since[uuid] = time.monotonic()
        on_event(HealthEvent(uuid, xid=xid))

    def _probe(self, on_event: EventCallback) -> None:
        """A card broken for recovery_hold_s comes back once NVML answers for it again."""
        now = time.monotonic()
        for uuid, since in list(self._broken_since.items()):
            if now - since < self.recovery_hold_s:
                continue
            try:
                handle = self.nvml.call("nvmlDeviceGetHandleByUUID", uuid.encode())
                self.nvml.call("nvmlDeviceGetMemoryInfo", handle)
            except BackendError:
                continue
            del self._broken_since[uuid]
            log.info("card %s answers NVML again, returning it to service", uuid)
            on_event(HealthEvent(uuid, healthy=True))
