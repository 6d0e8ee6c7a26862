"""`vgpu status` reads the real usage the hook records in the shared file."""

from __future__ import annotations

from pathlib import Path

from tests.hooks.test_hooks import release, start_probe
from vgpu.cli.status import hook_usage_mib


def test_status_reads_the_hooks_shared_budget(tmp_path: Path) -> None:
    budget_file = tmp_path / "vgpu.shm"
    assert hook_usage_mib(budget_file) is None  # no hook ran here yet
    holder, _ = start_probe(
        "alloc", "mem", 600, VGPU_MEMORY_LIMIT_MIB=1024, VGPU_SHARED_DIR=str(tmp_path)
    )
    try:
        assert hook_usage_mib(budget_file) == 600
    finally:
        release(holder)
    assert hook_usage_mib(budget_file) == 0  # the exited process gave its share back
