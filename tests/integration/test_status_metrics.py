"""`vgpu status` and the Prometheus metrics agree with what was placed."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vgpu.sim.harness import SimNode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def metrics_node() -> Iterator[tuple[SimNode, str]]:
    port = _free_port()
    node = SimNode(
        daemon_args=[
            "--metrics-address",
            f"127.0.0.1:{port}",
            "--log-format",
            "json",
            "--metrics-container-names",
            "true",
        ]
    )
    node.start()
    try:
        yield node, f"http://127.0.0.1:{port}"
    finally:
        node.close()


def _status(node: SimNode, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vgpu", "status", "--state-dir", str(node.state_dir), *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


Sample = tuple[str, frozenset[tuple[str, str]]]


def _scrape(url: str) -> dict[Sample, float]:
    body = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
    return out


def _key(name: str, **labels: str) -> Sample:
    return (name, frozenset(labels.items()))


@pytest.mark.timeout(60)
def test_status_json_and_metrics_match_placements(metrics_node: tuple[SimNode, str]) -> None:
    node, url = metrics_node
    nb = node.pod("nb", {node.core: 30, node.memory: 40})
    inf = node.pod("inf", {node.core: 50, node.memory: 100})
    whole = node.pod("train", {node.core: 100})
    for pod in (nb, inf, whole):
        assert node.submit(pod).ok
    refused = node.submit(node.pod("bad", {node.core: 10}))
    assert not refused.ok

    def owners_known() -> bool:
        doc = json.loads(_status(node, "-o", "json").stdout)
        return len(doc["containers"]) == 3 and all(c["pod"] for c in doc["containers"])

    assert node.wait(owners_known, 10)
    doc = json.loads(_status(node, "-o", "json").stdout)
    cards = {c["uuid"]: c for c in doc["cards"]}
    by_pod = {c["pod"]: c for c in doc["containers"]}
    assert by_pod["nb"]["core"] == 30 and by_pod["nb"]["memory_mib"] == 40 * 256
    assert by_pod["nb"]["namespace"] == "default" and by_pod["nb"]["container"] == "main"
    assert by_pod["train"]["core"] == 100 and by_pod["train"]["whole_cards"]
    shared = by_pod["nb"]["cards"][0]
    assert by_pod["inf"]["cards"] == [shared]  # binpack
    assert cards[shared]["core_allocated"] == 80
    assert cards[shared]["memory_allocated_mib"] == 140 * 256
    assert cards[by_pod["train"]["cards"][0]]["core_allocated"] == 100
    for card in doc["cards"]:
        assert {"uuid", "index", "name", "health", "memory_mib"} <= set(card)
        assert card["health"] == "Healthy"

    metrics = _scrape(url)
    card = {"uuid": shared, "index": str(cards[shared]["index"]), "model": "NVIDIA H200"}
    assert metrics[_key("vgpu_card_core_allocated_percent", **card)] == 80
    assert metrics[_key("vgpu_card_memory_allocated_mib", **card)] == 140 * 256
    assert metrics[_key("vgpu_card_memory_total_mib", **card)] == 143771
    assert metrics[_key("vgpu_card_healthy", **card)] == 1
    nb_labels = {"namespace": "default", "pod": "nb", "container": "main", "uuid": shared}
    assert metrics[_key("vgpu_container_core_limit_percent", **nb_labels)] == 30
    assert metrics[_key("vgpu_container_memory_limit_mib", **nb_labels)] == 40 * 256
    ok_core = _key("vgpu_calls_total", method="Allocate", resource="vcuda-core", outcome="ok")
    assert metrics[ok_core] == 3
    refusals = [
        v
        for (name, labels), v in metrics.items()
        if name == "vgpu_calls_total" and ("outcome", "InvalidRequest") in labels
    ]
    assert sum(refusals) == 1
    assert metrics[_key("vgpu_events_total", kind="registered")] >= 1
    assert any(name == "vgpu_call_duration_seconds_bucket" for name, _ in metrics)
    health = urllib.request.urlopen(url + "/healthz", timeout=5)
    assert health.status == 200

    # Table and wide output render every card and container.
    table = _status(node).stdout
    assert "default/nb/main" in table and "whole card" in table
    assert "\x1b[" not in table  # no colour when piped
    wide = _status(node, "-o", "wide").stdout
    assert "config " in wide and "vcuda-core:" in wide and "NUMA" in wide

    # JSON logs: one object per line, with the placement lines.
    node.stop_daemon()
    lines = [json.loads(line) for line in node.log().splitlines() if line.startswith("{")]
    assert any("placed" in rec["msg"] for rec in lines)
    assert any("registered" in rec["msg"] for rec in lines)


@pytest.mark.timeout(60)
def test_status_after_a_crash_shows_what_is_recorded(metrics_node: tuple[SimNode, str]) -> None:
    node, _ = metrics_node
    assert node.submit(node.pod("nb", {node.core: 30, node.memory: 40})).ok
    node.kill_daemon()
    result = _status(node, "-o", "json")
    assert result.returncode == 0
    doc = json.loads(result.stdout)
    assert [c["core"] for c in doc["containers"]] == [30]


def test_status_without_state_is_a_clear_error(tmp_path: object) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "vgpu", "status", "--state-dir", "/nonexistent/vgpu"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert "nothing to show" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.timeout(60)
def test_real_card_usage_reaches_status_and_metrics(tmp_path: Path) -> None:
    gpus = tmp_path / "gpus.json"
    gpus.write_text(
        json.dumps(
            {
                "gpus": [
                    {
                        "uuid": "GPU-real0000-0000-4000-8000-000000000000",
                        "name": "NVIDIA H200",
                        "memory_mib": 143771,
                        "memory_used_mib": 4096,
                        "utilization_percent": 55,
                    }
                ]
            }
        )
    )
    port = _free_port()
    node = SimNode(gpus=gpus, daemon_args=["--metrics-address", f"127.0.0.1:{port}"])
    node.start()
    try:

        def card() -> dict[str, object]:
            return dict(json.loads(_status(node, "-o", "json").stdout)["cards"][0])

        assert node.wait(lambda: card()["memory_used_mib"] == 4096, 10)
        assert card()["utilization_percent"] == 55
        assert "4.0 GiB in use, 55% busy" in _status(node).stdout
        labels = {
            "uuid": "GPU-real0000-0000-4000-8000-000000000000",
            "index": "0",
            "model": "NVIDIA H200",
        }
        metrics = _scrape(f"http://127.0.0.1:{port}")
        assert metrics[_key("vgpu_card_memory_used_mib", **labels)] == 4096
        assert metrics[_key("vgpu_card_utilization_percent", **labels)] == 55
    finally:
        node.close()
