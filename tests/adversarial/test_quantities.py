"""Issue 13, item 7: quantities are parsed as Kubernetes writes them.

The API server writes 1000 as "1k"; users may write "1Ki" or "1e3". These
parsed as 0 and valid requests were refused. A non-integer is refused with a
message naming the container and the resource, at the admission.
"""

from __future__ import annotations

import grpc
import pytest

from tests.conftest import NodeFactory
from tests.integration.conftest_placement import CORE, MEM, assert_admitted_ok
from vgpu.adapters.kube import container_specs, parse_units
from vgpu.sim.apiserver import make_pod
from vgpu.sim.harness import SimNode
from vgpu.sim.kubelet import Admission

CASES = [
    ("1k", 1000, False),
    ("1Ki", 1024, False),
    ("1e3", 1000, False),
    ("2000m", 2, False),
    ("40", 40, False),
    (7, 7, False),
    ("1500m", 2, True),  # the kubelet would ask 2 (it rounds up): refused
    ("1.5", 2, True),
    ("-1", 0, True),
    ("lots", 0, True),
]


@pytest.mark.parametrize(("raw", "units", "bad"), CASES, ids=[str(c[0]) for c in CASES])
def test_parse_units(raw: object, units: int, bad: bool) -> None:
    got, problem = parse_units(raw)
    assert got == units
    assert bool(problem) is bad, problem


def test_problem_names_the_container_and_resource() -> None:
    pod = make_pod(
        "p",
        node="n",
        namespace="team",
        containers=[{"name": "main", "resources": {"limits": {CORE: "10", MEM: "1500m"}}}],
    )
    (spec,) = container_specs(pod, "vendor.io")
    assert spec.request.core_percent == 10 and spec.request.memory_units == 2
    assert "team/p/main" in spec.problem and f"{MEM}='1500m'" in spec.problem
    assert "whole number" in spec.problem


def submit_as_written(
    node: SimNode, name: str, limits: dict[str, str], counts: dict[str, int]
) -> Admission:
    """The API server holds the quantities as written; the kubelet asks integers."""
    assert node.api is not None
    node.api.add_pod(
        make_pod(
            name, node=node.node, containers=[{"name": "main", "resources": {"limits": limits}}]
        )
    )
    return node.admit(node.pod(name, counts))


@pytest.mark.timeout(60)
def test_canonical_quantities_are_admitted_and_non_integers_refused(
    make_node: NodeFactory,
) -> None:
    node = make_node("preset:1xH200", api=True, daemon_args=("--memory-unit-mib", "64"))
    a = submit_as_written(node, "a", {CORE: "20", MEM: "1k"}, {CORE: 20, MEM: 1000})
    assert_admitted_ok(a)
    assert a.container("main").envs["VGPU_MEMORY_LIMIT_MIB"] == str(1000 * 64)
    b = submit_as_written(node, "b", {CORE: "2e1", MEM: "1Ki"}, {CORE: 20, MEM: 1024})
    assert_admitted_ok(b)
    assert b.container("main").envs["VGPU_MEMORY_LIMIT_MIB"] == str(1024 * 64)
    assert b.container("main").envs["VGPU_CORE_LIMIT"] == "20"
    c = submit_as_written(node, "c", {CORE: "10", MEM: "1500m"}, {CORE: 10, MEM: 2})
    assert c.code == grpc.StatusCode.INVALID_ARGUMENT, c.error
    assert "default/c/main" in (c.error or "") and f"{MEM}='1500m'" in (c.error or "")
