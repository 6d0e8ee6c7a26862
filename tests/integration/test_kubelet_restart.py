"""Issue 28: a kubelet restart never releases a live slice, never leaves a
running container without its files, and never hands one pod's limits to
another. The kubelet simulator restarts as a real kubelet 1.36 does: its
pod-resources API answers at once, with an empty and then a partial List,
and kubelet.sock is re-created a moment later."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.adversarial.helpers import config
from tests.integration.conftest_placement import (
    CORE,
    MEM,
    NodeMaker,
    allocate,
    assert_admitted_ok,
    pl_tmp,
    plugin_stub,
    restart_kubelet,
    sim_node,
    status,
    wait_consistent,
    wait_until,
)
from vgpu.core.model import Resource
from vgpu.pb import deviceplugin_v1beta1_pb2 as pb
from vgpu.sim.harness import SimNode
from vgpu.sim.kubelet import Admission

__all__ = ["pl_tmp", "sim_node"]

UNIT_MIB = 256
FAST = ["--reconcile-interval-s", "1"]  # periodic checks inside the restart's window


def files_of(node: SimNode) -> dict[str, tuple[Path, Path]]:
    """key -> (config file, budget file) of every placement the daemon shows."""
    return {
        c["key"]: (
            Path(c["config_path"]),
            Path(c["config_path"]).parent / "shared" / "vgpu.shm",
        )
        for c in status(node)["containers"]
    }


def file_problems(files: dict[str, tuple[Path, Path]]) -> list[str]:
    problems = []
    for key, (config_file, budget) in files.items():
        if not config_file.is_file():
            problems.append(f"{key}: config {config_file} is not a file")
        if not budget.is_file():
            problems.append(f"{key}: budget {budget} is not a file")
    return problems


def status_problems(node: SimNode) -> list[str]:
    """`vgpu status` is consistent: one record per container, and each card's
    allocation totals equal the sums over the containers on it."""
    doc = status(node)
    problems = []
    owners: dict[tuple[str, str, str], str] = {}
    for c in doc["containers"]:
        who = (c.get("namespace"), c.get("pod"), c.get("container"))
        if None in who:
            continue
        if who in owners:
            problems.append(f"{'/'.join(map(str, who))} listed twice: {owners[who]}, {c['key']}")
        owners[who] = c["key"]  # type: ignore[index]
    for card in doc["cards"]:
        on_card = [c for c in doc["containers"] if card["uuid"] in c["cards"]]
        core = sum(len(c["device_ids"].get("vcuda-core", [])) for c in on_card)
        memory = sum(len(c["device_ids"].get("vcuda-memory", [])) for c in on_card) * UNIT_MIB
        if core != card["core_allocated"]:
            problems.append(f"card {card['index']}: containers' core {core} != {card}")
        if memory != card["memory_allocated_mib"]:
            problems.append(f"card {card['index']}: containers' memory {memory} != {card}")
    return problems


def own_limits_problems(result: Admission, asked: dict[str, int]) -> list[str]:
    """The container's merged answer and its config say exactly what its pod asked."""
    c = result.container("main")
    problems = []
    core, memory = asked.get(CORE, 0), asked.get(MEM, 0)
    want_env = {
        "VGPU_CORE_LIMIT": str(core) if 0 < core < 100 else None,
        "VGPU_MEMORY_LIMIT_MIB": str(memory * UNIT_MIB) if memory and core < 100 else None,
    }
    for name, want in want_env.items():
        if c.envs.get(name) != want:
            problems.append(f"{result.pod.name}: {name}={c.envs.get(name)} but it asked {want}")
    record = config(c)
    got = {r.split("/")[1]: len(ids) for r, ids in c.device_ids.items()}
    if {k: len(v) for k, v in record["device_ids"].items() if v} != got:
        problems.append(f"{result.pod.name}: its config holds {record['device_ids']}, not {got}")
    return problems


@pytest.mark.timeout(90)
@pytest.mark.parametrize("api", [True, False], ids=["api-server", "no-api-server"])
def test_an_empty_then_partial_list_after_a_kubelet_restart_releases_nothing(
    sim_node: NodeMaker, api: bool
) -> None:
    """Periodic checks every second run while the new kubelet lists nothing,
    then half of the pods; the old daemon released the unlisted placements."""
    node = sim_node(api=api, daemon_args=FAST)
    asked = [{CORE: 10 + i, MEM: 8 + i} for i in range(4)] + [{MEM: 12}]
    results = [node.submit(node.pod(f"r{i}", a)) for i, a in enumerate(asked)]
    for r in results:
        assert_admitted_ok(r)
    wait_consistent(node)
    files = files_of(node)
    assert len(files) == len(asked)

    restart_kubelet(node, podres_blank_s=1.5, podres_partial_s=1.5, register_delay_s=0.3)
    # Through the blank and partial windows, and the second sightings after them.
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        assert files_of(node) == files, node.log()[-3000:]
        assert not file_problems(files)
        time.sleep(0.1)
    log = node.log()
    assert "vgpu: released " not in log, log[-3000:]
    assert "kubelet restart noticed" in log
    assert "releases held" in log
    for result, a in zip(results, asked, strict=True):
        assert not own_limits_problems(result, a)
    assert not status_problems(node)
    wait_consistent(node)


@pytest.mark.timeout(90)
def test_a_burst_across_a_kubelet_restart_keeps_every_pod_its_own(sim_node: NodeMaker) -> None:
    """A burst of 12 slice pods, Pending until 2 s after admission as on a real
    node, with the kubelet restarting after the first six were admitted and
    listed: every pod has its own limits, config and budget file; status is
    consistent; the deleted pods' records are gone within a reconcile period.
    Pods i and i+6 ask the same core and different memory, so a pod matched
    to its neighbour would show it."""
    node = sim_node(api=True, daemon_args=FAST)
    node.auto_admit(running_after_s=2.0)
    asked = {f"slice-{i:02d}": {CORE: 10 + 2 * (i % 6), MEM: 8 + i % 9} for i in range(12)}
    pods = {name: node.pod(name, a) for name, a in asked.items()}
    names = list(pods)
    for name in names[:6]:
        node.create(pods[name])
    assert node.wait(lambda: len(node.admissions) == 6, 10), node.log()[-3000:]
    time.sleep(0.8)  # the first six are listed by the kubelet (learn owners)
    for name in names[6:]:
        node.create(pods[name])
    restart_kubelet(node, podres_blank_s=1.0, podres_partial_s=1.0, register_delay_s=0.2)
    assert node.wait(lambda: len(node.admissions) == len(pods), 30), node.log()[-3000:]
    by_name = {a.pod.name: a for a in node.admissions.values()}
    for name, a in asked.items():
        assert_admitted_ok(by_name[name])
        assert not own_limits_problems(by_name[name], a)
    time.sleep(3.5)  # past the restart's windows and any second sighting
    assert "vgpu: released " not in node.log(), node.log()[-3000:]
    files = files_of(node)
    assert len(files) == len(pods)
    assert not file_problems(files)
    assert not status_problems(node)
    wait_consistent(node)

    for pod in pods.values():
        node.delete(pod)
    started = time.monotonic()
    assert wait_until(lambda: not status(node)["containers"], 10.0), status(node)
    took = time.monotonic() - started
    assert took < 1.0 + 2.0 + 1.0, took  # one reconcile period, the grace, slack


def _release_lines(node: SimNode) -> list[str]:
    return [line for line in node.log().splitlines() if "vgpu: released " in line]


@pytest.mark.timeout(60)
def test_a_release_needs_two_sightings_and_the_api_servers_word(sim_node: NodeMaker) -> None:
    """The kubelet stops listing a pod the API server still shows running
    (its record is lost, say): the placement stays. Once the API server agrees,
    it goes after two sightings at least the grace apart."""
    node = sim_node(api=True, daemon_args=FAST)
    pod = node.pod("kept", {CORE: 20, MEM: 10})
    assert_admitted_ok(node.submit(pod))
    wait_consistent(node)
    node.kubelet.remove_pod(pod.uid)  # the kubelet forgets it; the API server does not
    time.sleep(3.5)
    assert len(status(node)["containers"]) == 1, node.log()[-3000:]
    assert not _release_lines(node)
    assert node.api is not None
    node.api.set_pod_phase(pod.namespace, pod.name, "Succeeded")
    started = time.monotonic()
    assert wait_until(lambda: not status(node)["containers"], 10.0)
    took = time.monotonic() - started
    assert 2.0 <= took < 4.5, took  # two sightings, the grace apart
    assert len(_release_lines(node)) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("order", [[CORE, MEM], [MEM, CORE]], ids=["core-first", "memory-first"])
def test_a_pod_admitted_out_of_order_never_gets_its_neighbours_limits(
    sim_node: NodeMaker, order: list[str]
) -> None:
    """Two pending pods ask the same of one resource and differ in the other;
    the kubelet admits the newer first (as after a restart, when it re-sorts
    what it has). Each still runs with exactly its own limits and config."""
    node = sim_node(api=True)
    older = node.pod("older", {CORE: 20, MEM: 12})
    newer = node.pod("newer", {CORE: 20, MEM: 8} if order[0] == CORE else {CORE: 30, MEM: 12})
    node.create(older)
    node.create(newer)
    time.sleep(0.3)  # both in the daemon's pod cache
    first = node.admit(newer, order)
    assert_admitted_ok(first)
    assert not own_limits_problems(first, newer.containers[0].requests)
    second = node.admit(older, order)
    assert_admitted_ok(second)
    assert not own_limits_problems(second, older.containers[0].requests)
    wait_consistent(node)
    assert not status_problems(node)
    owners = {c["pod"]: c for c in status(node)["containers"]}
    assert set(owners) == {"older", "newer"}, owners


@pytest.mark.timeout(60)
def test_fallback_placements_go_with_their_pods_after_a_restart(sim_node: NodeMaker) -> None:
    """No API server: every placement is made by the fallback rule, with no
    owner. After a kubelet restart, they stay while their pods run and go
    within a reconcile period and the grace once the pods are deleted."""
    node = sim_node(api=False, daemon_args=FAST)
    pods = [node.pod(f"f{i}", {CORE: 15, MEM: 10 + i}) for i in range(3)]
    for pod in pods:
        assert_admitted_ok(node.submit(pod))
    wait_consistent(node)
    restart_kubelet(node, podres_blank_s=1.0, podres_partial_s=1.0, register_delay_s=0.2)
    assert node.wait(lambda: "releases resume" in node.log(), 15), node.log()[-3000:]
    assert len(status(node)["containers"]) == 3
    assert "vgpu: released " not in node.log()
    for pod in pods:
        node.delete(pod)
    started = time.monotonic()
    assert wait_until(lambda: not status(node)["containers"], 10.0), node.log()[-3000:]
    took = time.monotonic() - started
    assert took < 1.0 + 2.0 + 1.0, took  # one reconcile period, the grace, slack


@pytest.mark.timeout(60)
def test_pods_deleted_one_after_another_go_two_seconds_after_each(sim_node: NodeMaker) -> None:
    """With the default 10 s reconcile period, each deleted pod's record goes
    about the grace (2 s) after the kubelet stops listing it: the follow-up
    look schedules the next one for sightings made while it waited."""
    node = sim_node(api=True, daemon_args=["--reconcile-interval-s", "10"])
    pods = [node.pod(f"s{i}", {CORE: 10, MEM: 10}) for i in range(3)]
    for pod in pods:
        assert_admitted_ok(node.submit(pod))
    wait_consistent(node)
    for pod in pods:
        node.delete(pod)
        time.sleep(0.7)
    started = time.monotonic()
    assert wait_until(lambda: not status(node)["containers"], 10.0), node.log()[-3000:]
    assert time.monotonic() - started < 3.0, node.log()[-2000:]


@pytest.mark.timeout(60)
def test_a_pod_half_admitted_before_a_restart_is_admitted_anew_without_waiting(
    sim_node: NodeMaker,
) -> None:
    """The old kubelet allocated the pod's core and stopped before its memory;
    the new one admits the pod anew and offers those core IDs as free. The
    half placement is released on that offer, and the pod is matched by its
    own request at once (not after 2 s per resource by the fallback rule)."""
    node = sim_node(api=True)
    pod = node.pod("half", {CORE: 20, MEM: 10})
    node.create(pod)
    time.sleep(0.3)
    available = list(node.kubelet.devices(CORE))
    channel, stub = plugin_stub(node, Resource.CORE)
    with channel:
        reply = stub.GetPreferredAllocation(
            pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(
                        available_deviceIDs=available, allocation_size=20
                    )
                ]
            ),
            timeout=10,
        )
    allocate(node, Resource.CORE, list(reply.container_responses[0].deviceIDs))
    restart_kubelet(node)
    started = time.monotonic()
    result = node.admit(pod, [CORE, MEM])
    took = time.monotonic() - started
    assert_admitted_ok(result)
    assert not own_limits_problems(result, pod.containers[0].requests)
    assert took < 1.5, (took, node.log()[-2000:])
    assert "fallback rule" not in node.log()
    wait_consistent(node)
    assert not status_problems(node)


@pytest.mark.timeout(60)
def test_a_pod_deleted_a_moment_ago_never_causes_a_wrongful_refusal(
    sim_node: NodeMaker,
) -> None:
    """The one card is held whole; its pod is deleted and, at once, a memory
    slice asks for the card. The kubelet offers only memory IDs, so the whole
    placement still counts until its second sighting: vgpu waits for that
    sighting (at most the 2 s grace) rather than refuse."""
    node = sim_node("preset:1xH200", api=True, daemon_args=["--reconcile-interval-s", "3600"])
    whole = node.pod("whole", {CORE: 100})
    assert_admitted_ok(node.submit(whole))
    wait_consistent(node)
    node.delete(whole)
    started = time.monotonic()
    result = node.submit(node.pod("after", {MEM: 10}))
    took = time.monotonic() - started
    assert_admitted_ok(result)
    assert took < 2.0 + 1.0, took
    assert "vgpu: released " in node.log()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("refusal", ["invalid", "no-room"])
def test_a_refused_pod_is_never_taken_for_the_next_one(sim_node: NodeMaker, refusal: str) -> None:
    """A pod refused at admission stays Pending in the API server until the
    kubelet's Failed reaches it (here: never). The next pod asking the same
    core is matched to itself, not to the refused one: it gets its own
    verdict and its own limits."""
    node = sim_node(api=True)
    if refusal == "no-room":
        # 10 core and 61 memory units left on each card.
        assert_admitted_ok(node.submit(node.pod("big", {CORE: 90, MEM: 500}), [CORE, MEM]))
        assert_admitted_ok(node.submit(node.pod("big2", {CORE: 90, MEM: 500}), [CORE, MEM]))
    refused = node.pod("refused", {CORE: 10} if refusal == "invalid" else {CORE: 10, MEM: 300})
    node.create(refused)
    time.sleep(0.3)
    first = node.kubelet.admit(refused, [CORE, MEM])  # not marked Failed in the API server
    assert not first.ok
    later = node.pod("later", {CORE: 10, MEM: 8})
    node.create(later)
    time.sleep(0.3)
    result = node.admit(later, [CORE, MEM])
    assert_admitted_ok(result)
    assert not own_limits_problems(result, later.containers[0].requests)


@pytest.mark.timeout(60)
def test_a_list_that_fails_while_the_kubelet_is_down_is_retried_at_once(
    sim_node: NodeMaker,
) -> None:
    """The old kubelet is gone 1 s before the new one serves, and the List made
    after an admission fails in that second. vgpu looks again a second later,
    so the hold ends one settle period (here 5 s) after the new kubelet
    answers, not after the next periodic check (up to 5 s later still)."""
    node = sim_node(api=True, daemon_args=["--reconcile-interval-s", "5"])
    assert_admitted_ok(node.submit(node.pod("before", {CORE: 10, MEM: 10})))
    restart = threading.Thread(target=node.kubelet.restart, kwargs={"down_s": 1.0})
    started = time.monotonic()
    restart.start()
    restart.join(10)
    assert node.wait(lambda: "releases resume" in node.log(), 15), node.log()[-3000:]
    took = time.monotonic() - started
    assert "stopped answering" in node.log()
    assert took < 1.0 + 1.0 + 5.0 + 1.0, (took, node.log()[-3000:])


@pytest.mark.timeout(60)
def test_a_hold_ends_one_settle_period_after_the_new_kubelet_answers(
    sim_node: NodeMaker,
) -> None:
    """The restart is noticed (kubelet.sock re-created) between two periodic
    checks 5 s apart: vgpu looks again a second later instead of waiting for
    the next one, so the hold ends about one settle period (5 s) after it."""
    node = sim_node(api=True, daemon_args=["--reconcile-interval-s", "5"])
    assert_admitted_ok(node.submit(node.pod("before", {CORE: 10, MEM: 10})))
    time.sleep(1.0)  # just after the learn-owners look: the periodic one is 4 s off
    started = time.monotonic()
    restart_kubelet(node, register_delay_s=0.2)
    assert node.wait(lambda: "releases resume" in node.log(), 20), node.log()[-3000:]
    took = time.monotonic() - started
    assert took < 0.5 + 1.0 + 5.0 + 1.0, (took, node.log()[-3000:])
