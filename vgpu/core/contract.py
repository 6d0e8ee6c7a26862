"""The limit contract: what a container holding a slice gets, whoever placed it.

The device plugin's Allocate answer and the DRA driver's CDI spec both carry
exactly these environment variables, mounts and device nodes, so the hook in
`hooks/` sees one contract. Pure: host paths come in as strings from the
filesystem adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from vgpu.core.model import CORE_UNITS_PER_CARD, Card, Placement

CONFIG_MOUNT = "/etc/vgpu"  # the container's config directory (read-only)
CONFIG_FILE = f"{CONFIG_MOUNT}/config.json"
SHARED_MOUNT = "/var/run/vgpu"  # VGPU_SHARED_DIR: the hook's budget file lives here
BUDGET_FILE_NAME = "vgpu.shm"  # the one file mounted there (read-write), never the directory
HOOK_MOUNT_DIR = "/usr/local/vgpu"  # the hook library, under its versioned name
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
PRELOAD_FILE = "/etc/ld.so.preload"  # hook_injection ld-so-preload: names the hook (read-only)
HOOK_INJECTIONS = ("ld-so-preload", "env")


@dataclass(frozen=True)
class MountSpec:
    container_path: str
    host_path: str
    read_only: bool


@dataclass(frozen=True)
class DeviceNode:
    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class ContainerEdits:
    """Env, mounts and device nodes for one container's slice."""

    envs: dict[str, str]
    mounts: tuple[MountSpec, ...] = ()
    devices: tuple[DeviceNode, ...] = ()
    annotations: dict[str, str] = field(default_factory=dict)


def limit_envs(placement: Placement, context_overhead_mib: int = 0) -> dict[str, str]:
    """The limit variables: VGPU_CORE_LIMIT for a fractional slice,
    VGPU_MEMORY_LIMIT_MIB (per card) when memory is limited, and
    VGPU_CONTEXT_OVERHEAD_MIB, the per-card context memory the hook charges
    where it cannot measure it (only when memory is limited and it is set)."""
    envs = {
        "NVIDIA_VISIBLE_DEVICES": ",".join(placement.cards),
        "VGPU_CONFIG": CONFIG_FILE,
        "VGPU_SHARED_DIR": SHARED_MOUNT,
    }
    if 0 < placement.core_percent < CORE_UNITS_PER_CARD:
        envs["VGPU_CORE_LIMIT"] = str(placement.core_percent)
    if placement.memory_mib:
        envs["VGPU_MEMORY_LIMIT_MIB"] = str(placement.memory_mib)
        if context_overhead_mib > 0:
            envs["VGPU_CONTEXT_OVERHEAD_MIB"] = str(context_overhead_mib)
    return envs


def container_edits(
    placement: Placement,
    cards: Sequence[Card | None],
    *,
    config_dir: str,
    shared_dir: str,
    hook_path: str | None,
    context_overhead_mib: int = 0,
) -> ContainerEdits:
    """Everything the container gets: the one contract of both modes.

    `shared_dir` is the host directory holding the container's budget file; only
    that file is mounted (read-write), so the container cannot create, link or
    grow anything else on the host's disk through it.
    """
    envs = limit_envs(placement, context_overhead_mib)
    mounts = [
        MountSpec(CONFIG_MOUNT, config_dir, True),
        MountSpec(f"{SHARED_MOUNT}/{BUDGET_FILE_NAME}", f"{shared_dir}/{BUDGET_FILE_NAME}", False),
    ]
    if hook_path is not None and not placement.whole:
        in_container = f"{HOOK_MOUNT_DIR}/{hook_path.rsplit('/', 1)[-1]}"
        mounts.append(MountSpec(in_container, hook_path, True))
        envs["LD_PRELOAD"] = in_container
    devices = [
        DeviceNode(f"/dev/nvidia{card.minor}", f"/dev/nvidia{card.minor}")
        for card in cards
        if card is not None
    ]
    devices += [DeviceNode(path, path) for path in CONTROL_DEVICES]
    return ContainerEdits(envs=envs, mounts=tuple(mounts), devices=tuple(devices))


def hook_container_path(hook_path: str) -> str:
    """Where a sliced container sees the hook library installed at `hook_path`."""
    return f"{HOOK_MOUNT_DIR}/{hook_path.rsplit('/', 1)[-1]}"


def preload_file_name(hook_path: str) -> str:
    """The name of the ld.so.preload file the daemon writes next to the hook library."""
    return f"{hook_path.rsplit('/', 1)[-1].removesuffix('.so')}.ld.so.preload"


def preload_file_text(hook_path: str) -> str:
    """What the container's /etc/ld.so.preload says: the hook at its container path."""
    return hook_container_path(hook_path) + "\n"


def with_hook_injection(
    edits: ContainerEdits, hook_path: str | None, injection: str
) -> ContainerEdits:
    """hook_injection ld-so-preload: a container that gets the hook (LD_PRELOAD
    in its env) also gets a read-only /etc/ld.so.preload naming it, so that
    processes started with a clean environment (env -i, sudo, sshd) load it too.
    The env stays as it is. `env`, whole cards and no hook: unchanged."""
    if injection != "ld-so-preload" or hook_path is None or "LD_PRELOAD" not in edits.envs:
        return edits
    host = f"{hook_path.rsplit('/', 1)[0]}/{preload_file_name(hook_path)}"
    return replace(edits, mounts=(*edits.mounts, MountSpec(PRELOAD_FILE, host, True)))
