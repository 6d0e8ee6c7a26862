"""Settings: one versioned tree, validated once into a frozen value.

Precedence, highest first (documented in the README, nowhere else):

1. command-line flags of `vgpu serve`;
2. environment variables ``VGPU_<KEY>`` (e.g. ``VGPU_MEMORY_UNIT_MIB=512``),
   plus ``NODE_NAME`` for ``node_name`` (the downward API's usual name);
3. the YAML config file given by ``--config`` / ``VGPU_CONFIG_FILE``;
4. the defaults below.

This module is the only reader of VGPU_* variables.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vgpu.core.contract import HOOK_INJECTIONS
from vgpu.core.errors import ConfigError
from vgpu.core.health import DEFAULT_IGNORED_XIDS
from vgpu.core.model import Policy

CONFIG_VERSION = "v1"
_DOMAIN_RE = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)+$")
_ADDRESS_RE = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9.\-]*):(\d{1,5})$")


@dataclass(frozen=True)
class Settings:
    """Everything `vgpu serve` can be told. Units are in the names."""

    backend: str = "nvml"
    mock_gpus: Path | None = None
    device_plugin_dir: Path = Path("/var/lib/kubelet/device-plugins")
    pod_resources_socket: Path = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    kubeconfig: Path | None = None
    node_name: str | None = None
    state_dir: Path = Path("/var/lib/vgpu")
    resource_domain: str = "vendor.io"
    memory_unit_mib: int = 256
    policy: Policy = Policy.BINPACK
    ignored_xids: tuple[int, ...] = tuple(sorted(DEFAULT_IGNORED_XIDS))
    metrics_address: str | None = None
    metrics_container_names: bool = False
    log_format: str = "text"
    log_level: str = "info"
    hook_library: Path | None = None
    hook_dir: Path = Path("/usr/local/vgpu")
    api_wait_s: float = 2.0
    reconcile_interval_s: float = 10.0
    mode: str = "device-plugin"
    kubelet_registry_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    kubelet_plugin_dir: Path | None = None  # None: /var/lib/kubelet/plugins/vgpu.<domain>
    cdi_dir: Path = Path("/var/run/cdi")

    def dra_plugin_dir(self) -> Path:
        """The DRA socket's directory (kubelet_plugin_dir, or its per-driver default)."""
        if self.kubelet_plugin_dir is not None:
            return self.kubelet_plugin_dir
        return Path("/var/lib/kubelet/plugins") / f"vgpu.{self.resource_domain}"

    context_overhead_mib: int = 0
    hook_injection: str = "ld-so-preload"
    api_unready_after_s: float = 60.0
    device_list_strategy: str = "envvar"
    host_dev_dir: Path = Path("/dev")
    host_proc_dir: Path = Path("/host/proc")
    unallocated_policy: str = "warn"
    default_core_limit_percent: int | None = None  # burst cap; None: equals the guarantee

    def public(self) -> dict[str, Any]:
        """The effective settings as plain data (for the start-up log and `config`)."""
        return _public(self)


def _public(settings: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if isinstance(value, Path):
            value = str(value)
        elif isinstance(value, Policy):
            value = value.value
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


# key -> (help text, allowed values text). The order is that of `config default`.
KEYS: dict[str, str] = {
    "backend": "where cards come from: nvml (real GPUs) or mock (a JSON/YAML file)",
    "mock_gpus": "the mock backend's file of cards (required with backend: mock)",
    "device_plugin_dir": "the kubelet's device-plugin directory",
    "pod_resources_socket": "the kubelet's pod-resources socket",
    "kubeconfig": "kubeconfig file; unset: in-cluster service account, or no API server",
    "node_name": "this node's name (usually from NODE_NAME via the downward API)",
    "state_dir": "where placements and per-container configs live (must survive reboots)",
    "resource_domain": "domain of the two resources, e.g. vendor.io/vcuda-core",
    "memory_unit_mib": "MiB per vcuda-memory unit (64-65536)",
    "policy": "card choice for fractional slices: binpack (fullest card that fits) or spread",
    "ignored_xids": "XIDs that do not mark a card unhealthy (application-level errors)",
    "metrics_address": "HOST:PORT for Prometheus /metrics and /healthz; unset: off",
    "metrics_container_names": (
        "label per-container series with namespace/pod/container instead of the placement "
        "key (only where the metrics endpoint is protected)"
    ),
    "log_format": "text or json",
    "log_level": "debug, info, warning or error",
    "hook_library": "the enforcement library (libvgpu.so) to install; unset: no enforcement",
    "hook_dir": "host directory the library is installed into and mounted from",
    "api_wait_s": "longest wait for a pod to appear in the API cache at admission (0-2)",
    "reconcile_interval_s": "how often to re-check the kubelet for finished pods (1-3600)",
    "mode": "device-plugin (extended resources) or dra (Dynamic Resource Allocation, 1.34+)",
    "kubelet_registry_dir": "dra: the kubelet's plugin-watcher directory",
    "kubelet_plugin_dir": "dra: the DRA socket dir; unset: /var/lib/kubelet/plugins/vgpu.<domain>",
    "cdi_dir": "where CDI spec files are written for the container runtime (dra, or cdi strategy)",
    "context_overhead_mib": (
        "per-card CUDA context memory (MiB) the hook charges where NVML cannot measure it (0-65536)"
    ),
    "hook_injection": (
        "how sliced containers load the hook: ld-so-preload (a read-only /etc/ld.so.preload "
        "mount plus LD_PRELOAD) or env (LD_PRELOAD only)"
    ),
    "api_unready_after_s": (
        "/readyz turns not-ready once the API server has been unreachable this long (5-86400)"
    ),
    "device_list_strategy": (
        "how cards reach a container: envvar (NVIDIA_VISIBLE_DEVICES), cdi (CDI specs in "
        "cdi_dir) or volume-mounts (/var/run/nvidia-container-devices)"
    ),
    "host_dev_dir": "the host's /dev as mounted here: only device nodes present there are named",
    "host_proc_dir": (
        "the host's /proc as mounted here (read-only): its locks file names each hook process's "
        "host pid, so that hooks need not list the card's processes at start; unreadable: off"
    ),
    "unallocated_policy": (
        "a running container asking vcuda resources that holds no vgpu device: warn (event "
        "and metric) or evict (also evicted through the Eviction API)"
    ),
    "default_core_limit_percent": (
        "burst cap (1-100) of a container without a vcuda-core-limit annotation (DRA: of a "
        "request without a coreLimit in its claim's config): the compute "
        "arbiter lets it use idle capacity up to this; unset: the cap equals its guarantee"
    ),
}
_PATHS = {
    "mock_gpus",
    "device_plugin_dir",
    "pod_resources_socket",
    "kubeconfig",
    "state_dir",
    "hook_library",
    "hook_dir",
    "kubelet_registry_dir",
    "kubelet_plugin_dir",
    "cdi_dir",
    "host_dev_dir",
    "host_proc_dir",
}
_OPTIONAL = {
    "mock_gpus",
    "kubeconfig",
    "node_name",
    "metrics_address",
    "hook_library",
    "kubelet_plugin_dir",
    "default_core_limit_percent",
}
MODES = ("device-plugin", "dra")


@dataclass(frozen=True)
class ExtenderSettings:
    """Everything `vgpu extender` can be told (same precedence as `vgpu serve`)."""

    listen: str = "127.0.0.1:8888"
    kubeconfig: Path | None = None
    resource_domain: str = "vendor.io"
    policy: Policy = Policy.BINPACK
    metrics_address: str | None = None
    log_format: str = "text"
    log_level: str = "info"
    bind_timeout_s: float = 5.0
    node_choice: str = "extender"

    def public(self) -> dict[str, Any]:
        return _public(self)


# `vgpu extender`'s keys; the shared ones mean what they mean for `vgpu serve`.
EXTENDER_KEYS: dict[str, str] = {
    "listen": "HOST:PORT of the extender's HTTP endpoint (kube-scheduler's urlPrefix)",
    "kubeconfig": KEYS["kubeconfig"],
    "resource_domain": KEYS["resource_domain"],
    "policy": "node choice (at filter or prioritize, see node_choice): binpack (fullest node "
    "and card) or spread (emptiest)",
    "metrics_address": KEYS["metrics_address"],
    "log_format": KEYS["log_format"],
    "log_level": KEYS["log_level"],
    "bind_timeout_s": "longest wait for each API call at bind (0.1-30); the bind then fails",
    "node_choice": (
        "extender (filter answers the one node the policy picks: one round trip per pod) or "
        "scheduler (filter keeps every node that fits; prioritize scores them and "
        "kube-scheduler weighs the score with its own plugins' scores)"
    ),
}


def _convert(key: str, value: Any, source: str) -> Any:
    """One raw value (str from env/flags, any from YAML) -> its typed form."""

    def bad(allowed: str) -> ConfigError:
        return ConfigError(f"{source}: {key}={value!r} is invalid; allowed: {allowed}")

    if key == "ignored_xids" and value == "":
        return ()  # an empty list from a flag or the environment: ignore no XID
    if value is None or value == "":
        if key in _OPTIONAL:
            return None
        raise bad("a value (this key cannot be empty)")
    if key in _PATHS:
        if not isinstance(value, str | Path):
            raise bad("a file system path")
        return Path(value)
    if key == "backend":
        if value not in ("nvml", "mock"):
            raise bad("nvml or mock")
        return value
    if key == "mode":
        if value not in MODES:
            raise bad(" or ".join(MODES))
        return value
    if key == "policy":
        try:
            return Policy(value)
        except ValueError:
            raise bad("binpack or spread") from None
    if key == "log_format":
        if value not in ("text", "json"):
            raise bad("text or json")
        return value
    if key == "log_level":
        if str(value).lower() not in ("debug", "info", "warning", "error"):
            raise bad("debug, info, warning or error")
        return str(value).lower()
    if key == "resource_domain":
        if not isinstance(value, str) or not _DOMAIN_RE.match(value) or len(value) > 200:
            raise bad("a DNS domain such as vendor.io (not kubernetes.io)")
        if value == "kubernetes.io" or value.endswith(".kubernetes.io"):
            raise bad("a domain outside kubernetes.io, which is reserved")
        return value
    if key == "memory_unit_mib":
        return _int(value, 64, 65536, bad)
    if key == "api_wait_s":
        return _float(value, 0.0, 2.0, bad)
    if key == "reconcile_interval_s":
        return _float(value, 1.0, 3600.0, bad)
    if key == "context_overhead_mib":
        return _int(value, 0, 65536, bad)
    if key == "api_unready_after_s":
        return _float(value, 5.0, 86400.0, bad)
    if key == "ignored_xids":
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple):
            raise bad("a list of XID numbers, e.g. [13, 31, 43]")
        return tuple(sorted({_int(i, 1, 1000, bad) for i in items if str(i).strip() != ""}))
    if key == "bind_timeout_s":
        return _float(value, 0.1, 30.0, bad)
    if key == "node_choice":
        if value not in ("extender", "scheduler"):
            raise bad("extender or scheduler")
        return value
    if key in ("metrics_address", "listen"):
        match = _ADDRESS_RE.match(str(value))
        if not match or not 0 < int(match.group(2)) < 65536:
            raise bad("HOST:PORT, e.g. 0.0.0.0:9400 or 127.0.0.1:9400")
        return str(value)
    if key == "node_name":
        return str(value)
    if key == "device_list_strategy":
        if value not in ("envvar", "cdi", "volume-mounts"):
            raise bad("envvar, cdi or volume-mounts")
        return value
    if key == "unallocated_policy":
        if value not in ("warn", "evict"):
            raise bad("warn or evict")
        return value
    if key == "metrics_container_names":
        return _bool(value, bad)
    if key == "hook_injection":
        if value not in HOOK_INJECTIONS:
            raise bad(" or ".join(HOOK_INJECTIONS))
        return value
    if key == "default_core_limit_percent":
        return _int(value, 1, 100, bad)
    raise ConfigError(f"{source}: unknown key {key!r}")  # pragma: no cover - guarded by KEYS


def _int(value: Any, low: int, high: int, bad: Any) -> int:
    if isinstance(value, bool):
        raise bad(f"a whole number from {low} to {high}")
    try:
        number = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        raise bad(f"a whole number from {low} to {high}") from None
    if not low <= number <= high:
        raise bad(f"a whole number from {low} to {high}")
    return number


def _bool(value: Any, bad: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "1", "on"):
        return True
    if text in ("false", "no", "0", "off"):
        return False
    raise bad("true or false")


def _float(value: Any, low: float, high: float, bad: Any) -> float:
    if isinstance(value, bool):
        raise bad(f"a number from {low} to {high}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise bad(f"a number from {low} to {high}") from None
    if not low <= number <= high:
        raise bad(f"a number from {low} to {high}")
    return number


def read_file(path: Path, keys: Mapping[str, str] = KEYS) -> dict[str, Any]:
    """Parse and check a config file's shape; ConfigError names the line or key."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise ConfigError(f"config file {path}: YAML {problem}{where}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of keys")
    version = data.pop("version", None)
    if version != CONFIG_VERSION:
        raise ConfigError(
            f"config file {path}: version={version!r} is not supported; "
            f"write 'version: {CONFIG_VERSION}' as the first line"
        )
    for key in data:
        if key not in keys:
            raise ConfigError(
                f"config file {path}: unknown key {key!r}; known keys: {', '.join(keys)}"
            )
    return data


def _merge(
    keys: Mapping[str, str],
    flags: Mapping[str, Any],
    env: Mapping[str, str] | None,
    config_file: Path | None,
    aliases: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Typed values of `keys`, merged flags > VGPU_<KEY> env (then `aliases`, env
    name -> key) > file; each checked, an error naming the key and its source."""
    env = os.environ if env is None else env
    raw: dict[str, tuple[Any, str]] = {}
    file_path = config_file or (
        Path(env["VGPU_CONFIG_FILE"]) if env.get("VGPU_CONFIG_FILE") else None
    )
    if file_path is not None:
        for key, value in read_file(file_path, keys).items():
            raw[key] = (value, f"config file {file_path}")
    for name, key in (aliases or {}).items():
        if env.get(name):
            raw[key] = (env[name], f"environment {name}")
    for key in keys:
        name = "VGPU_" + key.upper()
        if name in env:
            raw[key] = (env[name], f"environment {name}")
    for key, value in flags.items():
        if key not in keys:
            raise ConfigError(f"unknown setting {key!r}")
        if value is not None:
            raw[key] = (value, f"flag --{key.replace('_', '-')}")
    return {key: _convert(key, value, source) for key, (value, source) in raw.items()}


def load(
    flags: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    config_file: Path | None = None,
) -> Settings:
    """Merge flags > env > file > defaults, validate, and return Settings."""
    settings = Settings(**_merge(KEYS, flags, env, config_file, {"NODE_NAME": "node_name"}))
    if settings.backend == "mock" and settings.mock_gpus is None:
        raise ConfigError(
            "backend=mock needs mock_gpus: pass --mock-gpus FILE (a JSON/YAML list of cards)"
        )
    return settings


def load_extender(
    flags: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    config_file: Path | None = None,
) -> ExtenderSettings:
    """`vgpu extender`'s settings: flags > VGPU_<KEY> env > file > defaults."""
    return ExtenderSettings(**_merge(EXTENDER_KEYS, flags, env, config_file))


def default_file() -> str:
    """A commented config file holding every key at its default."""
    defaults = Settings().public()
    lines = [
        "# vgpu configuration file (vgpu serve --config FILE).",
        "# Precedence: command-line flags > VGPU_<KEY> environment > this file > defaults.",
        f"version: {CONFIG_VERSION}",
    ]
    for key, help_text in KEYS.items():
        lines.append(f"# {help_text}")
        value = defaults[key]
        dumped = yaml.safe_dump({key: value}, default_flow_style=True).strip()[1:-1]
        lines.append(dumped if value is not None else f"# {key}:")
    return "\n".join(lines) + "\n"
