"""The DRA burst cap end to end: the DRA driver (a real process, mock cards
with per-process utilisation) takes each request's cap from its claim's opaque
config (`SliceConfig.coreLimit`) at prepare time, keeps it in the claim record
and runs the same compute arbiter as the device plugin over the prepared
requests; a bad coreLimit is ignored with a Warning Event naming the claim,
the request and the value."""

from __future__ import annotations

import fcntl
import json
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import MockGpusFile, card
from tests.integration.test_arbiter_caps import _free_port, _gauges
from vgpu.adapters import budget
from vgpu.sim.allocator import claim_body
from vgpu.sim.draharness import DraSimNode, PodRun

pytestmark = pytest.mark.timeout(90)
DRIVER = "vgpu.vendor.io"


def _wait(check: Callable[[], Any], timeout_s: float) -> Any:
    """Poll `check` until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(0.02)


def _claim(node: DraSimNode, name: str, cores: str, core_limit: object | None) -> None:
    """A claim of `cores` on the driver's class, with an opaque SliceConfig when
    `core_limit` is given (the allocator copies it into the allocation)."""
    capacity = {"cores": cores, "memory": "10Gi"}  # cores alone would take all the memory
    body = claim_body(name, device_class=DRIVER, capacity=capacity)
    if core_limit is not None:
        params = {"apiVersion": f"{DRIVER}/v1", "kind": "SliceConfig", "coreLimit": core_limit}
        body["spec"]["devices"]["config"] = [
            {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": params}}
        ]
    node.api.add_object("resourceclaims", body)


def _budget_file(run: PodRun, claim: str) -> Path:
    return Path(run.edits[claim].mounts["/var/run/vgpu/vgpu.shm"]["hostPath"])


def _record(node: DraSimNode) -> tuple[Path, dict[str, Any]]:
    (path,) = (node.state_dir / "dra" / "claims").glob("*.json")
    return path, json.loads(path.read_text())


class BusyHook:
    """What a container's hook does in the budget file while its process runs
    kernels: claims slot 0 with its host pid (this test process, which the mock
    card reports busy), holds the slot's liveness lock, and counts launches that
    waited for tokens (so the arbiter sees the container pressing its share)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        header = budget.HEADER.pack(
            budget.MAGIC, budget.VERSION, budget.FILE_BYTES, budget.MAX_SLOTS, 1, 0, 0, 0, 0
        )
        os.pwrite(self.fd, header, 0)
        os.pwrite(self.fd, struct.pack("<iI", 1, os.getpid()), budget.SLOTS_AT)
        lock = struct.pack(budget._FLOCK, fcntl.F_WRLCK, os.SEEK_SET, budget.SLOT_LOCK_BASE, 1, 0)
        fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, lock)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._launches, daemon=True)
        self.thread.start()

    def _launches(self) -> None:
        waits = 0
        while not self.stop.wait(0.02):
            waits += 1
            os.pwrite(self.fd, struct.pack("<I", waits), budget.ARBITER_AT + 20)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        os.close(self.fd)


@pytest.fixture
def gpus(mock_gpus_file: MockGpusFile) -> Callable[[dict[int, float]], Path]:
    """One mock card; its NVML view of per-process utilisation as given."""

    def write(per_pid: dict[int, float]) -> Path:
        utilization = {str(pid): percent for pid, percent in per_pid.items()}
        return mock_gpus_file([card(0, process_utilization=utilization)])

    return write


@pytest.fixture
def node_factory(short_tmp: Path) -> Iterator[Callable[..., DraSimNode]]:
    nodes: list[DraSimNode] = []

    def make(gpus: Path, env: dict[str, str] | None = None, port: int | None = None) -> DraSimNode:
        root = short_tmp / f"n{len(nodes)}"
        root.mkdir()
        library = root / "libvgpu.so"
        library.write_bytes(b"\x7fELF stand-in hook library")
        args = ["--hook-library", str(library), "--hook-dir", str(root / "hook")]
        if port is not None:
            args += ["--metrics-address", f"127.0.0.1:{port}"]
        node = DraSimNode(root, gpus=gpus, daemon_args=args, env=env)
        nodes.append(node)
        node.start(timeout_s=15.0)
        return node

    yield make
    for node in nodes:
        log = node.log()
        node.close()
        assert "Traceback" not in log, log[-4000:]


def test_a_claims_core_limit_caps_it_and_the_arbiter_lets_it_burst(
    gpus: Callable[[dict[int, float]], Path], node_factory: Callable[..., DraSimNode]
) -> None:
    port = _free_port()
    path = gpus({})  # an idle card: the arbiter runs
    node = node_factory(path, port=port)
    _claim(node, "nb", "30", 80)
    run = node.run_pod("notebook", ["nb"])
    assert run.ok, run.reply
    shm = _budget_file(run, "nb")
    # The guarantee stays the hook's fixed fallback cap (VGPU_CORE_LIMIT).
    assert run.edits["nb"].env["VGPU_CORE_LIMIT"] == "30"
    view = _wait(lambda: budget.read_arbiter(shm), 10)
    assert (view.guarantee_percent, view.cap_percent, view.allowed_percent) == (30, 80, 30)
    assert _record(node)[1]["core_caps"] == {"gpu": 80}

    # Its process runs kernels and waits for tokens: the idle card lets it burst to its cap.
    hook = BusyHook(shm)
    try:
        gpus({os.getpid(): 75})
        view = _wait(lambda: (v := budget.read_arbiter(shm)) and v.allowed_percent == 80 and v, 10)
        assert view.cap_percent == 80 and view.guarantee_percent == 30
        _wait(lambda: (v := budget.read_arbiter(shm)) and v.achieved_percent == 75, 10)

        status = subprocess.run(
            [sys.executable, "-m", "vgpu", "status", "--state-dir", str(node.state_dir)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert "compute: guarantee 30%, cap 80%, allowed 80%, achieved 75%" in status, status
        gauges = _gauges("vgpu_container_core_", port)
        want = {
            "vgpu_container_core_guarantee_percent": 30.0,
            "vgpu_container_core_cap_percent": 80.0,
            "vgpu_container_core_allowed_percent": 80.0,
        }
        assert {k: gauges.get(k) for k in want} == want, gauges
    finally:
        hook.close()

    # A record from before caps were kept still loads: its cap is the guarantee
    # (no cluster default here), and the arbiter holds the busy container to it.
    assert node.stop_daemon() == 0
    record_path, record = _record(node)
    del record["core_caps"]
    record_path.write_text(json.dumps(record))
    node.start_daemon()
    hook = BusyHook(shm)
    try:
        view = _wait(lambda: (v := budget.read_arbiter(shm)) and v.cap_percent == 30 and v, 10)
        time.sleep(0.3)  # several periods of pressing: still its guarantee
        view = budget.read_arbiter(shm)
        assert view is not None and view.allowed_percent == 30
    finally:
        hook.close()
    assert "recovered 1 prepared claim" in node.log()


def test_a_bad_core_limit_gets_an_event_and_the_default_cap(
    gpus: Callable[[dict[int, float]], Path], node_factory: Callable[..., DraSimNode]
) -> None:
    node = node_factory(gpus({}), env={"VGPU_DEFAULT_CORE_LIMIT_PERCENT": "50"})
    _claim(node, "lots", "20", "lots")  # not a whole percent
    _claim(node, "low", "30", 10)  # below its guarantee: it cannot lower it
    _claim(node, "plain", "10", None)  # no config: the cluster default
    runs = [node.run_pod(f"p-{name}", [name]) for name in ("lots", "low", "plain")]
    assert all(r.ok for r in runs), [r.reply for r in runs]

    events = _wait(
        lambda: (
            (e := [e for e in node.api.events() if e["reason"] == "InvalidCoreLimit"])
            and len(e) == 2
            and e
        ),
        5,
    )
    by_pod = {e["involvedObject"]["name"]: e for e in events}
    assert set(by_pod) == {"p-lots", "p-low"}
    lots = by_pod["p-lots"]
    assert lots["type"] == "Warning" and lots["involvedObject"]["kind"] == "Pod"
    assert lots["involvedObject"]["uid"] == runs[0].uid
    for text in ("default/lots", "'gpu'", "coreLimit='lots'", "burst cap is 50%"):
        assert text in lots["message"], lots["message"]
    for text in ("default/low", "coreLimit=10", "outside 30-100", "burst cap is 50%"):
        assert text in by_pod["p-low"]["message"], by_pod["p-low"]["message"]

    def written(run: PodRun, name: str) -> budget.ArbiterView:
        shm = _budget_file(run, name)
        return _wait(lambda: budget.read_arbiter(shm), 10)  # type: ignore[no-any-return]

    caps = {name: written(r, name) for r, name in zip(runs, ("lots", "low", "plain"), strict=True)}
    assert {n: (v.guarantee_percent, v.cap_percent) for n, v in caps.items()} == {
        "lots": (20, 50),
        "low": (30, 50),
        "plain": (10, 50),
    }
    # Prepared again (the kubelet retries after a restart): no second Event.
    node.kubelet.prepare(DRIVER, runs[0].claims)
    time.sleep(0.5)
    assert len([e for e in node.api.events() if e["reason"] == "InvalidCoreLimit"]) == 2
