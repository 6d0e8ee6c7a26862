"""Issue 19's fast path through the real daemon: the first admission after a
start finds its pod in the cache, a container's second answer carries nothing
the first did not, and the kubelet's checkpoint stays small."""

from __future__ import annotations

import pytest

from tests.integration.conftest_placement import (
    CORE,
    MEM,
    NodeMaker,
    assert_admitted_ok,
    pl_tmp,
    sim_node,
)
from vgpu.core.slicing import MAX_DEVICE_ID_LEN
from vgpu.sim import checkpoint

__all__ = ["pl_tmp", "sim_node"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("order", [[CORE, MEM], [MEM, CORE]], ids=["core-first", "memory-first"])
def test_first_admission_uses_the_pod_cache_and_answers_once(
    sim_node: NodeMaker, order: list[str]
) -> None:
    node = sim_node()
    # The very first admission after start: its pod is already in the cache
    # (the daemon registers only once the cache synced), so it is placed by the
    # pod's spec, not by the fallback rule after a wait.
    result = node.submit(node.pod("first", {CORE: 30, MEM: 40}), order)
    assert_admitted_ok(result)
    log = node.log()
    assert "fallback rule" not in log and "not synced" not in log, log[-2000:]
    c = result.containers[0]
    first, second = c.responses[order[0]], c.responses[order[1]]
    # The first answer carries the whole contract; the second adds nothing.
    assert first.envs["VGPU_CORE_LIMIT"] == "30"
    assert first.envs["VGPU_MEMORY_LIMIT_MIB"] == str(40 * 256)
    # (A preset card names no device node: see tests/integration/test_device_lists.py.)
    assert len(first.mounts) >= 2
    assert second.ByteSize() == 0, second
    assert c.envs == dict(first.envs) and not c.clashes

    # A second pod, and the checkpoint the kubelet wrote after it: short IDs,
    # one full answer per container.
    assert_admitted_ok(node.submit(node.pod("second", {CORE: 20, MEM: 10}), order))
    entries, registered = checkpoint.decode(node.kubelet.checkpoint_path.read_bytes())
    assert {e.pod_uid for e in entries} >= {result.pod.uid}
    assert all(len(d) <= MAX_DEVICE_ID_LEN for ids in registered.values() for d in ids)
    full = [e for e in entries if e.alloc_resp]
    assert len(full) == len({(e.pod_uid, e.container) for e in entries})


@pytest.mark.timeout(90)
def test_a_container_asking_one_resource_gets_the_full_answer(sim_node: NodeMaker) -> None:
    node = sim_node()
    result = node.submit(node.pod("mem-only", {MEM: 16}))
    assert_admitted_ok(result)
    answer = result.containers[0].responses[MEM]
    assert answer.envs["VGPU_MEMORY_LIMIT_MIB"] == str(16 * 256) and answer.mounts
