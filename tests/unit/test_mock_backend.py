"""The mock GPU backend: file formats, presets, validation and change detection."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import H200_MIB, MockGpusFile, card, cards
from vgpu.adapters.gpus import PRESETS, CardReading, MockBackend, parse_mock, preset_cards
from vgpu.core.errors import ConfigError
from vgpu.core.health import HealthEvent
from vgpu.core.model import Card
from vgpu.core.slicing import MAX_UUID_LEN
from vgpu.sim.harness import wait_until

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("fmt", ["json", "yaml", "yml"])
def test_reads_json_and_yaml(mock_gpus_file: MockGpusFile, fmt: str) -> None:
    gpus = [card(0, numa_node=1), card(1, xid=79, healthy=True, minor=7)]
    backend = MockBackend(mock_gpus_file(gpus, fmt=fmt))
    got = backend.cards()
    assert [c.uuid for c in got] == [g["uuid"] for g in gpus]
    assert got[0] == Card(
        uuid=got[0].uuid,
        index=0,
        name="NVIDIA H200",
        memory_mib=H200_MIB,
        minor=0,
        numa_node=1,
        device_nodes=(),  # a mock card names no device node unless its file lists them
    )
    assert (got[1].index, got[1].minor, got[1].xid, got[1].healthy) == (1, 7, 79, True)
    assert backend.readings() == {}


def test_optional_fields_default_sensibly() -> None:
    data = {"gpus": [{"uuid": "GPU-a", "name": "x", "memory_mib": 1024, "index": None}]}
    (only,) = parse_mock(data, "f")
    assert (only.index, only.minor, only.numa_node, only.healthy, only.xid) == (
        0,
        0,
        None,
        True,
        None,
    )


@pytest.mark.parametrize(
    "spec, count, model",
    [("preset:2xH200", 2, "H200"), ("preset:8xH200", 8, "H200"), ("preset:1xl4", 1, "L4")],
)
def test_presets(spec: str, count: int, model: str) -> None:
    got = MockBackend(spec).cards()
    name, memory = PRESETS[model]
    assert len(got) == count
    assert [c.index for c in got] == list(range(count))
    assert {(c.name, c.memory_mib) for c in got} == {(name, memory)}
    assert len({c.uuid for c in got}) == count
    assert all(c.healthy and c.xid is None for c in got)
    assert got == preset_cards(spec)  # stable across calls
    if count == 8:
        assert [c.numa_node for c in got] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("spec", ["preset:0xH200", "preset:65xH200", "preset:2xB9000", "preset:x"])
def test_unknown_preset_is_refused_with_the_syntax(spec: str) -> None:
    with pytest.raises(ConfigError, match=r"preset:<1-64>x<MODEL>"):
        MockBackend(spec).cards()


def _doc(**override: Any) -> dict[str, Any]:
    item: dict[str, Any] = {"uuid": "GPU-a", "name": "n", "memory_mib": 1024}
    for key, value in override.items():
        if value is _DROP:
            item.pop(key)
        else:
            item[key] = value
    return {"gpus": [{"uuid": "GPU-z", "name": "n", "memory_mib": 1024}, item]}


_DROP = object()

BAD_FILES = [
    pytest.param({"cards": []}, r"gpus", id="no-gpus-list"),
    pytest.param([1, 2], r"gpus", id="top-level-list"),
    pytest.param(
        {"gpus": [{"uuid": "GPU-z", "name": "n", "memory_mib": 1}, 5]},
        r"gpus\[1\]",
        id="item-not-mapping",
    ),
    pytest.param(_doc(uuid=_DROP), r"gpus\[1\]\.uuid", id="missing-uuid"),
    pytest.param(_doc(name=_DROP), r"gpus\[1\]\.name", id="missing-name"),
    pytest.param(_doc(memory_mib=_DROP), r"gpus\[1\]\.memory_mib", id="missing-memory"),
    pytest.param(_doc(uuid="GPU a"), r"gpus\[1\]\.uuid", id="uuid-space"),
    pytest.param(_doc(uuid="-GPU"), r"gpus\[1\]\.uuid", id="uuid-leading-dash"),
    pytest.param(_doc(uuid="G" * (MAX_UUID_LEN + 1)), r"gpus\[1\]\.uuid", id="uuid-too-long"),
    pytest.param(_doc(uuid="GPU-z"), r"gpus\[1\]\.uuid.*twice", id="uuid-duplicate"),
    pytest.param(_doc(memory_mib=0), r"gpus\[1\]\.memory_mib", id="memory-zero"),
    pytest.param(_doc(memory_mib="80GB"), r"gpus\[1\]\.memory_mib", id="memory-string"),
    pytest.param(_doc(memory_mib=True), r"gpus\[1\]\.memory_mib", id="memory-bool"),
    pytest.param(_doc(memory_mib=1.5), r"gpus\[1\]\.memory_mib", id="memory-float"),
    pytest.param(_doc(minor="0"), r"gpus\[1\]\.minor", id="minor-string"),
    pytest.param(_doc(numa_node=-1), r"gpus\[1\]\.numa_node", id="numa-negative"),
    pytest.param(_doc(xid=True), r"gpus\[1\]\.xid", id="xid-bool"),
    pytest.param(_doc(index=0), r"gpus\[1\]\.index.*twice", id="index-duplicate"),
    pytest.param(_doc(healthy="no"), r"gpus\[1\]\.healthy", id="healthy-string"),
    pytest.param(_doc(colour="red"), r"gpus\[1\].*colour", id="unknown-key"),
]


@pytest.mark.parametrize("data, field", BAD_FILES)
def test_every_validation_error_names_the_field(data: Any, field: str) -> None:
    with pytest.raises(ConfigError, match=field) as info:
        parse_mock(data, "mock GPU file f.yaml")
    assert info.value.message.startswith("mock GPU file f.yaml")
    assert "\n" not in info.value.message


def test_missing_and_unparsable_files(short_tmp: Path, mock_gpus_file: MockGpusFile) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        MockBackend(short_tmp / "nope.json").cards()
    with pytest.raises(ConfigError, match="not valid JSON/YAML"):
        MockBackend(mock_gpus_file("{not json", fmt="json")).cards()
    with pytest.raises(ConfigError, match="not valid JSON/YAML"):
        MockBackend(mock_gpus_file("gpus: [\n", fmt="yaml")).cards()


# --------------------------------------------------------------------- watch()


class Watch:
    """watch() on a thread, collecting what it reports."""

    def __init__(self, backend: MockBackend) -> None:
        self.backend = backend
        self.stop = threading.Event()
        self.updates: list[list[Card]] = []
        self.events: list[HealthEvent] = []
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.backend.watch(self.stop, self._on_cards, self.events.append)

    def _on_cards(self, got: list[Card]) -> None:
        with self.changed:
            self.updates.append(got)
            self.changed.notify_all()

    def wait_updates(self, n: int, timeout_s: float = 3.0) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: len(self.updates) >= n, timeout_s)


@pytest.fixture
def watching(mock_gpus_file: MockGpusFile) -> Iterator[Watch]:
    path = mock_gpus_file(cards(2))
    backend = MockBackend(path, poll_interval_s=0.02)
    backend.cards()
    watch = Watch(backend)
    watch.thread.start()
    yield watch
    watch.stop.set()
    watch.thread.join(2.0)
    assert not watch.thread.is_alive(), "watch() did not return after stop was set"


def test_watch_reports_a_changed_file(watching: Watch, mock_gpus_file: MockGpusFile) -> None:
    gpus = cards(2)
    gpus[1]["healthy"] = False
    mock_gpus_file(gpus)
    assert watching.wait_updates(1)
    assert [c.healthy for c in watching.updates[-1]] == [True, False]
    mock_gpus_file(gpus[:1])
    assert watching.wait_updates(2)
    assert len(watching.updates[-1]) == 1
    assert watching.events == []  # the mock reports whole card lists


def test_watch_keeps_quiet_on_a_corrupt_file_then_resumes(
    watching: Watch, mock_gpus_file: MockGpusFile, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vgpu.adapters.gpus")
    mock_gpus_file("{corrupt")
    assert wait_until(lambda: "keeping the last cards" in caplog.text, 3.0)
    assert watching.updates == []
    gpus = cards(2, xid=79)
    mock_gpus_file(gpus, name="other")  # an unrelated file: no effect
    mock_gpus_file(gpus)
    assert watching.wait_updates(1)
    assert [c.xid for c in watching.updates[0]] == [79, 79]
    assert len(watching.updates) == 1


def test_a_change_between_cards_and_watch_is_not_lost(mock_gpus_file: MockGpusFile) -> None:
    path = mock_gpus_file(cards(2))
    backend = MockBackend(path, poll_interval_s=0.02)
    assert len(backend.cards()) == 2
    mock_gpus_file(cards(1))  # before the watch starts (the daemon registers in between)
    watch = Watch(backend)
    watch.thread.start()
    try:
        assert watch.wait_updates(1), "the change made before watch() started was missed"
        assert len(watch.updates[0]) == 1
    finally:
        watch.stop.set()
        watch.thread.join(2.0)


def test_preset_watch_returns_when_stopped() -> None:
    watch = Watch(MockBackend("preset:1xH100"))
    watch.thread.start()
    watch.stop.set()
    watch.thread.join(2.0)
    assert not watch.thread.is_alive()
    assert watch.updates == []


def test_mock_file_can_report_real_usage(mock_gpus_file: Any) -> None:
    gpus = [card(0, memory_used_mib=4096, utilization_percent=55), card(1)]
    backend = MockBackend(mock_gpus_file(gpus))
    got = backend.cards()
    assert backend.readings() == {got[0].uuid: CardReading(4096, 55)}
    bad = {"gpus": [{"uuid": "GPU-a", "name": "x", "memory_mib": 1, "utilization_percent": 101}]}
    with pytest.raises(ConfigError, match=r"gpus\[0\]\.utilization_percent"):
        parse_mock(bad, "f")


def test_device_nodes_are_listed_per_card_and_checked() -> None:
    data = {
        "gpus": [
            {"uuid": "GPU-a", "name": "x", "memory_mib": 1024},
            {
                "uuid": "GPU-b",
                "name": "x",
                "memory_mib": 1024,
                "device_nodes": ["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia1"],
            },
        ]
    }
    a, b = parse_mock(data, "f")
    assert a.device_nodes == () and b.device_nodes == ("/dev/nvidia1", "/dev/nvidiactl")
    for bad in (["nvidia0"], ["/dev/../etc/passwd"], "/dev/nvidia0", [3]):
        data["gpus"][1]["device_nodes"] = bad
        with pytest.raises(ConfigError, match=r"gpus\[1\]\.device_nodes: must be a list"):
            parse_mock(data, "f")
    assert all(c.device_nodes == () for c in preset_cards("preset:2xH200"))


def test_process_utilization_comes_from_the_file_or_is_unknown(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    busy = {**card(0), "process_utilization": {"4242": 30, "4243": 12.5}}
    idle = {**card(1), "process_utilization": {}}
    path.write_text(json.dumps({"gpus": [busy, idle, card(2)]}))
    backend = MockBackend(path)
    found = backend.cards()
    assert backend.process_utilization(found[0].uuid) == {4242: 30.0, 4243: 12.5}
    assert backend.process_utilization(found[1].uuid) == {}
    assert backend.process_utilization(found[2].uuid) is None  # not given: unknown
    assert (
        MockBackend("preset:1xH200").process_utilization(preset_cards("preset:1xH200")[0].uuid)
        is None
    )


@pytest.mark.parametrize("bad", [{"pid": 30}, {"4242": 101}, {"4242": "x"}, [1]])
def test_bad_process_utilization_is_refused_naming_the_key(bad: object) -> None:
    with pytest.raises(ConfigError, match="process_utilization"):
        parse_mock({"gpus": [{**card(0), "process_utilization": bad}]}, "f")
