"""Issue 13, item 1: no tree a tenant writes can stop the daemon's cleanup.

Removal is iterative (no recursion limit), never follows a link, is bounded
in time per pass, and runs in the background, at start-up too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.adversarial.helpers import config_dir, writable_mounts
from tests.conftest import NodeFactory
from tests.integration.conftest_placement import CORE, MEM, assert_admitted_ok, restart_daemon
from vgpu.adapters.fs import remove_tree
from vgpu.sim.harness import wait_until


def nest(top: Path, depth: int, every: int = 100, outside: Path | None = None) -> None:
    """A chain of `depth` directories with files, FIFOs and links to `outside`."""
    top.mkdir(parents=True, exist_ok=True)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(depth):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
            if level % every == 0:
                os.mkfifo("fifo", dir_fd=fd)
                with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as fh:
                    fh.write("x")
                if outside is not None:
                    os.symlink(outside, "to-host-dir", dir_fd=fd)
                    os.symlink(outside / "keep", "to-host-file", dir_fd=fd)
    finally:
        os.close(fd)


def host_dir(base: Path) -> Path:
    """A host directory a hostile tree points into; it must survive untouched."""
    outside = base / "host"
    outside.mkdir()
    (outside / "keep").write_text("host file")
    return outside


def test_remove_tree_deeper_than_the_recursion_limit_never_follows_links(
    short_tmp: Path,
) -> None:
    outside = host_dir(short_tmp)
    tree = short_tmp / "tree"
    nest(tree / "shared", sys.getrecursionlimit() * 3, outside=outside)
    for i in range(500):
        (tree / f"wide{i}").mkdir()
    os.link(outside / "keep", tree / "hardlink")
    result = remove_tree(tree, time.monotonic() + 0.01)  # a pass bounded in time
    passes = 1
    while not result.done:
        result = remove_tree(tree, time.monotonic() + 0.5)
        passes += 1
        assert passes < 100, result
    assert not tree.exists()
    assert (outside / "keep").read_text() == "host file"
    assert result.stuck == 0


def test_remove_tree_of_a_link_removes_only_the_link(short_tmp: Path) -> None:
    outside = host_dir(short_tmp)
    link = short_tmp / "link"
    link.symlink_to(outside, target_is_directory=True)
    assert remove_tree(link).done
    assert not link.is_symlink() and (outside / "keep").exists()


def test_remove_tree_reports_what_it_cannot_remove(short_tmp: Path) -> None:
    # Like the daemon in its DaemonSet (root, every capability dropped) facing
    # a tenant's directories owned by the tenant's UID: reported as stuck,
    # never an exception.
    if shutil.which("setpriv") is None:
        pytest.fail("setpriv (util-linux) is needed to drop capabilities")
    tree = short_tmp / "tree"
    nest(tree / "locked", 5)
    for path in [tree / "locked", *(tree / "locked").rglob("*")]:
        os.chown(path, 65534, 65534, follow_symlinks=False)
    script = (
        "import sys; from pathlib import Path; from vgpu.adapters.fs import remove_tree; "
        "r = remove_tree(Path(sys.argv[1])); print(r.done, r.stuck, r.error)"
    )
    drop = "--bounding-set=-dac_override,-dac_read_search,-fowner"
    out = subprocess.run(
        ["setpriv", drop, "--", sys.executable, "-c", script, str(tree)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    done, stuck, error = out.stdout.split(" ", 2)
    assert done == "False" and int(stuck) >= 1 and "Permission denied" in error
    assert (tree / "locked").exists()


@pytest.mark.timeout(60)
def test_deep_tenant_tree_never_stops_the_daemon(make_node: NodeFactory, short_tmp: Path) -> None:
    outside = host_dir(short_tmp)
    node = make_node("preset:1xH200")
    result = node.submit(node.pod("deep", {CORE: 10, MEM: 10}))
    assert_admitted_ok(result)
    c = result.container("main")
    dirs = [p for p in writable_mounts(c) if p.is_dir()]
    # Through its writable mount; an old version's record keeps shared/ too.
    target = dirs[0] if dirs else config_dir(c) / "shared"
    nest(target / "t", 1500, outside=outside)
    record = config_dir(c)

    node.delete(result.pod)
    # The next admission frees the IDs; reconcile removes the record.
    assert_admitted_ok(node.submit(node.pod("next", {CORE: 10, MEM: 10})))
    trash = record.parent
    assert wait_until(
        lambda: not (target / "t").exists() and not any(trash.glob(".trash-*")), 30
    ), node.log()[-2000:]
    assert node.proc is not None and node.proc.poll() is None
    assert (outside / "keep").read_text() == "host file"

    # Left over by a crash: a deeper tree and many files in the trash.
    node.kill_daemon()
    leftover = trash / ".trash-pdead-00000000"
    nest(leftover, 4000, every=50, outside=outside)
    wide = leftover / "wide"
    wide.mkdir()
    for i in range(20_000):
        (wide / str(i)).touch()
    restart_daemon(node)  # serves at once: the trash goes in the background
    assert wait_until(lambda: not leftover.exists(), 40), node.log()[-2000:]
    assert (outside / "keep").read_text() == "host file"
    log = node.log()
    assert "Traceback" not in log and "RecursionError" not in log
    assert_admitted_ok(node.submit(node.pod("after", {CORE: 10, MEM: 10})))
