"""The GPU backend port and the mock backend.

A backend enumerates cards and reports health changes. The mock backend reads
a JSON or YAML file (or a preset such as ``preset:2xH200``) and re-reads it
when it changes: that is how tests, the demo and laptops inject faults.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from vgpu.core.errors import ConfigError
from vgpu.core.health import HealthEvent
from vgpu.core.model import Card, CardUuid
from vgpu.core.slicing import check_card_uuid

log = logging.getLogger(__name__)

# A full, fresh card list (mock) or one health event (NVML).
CardsCallback = Callable[[list[Card]], None]
EventCallback = Callable[[HealthEvent], None]


@dataclass(frozen=True)
class CardReading:
    """What a card really does right now, where the backend can tell."""

    memory_used_mib: int | None = None
    utilization_percent: int | None = None


class GpuBackend(Protocol):
    """Where cards come from."""

    name: str

    def cards(self) -> list[Card]:
        """The cards present now (a Card.xid is an XID still to be judged by the
        health tracker). Raises BackendError or ConfigError with a hint."""
        ...

    def watch(
        self, stop: threading.Event, on_cards: CardsCallback, on_event: EventCallback
    ) -> None:
        """Block until `stop` is set, reporting changes through the callbacks."""
        ...

    def readings(self) -> dict[CardUuid, CardReading]:
        """Real memory use and utilisation per card (empty where unknown)."""
        ...


class BackendError(Exception):
    """The backend cannot be used; the message says why and what to do."""


PRESETS: dict[str, tuple[str, int]] = {
    "H200": ("NVIDIA H200", 143771),
    "H100": ("NVIDIA H100 80GB HBM3", 81559),
    "H20": ("NVIDIA H20", 97871),
    "A100": ("NVIDIA A100-SXM4-80GB", 81920),
    "L4": ("NVIDIA L4", 23034),
}
_PRESET_RE = re.compile(r"^preset:(\d{1,2})x([A-Za-z0-9]+)$")


def preset_cards(spec: str) -> list[Card]:
    """Cards for 'preset:<N>x<MODEL>', e.g. preset:8xH200. Stable fake UUIDs."""
    match = _PRESET_RE.match(spec)
    if not match or match.group(2).upper() not in PRESETS or not 1 <= int(match.group(1)) <= 64:
        raise ConfigError(
            f"mock preset {spec!r} is not known; use preset:<1-64>x<MODEL> with MODEL one of "
            f"{', '.join(PRESETS)}, e.g. preset:2xH200"
        )
    count, model = int(match.group(1)), match.group(2).upper()
    name, memory_mib = PRESETS[model]
    return [
        Card(
            uuid=CardUuid(f"GPU-{model.lower():0>8}-0000-4000-8000-{i:012d}"[:40]),
            index=i,
            name=name,
            memory_mib=memory_mib,
            minor=i,
            numa_node=i * 2 // count if count > 1 else 0,
            device_nodes=(),  # a preset has no device nodes: it runs on any host
        )
        for i in range(count)
    ]


READING_KEYS = ("memory_used_mib", "utilization_percent")


def mock_readings(data: Any) -> dict[CardUuid, CardReading]:
    """The readings of a mock file already checked by parse_mock."""
    out = {}
    for item in data["gpus"]:
        if any(item.get(k) is not None for k in READING_KEYS):
            out[CardUuid(str(item["uuid"]))] = CardReading(
                item.get("memory_used_mib"), item.get("utilization_percent")
            )
    return out


def parse_mock(data: Any, source: str) -> list[Card]:
    """Cards from the mock file's data; a reported XID rides on Card.xid."""
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), list):
        raise ConfigError(f'{source}: gpus: expected {{"gpus": [{{"uuid": ..., ...}}, ...]}}')
    cards: list[Card] = []
    allowed = {"uuid", "name", "memory_mib", "minor", "numa_node", "healthy", "xid", "index"}
    allowed.add("device_nodes")
    allowed |= set(READING_KEYS) | {"process_utilization"}
    for i, item in enumerate(data["gpus"]):
        where = f"{source}: gpus[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"{where} must be a mapping with uuid, name and memory_mib")
        extra = set(item) - allowed
        if extra:
            raise ConfigError(
                f"{where}: unknown key(s) {sorted(extra)}; allowed: {sorted(allowed)}"
            )
        for key in ("uuid", "name", "memory_mib"):
            if key not in item:
                raise ConfigError(
                    f"{where}.{key}: missing (uuid, name and memory_mib are required)"
                )
        try:
            uuid = check_card_uuid(str(item["uuid"]))
        except ConfigError as exc:
            raise ConfigError(f"{where}.uuid: {exc.message}") from None
        memory = item["memory_mib"]
        if isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0:
            raise ConfigError(f"{where}.memory_mib: must be a positive whole number of MiB")
        for key in ("minor", "numa_node", "xid", "index", *READING_KEYS):
            value = item.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ConfigError(f"{where}.{key}: must be a whole number >= 0 or null")
        utilization = item.get("utilization_percent")
        if utilization is not None and utilization > 100:
            raise ConfigError(f"{where}.utilization_percent: must be 0-100 or null")
        per_pid = item.get("process_utilization")
        if per_pid is not None and (
            not isinstance(per_pid, dict)
            or not all(
                str(k).isdigit() and isinstance(v, int | float) and 0 <= v <= 100
                for k, v in per_pid.items()
            )
        ):
            raise ConfigError(
                f"{where}.process_utilization: must map host pids to percent (0-100), "
                'e.g. {"4242": 30}'
            )
        healthy = item.get("healthy", True)
        if not isinstance(healthy, bool):
            raise ConfigError(f"{where}.healthy: must be true or false")
        if any(c.uuid == uuid for c in cards):
            raise ConfigError(f"{where}.uuid: {uuid} appears twice")
        # null means "not given": the position in the list, and minor = index.
        index = item["index"] if item.get("index") is not None else i
        if any(c.index == index for c in cards):
            raise ConfigError(f"{where}.index: {index} appears twice")
        cards.append(
            Card(
                uuid=uuid,
                index=index,
                name=str(item["name"]),
                memory_mib=memory,
                minor=item["minor"] if item.get("minor") is not None else index,
                numa_node=item.get("numa_node"),
                healthy=healthy,
                xid=item.get("xid"),
                device_nodes=_mock_nodes(item.get("device_nodes"), f"{where}.device_nodes"),
            )
        )
    return cards


_NODE_RE = re.compile(r"^/dev/[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _mock_nodes(value: Any, where: str) -> tuple[str, ...]:
    """A mock card's device nodes: none unless the file lists them (e.g.
    [/dev/nvidia0, /dev/nvidiactl]); only those the host has are named."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(v, str) and _NODE_RE.match(v) for v in value
    ):
        raise ConfigError(
            f"{where}: must be a list of device paths directly under /dev, e.g. "
            "[/dev/nvidia0, /dev/nvidiactl]"
        )
    return tuple(dict.fromkeys(value))


class MockBackend:
    """Cards described by a file (JSON or YAML) or a preset; faults by editing it."""

    name = "mock"

    def __init__(self, source: str | Path, poll_interval_s: float = 0.2) -> None:
        self.source = str(source)
        self.poll_interval_s = poll_interval_s
        self._preset = self.source.startswith("preset:")
        # The file's stamp as of the last successful read: the watch compares
        # against what was delivered, so a change made between cards() and
        # the start of watch() is not lost.
        self._read_stamp: tuple[int, int, int] | None = None
        self._readings: dict[CardUuid, CardReading] = {}
        self._per_pid: dict[CardUuid, dict[int, float]] = {}

    def process_utilization(self, uuid: CardUuid) -> dict[int, float] | None:
        """The file's optional `process_utilization` of a card (host pid -> percent;
        {} = an idle card); None where the file gives none (presets too): the
        compute arbiter then leaves the card's containers at their guarantees."""
        per_pid = self._per_pid.get(uuid)
        return dict(per_pid) if per_pid is not None else None

    def _read(self) -> list[Card]:
        if self._preset:
            return preset_cards(self.source)
        path = Path(self.source)
        stamp = self._stamp(path)  # before reading: a later write is seen as a change
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise ConfigError(f"mock GPU file {path} does not exist") from None
        except OSError as exc:
            raise ConfigError(f"mock GPU file {path} cannot be read: {exc.strerror}") from None
        try:
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as exc:
            raise ConfigError(f"mock GPU file {path} is not valid JSON/YAML: {exc}") from None
        cards = parse_mock(data, f"mock GPU file {path}")
        self._readings = mock_readings(data)
        self._per_pid = {
            CardUuid(str(item["uuid"])): {
                int(k): float(v) for k, v in item["process_utilization"].items()
            }
            for item in data["gpus"]
            if item.get("process_utilization") is not None
        }
        self._read_stamp = stamp
        return cards

    def cards(self) -> list[Card]:
        """The file's cards; Card.xid carries an injected XID for the daemon to filter."""
        return self._read()

    def readings(self) -> dict[CardUuid, CardReading]:
        """Optional `memory_used_mib` / `utilization_percent` keys of the file."""
        return dict(self._readings)

    def watch(
        self, stop: threading.Event, on_cards: CardsCallback, on_event: EventCallback
    ) -> None:
        if self._preset:
            stop.wait()
            return
        path = Path(self.source)
        last = self._read_stamp
        while not stop.wait(self.poll_interval_s):
            stamp = self._stamp(path)
            if stamp == last:
                continue
            last = stamp
            try:
                cards = self._read()
            except ConfigError as exc:
                log.warning(
                    "mock GPU file changed but is unusable, keeping the last cards: %s", exc
                )
                continue
            on_cards(cards)

    @staticmethod
    def _stamp(path: Path) -> tuple[int, int, int] | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)
