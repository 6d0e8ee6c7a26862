"""Issue 13, item 4: a full, read-only or descriptor-starved disk never
crash-loops the daemon. It comes up and serves whatever the disk does, refuses
with a code and a message naming the cause and the path, leaves nothing
half-written, and recovers by itself when the disk does.

The faults are real: a small tmpfs that fills up (ENOSPC) or is remounted
read-only (EROFS), and the daemon's own open-file limit lowered (EMFILE).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.adversarial.helpers import config_dir
from tests.conftest import NodeFactory
from tests.integration.conftest_placement import (
    CORE,
    MEM,
    assert_admitted_ok,
    capacity_problems,
    restart_daemon,
    wait_consistent,
)
from vgpu.sim.faults import SmallDisk, open_file_limit
from vgpu.sim.harness import SimNode, wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def disk_node(make_node: NodeFactory) -> Iterator[tuple[SimNode, SmallDisk]]:
    """A node whose state directory is a small disk of its own."""
    node = make_node("preset:1xH200", start=False, daemon_args=("--reconcile-interval-s", "1"))
    disk = SmallDisk(node.state_dir, size_mib=4).mount()
    try:
        node.start(timeout_s=15)
        yield node, disk
        assert node.stop_daemon() == 0, node.log()[-3000:]
    finally:
        node.stop_daemon()
        disk.unmount()


def records(node: SimNode) -> set[str]:
    root = node.state_dir / "containers"
    return (
        {p.name for p in root.iterdir() if not p.name.startswith(".")} if root.exists() else set()
    )


def leftovers(node: SimNode) -> list[str]:
    """Temporary files of an interrupted write."""
    return [str(p) for p in node.state_dir.rglob("*.tmp")]


@pytest.mark.timeout(90)
def test_full_disk(disk_node: tuple[SimNode, SmallDisk]) -> None:
    node, disk = disk_node
    a = node.submit(node.pod("a", {CORE: 20, MEM: 20}))
    b = node.submit(node.pod("b", {CORE: 30, MEM: 30}))
    for r in (a, b):
        assert_admitted_ok(r)
    wait_consistent(node)
    lost = config_dir(a.container("main"))

    # A crash, a record to rebuild at start, and no space left.
    node.kill_daemon()
    shutil.rmtree(lost)
    disk.fill()
    restart_daemon(node)
    assert node.proc is not None and node.proc.poll() is None
    assert wait_until(lambda: "ENOSPC" in node.log(), 10), node.log()[-2000:]

    before = records(node)
    refused = node.submit(node.pod("c", {CORE: 10, MEM: 10}))
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.error
    assert "ENOSPC" in (refused.error or "") and str(node.state_dir) in (refused.error or "")
    assert "is full" in (refused.error or "")
    assert records(node) == before  # the refused container left no directory
    assert leftovers(node) == []
    trash = node.state_dir / "containers"
    assert wait_until(lambda: not any(trash.glob(".trash-*")), 10)  # even on a full disk
    assert not capacity_problems(node)

    # Space again: the rebuilt record is written and admissions work, unaided.
    disk.free()
    assert wait_until(lambda: (lost / "config.json").exists(), 10), node.log()[-2000:]
    assert "takes writes again" in node.log()
    assert_admitted_ok(node.submit(node.pod("d", {CORE: 10, MEM: 10})))
    wait_consistent(node)


@pytest.mark.timeout(90)
def test_read_only_disk(disk_node: tuple[SimNode, SmallDisk]) -> None:
    node, disk = disk_node
    a = node.submit(node.pod("a", {CORE: 20, MEM: 20}))
    assert_admitted_ok(a)
    wait_consistent(node)
    disk.read_only(True)
    try:
        refused = node.submit(node.pod("b", {CORE: 10, MEM: 10}))
        assert refused.code == grpc.StatusCode.FAILED_PRECONDITION, refused.error
        error = refused.error or ""
        assert "EROFS" in error and "read-only" in error and str(node.state_dir) in error
        node.delete(a.pod)  # its directory cannot go now; it goes later
        assert wait_until(lambda: "cannot move" in node.log(), 10)
    finally:
        disk.read_only(False)
    assert node.proc is not None and node.proc.poll() is None
    assert_admitted_ok(node.submit(node.pod("c", {CORE: 10, MEM: 10})))
    wait_consistent(node)
    assert leftovers(node) == []


@pytest.mark.timeout(60)
def test_out_of_file_descriptors(make_node: NodeFactory) -> None:
    node = make_node("preset:1xH200")
    assert_admitted_ok(node.submit(node.pod("a", {CORE: 20, MEM: 20})))
    assert node.proc is not None
    with open_file_limit(node.proc.pid):
        refused = node.submit(node.pod("b", {CORE: 10, MEM: 10}))
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.error
    assert "EMFILE" in (refused.error or "") and "RLIMIT_NOFILE" in (refused.error or "")
    assert node.proc.poll() is None
    assert_admitted_ok(node.submit(node.pod("c", {CORE: 10, MEM: 10})))
    wait_consistent(node)


@pytest.mark.timeout(60)
def test_hook_library_install_on_a_full_disk(make_node: NodeFactory, short_tmp: Path) -> None:
    library = short_tmp / "libvgpu.so"
    shutil.copy(ROOT / "hooks" / "build" / "libvgpu.so", library)  # built by `make -C hooks`
    hook_dir = short_tmp / "hook"
    with SmallDisk(hook_dir, size_mib=1) as disk:
        disk.fill()
        node = make_node(
            "preset:2xH200",
            daemon_args=("--hook-library", str(library), "--hook-dir", str(hook_dir)),
        )
        try:
            refused = node.submit(node.pod("a", {CORE: 10, MEM: 10}))
            assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.error
            assert "install the hook library" in (refused.error or "")
            # A whole card needs no hook: admitted meanwhile.
            assert_admitted_ok(node.submit(node.pod("whole", {CORE: 100})))
            disk.free()
            assert wait_until(lambda: any(hook_dir.glob("libvgpu-*.so")), 10)
            ok = node.submit(node.pod("b", {CORE: 10, MEM: 10}))
            assert_admitted_ok(ok)
            assert ok.container("main").envs["LD_PRELOAD"].startswith("/usr/local/vgpu/libvgpu-")
        finally:
            assert node.stop_daemon() == 0, node.log()[-3000:]
