"""Shared fixtures: short temp dirs, mock GPU files and a started SimNode.

Unix socket paths are limited to 107 bytes, so every directory lives directly
under /tmp with a short prefix rather than under pytest's deep tmp_path.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import pytest
import yaml

from vgpu.sim.harness import SimNode

H200_MIB = 143771
SOCKETS = ("vgpu-vcuda-core.sock", "vgpu-vcuda-memory.sock")


def card(
    i: int,
    *,
    memory_mib: int = H200_MIB,
    numa_node: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One mock card as the mock file describes it (stable uuid from the index)."""
    out: dict[str, Any] = {
        "uuid": f"GPU-test{i:04d}-0000-4000-8000-{i:012d}",
        "name": "NVIDIA H200",
        "memory_mib": memory_mib,
        "numa_node": numa_node if numa_node is not None else i,
    }
    out.update(extra)
    return out


def cards(n: int = 2, **extra: Any) -> list[dict[str, Any]]:
    return [card(i, **extra) for i in range(n)]


class MockGpusFile(Protocol):
    def __call__(
        self,
        gpus: Sequence[Mapping[str, Any]] | Mapping[str, Any] | str,
        fmt: str = "json",
        name: str = "gpus",
    ) -> Path: ...


@pytest.fixture(scope="session")
def hook_binaries() -> None:
    """Builds hooks/ with the stand-in driver, NVML and probe programs, once per run.

    Requested by tests/hooks/ and tests/adversarial/ through their conftest.py,
    so that a fresh clone builds the binaries whichever test runs first.
    """
    for tool in ("gcc", "make", "objdump"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is required to build and test hooks/ (apt-get install it)")
    hooks = Path(__file__).resolve().parents[1] / "hooks"
    # Each pytest-xdist worker asks once; a lock keeps two builds out of one tree.
    with open(hooks / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        run = subprocess.run(
            ["make", "-C", str(hooks), "test-bins"], capture_output=True, text=True, timeout=300
        )
    if run.returncode != 0:
        pytest.fail(f"make -C hooks test-bins failed:\n{run.stdout}\n{run.stderr}")


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="vt", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def mock_gpus_file(short_tmp: Path) -> MockGpusFile:
    """Write (or atomically rewrite) a mock GPU file; returns its path.

    `gpus` is a card list (wrapped as {"gpus": [...]}), a whole document, or raw
    text written as is (for corrupt files). The rename makes a reader never see
    a half-written file, and changes the inode so the watcher notices.
    """

    def write(
        gpus: Sequence[Mapping[str, Any]] | Mapping[str, Any] | str,
        fmt: str = "json",
        name: str = "gpus",
    ) -> Path:
        path = short_tmp / f"{name}.{fmt}"
        if isinstance(gpus, str):
            text = gpus
        else:
            doc = gpus if isinstance(gpus, Mapping) else {"gpus": list(gpus)}
            text = json.dumps(doc) if fmt == "json" else yaml.safe_dump(dict(doc))
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        return path

    return write


class NodeFactory(Protocol):
    def __call__(
        self,
        gpus: str | Path = "preset:2xH200",
        *,
        start: bool = True,
        api: bool = False,
        daemon_args: Sequence[str] = (),
        domain: str = "vendor.io",
        env: Mapping[str, str] | None = None,
        seed: int | None = 0,
    ) -> SimNode: ...


@pytest.fixture
def make_node(short_tmp: Path) -> Iterator[NodeFactory]:
    """Build SimNodes in a short dir; at teardown each daemon must exit 0 on SIGTERM."""
    nodes: list[SimNode] = []

    def factory(
        gpus: str | Path = "preset:2xH200",
        *,
        start: bool = True,
        api: bool = False,
        daemon_args: Sequence[str] = (),
        domain: str = "vendor.io",
        env: Mapping[str, str] | None = None,
        seed: int | None = 0,
    ) -> SimNode:
        root = short_tmp / f"n{len(nodes)}"
        root.mkdir()
        node = SimNode(
            root, gpus=gpus, api=api, daemon_args=daemon_args, domain=domain, env=env, seed=seed
        )
        nodes.append(node)
        if start:
            node.start(timeout_s=15.0)
        return node

    yield factory
    problems = []
    for node in nodes:
        proc = node.proc
        alive = proc is not None and proc.poll() is None
        rc = node.stop_daemon(signal.SIGTERM, timeout_s=5.0) if alive else None
        node.close()
        if alive and rc != 0:
            problems.append(f"daemon exited {rc} on SIGTERM; log:\n{node.log()[-3000:]}")
        if "Traceback" in node.log():
            problems.append(f"traceback in the daemon log:\n{node.log()[-4000:]}")
    assert not problems, "\n".join(problems)


@pytest.fixture
def node(make_node: NodeFactory) -> SimNode:
    """A started SimNode: 2 mock H200, the kubelet simulator, no API server."""
    return make_node()
