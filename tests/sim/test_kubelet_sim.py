"""The kubelet simulator against NullDevicePlugin, over real gRPC on Unix sockets."""

from __future__ import annotations

import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from vgpu.pb import deviceplugin_v1beta1_pb2 as pb
from vgpu.pb import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from vgpu.pb import podresources_v1_pb2 as pr
from vgpu.pb import podresources_v1_pb2_grpc as pr_grpc
from vgpu.sim.kubelet import KubeletSimulator, SimContainer, SimPod
from vgpu.sim.nullplugin import NullDevicePlugin

CORE = "vendor.io/vcuda-core"
MEM = "vendor.io/vcuda-memory"

pytestmark = pytest.mark.timeout(30)


def _our_threads() -> list[str]:
    return [
        t.name
        for t in threading.enumerate()
        if t.is_alive() and t.name.startswith(("kubelet-sim-", "nullplugin-"))
    ]


@pytest.fixture
def tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="v", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class Env:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.plugin_dir = root / "dp"
        self.pr_sock = root / "pr.sock"
        self.sims: list[KubeletSimulator] = []
        self.plugins: list[NullDevicePlugin] = []

    def sim(self, seed: int | None = 1, **kw: object) -> KubeletSimulator:
        s = KubeletSimulator(self.plugin_dir, self.pr_sock, seed=seed, **kw)  # type: ignore[arg-type]
        self.sims.append(s)
        s.start()
        return s

    def plugin(
        self,
        resource: str = CORE,
        count: int = 4,
        sock: str = "a.sock",
        start: bool = True,
        **kw: object,
    ) -> NullDevicePlugin:
        p = NullDevicePlugin(self.plugin_dir, resource, count, sock, **kw)  # type: ignore[arg-type]
        self.plugins.append(p)
        if start:
            p.start()
        return p

    def close(self) -> None:
        for p in self.plugins:
            p.stop()
        for s in self.sims:
            s.stop()


@pytest.fixture
def env(tmp: Path) -> Iterator[Env]:
    e = Env(tmp)
    try:
        yield e
    finally:
        e.close()
        deadline = time.monotonic() + 3
        while _our_threads() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _our_threads() == []
        leftovers = [p for p in e.plugin_dir.glob("*") if stat.S_ISSOCK(p.lstat().st_mode)]
        assert leftovers == []
        assert not e.pr_sock.exists()


def _register_raw(plugin_dir: Path, req: pb.RegisterRequest) -> None:
    with grpc.insecure_channel(f"unix://{plugin_dir / 'kubelet.sock'}") as ch:
        pb_grpc.RegistrationStub(ch).Register(req, timeout=10)


def _pr_stub(env: Env) -> tuple[grpc.Channel, pr_grpc.PodResourcesListerStub]:
    ch = grpc.insecure_channel(f"unix://{env.pr_sock}")
    return ch, pr_grpc.PodResourcesListerStub(ch)


# ---- registration and ListAndWatch -------------------------------------------------------------


def test_registration_uses_get_options_answer(env: Env) -> None:
    sim = env.sim()
    env.plugin(
        preferred_available=False,
        register_options=pb.DevicePluginOptions(get_preferred_allocation_available=True),
    )
    assert sim.wait_registered([CORE])
    assert sim.registrations(CORE) == 1
    opts = sim.options(CORE)
    assert opts is not None and not opts.get_preferred_allocation_available
    assert sim.devices(CORE) == {f"null-{i}": "Healthy" for i in range(4)}
    assert sim.capacity(CORE) == 4 and sim.allocatable(CORE) == 4
    assert sim.stream_messages(CORE) == 1 and sim.max_message_bytes(CORE) > 0
    # The kubelet used the served options: no GetPreferredAllocation.
    adm = sim.admit(SimPod.single("p", {CORE: 2}))
    assert adm.ok, adm.error
    assert adm.containers[0].calls == [("Allocate", CORE)]


def test_register_rejects_bad_version_name_and_dead_endpoint(env: Env) -> None:
    sim = env.sim(dial_timeout_s=0.3)
    with pytest.raises(grpc.RpcError) as err:
        _register_raw(
            env.plugin_dir,
            pb.RegisterRequest(version="v1alpha", endpoint="x.sock", resource_name=CORE),
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        _register_raw(
            env.plugin_dir,
            pb.RegisterRequest(version="v1beta1", endpoint="x.sock", resource_name="nvidia.com"),
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        _register_raw(
            env.plugin_dir,
            pb.RegisterRequest(version="v1beta1", endpoint="x.sock", resource_name=CORE),
        )
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert sim.registrations(CORE) == 0


def test_device_updates_propagate(env: Env) -> None:
    sim = env.sim()
    plugin = env.plugin(topology={"null-0": [0], "null-1": [1]})
    assert sim.wait_registered([CORE])
    assert sim.topology(CORE)["null-1"] == [1]
    plugin.set_devices({"null-0": "Healthy", "null-1": "Unhealthy", "null-2": "Healthy"})
    assert sim.wait_for(lambda: sim.capacity(CORE) == 3)
    assert sim.devices(CORE) == {"null-0": "Healthy", "null-1": "Unhealthy", "null-2": "Healthy"}
    assert sim.allocatable(CORE) == 2
    assert sim.stream_messages(CORE) == 2


def test_stream_end_marks_unhealthy_and_never_reconnects(env: Env) -> None:
    sim = env.sim()
    plugin = env.plugin()
    assert sim.wait_registered([CORE])
    plugin.end_stream()
    assert sim.wait_for(lambda: set(sim.devices(CORE).values()) == {"Unhealthy"})
    assert sim.capacity(CORE) == 4 and sim.allocatable(CORE) == 0
    assert not sim.connected(CORE)
    # No reconnect: the plugin sees no new stream.
    assert not sim.wait_for(lambda: plugin.active_streams() > 0, timeout_s=0.5)
    adm = sim.admit(SimPod.single("p", {CORE: 1}))
    assert not adm.ok
    assert (
        adm.error
        == f"requested number of devices unavailable for {CORE}. Requested: 1, Available: 0"
    )
    # Registering again brings the devices back.
    plugin.register()
    assert sim.wait_registered([CORE])
    assert sim.allocatable(CORE) == 4 and sim.registrations(CORE) == 2


def test_oversized_message_ends_stream(env: Env) -> None:
    sim = env.sim()
    plugin = env.plugin()
    assert sim.wait_registered([CORE])
    big = {f"{'x' * 64}-{i:08d}": "Healthy" for i in range(60_000)}  # ~4.6 MiB
    plugin.set_devices(big)
    assert sim.wait_for(lambda: set(sim.devices(CORE).values()) == {"Unhealthy"})
    assert sim.capacity(CORE) == 4


def test_new_registration_replaces_old_and_leaves_its_stream_open(env: Env) -> None:
    sim = env.sim()
    plugin = env.plugin()
    assert sim.wait_registered([CORE])
    plugin.register()
    assert sim.wait_for(lambda: sim.registrations(CORE) == 2)
    # The kubelet does not close the replaced registration's stream.
    assert sim.wait_for(lambda: plugin.active_streams() == 2 and sim.connected(CORE))
    assert sim.stream_messages(CORE) == 2
    assert sim.allocatable(CORE) == 4


def test_a_replaced_stream_that_ends_disconnects_the_current_registration(env: Env) -> None:
    sim = env.sim()
    old = env.plugin(CORE, 4, "old.sock")
    assert sim.wait_registered([CORE])
    new = env.plugin(CORE, 4, "new.sock")
    assert sim.wait_for(lambda: sim.registrations(CORE) == 2 and sim.allocatable(CORE) == 4)
    old.stop()  # its stream ends after the newer registration
    # Seen on kubelet 1.36.2: the newer registration is disconnected too.
    assert sim.wait_for(lambda: set(sim.devices(CORE).values()) == {"Unhealthy"})
    assert sim.wait_for(lambda: new.active_streams() == 0 and not sim.connected(CORE))
    assert sim.allocatable(CORE) == 0
    new.register()  # only a new registration brings the devices back
    assert sim.wait_for(lambda: sim.allocatable(CORE) == 4)


def test_restart_deletes_every_socket_and_keeps_allocations(env: Env) -> None:
    sim = env.sim()
    a = env.plugin(CORE, 4, "a.sock")
    b = env.plugin(MEM, 2, "b.sock")
    assert sim.wait_registered([CORE, MEM])
    adm = sim.admit(SimPod.single("p", {CORE: 1}))
    assert adm.ok, adm.error
    (env.plugin_dir / "kubelet_internal_checkpoint").write_text("{}")

    sim.restart()
    assert not a.socket_path.exists() and not b.socket_path.exists()
    assert (env.plugin_dir / "kubelet.sock").exists()
    assert (env.plugin_dir / "kubelet_internal_checkpoint").exists()  # only sockets go
    assert sim.capacity(CORE) == 0 and sim.capacity(MEM) == 0
    assert not sim.connected(CORE)
    failed = sim.admit(SimPod.single("q", {CORE: 1}))
    assert failed.error == (
        f"requested number of devices unavailable for {CORE}. Requested: 1, Available: 0"
    )
    assert sim.allocated(adm.pod.uid) == {
        adm.pod.uid: {"main": {CORE: adm.containers[0].device_ids[CORE]}}
    }

    # The plugin notices, serves again and re-registers.
    a.stop()
    a.start()
    assert sim.wait_registered([CORE])
    assert sim.registrations(CORE) == 2
    assert sim.capacity(CORE) == 4 and sim.allocatable(CORE) == 3
    assert sim.capacity(MEM) == 0


def test_watching_plugin_recovers_from_restart_and_early_start(env: Env) -> None:
    plugin = env.plugin(watch=True)  # before the kubelet exists
    sim = env.sim()
    assert sim.wait_registered([CORE])
    sim.restart()
    assert sim.wait_for(lambda: sim.registrations(CORE) == 2 and sim.connected(CORE))
    assert sim.capacity(CORE) == 4
    assert sim.wait_for(lambda: plugin.registrations == 2)


def test_stop_is_prompt_and_idempotent(env: Env) -> None:
    sim = env.sim()
    plugin = env.plugin()
    assert sim.wait_registered([CORE])
    t0 = time.monotonic()
    sim.stop()
    sim.stop()
    assert time.monotonic() - t0 < 2.0
    assert sim.wait_for(lambda: plugin.active_streams() == 0, timeout_s=2)
    assert not (env.plugin_dir / "kubelet.sock").exists()
    assert not env.pr_sock.exists()


# ---- admission ---------------------------------------------------------------------------------


def test_admission_merges_first_wins(env: Env) -> None:
    sim = env.sim()
    env.plugin(CORE, 4, "a.sock", env_name="SHARED")
    env.plugin(MEM, 4, "b.sock", env_name="SHARED", id_prefix="mem")
    assert sim.wait_registered([CORE, MEM])
    pod = SimPod.new("p", [SimContainer("c", {CORE: 2, MEM: 1}), SimContainer("idle", {})])
    adm = sim.admit(pod, resource_order=[MEM, CORE])
    assert adm.ok, adm.error
    c = adm.container("c")
    assert c.calls == [
        ("GetPreferredAllocation", MEM),
        ("Allocate", MEM),
        ("GetPreferredAllocation", CORE),
        ("Allocate", CORE),
    ]
    assert len(c.device_ids[CORE]) == 2 and len(c.device_ids[MEM]) == 1
    assert c.envs == {"SHARED": ",".join(c.device_ids[MEM])}  # MEM came first
    assert len(c.clashes) == 1 and "SHARED" in c.clashes[0]
    assert c.responses[CORE].envs["SHARED"] == ",".join(c.device_ids[CORE])
    assert adm.container("idle").calls == []
    assert sorted(adm.latencies_s) == ["Allocate", "GetPreferredAllocation", "checkpoint write"]
    assert len(adm.latencies_s["Allocate"]) == 2
    assert sim.allocated() == {pod.uid: {"c": c.device_ids, "idle": {}}}
    assert sim.allocatable(CORE) == 2 and sim.allocatable(MEM) == 3
    assert [p.uid for p in sim.active_pods()] == [pod.uid]


def test_insufficient_devices(env: Env) -> None:
    sim = env.sim()
    env.plugin(count=4)
    assert sim.wait_registered([CORE])
    first = sim.admit(SimPod.single("a", {CORE: 3}))
    assert first.ok
    adm = sim.admit(SimPod.single("b", {CORE: 2}))
    assert not adm.ok and adm.code is None
    assert (
        adm.error
        == f"requested number of devices unavailable for {CORE}. Requested: 2, Available: 1"
    )
    assert [p.name for p in sim.active_pods()] == ["a"]
    assert sim.allocatable(CORE) == 1
    unknown = sim.admit(SimPod.single("c", {"other.io/x": 1}))
    assert not unknown.ok and "unregistered" in (unknown.error or "")


def test_preferred_allocation_honoured(env: Env) -> None:
    sim = env.sim()
    plugin = env.plugin(count=8)
    plugin.preference = lambda req: sorted(req.available_deviceIDs)[-3:][::-1]
    assert sim.wait_registered([CORE])
    adm = sim.admit(SimPod.single("p", {CORE: 3}))
    assert adm.ok, adm.error
    assert adm.containers[0].device_ids[CORE] == ["null-7", "null-6", "null-5"]
    kind, req = plugin.calls()[0]
    assert kind == "GetPreferredAllocation"
    assert isinstance(req, pb.ContainerPreferredAllocationRequest)
    assert req.allocation_size == 3 and list(req.must_include_deviceIDs) == []
    assert sorted(req.available_deviceIDs) == sorted(f"null-{i}" for i in range(8))
    kind, areq = plugin.calls()[1]
    assert kind == "Allocate" and isinstance(areq, pb.ContainerAllocateRequest)
    assert list(areq.devices_ids) == ["null-7", "null-6", "null-5"]


def test_bogus_preference_is_filled_arbitrarily(env: Env) -> None:
    sim = env.sim()
    plugin = env.plugin(count=8)
    plugin.preference = lambda req: ["nope", "null-3", "null-3"]
    assert sim.wait_registered([CORE])
    adm = sim.admit(SimPod.single("p", {CORE: 3}))
    ids = adm.containers[0].device_ids[CORE]
    assert ids[0] == "null-3" and len(set(ids)) == 3 and "nope" not in ids


def test_preferred_error_fails_admission_and_releases(env: Env) -> None:
    sim = env.sim()
    env.plugin(CORE, 4, "a.sock")
    bad = env.plugin(MEM, 4, "b.sock", id_prefix="mem")
    bad.preferred_error = (grpc.StatusCode.RESOURCE_EXHAUSTED, "no single card fits")
    assert sim.wait_registered([CORE, MEM])
    pod = SimPod.new("p", [SimContainer("a", {CORE: 2}), SimContainer("b", {MEM: 1})])
    adm = sim.admit(pod)
    assert not adm.ok
    assert adm.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert adm.error == "no single card fits"
    assert adm.container("a").device_ids[CORE]  # container a had been allocated
    assert adm.container("b").calls == [("GetPreferredAllocation", MEM)]
    assert sim.allocated() == {} and sim.active_pods() == []
    assert sim.allocatable(CORE) == 4 and sim.allocatable(MEM) == 4


def test_allocate_error_fails_admission(env: Env) -> None:
    sim = env.sim()
    plugin = env.plugin()
    plugin.allocate_error = (grpc.StatusCode.FAILED_PRECONDITION, "card gone")
    assert sim.wait_registered([CORE])
    adm = sim.admit(SimPod.single("p", {CORE: 1}))
    assert (adm.ok, adm.code, adm.error) == (
        False,
        grpc.StatusCode.FAILED_PRECONDITION,
        "card gone",
    )
    assert sim.allocatable(CORE) == 4 and sim.active_pods() == []


def test_init_container_reuse_via_must_include(env: Env) -> None:
    sim = env.sim()
    plugin = env.plugin(count=6)
    assert sim.wait_registered([CORE])
    pod = SimPod.new(
        "p", [SimContainer("app", {CORE: 3})], init_containers=[SimContainer("init", {CORE: 2})]
    )
    adm = sim.admit(pod)
    assert adm.ok, adm.error
    init_ids = adm.container("init").device_ids[CORE]
    app_ids = adm.container("app").device_ids[CORE]
    assert set(init_ids) < set(app_ids) and len(app_ids) == 3
    pref = [req for kind, req in plugin.calls() if kind == "GetPreferredAllocation"]
    assert len(pref) == 2
    app_req = pref[1]
    assert isinstance(app_req, pb.ContainerPreferredAllocationRequest)
    assert sorted(app_req.must_include_deviceIDs) == sorted(init_ids)
    assert app_req.allocation_size == 3
    assert set(init_ids) <= set(app_req.available_deviceIDs)
    assert len(app_req.available_deviceIDs) == 6  # 4 free + the 2 reused
    assert sim.allocatable(CORE) == 3
    assert sim.allocated(pod.uid)[pod.uid]["init"][CORE] == init_ids


def test_init_container_reuse_without_preferred_call(env: Env) -> None:
    sim = env.sim()
    env.plugin(count=4)
    assert sim.wait_registered([CORE])
    pod = SimPod.new(
        "p",
        [SimContainer("app1", {CORE: 2}), SimContainer("app2", {CORE: 1})],
        init_containers=[SimContainer("init", {CORE: 2})],
    )
    adm = sim.admit(pod)
    assert adm.ok, adm.error
    init_ids = adm.container("init").device_ids[CORE]
    assert adm.container("app1").calls == [("Allocate", CORE)]
    assert sorted(adm.container("app1").device_ids[CORE]) == sorted(init_ids)
    # The init IDs were used up by app1: app2 needs a fresh one, through the preferred call.
    assert adm.container("app2").calls == [("GetPreferredAllocation", CORE), ("Allocate", CORE)]
    assert not set(adm.container("app2").device_ids[CORE]) & set(init_ids)
    assert sim.allocatable(CORE) == 1


def test_remove_pod_frees(env: Env) -> None:
    sim = env.sim()
    env.plugin(count=2)
    assert sim.wait_registered([CORE])
    a = sim.admit(SimPod.single("a", {CORE: 2}))
    assert a.ok and sim.allocatable(CORE) == 0
    assert not sim.admit(SimPod.single("b", {CORE: 1})).ok
    sim.remove_pod(a.pod.uid)
    sim.remove_pod(a.pod.uid)
    assert sim.allocatable(CORE) == 2 and sim.allocated() == {}
    assert sim.admit(SimPod.single("c", {CORE: 2})).ok


def test_call_preferred_false(env: Env) -> None:
    sim = env.sim(call_preferred=False)
    plugin = env.plugin()
    assert sim.wait_registered([CORE])
    adm = sim.admit(SimPod.single("p", {CORE: 2}))
    assert adm.ok and adm.containers[0].calls == [("Allocate", CORE)]
    assert [k for k, _ in plugin.calls()] == ["Allocate"]


# ---- pod resources -----------------------------------------------------------------------------


def test_pod_resources_over_grpc(env: Env) -> None:
    sim = env.sim()
    env.plugin(CORE, 4, "a.sock", topology={f"null-{i}": [i % 2] for i in range(4)})
    env.plugin(MEM, 2, "b.sock", id_prefix="mem")
    assert sim.wait_registered([CORE, MEM])
    pod = SimPod.new(
        "p",
        [SimContainer("gpu", {CORE: 2, MEM: 1}), SimContainer("side", {})],
        init_containers=[SimContainer("init", {MEM: 1})],
        namespace="ns",
    )
    adm = sim.admit(pod)
    assert adm.ok, adm.error
    ch, stub = _pr_stub(env)
    with ch:
        listed = stub.List(pr.ListPodResourcesRequest(), timeout=5).pod_resources
        assert [(p.name, p.namespace) for p in listed] == [("p", "ns")]
        containers = {c.name: c for c in listed[0].containers}
        assert sorted(containers) == ["gpu", "side"]  # app containers only
        assert list(containers["side"].devices) == []
        got: dict[str, set[str]] = {}
        for dev in containers["gpu"].devices:
            got.setdefault(dev.resource_name, set()).update(dev.device_ids)
        assert got == {k: set(v) for k, v in adm.container("gpu").device_ids.items()}
        core_nodes = {
            d.topology.nodes[0].ID for d in containers["gpu"].devices if d.resource_name == CORE
        }
        assert core_nodes <= {0, 1}

        one = stub.Get(pr.GetPodResourcesRequest(pod_name="p", pod_namespace="ns"), timeout=5)
        assert one.pod_resources == listed[0]
        with pytest.raises(grpc.RpcError) as err:
            stub.Get(pr.GetPodResourcesRequest(pod_name="p", pod_namespace="default"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

        alloc = stub.GetAllocatableResources(pr.AllocatableResourcesRequest(), timeout=5).devices
        assert sorted((d.resource_name, d.device_ids[0]) for d in alloc) == sorted(
            [(CORE, f"null-{i}") for i in range(4)] + [(MEM, "mem-0"), (MEM, "mem-1")]
        )
        sim.remove_pod(pod.uid)
        assert list(stub.List(pr.ListPodResourcesRequest(), timeout=5).pod_resources) == []


def test_pod_appears_during_admission(env: Env) -> None:
    sim = env.sim(seed=3)
    plugin = env.plugin(count=4)
    assert sim.wait_registered([CORE])
    plugin.allocate_delay_s = 0.3
    pod = SimPod.new("p", [SimContainer("a", {CORE: 1}), SimContainer("b", {CORE: 1})])
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(sim.admit(pod).ok))
    t.start()
    ch, stub = _pr_stub(env)
    with ch:

        def a_listed_b_not() -> bool:
            pods = stub.List(pr.ListPodResourcesRequest(), timeout=5).pod_resources
            if not pods:
                return False
            devs = {c.name: len(c.devices) for c in pods[0].containers}
            return devs == {"a": 1, "b": 0}

        assert sim.wait_for(a_listed_b_not, timeout_s=5)
    t.join(10)
    assert result == [True]


# ---- determinism -------------------------------------------------------------------------------


def _run(env: Env, seed: int, sub: str) -> list[dict[str, list[str]]]:
    d = env.root / sub
    sim = KubeletSimulator(d, seed=seed, call_preferred=False)
    env.sims.append(sim)
    sim.start()
    p1 = NullDevicePlugin(d, CORE, 16, "a.sock")
    p2 = NullDevicePlugin(d, MEM, 16, "b.sock", id_prefix="mem")
    env.plugins += [p1, p2]
    p1.start()
    p2.start()
    assert sim.wait_registered([CORE, MEM])
    out = []
    for i in range(5):
        pod = SimPod.new(f"p{i}", [SimContainer("c", {CORE: 2, MEM: 1})], uid=f"uid-{i}")
        adm = sim.admit(pod)
        assert adm.ok, adm.error
        out.append(adm.containers[0].device_ids)
        out.append({"order": [r for k, r in adm.containers[0].calls]})
    p1.stop()
    p2.stop()
    sim.stop()
    return out


def test_deterministic_with_seed(env: Env) -> None:
    first = _run(env, 42, "s1")
    assert first == _run(env, 42, "s2")
    # Not lowest-first: the arbitrary fill is random.
    assert any(ids != sorted(ids) or ids[0] != "null-0" for d in first for ids in d.values())


def test_many_concurrent_admissions_are_serialized(env: Env) -> None:
    sim = env.sim()
    env.plugin(count=10)
    assert sim.wait_registered([CORE])
    results: list[bool] = []
    lock = threading.Lock()

    def admit(i: int) -> Callable[[], None]:
        def run() -> None:
            ok = sim.admit(SimPod.single(f"p{i}", {CORE: 1})).ok
            with lock:
                results.append(ok)

        return run

    threads = [threading.Thread(target=admit(i)) for i in range(14)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(results) == [False] * 4 + [True] * 10
    held = [i for c in sim.allocated().values() for ids in c["main"].values() for i in ids]
    assert len(held) == len(set(held)) == 10
