"""The daemon's side of the hook's budget file (vgpu/adapters/budget.py) and the
contract that mounts it."""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import pytest

from vgpu.adapters import budget
from vgpu.core.contract import container_edits, limit_envs
from vgpu.core.model import CardUuid, Placement, Resource


def test_created_at_its_size_with_its_blocks_and_shared_by_every_user(tmp_path: Path) -> None:
    path = tmp_path / budget.FILE_NAME
    old = os.umask(0o077)
    try:
        assert budget.ensure(path) is None
    finally:
        os.umask(old)
    st = path.stat()
    assert st.st_size == budget.FILE_BYTES
    assert st.st_blocks * 512 >= budget.FILE_BYTES  # allocated, not sparse
    assert stat.S_IMODE(st.st_mode) == 0o666
    assert path.read_bytes() == bytes(budget.FILE_BYTES)  # zero-filled: the hook initialises it
    assert budget.usage_mib(path) == 0


def test_an_existing_good_file_is_kept_with_its_contents(tmp_path: Path) -> None:
    path = tmp_path / budget.FILE_NAME
    budget.ensure(path)
    with path.open("r+b") as fh:
        fh.write(b"live")
    assert budget.ensure(path) is None
    assert path.read_bytes()[:4] == b"live"


@pytest.mark.parametrize("size", [10, budget.FILE_BYTES + 4096])
def test_a_file_of_another_size_is_brought_back_to_size(tmp_path: Path, size: int) -> None:
    path = tmp_path / budget.FILE_NAME
    path.write_bytes(b"\1" * size)
    repaired = budget.ensure(path)
    assert repaired is not None and "cut back" in repaired
    assert path.stat().st_size == budget.FILE_BYTES
    assert path.read_bytes()[:10] == b"\1" * 10


def test_a_version_1_file_of_a_running_old_container_is_left_alone(tmp_path: Path) -> None:
    """Its old hook maps exactly its size: resizing it would kill those processes."""
    path = tmp_path / budget.FILE_NAME
    path.write_bytes(struct.pack("<II", budget.MAGIC, 1) + bytes(139464 - 8))
    assert budget.ensure(path) is None and budget.cut_back(path) is None
    assert path.stat().st_size == 139464


@pytest.mark.parametrize("version", [2, 3, 4])
def test_a_file_of_versions_2_to_4_is_left_at_the_size_its_hooks_map(
    tmp_path: Path, version: int
) -> None:
    path = tmp_path / budget.FILE_NAME
    path.write_bytes(struct.pack("<II", budget.MAGIC, version) + bytes(143360 - 8))
    assert budget.ensure(path) is None and budget.cut_back(path) is None
    assert path.stat().st_size == 143360
    # the arbiter and the teller refuse it, naming both versions; nothing is written
    with pytest.raises(budget.OldFormat, match=f"version {version}"):
        budget.write_arbiter(path, 1, 5000, 3000, 10000, 0)
    assert budget.tell(path, {0: (7, 1007)}, 1) == 0
    assert path.read_bytes()[8:] == bytes(143360 - 8)


def test_a_file_at_the_old_size_without_an_old_header_is_brought_to_size(tmp_path: Path) -> None:
    path = tmp_path / budget.FILE_NAME
    path.write_bytes(struct.pack("<II", budget.MAGIC, budget.VERSION) + bytes(143360 - 8))
    assert "cut back" in (budget.ensure(path) or "")
    assert path.stat().st_size == budget.FILE_BYTES


def test_something_else_planted_is_replaced(tmp_path: Path) -> None:
    target = tmp_path / "host-file"
    target.write_text("do not touch")
    path = tmp_path / budget.FILE_NAME
    path.symlink_to(target)
    assert "replaced" in (budget.ensure(path) or "")
    assert not path.is_symlink() and target.read_text() == "do not touch"
    path.unlink()
    os.mkfifo(path)
    assert "replaced" in (budget.ensure(path) or "")
    assert path.is_file()


def _placement(memory_mib: int, core: int = 30) -> Placement:
    card = CardUuid("GPU-00000000-0000-4000-8000-000000000000")
    return Placement(
        key="k", cards=(card,), ids={Resource.CORE: frozenset()}, core_percent=core,
        memory_mib=memory_mib, owner=None, created_s=0.0,
    )  # fmt: skip


def test_only_the_budget_file_is_mounted_writable() -> None:
    edits = container_edits(
        _placement(1024), [None], config_dir="/s/c/k", shared_dir="/s/c/k/shared", hook_path=None
    )
    writable = [(m.container_path, m.host_path) for m in edits.mounts if not m.read_only]
    assert writable == [("/var/run/vgpu/vgpu.shm", "/s/c/k/shared/vgpu.shm")]
    assert edits.envs["VGPU_SHARED_DIR"] == "/var/run/vgpu"


@pytest.mark.parametrize(
    ("memory_mib", "overhead", "expected"),
    [(1024, 0, None), (1024, 512, "512"), (0, 512, None)],
    ids=["absent-means-0", "estimate-passed", "no-memory-limit-nothing-to-charge"],
)
def test_context_overhead_estimate_in_the_answer(
    memory_mib: int, overhead: int, expected: str | None
) -> None:
    envs = limit_envs(_placement(memory_mib), overhead)
    assert envs.get("VGPU_CONTEXT_OVERHEAD_MIB") == expected
