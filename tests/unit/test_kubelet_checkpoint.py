"""The kubelet's device checkpoint, read for adoption (issue 28): bounded, no
links followed, malformed files refused, and the key a saved answer mounts."""

from __future__ import annotations

from pathlib import Path

import pytest

from vgpu.adapters.kubelet import checkpoint
from vgpu.pb import deviceplugin_v1beta1_pb2 as pb
from vgpu.sim import checkpoint as sim_checkpoint

ROOT = Path("/var/lib/vgpu/containers")
KEY = "p0123456789abcdef0123"


def _answer(**fields: object) -> bytes:
    return pb.ContainerAllocateResponse(**fields).SerializeToString()  # type: ignore[arg-type]


def _entries(alloc: bytes) -> list[checkpoint.Entry]:
    return [
        checkpoint.Entry("uid-1", "main", "vendor.io/vcuda-memory", {0: ["m1", "m2"]}, alloc),
        checkpoint.Entry("uid-1", "main", "vendor.io/vcuda-core", {0: ["c1"]}, b""),
        checkpoint.Entry("uid-2", "main", "vendor.io/vcuda-core", {0: ["c9"]}, b"garbage"),
    ]


def test_the_key_comes_from_the_saved_answers_config_mount() -> None:
    alloc = _answer(
        mounts=[pb.Mount(container_path="/etc/vgpu", host_path=str(ROOT / KEY), read_only=True)]
    )
    # Either resource's IDs find the container; its first answer names the key.
    assert checkpoint.mounted_key(_entries(alloc), {"c1"}, ROOT) == KEY
    assert checkpoint.mounted_key(_entries(alloc), {"m2"}, ROOT) == KEY
    assert checkpoint.mounted_key(_entries(alloc), {"c9"}, ROOT) is None  # unparsable answer
    assert checkpoint.mounted_key(_entries(alloc), {"zz"}, ROOT) is None


def test_the_key_comes_from_a_cdi_device_name() -> None:
    alloc = _answer(cdi_devices=[pb.CDIDevice(name=f"vendor.io/vgpu={KEY}")])
    assert checkpoint.mounted_key(_entries(alloc), {"c1"}, ROOT) == KEY


def test_a_mount_outside_the_state_root_or_not_a_key_is_ignored() -> None:
    for host in ("/elsewhere/" + KEY, str(ROOT / "../../etc"), str(ROOT / "not-a-key")):
        alloc = _answer(mounts=[pb.Mount(container_path="/etc/vgpu", host_path=host)])
        assert checkpoint.mounted_key(_entries(alloc), {"c1"}, ROOT) is None


def test_read_round_trips_what_the_kubelet_writes(tmp_path: Path) -> None:
    path = tmp_path / checkpoint.CHECKPOINT_NAME
    entries = _entries(_answer())
    sim_checkpoint.write(path, sim_checkpoint.encode(entries, {"vendor.io/vcuda-core": ["c1"]}))
    assert checkpoint.read(path) == entries


def test_read_refuses_links_malformed_and_oversized_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = tmp_path / "real"
    sim_checkpoint.write(real, sim_checkpoint.encode(_entries(b""), {}))
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(OSError):
        checkpoint.read(link)
    bad = tmp_path / "bad"
    for text in (b"not json", b'{"Data": {"PodDeviceEntries": [{"PodUID": 1}]}}', b"[]"):
        bad.write_bytes(text)
        with pytest.raises(ValueError):
            checkpoint.read(bad)
    monkeypatch.setattr(checkpoint, "MAX_CHECKPOINT_BYTES", 10)
    with pytest.raises(ValueError, match="over 10 bytes"):
        checkpoint.read(real)
