"""The guard's rule (pure): who escaped allocation."""

from __future__ import annotations

from vgpu.core.guard import Escapee, escaped
from vgpu.core.model import ContainerSpec, Request


def spec(
    pod: str, container: str, core: int = 30, mem: int = 0, init: bool = False
) -> ContainerSpec:
    return ContainerSpec(f"uid-{pod}", "ns", pod, container, Request(core, mem), 0.0, init=init)


def test_only_running_app_containers_that_ask_and_hold_nothing() -> None:
    running = [
        spec("a", "main"),  # holds devices
        spec("b", "main", core=0, mem=16),  # holds none: escaped
        spec("b", "side", core=0, mem=0),  # asks nothing
        spec("c", "init", init=True),  # an init container: finished, not judged
    ]
    got = escaped(running, {("ns", "a", "main")})
    assert got == [Escapee("ns", "b", "main", "uid-b", 0, 16)]
    assert "vendor.io/vcuda-memory=16" in got[0].message("vendor.io")
    assert "vcuda-core" not in got[0].message("vendor.io")
    assert escaped(running, {("ns", "a", "main"), ("ns", "b", "main")}) == []
