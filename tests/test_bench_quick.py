"""`python -m bench --quick` runs end to end and writes every section with numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = (
    "admission",
    "scale",
    "footprint",
    "packing",
    "hooks",
    "dra",
    "extender",
    "webhook",
    "fastpath",
)


def _numbers(value: Any) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return []


@pytest.mark.timeout(300)
def test_bench_quick_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=290,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert str(out) in proc.stdout
    results = json.loads(out.read_text())
    assert results["meta"]["mode"] == "quick"
    sections = results["sections"]
    assert set(SECTIONS) <= set(sections), sorted(sections)
    for name in SECTIONS:
        section = sections[name]
        assert "error" not in section, f"{name}: {section.get('traceback', section['error'])}"
        assert _numbers(section), f"{name} has no numbers"
        for target in section["targets"]:
            assert isinstance(target["value"], int | float), target
            assert isinstance(target["passed"], bool), target

    admission = sections["admission"]
    for plugin in ("vgpu", "null"):
        assert admission[plugin]["failures"] == 0, admission[plugin]
        for kind in ("GetPreferredAllocation", "Allocate"):
            assert admission[plugin][kind]["p50_ms"] > 0
            assert admission[plugin][kind]["p99_ms"] >= admission[plugin][kind]["p50_ms"]
    assert {t["name"] for t in admission["targets"]} == {
        "Allocate p50 vs null plugin",
        "Allocate p99 vs null plugin",
    }

    shapes = {s["shape"]: s for s in sections["scale"]["shapes"]}
    assert len(shapes) == 5
    for shape in shapes.values():
        assert all(size > 0 for size in shape["message_bytes"].values()), shape
        assert shape["startup_s"] > 0

    footprint = sections["footprint"]
    assert footprint["failures"] == 0
    assert footprint["rss_end_mib"] > 0 and footprint["idle_cpu_percent"] >= 0

    runs = sections["packing"]["runs"]
    assert {r["policy"] for r in runs} == {"binpack", "spread", "first-fit"}
    for run in runs:
        assert 0 <= run["fragmentation_share"] <= 1
        assert 0 < run["mean_core_utilisation"] <= 1

    dra = sections["dra"]
    for name in ("prepare_one_claim", "prepare_pod_of_8_claims"):
        assert dra[name]["calls"] > 0 and 0 < dra[name]["p50_ms"] <= dra[name]["p99_ms"]
    assert 0 < dra["publication_s"]["p50_s"] <= dra["publication_s"]["max_s"]
    assert dra["claim_reads"]["cache"] + dra["claim_reads"].get("api", 0) > 0
    assert len(dra["targets"]) == 3
    ext = sections["extender"]
    assert ext["vgpu"]["bound"] > 0 and ext["rss_mib"] > 0
    for verb in ("filter", "prioritize", "bind"):
        assert ext["vgpu"][verb]["p99_ms"] >= ext["vgpu"][verb]["p50_ms"] > 0
    picking = ext["vgpu_picking"]  # filter answers one node: no prioritize
    assert picking["prioritize"]["requests"] == 0 and picking["bound"] > 0
    assert picking["bound"] + picking["unschedulable"] == picking["pods"]  # no bind refused
    assert picking["filter"]["p99_ms"] >= picking["filter"]["p50_ms"] > 0
    assert len(ext["targets"]) == 6

    hook = sections["webhook"]
    for name in ("validate", "mutate"):
        kept, fresh = hook[name]["kept_alive"], hook[name]["new_connection"]
        assert kept["requests"] == 200 and 0 < kept["p50_ms"] <= kept["p99_ms"]
        assert fresh["requests"] == 100 and 0 < fresh["p50_ms"] <= fresh["p99_ms"]
        assert 0 < hook[name]["handler"]["p50_ms"] <= kept["p50_ms"]
    assert len(hook["targets"]) == 2

    fast = sections["fastpath"]
    assert fast["node"]["failures"] == 0
    assert fast["node"]["vgpu"]["p99_ms"] >= fast["node"]["vgpu"]["p50_ms"] > 0
    for shape in fast["checkpoint"]["shapes"]:
        assert 0 < shape["bytes"] < shape["legacy_bytes"], shape
    assert all(r["bytes"] < r["legacy_bytes"] for r in fast["listandwatch"]["memory"])
    e2e = fast["extender"]
    assert e2e["vgpu"]["bound"] == e2e["pods"] and e2e["baseline"]["bound"] == e2e["pods"]
    assert e2e["burst"]["bound"] == e2e["burst"]["pods"] and e2e["overcommitted_cards"] == 0
    # The extender picks the node at filter: the stand-in never needs prioritize.
    assert e2e["node_choice"] == "extender" and e2e["scheduler_calls"]["prioritize"] == 0
    # Paired rounds: a ratio per round, and the reported one is their median.
    assert len(e2e["ratios"]) == e2e["rounds"] == 3
    assert e2e["ratio"] == sorted(e2e["ratios"])[1]
    assert all(len(v) == 3 for v in e2e["pods_per_s_by_round"].values())
    roles = e2e["bench_cpu_ms_per_pod_by_role"]  # the threads were told apart
    assert roles["baseline"]["API server"] > 0 and roles["with_extender"]["scheduling cycle"] > 0

    hooks = sections["hooks"]
    if hooks["available"]:
        assert _numbers(hooks["metrics"])
    else:
        assert hooks["reason"]


@pytest.mark.timeout(200)
def test_bench_extender_stand_in_mode_runs_and_the_kit_checks_catch_overcommit(
    tmp_path: Path,
) -> None:
    """`python -m bench extender --stand-in` end to end (small); the real mode's
    pure parts: the chart's scheduler configuration it runs, and the checks it
    applies to the assignments (the kit itself is not started here)."""
    from bench import extender_kit as kit

    out = tmp_path / "ext.json"
    argv = ["extender", "--stand-in", "--nodes", "20", "--pods", "60", "--rounds", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "bench", *argv, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["kind"].startswith("stand-ins")
    assert result["vgpu"]["bound"] == result["baseline"]["bound"] == 60
    assert result["overcommitted_cards"] == 0 and len(result["ratios"]) == 1

    config = kit.vgpu_config((1000, 1000), 4321)
    assert config["clientConnection"] == {"kubeconfig": "@KUBECONFIG@", "qps": 1000, "burst": 1000}
    assert config["profiles"][0]["schedulerName"] == "vgpu-scheduler"
    (extender,) = config["extenders"]
    assert extender["urlPrefix"] == "http://127.0.0.1:4321" and extender["bindVerb"] == "bind"
    assert extender["nodeCacheCapable"] is True
    assert "qps" not in kit.default_config(None)["clientConnection"]  # stock: the defaults

    nodes = kit.node_objects(2)
    cards = [
        json.loads(n["metadata"]["annotations"]["vendor.io/vgpu-node"])["cards"] for n in nodes
    ]
    card = cards[0][0]["uuid"]

    def bound(name: str, core: int, node: str, uuid: str) -> dict[str, Any]:
        pod = kit.pod_object(name, "vgpu-scheduler", core, 16, "s")
        pod["spec"]["nodeName"] = node
        assignment = {"node": "node-0000", "containers": {"main": [uuid]}}
        pod["metadata"]["annotations"] = {"vendor.io/vgpu-assignment": json.dumps(assignment)}
        return pod

    fine = [bound("a", 60, "node-0000", card), bound("b", 40, "node-0000", card)]
    assert kit.check_assignments(fine, nodes)["overcommitted_cards"] == 0
    over = [*fine, bound("c", 10, "node-0000", card)]
    assert kit.check_assignments(over, nodes)["overcommitted_cards"] == 1
    elsewhere = [bound("d", 10, "node-0001", card)]  # its card is not on its node
    assert kit.check_assignments(elsewhere, nodes)["cards_not_on_the_pods_node"] == 1
    pending = [*fine, kit.pod_object("e", "vgpu-scheduler", 30, 16, "s")]  # 15 cards have room
    checks = kit.check_assignments(pending, nodes)
    assert checks["pending"] == 1 and checks["pending_though_a_card_fits"] == 1
