"""Issue 17 (1, 2): device nodes come from the host, never assumed; the device
list strategies envvar, cdi and volume-mounts hand the one contract over.

The daemon runs as a process over gRPC with the kubelet simulator; what the
container sees is computed by the runtime stand-in (vgpu.sim.runtime), which
resolves CDI names and refuses device nodes the (temporary) host /dev lacks,
as containerd does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.cdi_schema import validate_spec
from tests.conftest import MockGpusFile, NodeFactory, card
from vgpu.core.slicing import parse_device_id
from vgpu.sim.harness import SimNode, wait_until
from vgpu.sim.runtime import ContainerCreateError, container_view

pytestmark = pytest.mark.timeout(90)

CORE = "vendor.io/vcuda-core"
MEM = "vendor.io/vcuda-memory"
DEVLIST = "/var/run/nvidia-container-devices"


def fake_dev(root: Path, *names: str) -> Path:
    """A stand-in for the host's /dev: character devices (links to /dev/null)."""
    root.mkdir(exist_ok=True)
    for name in names:
        os.symlink("/dev/null", root / name)
    return root


def node_with(
    make_node: NodeFactory, gpus: str | Path, dev: Path, strategy: str, *extra: str
) -> SimNode:
    return make_node(
        gpus,
        daemon_args=[
            "--host-dev-dir",
            str(dev),
            "--device-list-strategy",
            strategy,
            "--cdi-dir",
            str(dev.parent / "cdi"),
            *extra,
        ],
    )


def two_cards_with_nodes(mock_gpus_file: MockGpusFile) -> Path:
    return mock_gpus_file(
        [
            card(0, device_nodes=["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm"]),
            card(1, device_nodes=["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"]),
        ]
    )


def test_only_nodes_present_on_the_host_are_named(
    make_node: NodeFactory, mock_gpus_file: MockGpusFile, short_tmp: Path
) -> None:
    dev = fake_dev(short_tmp / "dev", "nvidia0", "nvidiactl")  # no nvidia1, no uvm yet
    node = node_with(make_node, two_cards_with_nodes(mock_gpus_file), dev, "envvar")
    # Card 1 has no device node on the host: unhealthy in ListAndWatch, with the reason logged.
    assert wait_until(
        lambda: (
            {h for d, h in node.kubelet.devices(CORE).items() if parse_device_id(d).card_index == 1}
            == {"Unhealthy"}
        ),
        10,
    )
    assert {
        h for d, h in node.kubelet.devices(CORE).items() if parse_device_id(d).card_index == 0
    } == {"Healthy"}
    assert "/dev/nvidia1 does not exist on the host" in node.log()
    cards = json.loads((node.state_dir / "node.json").read_text())["cards"]
    assert [c["problem"] for c in cards] == [
        None,
        "its device node /dev/nvidia1 does not exist on the host",
    ]
    result = node.submit(node.pod("p", {CORE: 20, MEM: 8}))
    assert result.ok, result.error
    c = result.containers[0]
    assert [d.container_path for d in c.devices] == ["/dev/nvidia0", "/dev/nvidiactl"]
    view = container_view(c, [], dev)  # the runtime creates it: every node exists
    assert view.devices == {"/dev/nvidia0": "/dev/nvidia0", "/dev/nvidiactl": "/dev/nvidiactl"}
    # The missing uvm node is logged once, not fatal.
    node.submit(node.pod("q", {CORE: 20, MEM: 8}))
    assert node.log().count("device node /dev/nvidia-uvm not handed") == 1
    # The uvm module loads, the missing card's node appears: both are used from then on.
    os.symlink("/dev/null", dev / "nvidia-uvm")
    os.symlink("/dev/null", dev / "nvidia1")
    assert wait_until(lambda: "Unhealthy" not in node.kubelet.devices(CORE).values(), 15)
    later = node.submit(node.pod("r", {CORE: 20, MEM: 8}))
    assert "/dev/nvidia-uvm" in [d.container_path for d in later.containers[0].devices]


def test_a_node_that_vanishes_is_never_named(
    make_node: NodeFactory, mock_gpus_file: MockGpusFile, short_tmp: Path
) -> None:
    """Before the periodic check catches it, Allocate still looks at the host."""
    dev = fake_dev(short_tmp / "dev", "nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm")
    node = node_with(make_node, two_cards_with_nodes(mock_gpus_file), dev, "envvar")
    (dev / "nvidiactl").unlink()
    result = node.submit(node.pod("p", {CORE: 20, MEM: 8}))
    assert result.ok, result.error
    paths = [d.container_path for d in result.containers[0].devices]
    assert "/dev/nvidiactl" not in paths and "/dev/nvidia-uvm" in paths
    container_view(result.containers[0], [], dev)


def test_the_runtime_stand_in_refuses_a_missing_node(short_tmp: Path) -> None:
    """The check the tests rely on can fail (it is containerd's error)."""
    from vgpu.pb import deviceplugin_v1beta1_pb2 as pb
    from vgpu.sim.kubelet import ContainerResult

    result = ContainerResult(name="main")
    result.devices.append(pb.DeviceSpec(container_path="/dev/nvidia0", host_path="/dev/nvidia0"))
    with pytest.raises(ContainerCreateError, match="lstat /dev/nvidia0"):
        container_view(result, [], fake_dev(short_tmp / "dev"))


@pytest.mark.parametrize("strategy", ["envvar", "cdi", "volume-mounts"])
def test_each_strategy_gives_the_container_the_same_contract(
    make_node: NodeFactory, mock_gpus_file: MockGpusFile, short_tmp: Path, strategy: str
) -> None:
    dev = fake_dev(short_tmp / "dev", "nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm")
    cdi_dir = short_tmp / "cdi"
    node = node_with(make_node, two_cards_with_nodes(mock_gpus_file), dev, strategy)
    result = node.submit(node.pod("p", {CORE: 30, MEM: 16}), [MEM, CORE])
    assert result.ok, result.error
    c = result.containers[0]
    assert not c.clashes
    view = container_view(c, [cdi_dir], dev)
    uuid = view.envs.get("NVIDIA_VISIBLE_DEVICES")
    placed = next(m for m in view.mounts if m == "/etc/vgpu")
    record = json.loads((Path(view.mounts[placed][0]) / "config.json").read_text())
    (card_uuid,) = record["cards"]
    minor = int(card_uuid[-1])
    # The one contract, whatever the delivery.
    assert view.envs["VGPU_CORE_LIMIT"] == "30"
    assert view.envs["VGPU_MEMORY_LIMIT_MIB"] == str(16 * 256)
    assert view.envs["VGPU_CONFIG"] == "/etc/vgpu/config.json"
    assert "/var/run/vgpu/vgpu.shm" in view.mounts
    assert set(view.devices) == {f"/dev/nvidia{minor}", "/dev/nvidiactl", "/dev/nvidia-uvm"}
    specs = sorted(p.name for p in cdi_dir.glob("*.json")) if cdi_dir.exists() else []
    if strategy == "envvar":
        assert uuid == card_uuid and not c.cdi_devices and specs == []
    elif strategy == "volume-mounts":
        assert uuid == DEVLIST
        assert view.mounts[f"{DEVLIST}/{card_uuid}"] == ("/dev/null", ("ro",))
        assert not c.cdi_devices and specs == []
    else:
        # Both resources' answers name the one device; the kubelet passes it once.
        assert [call for call, _ in c.calls].count("Allocate") == 2
        assert c.cdi_devices == [f"vendor.io/vgpu={record['key']}"]
        assert c.envs == {} and list(c.mounts) == [] and list(c.devices) == []
        assert uuid == card_uuid
        assert specs == [f"vendor.io-vgpu_{record['key']}.json"]
        validate_spec(json.loads((cdi_dir / specs[0]).read_text()))


@pytest.mark.timeout(300)  # ~45 s alone (30 s of it the grace period); more when loaded
def test_cdi_specs_of_gone_containers_are_swept(make_node: NodeFactory, short_tmp: Path) -> None:
    """Hundreds of admissions (each pod deleted after it) leave no spec behind."""
    dev = fake_dev(short_tmp / "dev")
    cdi_dir = short_tmp / "cdi"
    node = node_with(make_node, "preset:2xH200", dev, "cdi", "--reconcile-interval-s", "1")
    live = []
    for i in range(300):  # 1,000 in the issue-17 measurement; 300 keeps CI short
        pod = node.pod(f"p{i}", {CORE: 10, MEM: 4})
        result = node.admit(pod, [CORE, MEM])
        assert result.ok, (i, result.error)
        live.append(pod)
        if len(live) > 3:
            node.delete(live.pop(0))
        # Bounded all along: never more specs than the cards have room for containers.
        assert len(list(cdi_dir.glob("*.json"))) <= 2 * 100 // 10, i
    for pod in live:
        node.delete(pod)
    # A placement the kubelet never listed is kept for the 30 s grace period
    # (its answer may still be on its way), then swept with its spec.
    assert wait_until(lambda: not list(cdi_dir.iterdir()), 45), sorted(
        p.name for p in cdi_dir.iterdir()
    )
