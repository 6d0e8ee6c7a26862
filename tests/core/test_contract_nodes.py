"""The contract's device nodes and deliveries (pure)."""

from __future__ import annotations

import pytest

from vgpu.core.contract import (
    ContainerEdits,
    MountSpec,
    as_cdi_reference,
    as_volume_mounts,
    container_edits,
    judge_nodes,
    node_problem,
    wanted_nodes,
)
from vgpu.core.model import Card, CardUuid, Placement

NVIDIA = Card(CardUuid("GPU-a"), 0, "H200", 1024, minor=3)
MOCK_BARE = Card(CardUuid("GPU-b"), 1, "H200", 1024, minor=1, device_nodes=())
MOCK_LISTED = Card(
    CardUuid("GPU-c"), 2, "H200", 1024, minor=2, device_nodes=("/dev/nvidia2", "/dev/x")
)


@pytest.mark.parametrize(
    ("cards", "want"),
    [
        pytest.param(
            [NVIDIA],
            ("/dev/nvidia3", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"),
            id="nvidia-card",
        ),
        pytest.param([MOCK_BARE], (), id="mock-without-nodes"),
        pytest.param([MOCK_LISTED], ("/dev/nvidia2", "/dev/x"), id="mock-listed"),
        pytest.param(
            [MOCK_LISTED, NVIDIA],
            (
                "/dev/nvidia2",
                "/dev/nvidia3",
                "/dev/x",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools",
            ),
            id="own-nodes-first-each-once",
        ),
    ],
)
def test_wanted_nodes(cards: list[Card], want: tuple[str, ...]) -> None:
    assert wanted_nodes(cards) == want


def test_only_present_nodes_are_named() -> None:
    placement = Placement("pk", (NVIDIA.uuid,), {}, 30, 1024)
    edits = container_edits(
        placement,
        [NVIDIA],
        config_dir="/s/c",
        shared_dir="/s/c/shared",
        hook_path=None,
        present_nodes={"/dev/nvidia3", "/dev/nvidiactl"},
    )
    assert [d.container_path for d in edits.devices] == ["/dev/nvidia3", "/dev/nvidiactl"]
    bare = container_edits(placement, [NVIDIA], config_dir="/c", shared_dir="/s", hook_path=None)
    assert bare.devices == ()  # nothing is assumed


def test_a_missing_own_node_makes_the_card_unhealthy_until_it_is_back() -> None:
    assert node_problem(MOCK_BARE, ()) is None
    sick = judge_nodes(NVIDIA, {"/dev/nvidiactl"})
    assert (
        not sick.healthy
        and sick.problem == "its device node /dev/nvidia3 does not exist on the host"
    )
    assert judge_nodes(sick, {"/dev/nvidiactl"}) is sick
    well = judge_nodes(sick, {"/dev/nvidia3"})
    assert well.healthy and well.problem is None
    assert judge_nodes(NVIDIA, {"/dev/nvidia3"}) is NVIDIA
    # An XID still holds the card when its node comes back.
    both = judge_nodes(Card(NVIDIA.uuid, 0, "H200", 1024, minor=3, healthy=False, xid=79), ())
    assert not judge_nodes(both, {"/dev/nvidia3"}).healthy


def test_deliveries_hand_over_one_contract() -> None:
    edits = ContainerEdits(
        envs={"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b", "VGPU_CORE_LIMIT": "30"},
        mounts=(MountSpec("/etc/vgpu", "/s/c", True),),
    )
    volumes = as_volume_mounts(edits, ["GPU-a", "GPU-b"])
    assert volumes.envs == {
        "NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices",
        "VGPU_CORE_LIMIT": "30",
    }
    assert volumes.mounts[1:] == (
        MountSpec("/var/run/nvidia-container-devices/GPU-a", "/dev/null", True),
        MountSpec("/var/run/nvidia-container-devices/GPU-b", "/dev/null", True),
    )
    ref = as_cdi_reference(edits, "vendor.io/vgpu=pk")
    assert ref.cdi_devices == ("vendor.io/vgpu=pk",) and ref.envs == {} and ref.mounts == ()
