"""The ld.so.preload delivery of the limit contract (vgpu.core.contract), pure."""

from __future__ import annotations

from pathlib import Path

import pytest

from vgpu.adapters.fs import install_hook
from vgpu.core.contract import (
    PRELOAD_FILE,
    container_edits,
    preload_file_name,
    preload_file_text,
    with_hook_injection,
)
from vgpu.core.model import CardUuid, Placement

HOOK = "/usr/local/vgpu/libvgpu-0.1.0-3f9c2a1b7d0e.so"


def placement(core: int, memory_mib: int) -> Placement:
    return Placement(
        key="k", cards=(CardUuid("GPU-1"),), ids={}, core_percent=core, memory_mib=memory_mib
    )


@pytest.mark.parametrize(
    ("core", "memory_mib", "injection", "hook", "mounted"),
    [
        pytest.param(30, 1024, "ld-so-preload", HOOK, True, id="slice-preload"),
        pytest.param(30, 0, "ld-so-preload", HOOK, True, id="cores-only-preload"),
        pytest.param(30, 1024, "env", HOOK, False, id="slice-env"),
        pytest.param(100, 0, "ld-so-preload", HOOK, False, id="whole-card"),
        pytest.param(30, 1024, "ld-so-preload", None, False, id="no-hook"),
    ],
)
def test_preload_mount_only_where_the_hook_goes(
    core: int, memory_mib: int, injection: str, hook: str | None, mounted: bool
) -> None:
    p = placement(core, memory_mib)
    base = container_edits(p, [None], config_dir="/c", shared_dir="/s", hook_path=hook)
    out = with_hook_injection(base, hook, injection)
    preload = [m for m in out.mounts if m.container_path == PRELOAD_FILE]
    assert out.envs == base.envs  # the env stays as it is
    assert out.mounts[: len(base.mounts)] == base.mounts
    if not mounted:
        assert out == base
        return
    (mount,) = preload
    assert mount.read_only
    assert mount.host_path == "/usr/local/vgpu/libvgpu-0.1.0-3f9c2a1b7d0e.ld.so.preload"


def test_preload_file_names_the_hook_at_its_container_path() -> None:
    host = "/var/lib/hooks/libvgpu-0.2.0-aaaaaaaaaaaa.so"
    assert preload_file_text(host) == "/usr/local/vgpu/libvgpu-0.2.0-aaaaaaaaaaaa.so\n"
    assert preload_file_name(host) == "libvgpu-0.2.0-aaaaaaaaaaaa.ld.so.preload"


def test_install_writes_the_preload_file_once_and_repairs_it(tmp_path: Path) -> None:
    library = tmp_path / "libvgpu.so"
    library.write_bytes(b"\x7fELF not really")
    hook_dir = tmp_path / "hooks"
    hook = install_hook(library, hook_dir, "0.1.0")
    preload = hook_dir / preload_file_name(str(hook))
    assert preload.read_text() == f"/usr/local/vgpu/{hook.name}\n"
    inode = preload.stat().st_ino
    assert install_hook(library, hook_dir, "0.1.0") == hook
    assert preload.stat().st_ino == inode  # unchanged: not rewritten under running containers
    preload.write_text("garbage\n")
    install_hook(library, hook_dir, "0.1.0")
    assert preload.read_text() == f"/usr/local/vgpu/{hook.name}\n"
    assert sorted(p.name for p in hook_dir.iterdir()) == sorted([hook.name, preload.name])
