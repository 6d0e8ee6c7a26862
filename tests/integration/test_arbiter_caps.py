"""The burst cap end to end: the daemon (a real process, mock cards whose NVML
view is idle) reads `<domain>/vcuda-core-limit[.<container>]` from its pod
cache every arbiter period and writes the cap into the container's budget
file; a bad annotation is ignored with a Kubernetes Event naming it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vgpu.adapters import budget
from vgpu.sim.harness import SimNode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PORT = _free_port()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[SimNode]:
    # Two mock cards whose NVML view is idle (no process uses them): the arbiter runs.
    gpus = tmp_path / "gpus.json"
    cards = [
        {
            "uuid": f"GPU-00000000-0000-4000-8000-00000000000{i}",
            "name": "NVIDIA H200",
            "memory_mib": 143771,
            "process_utilization": {},
        }
        for i in range(2)
    ]
    gpus.write_text(json.dumps({"gpus": cards}))
    with SimNode(gpus=gpus, daemon_args=["--metrics-address", f"127.0.0.1:{PORT}"]) as n:
        yield n


def _gauges(prefix: str, port: int = PORT) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        sample.name: float(sample.value)
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name.startswith(prefix)
    }


def _budget_files(node: SimNode) -> list[Path]:
    """The containers' budget files (not those of the directories made ahead)."""
    return sorted(
        p
        for p in node.state_dir.rglob(budget.FILE_NAME)
        if not any(part.startswith(".") for part in p.relative_to(node.state_dir).parts)
    )


def _wait(check: Callable[[], Any], timeout_s: float) -> tuple[Any, float]:
    """Poll `check` until it returns something truthy; (value, seconds it took)."""
    start = time.monotonic()
    while True:
        value = check()
        if value:
            return value, time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(0.02)


def _annotate(node: SimNode, pod: str, **annotations: str | None) -> None:
    assert node.api is not None

    def mutate(obj: dict[str, Any]) -> None:
        meta = obj["metadata"].setdefault("annotations", {})
        for key, value in annotations.items():
            key = key.replace("__", "/").replace("_dot_", ".").replace("_", "-")
            if value is None:
                meta.pop(key, None)
            else:
                meta[key] = value

    node.api.update_pod("default", pod, mutate)


POD_KEY = "vendor.io__vcuda_core_limit"
MAIN_KEY = "vendor.io__vcuda_core_limit_dot_main"


@pytest.mark.timeout(90)
def test_cap_follows_the_annotation_within_a_second_and_bad_ones_raise_an_event(
    node: SimNode,
) -> None:
    pod = node.pod("nb", {node.core: 30, node.memory: 40})
    assert node.submit(pod).ok
    (path,) = _wait(lambda: _budget_files(node), 10)[0]
    view, _ = _wait(lambda: budget.read_arbiter(path), 5)
    assert (view.guarantee_percent, view.cap_percent) == (30, 30)  # no annotation: cap = guarantee
    assert view.allowed_percent == 30  # an idle card: allowed its guarantee

    _annotate(node, "nb", **{POD_KEY: "80"})
    view, took = _wait(lambda: (v := budget.read_arbiter(path)) and v.cap_percent == 80 and v, 5)
    print(f"cap 80 effective after {took:.2f} s")
    assert took <= 1.0
    assert view.guarantee_percent == 30  # the guarantee never changes

    # a per-container annotation wins; a malformed one is ignored with an Event
    assert node.api is not None
    _annotate(node, "nb", **{MAIN_KEY: "lots"})
    events, _ = _wait(
        lambda: [e for e in node.api.events() if e["reason"] == "InvalidCoreLimit"], 5
    )
    assert "vcuda-core-limit.main" in events[0]["message"]
    assert events[0]["involvedObject"]["name"] == "nb"
    assert events[0]["type"] == "Warning"
    time.sleep(0.3)
    assert budget.read_arbiter(path).cap_percent == 80  # type: ignore[union-attr]

    _annotate(node, "nb", **{MAIN_KEY: "10"})  # below the guarantee: cannot lower it
    _wait(lambda: any("outside 30-100" in e["message"] for e in node.api.events()), 5)  # type: ignore[union-attr]
    time.sleep(0.3)
    assert budget.read_arbiter(path).cap_percent == 80  # type: ignore[union-attr]

    _annotate(node, "nb", **{MAIN_KEY: "55"})
    _wait(lambda: (v := budget.read_arbiter(path)) and v.cap_percent == 55, 2)

    status = subprocess.run(
        [sys.executable, "-m", "vgpu", "status", "--state-dir", str(node.state_dir), "-o", "json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    (row,) = json.loads(status.stdout)["containers"]
    assert (row["core_guarantee"], row["core_cap"], row["core_allowed"]) == (30, 55, 30)
    assert row["core_achieved"] == 0
    table = subprocess.run(
        [sys.executable, "-m", "vgpu", "status", "--state-dir", str(node.state_dir)],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    assert "compute: guarantee 30%, cap 55%, allowed 30%, achieved 0%" in table
    want = {
        "vgpu_container_core_guarantee_percent": 30.0,
        "vgpu_container_core_cap_percent": 55.0,
        "vgpu_container_core_allowed_percent": 30.0,
        "vgpu_container_core_achieved_percent": 0.0,
    }
    gauges = _gauges("vgpu_container_core_")
    assert {k: gauges.get(k) for k in want} == want, gauges
