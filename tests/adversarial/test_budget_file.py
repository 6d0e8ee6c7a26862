"""A container's budget file is ground the tenant can write: nothing planted or
grown there may hang, mislead or crash the host side, or fill the node's disk,
and a full disk never kills a hook process (issue 12 item 8, issue 13 items 3/6)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hooks.test_hooks import PROBE, base_env, release, start_probe
from vgpu.adapters import budget
from vgpu.sim.harness import SimNode, wait_until

MIB = 1024 * 1024


def _status(node: SimNode) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "vgpu", "status", "-o", "json", "--state-dir", str(node.state_dir)],
        capture_output=True,
        text=True,
        timeout=20,
    )
    return result, time.monotonic() - started


@pytest.fixture(scope="module")
def node() -> Iterator[SimNode]:
    sim = SimNode(daemon_args=["--log-level", "debug"])
    sim.start()
    try:
        yield sim
    finally:
        sim.close()


def _budget_files(node: SimNode, count: int) -> dict[str, Path]:
    """Admit `count` sliced pods; their budget files by pod name."""
    files = {}
    for i in range(count):
        name = f"t{i}-{time.monotonic_ns()}"
        admitted = node.submit(node.pod(name, {node.core: 10, node.memory: 4}))
        assert admitted.ok, admitted.error
        mount = {m.container_path: m for m in admitted.containers[0].mounts}
        files[name] = Path(mount["/var/run/vgpu/vgpu.shm"].host_path)
    return files


@pytest.mark.timeout(90)
def test_planted_files_are_usage_unknown_for_that_container_only(
    node: SimNode, tmp_path: Path
) -> None:
    files = list(_budget_files(node, 6).values())
    good, fifo, link, huge, short, garbage = files
    for path in files:
        assert path.is_file() and path.stat().st_size == budget.FILE_BYTES  # made before start
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    holder, _ = start_probe(
        "alloc", "mem", 600, VGPU_MEMORY_LIMIT_MIB=1024, VGPU_SHARED_DIR=good.parent
    )
    other, _ = start_probe(
        "alloc", "mem", 300, VGPU_MEMORY_LIMIT_MIB=1024, VGPU_SHARED_DIR=elsewhere
    )
    try:
        fifo.unlink()
        os.mkfifo(fifo)  # a reader that followed it would block forever
        link.unlink()
        link.symlink_to(elsewhere / "vgpu.shm")  # a valid budget file, elsewhere on the host
        with huge.open("r+b") as fh:
            fh.truncate(10 * 1024 * MIB)
        short.write_bytes(b"\0" * 100)
        garbage.write_bytes(os.urandom(budget.FILE_BYTES))
        result, took_s = _status(node)
        assert result.returncode == 0, result.stderr
        assert took_s < 15
        used = {
            c["config_path"]: c["memory_used_mib"] for c in json.loads(result.stdout)["containers"]
        }
        by_file = {p: used[str(p.parent.parent / "config.json")] for p in files}
        assert by_file[good] == 600
        assert all(by_file[p] is None for p in (fifo, link, garbage)), by_file
        # The daemon's budget watch (every second) may already have cut the
        # grown file back, or filled the short one up, to its size: with no
        # live process in it, it then reads as 0.
        for resized in (huge, short):
            assert by_file[resized] is None or (
                by_file[resized] == 0 and resized.stat().st_size == budget.FILE_BYTES
            ), by_file
        assert budget.usage_mib(elsewhere / "vgpu.shm") == 300  # the link's target is fine itself
    finally:
        release(holder)
        release(other)


@pytest.mark.timeout(90)
def test_a_grown_budget_file_is_cut_back_and_logged(node: SimNode) -> None:
    (path,) = _budget_files(node, 1).values()
    holder, _ = start_probe(
        "alloc", "mem", 100, VGPU_MEMORY_LIMIT_MIB=1024, VGPU_SHARED_DIR=path.parent
    )
    try:
        with path.open("r+b") as fh:
            fh.seek(50 * MIB)
            fh.write(b"x" * MIB)  # really allocated: the tenant filling the disk
        assert wait_until(lambda: path.stat().st_size == budget.FILE_BYTES, timeout_s=10)
        assert "budget file" in node.log() and "cut back" in node.log()
        assert budget.usage_mib(path) == 100  # the live contents survive the cut
    finally:
        release(holder)


@pytest.mark.timeout(90)
def test_allocate_replaces_something_planted_in_an_old_shared_directory(node: SimNode) -> None:
    """Before this version the whole directory was tenant-writable (mode 1777)."""
    (path,) = _budget_files(node, 1).values()
    name = path.parent.parent.name
    path.unlink()
    path.symlink_to("/etc/hostname")
    store_write = subprocess.run(
        [sys.executable, "-c",
         "import sys; from pathlib import Path; from vgpu.adapters import budget; "
         "print(budget.ensure(Path(sys.argv[1])))", str(path)],
        capture_output=True, text=True, timeout=20,
    )  # fmt: skip
    assert store_write.returncode == 0, store_write.stderr
    # The daemon's own rewrite of the record (its owner learned from the pod
    # cache) may have replaced it first: either way it is replaced, and said.
    assert "replaced" in store_write.stdout or (
        f"budget file of {name}: replaced a non-regular file" in node.log()
    )
    assert not path.is_symlink() and path.stat().st_size == budget.FILE_BYTES
    assert Path("/etc/hostname").stat().st_size != budget.FILE_BYTES


# ---- a full disk ----


@pytest.fixture
def small_fs() -> Iterator[Path]:
    """A 2 MiB tmpfs to fill up (root only)."""
    mount = Path(tempfile.mkdtemp(prefix="vgpu-full-", dir="/tmp"))
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
        capture_output=True, text=True, timeout=20,
    )  # fmt: skip
    if result.returncode != 0:
        shutil.rmtree(mount, ignore_errors=True)
        pytest.skip(f"cannot mount a small tmpfs to fill here: {result.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, timeout=20)
        shutil.rmtree(mount, ignore_errors=True)


def _fill(directory: Path) -> None:
    with (directory / "filler").open("wb") as fh:
        try:
            while True:
                fh.write(b"\xff" * 65536)
                fh.flush()
        except OSError:
            pass


@pytest.mark.timeout(60)
def test_full_disk_never_kills_a_hook_process(small_fs: Path) -> None:
    ready = small_fs / "ready"
    sparse = small_fs / "sparse"
    ready.mkdir()
    sparse.mkdir()
    budget.ensure(ready / "vgpu.shm")  # what the daemon does before the container starts
    with (sparse / "vgpu.shm").open("wb") as fh:
        fh.truncate(budget.FILE_BYTES)  # the right size, but no blocks behind it
    _fill(small_fs)
    ops = ("alloc", "mem", 100, "alloc", "mem", 100, "free", 0, "info", "forkchild", 10)
    env = base_env()
    env["VGPU_MEMORY_LIMIT_MIB"] = "1024"
    for shared, fallback in ((ready, False), (sparse, True)):
        env["VGPU_SHARED_DIR"] = str(shared)
        run = subprocess.run(
            [str(PROBE), *map(str, ops)], env=env, capture_output=True, text=True, timeout=30
        )
        died = signal.Signals(-run.returncode).name if run.returncode < 0 else run.returncode
        assert run.returncode == 0, f"{shared.name}: {died} {run.stderr}"
        lines = [json.loads(line) for line in run.stdout.splitlines()]
        assert [line["rc"] for line in lines if line["op"] == "alloc"] == [0, 0]
        assert ("unusable" in run.stderr) == fallback, run.stderr
        if not fallback:
            assert lines[3]["free"] == 924 * MIB  # the shared budget works on a full disk
