"""A stand-in for the kubelet's side of DRA, speaking the real gRPC APIs over
Unix sockets (see vgpu/pb/dra_v1.proto and pluginregistration_v1.proto):

* Plugin watcher: polls the registry directory (the kubelet uses fsnotify)
  for sockets; for each new one it calls ``Registration.GetInfo``, checks the
  answer (type ``DRAPlugin``, a name, an endpoint that is a socket, a supported
  version ``v1.DRAPlugin``) and reports the outcome with
  ``NotifyRegistrationStatus``. A socket that goes away deregisters the
  driver; with an API server, the driver's slices of this node are wiped
  ``wipe_delay_s`` later unless it registered again meanwhile (the kubelet
  waits about 30 s).
* ``prepare`` / ``unprepare``: one ``NodePrepareResources`` /
  ``NodeUnprepareResources`` call to the registered endpoint with the claims of
  one pod, as the kubelet makes them (client-side latencies recorded).
* Health (1.36): after a registration it opens the driver's
  ``v1alpha1.DRAResourceHealth/NodeWatchResources`` stream and keeps the
  latest health per device (``health``); an error (e.g. UNIMPLEMENTED) is
  recorded in ``health_errors`` and the stream opened again ``health_retry_s``
  later, as the kubelet does every 5 s.
* ``restart``: a starting kubelet deletes every ResourceSlice of its node.
* ``resolve``: what a CDI-enabled container runtime does with the CDI device
  IDs the kubelet hands it: find each device in the CDI spec directory and
  merge the containerEdits (env by name, mounts by container path, device
  nodes by path).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from vgpu.pb import dra_v1_pb2 as pb
from vgpu.pb import dra_v1_pb2_grpc as pb_grpc
from vgpu.pb import drahealth_v1alpha1_pb2 as hpb
from vgpu.pb import drahealth_v1alpha1_pb2_grpc as hpb_grpc
from vgpu.pb import pluginregistration_v1_pb2 as reg
from vgpu.pb import pluginregistration_v1_pb2_grpc as reg_grpc
from vgpu.sim.apiserver import FakeApiServer

__all__ = ["CdiEdits", "DraKubelet", "Registration"]

PLUGIN_TYPE = "DRAPlugin"
SERVICE_VERSION = "v1.DRAPlugin"


@dataclass(frozen=True)
class Registration:
    driver: str
    endpoint: str
    socket: str
    versions: tuple[str, ...]


@dataclass
class CdiEdits:
    """What a container gets from its CDI devices, merged like a runtime does."""

    env: dict[str, str] = field(default_factory=dict)
    mounts: dict[str, dict[str, Any]] = field(default_factory=dict)  # by container path
    device_nodes: dict[str, dict[str, Any]] = field(default_factory=dict)  # by path


class DraKubelet:
    def __init__(
        self,
        registry_dir: Path,
        cdi_dir: Path,
        *,
        api: FakeApiServer | None = None,
        node: str = "",
        poll_s: float = 0.05,
        wipe_delay_s: float | None = 30.0,
        rpc_timeout_s: float = 30.0,
    ) -> None:
        self.registry_dir = registry_dir
        self.cdi_dir = cdi_dir
        self.api = api
        self.node = node
        self.poll_s = poll_s
        self.wipe_delay_s = wipe_delay_s
        self.rpc_timeout_s = rpc_timeout_s
        self.plugins: dict[str, Registration] = {}
        self.refused: list[str] = []  # why registrations were refused
        self.retried: list[str] = []  # registrations whose calls failed, tried again
        self.latencies_s: dict[str, list[float]] = {"prepare": [], "unprepare": []}
        self._registrations: dict[str, int] = {}
        self._seen: dict[str, tuple[int, int]] = {}  # socket path -> (inode, ctime)
        self._channels: dict[str, grpc.Channel] = {}
        self._wipes: dict[str, threading.Timer] = {}
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.health_retry_s = 5.0
        # driver -> (pool, device) -> (HEALTHY/UNHEALTHY/UNKNOWN, message)
        self.health: dict[str, dict[tuple[str, str], tuple[str, str]]] = {}
        self.health_messages: dict[str, int] = {}
        self.health_errors: list[str] = []
        self._health_threads: dict[str, threading.Thread] = {}
        self._health_calls: dict[str, Any] = {}

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="dra-kubelet-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        for timer in list(self._wipes.values()):
            timer.cancel()
        for call in list(self._health_calls.values()):
            call.cancel()
        for thread in list(self._health_threads.values()):
            thread.join(2.0)
        self._health_threads.clear()
        for channel in list(self._channels.values()):
            channel.close()
        self._channels.clear()

    def restart(self) -> None:
        """A starting kubelet: deletes its node's ResourceSlices, then watches again."""
        self.stop()
        with self._lock:
            self.plugins.clear()
            self._seen.clear()
        if self.api is not None:
            for obj in self.api.objects("resourceslices"):
                if (obj.get("spec") or {}).get("nodeName") == self.node:
                    with contextlib.suppress(KeyError):
                        self.api.delete_object("resourceslices", obj["metadata"]["name"])
        self.start()

    # -------------------------------------------------------- plugin watcher

    def _watch(self) -> None:
        while not self._stop.is_set():
            present: dict[str, tuple[int, int]] = {}
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(self.registry_dir):
                    with contextlib.suppress(OSError):
                        st = entry.stat(follow_symlinks=False)
                        if stat.S_ISSOCK(st.st_mode):
                            present[entry.path] = (st.st_ino, st.st_ctime_ns)
            for path, ident in present.items():
                if self._seen.get(path) != ident:
                    self._seen[path] = ident
                    self._register(path)
            for path in set(self._seen) - set(present):
                del self._seen[path]
                self._deregister(path)
            self._stop.wait(self.poll_s)

    def _register(self, path: str) -> None:
        try:
            with grpc.insecure_channel(f"unix://{path}") as channel:
                stub = reg_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
                info = stub.GetInfo(reg.InfoRequest(), timeout=5)
                error = self._check(info)
                stub.NotifyRegistrationStatus(
                    reg.RegistrationStatus(plugin_registered=not error, error=error), timeout=5
                )
        except grpc.RpcError as exc:
            # Not a refusal: the kubelet's plugin manager retries a registration
            # whose calls failed (its reconciler, every second), so look at the
            # socket again at the next poll.
            self.retried.append(f"{path}: {exc.code().name}")
            self._seen.pop(path, None)
            return
        if error:
            self.refused.append(error)
            return
        with self._lock:
            timer = self._wipes.pop(info.name, None)
            if timer is not None:
                timer.cancel()
            old = self.plugins.get(info.name)
            if old is not None and old.endpoint != info.endpoint:
                channel_old = self._channels.pop(info.name, None)
                if channel_old is not None:
                    channel_old.close()
            self.plugins[info.name] = Registration(
                info.name, info.endpoint, path, tuple(info.supported_versions)
            )
            self._registrations[info.name] = self._registrations.get(info.name, 0) + 1
            self._lock.notify_all()
            running = self._health_threads.get(info.name)
            if running is None or not running.is_alive():
                thread = threading.Thread(
                    target=self._watch_health, args=(info.name,), name="dra-health", daemon=True
                )
                self._health_threads[info.name] = thread
                thread.start()

    def _watch_health(self, driver: str) -> None:
        """The kubelet's health stream on a registered driver, opened again after errors."""
        while not self._stop.is_set():
            with self._lock:
                plugin = self.plugins.get(driver)
            if plugin is None:
                return
            try:
                with grpc.insecure_channel(f"unix://{plugin.endpoint}") as channel:
                    stub = hpb_grpc.DRAResourceHealthStub(channel)  # type: ignore[no-untyped-call]
                    call = stub.NodeWatchResources(hpb.NodeWatchResourcesRequest())
                    self._health_calls[driver] = call
                    for message in call:
                        devices = {
                            (d.device.pool_name, d.device.device_name): (
                                hpb.HealthStatus.Name(d.health),
                                d.message,
                            )
                            for d in message.devices
                        }
                        with self._lock:
                            self.health[driver] = devices
                            self.health_messages[driver] = self.health_messages.get(driver, 0) + 1
                            self._lock.notify_all()
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED:
                    self.health_errors.append(f"{driver}: {exc.code().name}")
            finally:
                self._health_calls.pop(driver, None)
            self._stop.wait(self.health_retry_s)

    def _check(self, info: reg.PluginInfo) -> str:
        if info.type != PLUGIN_TYPE:
            return f"plugin type {info.type!r} is not {PLUGIN_TYPE}"
        if not info.name:
            return "the plugin gave no name"
        if SERVICE_VERSION not in info.supported_versions:
            return f"{info.name} supports {list(info.supported_versions)}, not {SERVICE_VERSION}"
        try:
            if not stat.S_ISSOCK(os.stat(info.endpoint).st_mode):
                return f"endpoint {info.endpoint} is not a socket"
        except OSError:
            return f"endpoint {info.endpoint!r} does not exist"
        return ""

    def _deregister(self, path: str) -> None:
        with self._lock:
            gone = [name for name, r in self.plugins.items() if r.socket == path]
            for name in gone:
                del self.plugins[name]
                channel = self._channels.pop(name, None)
                if channel is not None:
                    channel.close()
                if self.api is not None and self.wipe_delay_s is not None:
                    timer = threading.Timer(self.wipe_delay_s, self._wipe, args=(name,))
                    timer.daemon = True
                    self._wipes[name] = timer
                    timer.start()
            self._lock.notify_all()

    def _wipe(self, driver: str) -> None:
        assert self.api is not None
        with self._lock:
            if driver in self.plugins:
                return
            self._wipes.pop(driver, None)
        for obj in self.api.objects("resourceslices"):
            spec = obj.get("spec") or {}
            if spec.get("nodeName") == self.node and spec.get("driver") == driver:
                with contextlib.suppress(KeyError):
                    self.api.delete_object("resourceslices", obj["metadata"]["name"])

    def registrations(self, driver: str) -> int:
        with self._lock:
            return self._registrations.get(driver, 0)

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.05))
        return True

    # -------------------------------------------------------------- calls

    def _stub(self, driver: str) -> pb_grpc.DRAPluginStub:
        with self._lock:
            plugin = self.plugins.get(driver)
            if plugin is None:
                raise LookupError(f"DRA driver {driver} is not registered")
            channel = self._channels.get(driver)
            if channel is None:
                channel = grpc.insecure_channel(f"unix://{plugin.endpoint}")
                self._channels[driver] = channel
        return pb_grpc.DRAPluginStub(channel)  # type: ignore[no-untyped-call]

    def prepare(
        self, driver: str, claims: Sequence[tuple[str, str, str]]
    ) -> pb.NodePrepareResourcesResponse:
        """NodePrepareResources for (namespace, uid, name) claims of one pod."""
        request = pb.NodePrepareResourcesRequest(claims=_claims(claims))
        reply: pb.NodePrepareResourcesResponse = self._timed(
            "prepare", self._stub(driver).NodePrepareResources, request
        )
        return reply

    def unprepare(
        self, driver: str, claims: Sequence[tuple[str, str, str]]
    ) -> pb.NodeUnprepareResourcesResponse:
        request = pb.NodeUnprepareResourcesRequest(claims=_claims(claims))
        reply: pb.NodeUnprepareResourcesResponse = self._timed(
            "unprepare", self._stub(driver).NodeUnprepareResources, request
        )
        return reply

    def _timed(self, kind: str, method: Callable[..., Any], request: Any) -> Any:
        started = time.perf_counter()
        reply = method(request, timeout=self.rpc_timeout_s)
        self.latencies_s[kind].append(time.perf_counter() - started)
        return reply

    # ---------------------------------------------------------------- CDI

    def cdi_devices(self) -> dict[str, dict[str, Any]]:
        """Every CDI device in the spec directory, by fully qualified ID."""
        out: dict[str, dict[str, Any]] = {}
        with contextlib.suppress(FileNotFoundError):
            for entry in sorted(self.cdi_dir.iterdir()):
                if entry.suffix != ".json":
                    continue
                spec = json.loads(entry.read_text())
                for device in spec.get("devices") or []:
                    out[f"{spec['kind']}={device['name']}"] = device
        return out

    def resolve(self, cdi_ids: Sequence[str]) -> CdiEdits:
        """Merge the containerEdits of these CDI devices; KeyError for an unresolvable ID."""
        known = self.cdi_devices()
        edits = CdiEdits()
        for cdi_id in cdi_ids:
            device = known[cdi_id]
            container = device.get("containerEdits") or {}
            for item in container.get("env") or []:
                key, _, value = item.partition("=")
                edits.env[key] = value
            for mount in container.get("mounts") or []:
                edits.mounts[mount["containerPath"]] = mount
            for node in container.get("deviceNodes") or []:
                edits.device_nodes[node["path"]] = node
        return edits


def _claims(claims: Sequence[tuple[str, str, str]]) -> list[pb.Claim]:
    return [pb.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in claims]
