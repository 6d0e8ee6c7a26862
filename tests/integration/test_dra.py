"""DRA mode end to end: the real daemon (`vgpu serve --mode dra`) as a
subprocess, the DRA kubelet stand-in over real gRPC, the fake API server over
real HTTP through the official client, and the scheduler stand-in."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc
import pytest
import yaml

from tests.conftest import MockGpusFile, cards
from vgpu.adapters import budget
from vgpu.cli.status import collect
from vgpu.sim.draharness import DraSimNode
from vgpu.sim.faults import SmallDisk
from vgpu.sim.harness import wait_until

pytestmark = pytest.mark.timeout(60)
DRIVER = "vgpu.vendor.io"
RBAC = Path(__file__).resolve().parents[2] / "deploy" / "dra" / "03-rbac.yaml"


class Factory(Protocol):
    def __call__(
        self,
        gpus: str | Path = "preset:2xH200",
        *,
        wipe_delay_s: float | None = 30.0,
        hook: bool = True,
        hook_dir: Path | None = None,
        extra: Sequence[str] = (),
    ) -> DraSimNode: ...


@pytest.fixture
def make_dra(short_tmp: Path) -> Iterator[Factory]:
    nodes: list[DraSimNode] = []

    def factory(
        gpus: str | Path = "preset:2xH200",
        *,
        wipe_delay_s: float | None = 30.0,
        hook: bool = True,
        hook_dir: Path | None = None,
        extra: Sequence[str] = (),
    ) -> DraSimNode:
        root = short_tmp / f"d{len(nodes)}"
        root.mkdir()
        args: list[str] = list(extra)
        if hook:
            library = root / "libvgpu.so"
            library.write_bytes(b"\x7fELF stand-in hook library")
            args += ["--hook-library", str(library), "--hook-dir", str(hook_dir or root / "hook")]
        node = DraSimNode(root, gpus=gpus, daemon_args=args, wipe_delay_s=wipe_delay_s)
        nodes.append(node)
        node.start(timeout_s=15.0)
        return node

    yield factory
    problems = []
    for node in nodes:
        alive = node.proc is not None and node.proc.poll() is None
        rc = node.stop_daemon(signal.SIGTERM, timeout_s=5.0) if alive else None
        if alive and rc != 0:
            problems.append(f"DRA driver exited {rc} on SIGTERM:\n{node.log()[-3000:]}")
        if alive and any(node.registry_dir.glob("*.sock")):
            problems.append("the registration socket outlived SIGTERM")
        node.close()
        if "Traceback" in node.log():
            problems.append(f"traceback in the driver log:\n{node.log()[-4000:]}")
    assert not problems, "\n".join(problems)


@pytest.fixture
def dra(make_dra: Factory) -> DraSimNode:
    return make_dra()


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def _records(dra: DraSimNode) -> list[str]:
    """Committed claim records (not a write in flight)."""
    return [n for n in _files(dra.state_dir / "dra" / "claims") if not n.startswith(".")]


def _config(node: DraSimNode, edits: Any) -> dict[str, Any]:
    host = Path(edits.mounts["/etc/vgpu"]["hostPath"])
    return dict(json.loads((host / "config.json").read_text()))


# ------------------------------------------------------------------ registration, slices


def test_registers_with_the_plugin_watcher_and_publishes_one_slice(dra: DraSimNode) -> None:
    registration = dra.kubelet.plugins[DRIVER]
    assert registration.endpoint == str(dra.plugin_dir / "dra.sock")
    assert registration.versions == ("v1.DRAPlugin",)
    assert Path(registration.socket).name == f"{DRIVER}-reg.sock"
    assert dra.kubelet.refused == []
    found = dra.slice()
    assert found is not None
    spec = found["spec"]
    assert spec["driver"] == DRIVER and spec["nodeName"] == dra.node
    assert spec["pool"]["name"] == dra.node and spec["pool"]["resourceSliceCount"] == 1
    assert dra.published() == ["gpu-0", "gpu-1"]
    memory = spec["devices"][0]["capacity"]["memory"]
    assert memory["value"] == "143616Mi"
    assert memory["requestPolicy"]["validRange"] == {
        "min": "256Mi",
        "max": "143616Mi",
        "step": "256Mi",
    }


# ------------------------------------------------------------------ prepare / unprepare


def test_prepared_claims_carry_the_limits_the_scheduler_allocated(make_dra: Factory) -> None:
    dra = make_dra("preset:3xH200")
    dra.claim("slice", {"cores": "30", "memory": "10Gi"})
    dra.claim("whole", {"cores": "100"})
    dra.claim("cores-only", {"cores": "20"})
    run = dra.run_pod("p1", ["slice", "whole", "cores-only"])
    assert run.ok, run.reply
    allocations = {
        c["metadata"]["name"]: c["status"]["allocation"]["devices"]["results"][0]
        for c in dra.api.objects("resourceclaims")
    }
    for _, uid, name in run.claims:
        (device,) = run.reply.claims[uid].devices
        assert device.request_names == ["gpu"] and device.pool_name == dra.node
        assert device.device_name == allocations[name]["device"]
        assert device.share_id == allocations[name]["shareID"]
        (cdi_id,) = device.cdi_device_ids
        assert cdi_id.startswith("vendor.io/vgpu=") and uid in cdi_id

    fractional = run.edits["slice"]
    assert fractional.env["VGPU_CORE_LIMIT"] == "30"
    assert fractional.env["VGPU_MEMORY_LIMIT_MIB"] == "10240"
    assert fractional.env["LD_PRELOAD"].startswith("/usr/local/vgpu/libvgpu-")
    assert fractional.mounts["/etc/vgpu"]["options"][0] == "ro"
    budget_mount = fractional.mounts["/var/run/vgpu/vgpu.shm"]
    assert budget_mount["options"][0] == "rw"
    # the daemon made the budget file before the container starts, at its size
    assert Path(budget_mount["hostPath"]).stat().st_size == budget.FILE_BYTES
    assert fractional.mounts[fractional.env["LD_PRELOAD"]]["options"][0] == "ro"
    # hook_injection ld-so-preload (the default): the hook also for a clean environment
    preload = fractional.mounts["/etc/ld.so.preload"]
    assert preload["options"][0] == "ro"
    assert Path(preload["hostPath"]).read_text() == fractional.env["LD_PRELOAD"] + "\n"
    # A preset card lists no device nodes: the spec names none (see test_dra_nodes).
    assert list(fractional.device_nodes) == []
    config = _config(dra, fractional)
    assert (config["core_percent"], config["memory_limit_mib"]) == (30, 10240)
    assert config["cards"] == [fractional.env["NVIDIA_VISIBLE_DEVICES"]]

    whole = run.edits["whole"]
    assert "VGPU_CORE_LIMIT" not in whole.env and "VGPU_MEMORY_LIMIT_MIB" not in whole.env
    assert "LD_PRELOAD" not in whole.env and "/etc/ld.so.preload" not in whole.mounts
    assert _config(dra, whole)["whole_cards"] is True

    # cores only: the memory default (the whole card's) is what it consumed
    assert run.edits["cores-only"].env["VGPU_CORE_LIMIT"] == "20"
    assert run.edits["cores-only"].env["VGPU_MEMORY_LIMIT_MIB"] == "143616"

    spec_files = _files(dra.cdi_dir)
    assert len(spec_files) == 3
    from tests.cdi_schema import validate_spec

    for name in spec_files:  # valid for the CDI version each declares
        validate_spec(json.loads((dra.cdi_dir / name).read_text()))
    spec = json.loads((dra.cdi_dir / spec_files[0]).read_text())
    assert spec["kind"] == "vendor.io/vgpu" and spec["cdiVersion"]


def test_the_context_estimate_reaches_sliced_claims_only(make_dra: Factory) -> None:
    """The same contract as Allocate: `context_overhead_mib` goes to the hook."""
    dra = make_dra(extra=("--context-overhead-mib", "512"))
    dra.claim("slice", {"cores": "30", "memory": "10Gi"})
    dra.claim("whole", {"cores": "100"})
    run = dra.run_pod("p", ["slice", "whole"])
    assert run.ok, run.reply
    assert run.edits["slice"].env["VGPU_CONTEXT_OVERHEAD_MIB"] == "512"
    assert "VGPU_CONTEXT_OVERHEAD_MIB" not in run.edits["whole"].env


def test_hook_injection_env_leaves_out_the_preload_mount(make_dra: Factory) -> None:
    dra = make_dra(extra=("--hook-injection", "env"))
    dra.claim("slice", {"cores": "30", "memory": "10Gi"})
    run = dra.run_pod("p", ["slice"])
    assert run.ok, run.reply
    assert run.edits["slice"].env["LD_PRELOAD"].startswith("/usr/local/vgpu/libvgpu-")
    assert "/etc/ld.so.preload" not in run.edits["slice"].mounts


@pytest.mark.timeout(60)
def test_a_full_hook_disk_refuses_sliced_claims_by_name_until_it_frees(
    make_dra: Factory, short_tmp: Path
) -> None:
    """Start-up on a full disk serves (no exit 2, no crash loop); sliced claims
    are refused with the disk's error, whole cards are prepared, and the hook is
    installed at the first prepare after the disk frees."""
    hook_dir = short_tmp / "hookdisk"
    with SmallDisk(hook_dir, size_mib=1) as disk:
        disk.fill()
        dra = make_dra(hook_dir=hook_dir)
        assert dra.proc is not None and dra.proc.poll() is None
        dra.claim("slice", {"cores": "30", "memory": "10Gi"})
        dra.claim("whole", {"cores": "100"})
        refused = dra.run_pod("p1", ["slice", "whole"])
        error = refused.error("slice")
        assert "install the hook library" in error and "ENOSPC" in error, error
        assert refused.error("whole") == ""
        assert not any(hook_dir.glob("libvgpu-*.so"))
        disk.free()
        dra.claim("later", {"cores": "30", "memory": "10Gi"})
        run = dra.run_pod("p2", ["later"])
        assert run.ok, run.reply
        assert run.edits["later"].env["LD_PRELOAD"].startswith("/usr/local/vgpu/libvgpu-")
        assert any(hook_dir.glob("libvgpu-*.so"))
        assert dra.stop_daemon(signal.SIGTERM, timeout_s=5.0) == 0, dra.log()[-3000:]


def test_prepare_is_idempotent_and_unprepare_removes_everything(dra: DraSimNode) -> None:
    dra.claim("c", {"cores": "10", "memory": "1Gi"})
    run = dra.run_pod("p", ["c"])
    assert run.ok
    spec_file = next(dra.cdi_dir.iterdir())
    stamp = spec_file.stat().st_mtime_ns
    again = dra.kubelet.prepare(DRIVER, run.claims)
    assert again == run.reply
    assert spec_file.stat().st_mtime_ns == stamp  # nothing rewritten
    containers = dra.state_dir / "dra" / "containers"
    assert len(_files(containers)) == 1

    reply = dra.end_pod(run)
    assert reply.claims[run.claims[0][1]].error == ""
    assert _files(dra.cdi_dir) == []
    assert [f for f in _files(containers) if not f.startswith(".")] == []
    assert _files(dra.state_dir / "dra" / "claims") == []
    twice = dra.kubelet.unprepare(DRIVER, run.claims)  # idempotent
    unknown = dra.kubelet.unprepare(DRIVER, [("default", "0000-unknown", "nope")])
    assert twice.claims[run.claims[0][1]].error == "" and unknown.claims["0000-unknown"].error == ""


def test_a_grown_budget_file_is_cut_back(dra: DraSimNode) -> None:
    """DRA containers' budget files are watched like the device plugin's."""
    dra.claim("grow", {"cores": "10", "memory": "1Gi"})
    run = dra.run_pod("grower", ["grow"])
    assert run.ok, run.reply
    path = Path(run.edits["grow"].mounts["/var/run/vgpu/vgpu.shm"]["hostPath"])
    with path.open("r+b") as fh:
        fh.seek(50 * 2**20)
        fh.write(b"x" * 2**20)  # the tenant filling the disk through its mount
    assert wait_until(lambda: path.stat().st_size == budget.FILE_BYTES, timeout_s=10)
    assert "cut back" in dra.log()
    dra.end_pod(run)


def _allocate_by_hand(dra: DraSimNode, name: str, results: list[dict[str, Any]]) -> str:
    stored = dra.claim(name)

    def write(obj: dict[str, Any]) -> None:
        obj["status"] = {"allocation": {"devices": {"results": results}}}

    dra.api.update_object("resourceclaims", name, write, "default")
    return str(stored["metadata"]["uid"])


def test_hostile_claims_get_their_own_errors_and_the_rest_is_prepared(dra: DraSimNode) -> None:
    mine = {"request": "gpu", "driver": DRIVER, "pool": dra.node}
    claims = {
        "other-driver": _allocate_by_hand(
            dra, "other-driver", [{**mine, "driver": "other.example.com", "device": "gpu-0"}]
        ),
        "unknown-device": _allocate_by_hand(
            dra, "unknown-device", [{**mine, "device": "gpu-7", "consumedCapacity": {"cores": "1"}}]
        ),
        "other-pool": _allocate_by_hand(
            dra, "other-pool", [{**mine, "pool": "n9", "device": "gpu-0"}]
        ),
        "off-grid": _allocate_by_hand(
            dra,
            "off-grid",
            [{**mine, "device": "gpu-0", "consumedCapacity": {"cores": "5", "memory": "100Mi"}}],
        ),
        "unallocated": str(dra.claim("unallocated")["metadata"]["uid"]),
    }
    good = _allocate_by_hand(
        dra,
        "good",
        [{**mine, "device": "gpu-1", "consumedCapacity": {"cores": "5", "memory": "1Gi"}}],
    )
    refs = [("default", uid, name) for name, uid in claims.items()]
    refs += [
        ("default", "11111111-2222-3333-4444-555555555555", "good"),  # a UID that is not its own
        ("default", "22222222-2222-3333-4444-555555555555", "never-created"),
        ("default", "../../etc/passwd", "good"),
        ("default", good, "good"),
    ]
    reply = dra.kubelet.prepare(DRIVER, refs)
    errors = {name: reply.claims[uid].error for _, uid, name in refs[:5]}
    assert "no device of driver vgpu.vendor.io" in errors["other-driver"]
    assert "does not have" in errors["unknown-device"]
    assert "another node" in errors["other-pool"]
    assert "cannot give" in errors["off-grid"]
    assert "has no allocation" in errors["unallocated"]
    assert "deleted and re-created" in reply.claims["11111111-2222-3333-4444-555555555555"].error
    assert "does not exist" in reply.claims["22222222-2222-3333-4444-555555555555"].error
    assert "not a Kubernetes UID" in reply.claims["../../etc/passwd"].error
    assert reply.claims[good].error == "" and len(reply.claims[good].devices) == 1
    assert len(_files(dra.cdi_dir)) == 1  # only the good claim has files
    # a claim without a UID or with an overlong name is its own error too
    odd = dra.kubelet.prepare(
        DRIVER,
        [("default", "", "no-uid"), ("default", "u-2", "x" * 300), ("default", good, "good")],
    )
    assert "not a Kubernetes UID" in odd.claims[""].error
    assert "at most 253" in odd.claims["u-2"].error and odd.claims[good].error == ""
    # only a call no kubelet makes fails as a whole, and the driver keeps serving
    with pytest.raises(grpc.RpcError) as info:
        dra.kubelet.prepare(DRIVER, [("default", f"u-{i}", "c") for i in range(1025)])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dra.kubelet.prepare(DRIVER, [("default", good, "good")]).claims[good].error == ""


# ------------------------------------------------------------------ health


def _time_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> float:
    started = time.monotonic()
    assert wait_until(predicate, timeout_s, 0.01), "condition not met in time"
    return time.monotonic() - started


def _tainted(dra: DraSimNode) -> list[str]:
    found = dra.slice()
    devices = (found or {}).get("spec", {}).get("devices") or []
    return [d["name"] for d in devices if d.get("taints")]


def test_a_sick_card_is_tainted_in_the_slice_within_two_seconds(
    make_dra: Factory, mock_gpus_file: MockGpusFile
) -> None:
    gpus = cards(2)
    path = mock_gpus_file(gpus)
    dra = make_dra(path)
    generation = dra.slice()["spec"]["pool"]["generation"]  # type: ignore[index]
    dra.claim("early", {"cores": "10", "memory": "1Gi"})
    dra.allocator.allocate("default", "early", node=dra.node)  # on gpu-0, before it falls ill
    mock_gpus_file([{**gpus[0], "xid": 79}, gpus[1]])
    # Still published (the claim on it stays visible), tainted NoSchedule with the XID.
    assert _time_until(lambda: _tainted(dra) == ["gpu-0"]) < 2.0
    assert dra.published() == ["gpu-0", "gpu-1"]
    sick = dra.slice()["spec"]["devices"][0]  # type: ignore[index]
    assert sick["taints"] == [
        {"key": f"{DRIVER}/unhealthy", "value": "xid-79", "effect": "NoSchedule"}
    ]
    # The scheduler (stand-in) allocates nothing new on it.
    dra.claim("late", {"cores": "10", "memory": "1Gi"})
    late = dra.allocator.allocate("default", "late", node=dra.node)
    assert late["allocation"]["devices"]["results"][0]["device"] == "gpu-1"
    after = dra.slice()["spec"]["pool"]["generation"]  # type: ignore[index]
    assert after > generation
    early = dra.api.get_object("resourceclaims", "early", "default")
    assert early is not None
    reply = dra.kubelet.prepare(DRIVER, [("default", early["metadata"]["uid"], "early")])
    assert "unhealthy (XID 79)" in reply.claims[early["metadata"]["uid"]].error
    mock_gpus_file(gpus)  # healthy again
    assert _time_until(lambda: _tainted(dra) == []) < 2.0
    mock_gpus_file([gpus[0]])  # gpu-1 gone
    assert _time_until(lambda: dra.published() == ["gpu-0"]) < 2.0
    assert dra.slice()["spec"]["pool"]["generation"] > after  # type: ignore[index]


def test_the_slice_comes_back_after_a_kubelet_restart_and_a_wipe(make_dra: Factory) -> None:
    dra = make_dra(wipe_delay_s=0.3)
    registrations = dra.kubelet.registrations(DRIVER)
    dra.kubelet.restart()  # deletes the node's slices, re-registers the plugin
    assert _time_until(lambda: dra.kubelet.registrations(DRIVER) > registrations) < 2.0
    assert _time_until(lambda: dra.published() == ["gpu-0", "gpu-1"]) < 2.0
    # a removed registration socket is served again
    before = dra.kubelet.registrations(DRIVER)
    next(dra.registry_dir.glob("*.sock")).unlink()
    assert _time_until(lambda: dra.kubelet.registrations(DRIVER) > before) < 2.0
    # stopped: sockets go, the slice stays until the kubelet wipes it
    assert dra.stop_daemon() == 0
    assert (
        list(dra.registry_dir.glob("*.sock")) == [] and not (dra.plugin_dir / "dra.sock").exists()
    )
    assert _time_until(lambda: dra.slice() is None) < 2.0
    dra.start_daemon()
    assert dra.published() == ["gpu-0", "gpu-1"]


# ------------------------------------------------------------------ crashes


def test_kill_9_then_restart_repairs_sweeps_and_unprepares(dra: DraSimNode) -> None:
    for name in ("a", "b"):
        dra.claim(name, {"cores": "10", "memory": "1Gi"})
    run = dra.run_pod("p", ["a", "b"])
    assert run.ok
    uid_a = run.claims[0][1]
    spec_a = dra.cdi_dir / f"vendor.io-vgpu_{uid_a}.json"
    written = spec_a.read_text()
    dra.stop_daemon(signal.SIGKILL)
    # the state of a crash after a's record, before its files (a reboot also
    # empties /var/run/cdi), plus leftovers no record names
    spec_a.unlink()
    config_a = Path(run.edits["a"].mounts["/etc/vgpu"]["hostPath"])
    for item in config_a.rglob("*"):
        if item.is_file():
            item.unlink()
    orphan_dir = dra.state_dir / "dra" / "containers" / "orphan-0000"
    orphan_dir.mkdir()
    (dra.cdi_dir / "vendor.io-vgpu_orphan.json").write_text("{}")
    (dra.state_dir / "dra" / "claims" / ".x.json.123.tmp").write_text("half")
    dra.start_daemon()
    assert spec_a.read_text() == written
    assert (config_a / "config.json").exists()
    assert not orphan_dir.exists() and not (dra.cdi_dir / "vendor.io-vgpu_orphan.json").exists()
    assert _files(dra.state_dir / "dra" / "claims") == sorted(f"{u}.json" for _, u, _ in run.claims)
    assert dra.kubelet.prepare(DRIVER, run.claims) == run.reply  # recovered, same answer
    assert dra.end_pod(run).claims[uid_a].error == ""
    assert _files(dra.cdi_dir) == []


def test_kill_9_during_prepares_leaves_every_claim_whole_or_absent(dra: DraSimNode) -> None:
    names = [f"k{i}" for i in range(16)]
    refs = []
    for name in names:
        uid = dra.claim(name, {"cores": "1", "memory": "256Mi"})["metadata"]["uid"]
        dra.allocator.allocate("default", name, pod=("p", "u"), node=dra.node)
        refs.append(("default", str(uid), name))
    done = threading.Event()

    def hammer() -> None:
        for ref in refs:
            try:
                dra.kubelet.prepare(DRIVER, [ref])
            except grpc.RpcError:
                break
        done.set()

    threading.Thread(target=hammer, daemon=True).start()
    assert wait_until(lambda: len(_records(dra)) >= 3, 10.0, 0.002)
    dra.stop_daemon(signal.SIGKILL)
    done.wait(10.0)
    (dra.cdi_dir / ".vendor.io-vgpu_x.json.1.tmp").write_text("half")  # a write cut short
    (dra.cdi_dir / ".other-vendor.json.1.tmp").write_text("not ours")
    dra.start_daemon()
    records = _files(dra.state_dir / "dra" / "claims")  # temp files swept: all committed
    assert len(records) >= 3
    specs = [n for n in _files(dra.cdi_dir) if n != ".other-vendor.json.1.tmp"]
    assert specs == sorted(f"vendor.io-vgpu_{r.removesuffix('.json')}" + ".json" for r in records)
    for spec in specs:
        for device in json.loads((dra.cdi_dir / spec).read_text())["devices"]:
            for mount in device["containerEdits"]["mounts"]:
                assert Path(mount["hostPath"]).exists(), mount
    reply = dra.kubelet.unprepare(DRIVER, refs)
    assert all(r.error == "" for r in reply.claims.values())
    assert _files(dra.cdi_dir) == [".other-vendor.json.1.tmp"]  # another vendor's file stays
    assert _files(dra.state_dir / "dra" / "claims") == []


# ------------------------------------------------------------------ status


def test_status_lists_dra_claims(dra: DraSimNode) -> None:
    dra.claim("nb", {"cores": "30", "memory": "10Gi"})
    dra.claim("tr", {"cores": "100"})
    assert dra.run_pod("notebook", ["nb"]).ok and dra.run_pod("trainer", ["tr"]).ok
    doc = collect(dra.state_dir)
    rows = {c["claim"]["name"]: c for c in doc["containers"]}
    assert rows["nb"]["pod"] == "notebook" and rows["nb"]["claim"]["request"] == "gpu"
    assert (rows["nb"]["core"], rows["nb"]["memory_mib"], rows["nb"]["whole_cards"]) == (
        30,
        10240,
        False,
    )
    assert rows["tr"]["whole_cards"] is True and rows["tr"]["pod"] == "trainer"
    by_card = {c["uuid"]: c for c in doc["cards"]}
    assert by_card[rows["nb"]["cards"][0]]["core_allocated"] == 30
    assert by_card[rows["tr"]["cards"][0]]["core_allocated"] == 100
    table = subprocess.run(
        [sys.executable, "-m", "vgpu", "status", "--state-dir", str(dra.state_dir)],
        capture_output=True,
        text=True,
        timeout=30,
        env={k: v for k, v in os.environ.items() if k != "NO_COLOR"},
        check=True,
    ).stdout
    assert "default/notebook claim nb" in table and "core 30%" in table
    assert "default/trainer claim tr" in table and "whole card" in table


# ------------------------------------------------------------------ device nodes, taints


def test_dra_names_host_nodes_only_and_taints_a_card_without_its_node(
    make_dra: Factory, mock_gpus_file: MockGpusFile, short_tmp: Path
) -> None:
    from tests.cdi_schema import validate_spec
    from tests.conftest import card

    dev = short_tmp / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidiactl"):
        os.symlink("/dev/null", dev / name)
    gpus = mock_gpus_file(
        [
            card(0, device_nodes=["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"]),
            card(1, device_nodes=["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"]),
        ]
    )
    dra = make_dra(gpus, extra=["--host-dev-dir", str(dev)])
    found = dra.slice()
    assert found is not None
    devices = {d["name"]: d for d in found["spec"]["devices"]}
    # The sick card stays published, tainted, so claims on it stay visible.
    assert devices["gpu-1"]["taints"] == [
        {"key": f"{DRIVER}/unhealthy", "value": "device-node-missing", "effect": "NoSchedule"}
    ]
    assert "taints" not in devices["gpu-0"]
    dra.claim("slice", {"cores": "30", "memory": "1Gi"})
    run = dra.run_pod("p1", ["slice"])
    assert run.ok, run.reply
    edits = run.edits["slice"]
    assert list(edits.device_nodes) == ["/dev/nvidia0", "/dev/nvidiactl"]  # on gpu-0 only
    for spec_file in dra.cdi_dir.glob("*.json"):
        validate_spec(json.loads(spec_file.read_text()))
    # The node appears: the taint goes.
    os.symlink("/dev/null", dev / "nvidia1")

    def untainted() -> bool:
        body = dra.slice()
        return body is not None and all("taints" not in d for d in body["spec"]["devices"])

    assert wait_until(untainted, 15)


def test_health_reaches_the_kubelet_through_the_dra_health_stream(
    make_dra: Factory, mock_gpus_file: MockGpusFile
) -> None:
    gpus = cards(2)
    path = mock_gpus_file(gpus)
    dra = make_dra(path)
    kubelet = dra.kubelet

    def health() -> dict[tuple[str, str], tuple[str, str]]:
        with kubelet._lock:
            return dict(kubelet.health.get(DRIVER, {}))

    # The full list first.
    assert wait_until(lambda: len(health()) == 2, 10), kubelet.health_errors
    assert health() == {
        (dra.node, "gpu-0"): ("HEALTHY", ""),
        (dra.node, "gpu-1"): ("HEALTHY", ""),
    }
    sent = kubelet.health_messages[DRIVER]
    # Then again on a change: an XID on gpu-1.
    mock_gpus_file([gpus[0], {**gpus[1], "xid": 79}])
    assert wait_until(lambda: health()[(dra.node, "gpu-1")] == ("UNHEALTHY", "XID 79"), 5)
    assert health()[(dra.node, "gpu-0")] == ("HEALTHY", "")
    assert kubelet.health_messages[DRIVER] > sent
    mock_gpus_file(gpus)
    assert wait_until(lambda: health()[(dra.node, "gpu-1")] == ("HEALTHY", ""), 5)
    assert kubelet.health_errors == []  # never Unimplemented


def test_a_memory_only_claim_gets_best_effort_compute_and_blocks_no_cores(
    make_dra: Factory,
) -> None:
    """One meaning per request in both modes: as a memory-only container in
    device-plugin mode, a memory-only claim has no core limit and consumes no
    cores, so a claim for all 100 cores still fits on the same card."""
    dra = make_dra("preset:1xH200")
    dra.claim("mem", {"memory": "10Gi"})
    dra.claim("cores", {"cores": "100", "memory": "10Gi"})
    run = dra.run_pod("p1", ["mem", "cores"])
    assert run.ok, run.reply
    mem = run.edits["mem"]
    assert "VGPU_CORE_LIMIT" not in mem.env
    assert mem.env["VGPU_MEMORY_LIMIT_MIB"] == "10240"
    assert _config(dra, mem)["core_units"] == 0
    assert _config(dra, run.edits["cores"])["whole_cards"] is True


def _chart_rules(without: str | None = None) -> list[dict[str, Any]]:
    """The DRA driver's ClusterRole rules as the chart renders them (deploy/dra)."""
    role = yaml.safe_load(RBAC.read_text().split("\n---\n")[0])
    assert role["kind"] == "ClusterRole"
    return [r for r in role["rules"] if without not in r["resources"]]


def test_config_names_the_pod_and_container_and_the_claim_status_has_the_card(
    make_dra: Factory,
) -> None:
    dra = make_dra("preset:2xH200")
    # The daemon writes as the chart's ServiceAccount would, with a token bound
    # to its node: the API server (1.36) checks resourceclaims/driver.
    dra.api.set_driver_status_access(_chart_rules(), node=dra.node)
    dra.claim("slice", {"cores": "30", "memory": "10Gi"})
    run = dra.run_pod("p1", ["slice"])
    assert run.ok, run.reply
    config = _config(dra, run.edits["slice"])
    assert config["pod"] == {"namespace": "default", "name": "p1", "uid": run.uid}
    assert config["container"] == "main"
    (card,) = config["cards"]

    def status() -> list[dict[str, Any]]:
        claim = dra.api.get_object("resourceclaims", "slice", "default")
        return list(((claim or {}).get("status") or {}).get("devices") or [])

    assert wait_until(lambda: len(status()) == 1, 10), dra.log()[-2000:]
    (entry,) = status()
    allocated = dra.api.get_object("resourceclaims", "slice", "default")["status"]["allocation"]  # type: ignore[index]
    result = allocated["devices"]["results"][0]
    assert (entry["driver"], entry["pool"], entry["device"]) == (
        DRIVER,
        result["pool"],
        result["device"],
    )
    assert entry["shareID"] == result["shareID"]
    assert entry["data"] == {
        "request": "gpu",
        "uuid": card,
        "wholeCard": False,
        "coreLimitPercent": 30,
        "memoryLimitMiB": 10240,
    }
    (ready,) = entry["conditions"]
    assert ready["type"] == "Ready" and ready["status"] == "True"
    assert ready["reason"] == "Prepared"
    assert ready["message"] == f"request gpu: {card}, core 30%, memory 10240 MiB"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", ready["lastTransitionTime"])
    # Unprepared: this driver's entries go with it.
    assert dra.kubelet.unprepare(DRIVER, run.claims).claims[run.claims[0][1]].error == ""
    assert wait_until(lambda: status() == [], 10)


def test_a_refused_claim_status_write_is_logged_with_the_api_servers_reason(
    make_dra: Factory,
) -> None:
    """Issue 29: on kube-apiserver 1.36 the chart's RBAC without
    resourceclaims/driver got every status.devices write refused with 422, and
    the warning cut the answer before its message. The claim still runs."""
    dra = make_dra("preset:1xH200")
    dra.api.set_driver_status_access(_chart_rules(without="resourceclaims/driver"), node=dra.node)
    dra.claim("slice", {"cores": "30", "memory": "10Gi"})
    run = dra.run_pod("p1", ["slice"])
    assert run.ok, run.reply
    wanted = 'status.devices: Forbidden: changing status.devices requires resource="resourceclaims'
    assert wait_until(lambda: wanted in dra.log(), 10), dra.log()[-2000:]
    line = next(x for x in dra.log().splitlines() if wanted in x)
    assert "cannot write the device status of claim default/slice: API server" in line
    assert "HTTP 422" in line and "associated-node:update" in line
    claim = dra.api.get_object("resourceclaims", "slice", "default")
    assert "devices" not in (claim or {}).get("status", {})
