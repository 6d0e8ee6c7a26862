"""The walking skeleton (issue 2): the real daemon, as a subprocess, against the
kubelet simulator over real gRPC on Unix sockets.

No grpc mocking and no fixed sleeps: every wait is a poll with a deadline.
"""

from __future__ import annotations

import signal
import stat
import time
from pathlib import Path

import grpc
import pytest

from tests.conftest import H200_MIB, SOCKETS, MockGpusFile, NodeFactory, card, cards
from tests.integration.conftest_placement import card_of
from vgpu.core.model import Resource
from vgpu.core.slicing import MAX_DEVICE_ID_LEN, parse_device_id
from vgpu.pb import deviceplugin_v1beta1_pb2 as pb
from vgpu.sim.harness import SimNode, wait_until
from vgpu.sim.kubelet import KubeletSimulator

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


class RecordingKubelet(KubeletSimulator):
    """The simulator, also keeping each RegisterRequest as sent by the plugin."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.requests: list[pb.RegisterRequest] = []

    def _register(
        self, request: pb.RegisterRequest, context: grpc.ServicerContext, epoch: int
    ) -> None:
        copy = pb.RegisterRequest()
        copy.CopyFrom(request)
        self.requests.append(copy)
        super()._register(request, context, epoch)


def ids(node: SimNode, resource: str) -> dict[str, str]:
    return node.kubelet.devices(resource)


def card_ids(node: SimNode, uuid: str) -> dict[str, str]:
    """ID -> health for every advertised ID of one card, both resources."""
    out: dict[str, str] = {}
    for resource in (node.core, node.memory):
        out.update({i: h for i, h in ids(node, resource).items() if card_of(i) == uuid})
    return out


def all_ids(node: SimNode) -> set[str]:
    return set(ids(node, node.core)) | set(ids(node, node.memory))


def expected_counts(
    n_cards: int, memory_mib: int = H200_MIB, unit_mib: int = 256
) -> dict[str, int]:
    return {"core": 100 * n_cards, "memory": n_cards * (memory_mib // unit_mib)}


def log_has(node: SimNode, text: str, timeout_s: float) -> bool:
    return wait_until(lambda: text in node.log(), timeout_s, interval_s=0.05)


# ------------------------------------------------------------------ registration


@pytest.mark.timeout(30)
def test_registers_both_resources_with_the_options_it_serves(make_node: NodeFactory) -> None:
    node = make_node(start=False)
    node.kubelet = RecordingKubelet(node.plugin_dir, node.podres_socket, seed=0)
    node.start(timeout_s=15.0)

    assert {r.resource_name for r in node.kubelet.requests} == {node.core, node.memory}
    for request in node.kubelet.requests:
        assert request.version == "v1beta1"
        assert request.endpoint in SOCKETS
        assert "/" not in request.endpoint  # relative to the plugin directory
    for resource in (node.core, node.memory):
        served = node.kubelet.options(resource)
        assert served is not None
        assert served.get_preferred_allocation_available is True
        registered = [r.options for r in node.kubelet.requests if r.resource_name == resource]
        assert registered[-1] == served


@pytest.mark.timeout(30)
def test_two_h200_advertise_200_core_and_561_memory_units_each(node: SimNode) -> None:
    want = expected_counts(2)
    assert node.kubelet.capacity(node.core) == want["core"] == 200
    assert node.kubelet.capacity(node.memory) == want["memory"] == 2 * 561
    assert set(ids(node, node.core).values()) == {HEALTHY}
    assert set(ids(node, node.memory).values()) == {HEALTHY}


@pytest.mark.timeout(30)
def test_memory_unit_flag_changes_the_memory_count(make_node: NodeFactory) -> None:
    node = make_node(daemon_args=["--memory-unit-mib", "512"])
    assert node.kubelet.capacity(node.memory) == 2 * 280
    assert node.kubelet.capacity(node.core) == 200


@pytest.mark.timeout(30)
def test_resource_domain_flag_renames_both_resources(make_node: NodeFactory) -> None:
    node = make_node(domain="example.com")
    assert node.core == "example.com/vcuda-core"
    assert node.kubelet.capacity("example.com/vcuda-core") == 200
    assert node.kubelet.capacity("example.com/vcuda-memory") == 2 * 561
    assert node.kubelet.registrations("vendor.io/vcuda-core") == 0
    assert node.kubelet.registrations("vendor.io/vcuda-memory") == 0


# --------------------------------------------------------------------------- IDs


@pytest.mark.timeout(30)
def test_device_ids_are_unique_short_and_encode_their_card(
    make_node: NodeFactory, mock_gpus_file: MockGpusFile
) -> None:
    gpus = [card(0, numa_node=1), card(1, numa_node=0), card(2, numa_node=None)]
    gpus[2].pop("numa_node")
    node = make_node(mock_gpus_file(gpus))
    numa = {c["uuid"]: c.get("numa_node") for c in gpus}
    for resource, kind in ((node.core, Resource.CORE), (node.memory, Resource.MEMORY)):
        devices = ids(node, resource)
        topology = node.kubelet.topology(resource)
        per_card: dict[str, set[int]] = {}
        for device_id in devices:
            assert len(device_id) <= MAX_DEVICE_ID_LEN
            ref = parse_device_id(device_id)
            assert not ref.legacy
            uuid, parsed_kind, index = card_of(device_id), ref.resource, ref.index
            assert parsed_kind is kind
            assert uuid in numa
            per_card.setdefault(uuid, set()).add(index)
            want = [numa[uuid]] if numa[uuid] is not None else []
            assert topology[device_id] == want, device_id
        units = 100 if kind is Resource.CORE else H200_MIB // 256
        assert per_card == {u: set(range(units)) for u in numa}
    # Unique across both resources too (the kubelet keys by ID per resource only,
    # but our own records key by ID alone).
    assert len(all_ids(node)) == len(ids(node, node.core)) + len(ids(node, node.memory))


@pytest.mark.timeout(40)
def test_device_ids_are_stable_across_a_daemon_restart(node: SimNode) -> None:
    before = {r: set(ids(node, r)) for r in (node.core, node.memory)}
    assert node.stop_daemon(signal.SIGTERM) == 0
    node.start_daemon(timeout_s=15.0)
    assert node.kubelet.wait_for(
        lambda: all(len(ids(node, r)) == len(before[r]) for r in before), 5.0
    )
    assert {r: set(ids(node, r)) for r in before} == before


# ------------------------------------------------------------------------ health


def _watch_file_node(
    make_node: NodeFactory, mock_gpus_file: MockGpusFile, *args: str
) -> tuple[SimNode, list[dict[str, object]]]:
    gpus = cards(2)
    node = make_node(mock_gpus_file(gpus), daemon_args=list(args))
    return node, gpus


@pytest.mark.timeout(30)
def test_unhealthy_card_in_mock_file_turns_its_ids_unhealthy_within_1s(
    make_node: NodeFactory, mock_gpus_file: MockGpusFile
) -> None:
    node, gpus = _watch_file_node(make_node, mock_gpus_file)
    sick, well = str(gpus[0]["uuid"]), str(gpus[1]["uuid"])
    n_ids = len(card_ids(node, sick))
    assert n_ids == 100 + 561

    gpus[0]["healthy"] = False
    started = time.monotonic()
    mock_gpus_file(gpus)
    assert node.kubelet.wait_for(lambda: set(card_ids(node, sick).values()) == {UNHEALTHY}, 1.0), (
        card_ids(node, sick)
    )
    assert time.monotonic() - started < 1.0
    assert len(card_ids(node, sick)) == n_ids  # still in capacity
    assert set(card_ids(node, well).values()) == {HEALTHY}

    gpus[0]["healthy"] = True
    started = time.monotonic()
    mock_gpus_file(gpus)
    assert node.kubelet.wait_for(lambda: set(card_ids(node, sick).values()) == {HEALTHY}, 1.0)
    assert time.monotonic() - started < 1.0


@pytest.mark.timeout(30)
def test_critical_xid_marks_unhealthy_and_application_xid_is_ignored(
    make_node: NodeFactory, mock_gpus_file: MockGpusFile
) -> None:
    node, gpus = _watch_file_node(make_node, mock_gpus_file)
    a, b = str(gpus[0]["uuid"]), str(gpus[1]["uuid"])
    # One write: card a gets XID 13 (ignored by default), card b XID 79.
    # b turning unhealthy proves the daemon read the file that also holds a's XID.
    gpus[0]["xid"] = 13
    gpus[1]["xid"] = 79
    mock_gpus_file(gpus)
    assert node.kubelet.wait_for(lambda: set(card_ids(node, b).values()) == {UNHEALTHY}, 2.0)
    assert set(card_ids(node, a).values()) == {HEALTHY}

    # Clearing the XID from the file brings the card back.
    del gpus[1]["xid"]
    mock_gpus_file(gpus)
    assert node.kubelet.wait_for(lambda: set(card_ids(node, b).values()) == {HEALTHY}, 2.0)


@pytest.mark.timeout(30)
def test_ignored_xids_flag_makes_79_ignored(
    make_node: NodeFactory, mock_gpus_file: MockGpusFile
) -> None:
    node, gpus = _watch_file_node(make_node, mock_gpus_file, "--ignored-xids", "79")
    a, b = str(gpus[0]["uuid"]), str(gpus[1]["uuid"])
    gpus[0]["xid"] = 79
    gpus[1]["healthy"] = False  # the barrier: the file was read
    mock_gpus_file(gpus)
    assert node.kubelet.wait_for(lambda: set(card_ids(node, b).values()) == {UNHEALTHY}, 2.0)
    assert set(card_ids(node, a).values()) == {HEALTHY}


@pytest.mark.timeout(30)
def test_removed_card_ids_disappear(make_node: NodeFactory, mock_gpus_file: MockGpusFile) -> None:
    node, gpus = _watch_file_node(make_node, mock_gpus_file)
    gone, kept = str(gpus[0]["uuid"]), str(gpus[1]["uuid"])
    mock_gpus_file(gpus[1:])
    assert node.kubelet.wait_for(lambda: not card_ids(node, gone), 2.0)
    assert node.kubelet.capacity(node.core) == 100
    assert node.kubelet.capacity(node.memory) == 561
    assert set(card_ids(node, kept).values()) == {HEALTHY}


@pytest.mark.timeout(30)
def test_corrupt_mock_file_keeps_the_last_good_state(
    make_node: NodeFactory, mock_gpus_file: MockGpusFile
) -> None:
    node, gpus = _watch_file_node(make_node, mock_gpus_file)
    before = {r: ids(node, r) for r in (node.core, node.memory)}
    mock_gpus_file('{"gpus": [ {"uuid": ')
    assert log_has(node, "keeping the last cards", 3.0), node.log()
    assert node.proc is not None and node.proc.poll() is None
    assert {r: ids(node, r) for r in before} == before
    assert node.kubelet.connected(node.core) and node.kubelet.connected(node.memory)

    # Still watching: a good file is picked up again.
    gpus[1]["healthy"] = False
    mock_gpus_file(gpus)
    b = str(gpus[1]["uuid"])
    assert node.kubelet.wait_for(lambda: set(card_ids(node, b).values()) == {UNHEALTHY}, 2.0)


# --------------------------------------------------------------- kubelet restart


def _our_sockets(node: SimNode) -> list[Path]:
    return [node.plugin_dir / s for s in SOCKETS]


@pytest.mark.timeout(30)
def test_kubelet_restart_recreates_sockets_and_reregisters_within_2s(node: SimNode) -> None:
    before_ids = {r: set(ids(node, r)) for r in (node.core, node.memory)}
    before = node.registrations()
    started = time.monotonic()
    node.kubelet.restart()
    assert node.kubelet.wait_for(
        lambda: (
            node.registrations() > before
            and all(set(ids(node, r)) == before_ids[r] for r in before_ids)
        ),
        2.0,
    ), node.log()[-2000:]
    assert time.monotonic() - started < 2.0 + 1.5  # restart() itself may take ~1 s
    assert all(p.exists() for p in _our_sockets(node))
    assert {r: set(ids(node, r)) for r in before_ids} == before_ids


@pytest.mark.timeout(30)
def test_plugin_started_before_the_kubelet_registers_once_it_appears(
    make_node: NodeFactory,
) -> None:
    node = make_node(start=False)
    node.start_daemon(wait=False)
    assert wait_until(lambda: all(p.exists() for p in _our_sockets(node)), 10.0), node.log()
    assert node.registrations() == 0
    node.kubelet.start()
    assert node.kubelet.wait_registered([node.core, node.memory], 5.0), node.log()
    assert node.kubelet.capacity(node.core) == 200
    assert node.kubelet.capacity(node.memory) == 2 * 561


@pytest.mark.timeout(30)
def test_plugin_dir_holds_only_sockets(node: SimNode) -> None:
    node.kubelet.restart()
    assert node.kubelet.wait_registered([node.core, node.memory], 3.0)
    entries = list(node.plugin_dir.iterdir())
    assert entries
    for entry in entries:
        assert stat.S_ISSOCK(entry.lstat().st_mode), f"not a socket: {entry}"


# ---------------------------------------------------------------------- signals


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_exits_0_within_5s_and_removes_our_sockets(
    node: SimNode, sig: signal.Signals
) -> None:
    assert all(p.exists() for p in _our_sockets(node))
    started = time.monotonic()
    rc = node.stop_daemon(sig, timeout_s=5.0)
    assert rc == 0, node.log()[-2000:]
    assert time.monotonic() - started < 5.0
    assert not any(p.exists() for p in _our_sockets(node))
    assert "Traceback" not in node.log()


@pytest.mark.timeout(30)
def test_list_and_watch_stream_stays_open_while_idle(node: SimNode) -> None:
    # Over a 3 s idle window nothing may end the stream: an ended stream turns
    # every device Unhealthy in the simulator (as in the kubelet).
    def broken() -> bool:
        return not all(
            node.kubelet.connected(r) and set(ids(node, r).values()) == {HEALTHY}
            for r in (node.core, node.memory)
        )

    assert not node.kubelet.wait_for(broken, 3.0)
    assert node.proc is not None and node.proc.poll() is None
