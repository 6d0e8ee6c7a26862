"""The filesystem adapters of issue 17: the host's device nodes and the CDI delivery."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from tests.cdi_schema import validate_spec
from vgpu.adapters.delivery import CdiDelivery, EnvvarDelivery, build_delivery
from vgpu.adapters.devnodes import HostDevices
from vgpu.adapters.dra.cdi import CdiDir
from vgpu.core.contract import ContainerEdits, MountSpec


def test_only_character_devices_count_and_a_missing_one_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    os.symlink("/dev/null", tmp_path / "nvidia0")
    (tmp_path / "nvidiactl").write_text("a regular file is no device")
    devices = HostDevices(tmp_path)
    wanted = ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/../etc/passwd"]
    with caplog.at_level(logging.WARNING, logger="vgpu"):
        assert devices.present(wanted) == {"/dev/nvidia0"}
        assert devices.present(wanted) == {"/dev/nvidia0"}
    uvm = [r for r in caplog.records if "/dev/nvidia-uvm " in r.getMessage()]
    assert len(uvm) == 1 and "nvidia-uvm module" in uvm[0].getMessage()
    assert any("not a character device" in r.getMessage() for r in caplog.records)
    # Back, then gone again: logged again.
    os.symlink("/dev/null", tmp_path / "nvidia-uvm")
    assert "/dev/nvidia-uvm" in devices.present(wanted)
    (tmp_path / "nvidia-uvm").unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vgpu"):
        devices.present(wanted)
    assert any("/dev/nvidia-uvm " in r.getMessage() for r in caplog.records)


EDITS = ContainerEdits(
    envs={"VGPU_CORE_LIMIT": "30"}, mounts=(MountSpec("/etc/vgpu", "/s/pk", True),)
)


def test_cdi_delivery_writes_names_forgets_and_sweeps(tmp_path: Path) -> None:
    cdi = CdiDir(tmp_path / "cdi", "vendor.io")
    delivery = build_delivery("cdi", cdi)
    assert isinstance(delivery, CdiDelivery)
    answer = delivery.deliver("pk1", EDITS, ["GPU-a"])
    assert answer.cdi_devices == ("vendor.io/vgpu=pk1",) and answer.envs == {}
    spec = json.loads((tmp_path / "cdi" / "vendor.io-vgpu_pk1.json").read_text())
    validate_spec(spec)
    assert spec["devices"][0]["containerEdits"]["env"] == ["VGPU_CORE_LIMIT=30"]
    stamp = (tmp_path / "cdi" / "vendor.io-vgpu_pk1.json").stat().st_mtime_ns
    delivery.deliver("pk1", EDITS, ["GPU-a"])  # the second resource: unchanged, not rewritten
    assert (tmp_path / "cdi" / "vendor.io-vgpu_pk1.json").stat().st_mtime_ns == stamp
    (tmp_path / "cdi" / "vendor.io-vgpu_pk1.json").unlink()  # a reboot emptied tmpfs
    delivery.deliver("pk1", EDITS, ["GPU-a"])
    assert (tmp_path / "cdi" / "vendor.io-vgpu_pk1.json").exists()
    delivery.deliver("pk2", EDITS, ["GPU-a"])
    delivery.forget("pk1")
    assert cdi.names() == ["vendor.io-vgpu_pk2.json"]
    (tmp_path / "cdi" / ".vendor.io-vgpu_pk3.json.x.tmp").write_text("{")  # a crash mid-write
    (tmp_path / "cdi" / "other-vendor.json").write_text("{}")  # not ours: kept
    assert delivery.sweep(set()) == ["vendor.io-vgpu_pk2.json"]
    assert sorted(p.name for p in (tmp_path / "cdi").iterdir()) == ["other-vendor.json"]


def test_envvar_is_the_default_and_writes_nothing(tmp_path: Path) -> None:
    delivery = build_delivery("envvar", CdiDir(tmp_path / "cdi", "vendor.io"))
    assert isinstance(delivery, EnvvarDelivery)
    assert delivery.deliver("pk", EDITS, ["GPU-a"]) is EDITS
    assert not (tmp_path / "cdi").exists()
