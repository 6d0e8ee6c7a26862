"""The plugin installs the hook library under a versioned name and preloads it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from vgpu.adapters import budget
from vgpu.sim.harness import SimNode

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(90)
def test_allocate_mounts_and_preloads_the_installed_hook(tmp_path: Path) -> None:
    library = tmp_path / "libvgpu.so"
    shutil.copy(ROOT / "hooks" / "build" / "libvgpu.so", library)  # built by `make -C hooks`
    node = SimNode()
    hook_dir = node.root / "hook"
    node.daemon_args = ["--hook-library", str(library), "--hook-dir", str(hook_dir)]
    node.start()
    try:
        installed = sorted(hook_dir.glob("libvgpu-*.so"))
        assert len(installed) == 1
        assert installed[0].read_bytes() == library.read_bytes()
        first = installed[0]

        sliced = node.submit(node.pod("nb", {node.core: 30, node.memory: 40}))
        assert sliced.ok, sliced.error
        c = sliced.containers[0]
        in_container = f"/usr/local/vgpu/{first.name}"
        assert c.envs["LD_PRELOAD"] == in_container
        mounts = {m.container_path: m for m in c.mounts}
        assert mounts[in_container].host_path == str(first)
        assert mounts[in_container].read_only
        # Only the budget file is mounted read-write, and it exists before the start.
        budget_mount = mounts["/var/run/vgpu/vgpu.shm"]
        assert not budget_mount.read_only
        assert "/var/run/vgpu" not in mounts
        budget_file = Path(budget_mount.host_path)
        assert budget_file.is_file() and budget_file.stat().st_size == budget.FILE_BYTES
        assert oct(budget_file.stat().st_mode & 0o777) == oct(0o666)
        assert oct(budget_file.parent.stat().st_mode & 0o7777) == oct(0o755)
        assert c.envs["VGPU_SHARED_DIR"] == "/var/run/vgpu"
        # hook_injection ld-so-preload (the default): a read-only /etc/ld.so.preload
        # naming the hook, written once next to it on the host.
        preload = mounts["/etc/ld.so.preload"]
        assert preload.read_only and Path(preload.host_path).parent == hook_dir
        assert Path(preload.host_path).read_text() == in_container + "\n"
        assert c.clashes == []

        whole = node.submit(node.pod("train", {node.core: 100}))
        assert whole.ok
        assert "LD_PRELOAD" not in whole.containers[0].envs  # a whole card needs no limits
        assert all(m.container_path != "/etc/ld.so.preload" for m in whole.containers[0].mounts)

        # A new library version never overwrites the file running containers have mapped.
        node.stop_daemon()
        library.write_bytes(library.read_bytes() + b"\0")
        first_bytes = first.read_bytes()
        node.start_daemon()
        installed = sorted(hook_dir.glob("libvgpu-*.so"))
        assert len(installed) == 2
        assert first.read_bytes() == first_bytes
        again = node.submit(node.pod("nb2", {node.core: 10, node.memory: 4}))
        assert again.ok
        assert again.containers[0].envs["LD_PRELOAD"] != in_container
        # Each version has its own preload file; the old one still names the old hook.
        assert sorted(p.name for p in hook_dir.glob("*.ld.so.preload")) == sorted(
            p.name.removesuffix(".so") + ".ld.so.preload" for p in installed
        )
        assert Path(preload.host_path).read_text() == in_container + "\n"
    finally:
        node.close()


@pytest.mark.timeout(60)
def test_hook_injection_env_mounts_no_ld_so_preload(tmp_path: Path) -> None:
    library = tmp_path / "libvgpu.so"
    shutil.copy(ROOT / "hooks" / "build" / "libvgpu.so", library)
    node = SimNode()
    hook_dir = node.root / "hook"
    node.daemon_args = [
        "--hook-library", str(library), "--hook-dir", str(hook_dir), "--hook-injection", "env",
    ]  # fmt: skip
    node.start()
    try:
        sliced = node.submit(node.pod("nb", {node.core: 30, node.memory: 40}))
        assert sliced.ok, sliced.error
        c = sliced.containers[0]
        assert c.envs["LD_PRELOAD"].startswith("/usr/local/vgpu/libvgpu-")
        assert all(m.container_path != "/etc/ld.so.preload" for m in c.mounts)
    finally:
        node.close()


@pytest.mark.timeout(30)
def test_missing_hook_library_is_a_clear_start_error(tmp_path: Path) -> None:
    node = SimNode(
        tmp_path,
        gpus="preset:1xH200",
        api=False,
        daemon_args=["--hook-library", str(tmp_path / "nope.so"), "--hook-dir", str(tmp_path)],
    )
    # The daemon's real command line, run to completion: it must refuse to start.
    result = subprocess.run(node.daemon_command(), capture_output=True, text=True, timeout=25)
    assert result.returncode == 2
    assert "hook library" in result.stderr and "Traceback" not in result.stderr
