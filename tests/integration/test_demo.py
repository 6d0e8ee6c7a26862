"""`vgpu demo` and `vgpu demo --cluster` run end to end in a subprocess."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _demo(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vgpu", "demo", *flags],
        capture_output=True,
        text=True,
        timeout=100,
    )


@pytest.mark.timeout(120)
def test_cluster_demo_steers_what_node_totals_would_fail() -> None:
    proc = _demo("--cluster")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "by-totals: Failed (UnexpectedAdmissionError)" in out
    assert "no card on this node can hold vendor.io/vcuda-core=50" in out
    assert "steered: Running on node-c" in out
    assert '"node":"node-c"' in out  # the assignment written at bind
    assert "nowhere: Pending, PodScheduled=False:" in out
    assert "0/3 nodes are available: " in out and "vgpu: no card fits" in out
    assert "default/steered/main" in out  # the `vgpu status --cluster` table
    assert "extender exit code 0, node daemons [0, 0, 0]" in out


@pytest.mark.timeout(120)
def test_demo_without_flags_is_the_one_node_demo() -> None:
    proc = _demo()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "admitted trainer" in proc.stdout and "REFUSED  too-big" in proc.stdout
    assert "--cluster" not in proc.stdout and "extender" not in proc.stdout
