"""A do-nothing device plugin over real gRPC.

It is the latency baseline for the benchmarks and lets the kubelet simulator be tested without
the vgpu daemon.  It serves the ``v1beta1.DevicePlugin`` service on ``plugin_dir/socket_name``
(several workers, before registering, as the kubelet dials back inside ``Register``) and then
registers with ``plugin_dir/kubelet.sock``.

* ``GetDevicePluginOptions``: ``get_preferred_allocation_available`` as configured (default on).
* ``ListAndWatch``: sends the device list, then a new full list after each :meth:`set_devices`;
  it never ends on its own (only :meth:`end_stream`, :meth:`stop` or a cancelled call end it).
* ``GetPreferredAllocation``: the first ``allocation_size`` of must-include, then available IDs
  (or :attr:`preference`), or :attr:`preferred_error`.
* ``Allocate``: one response per container request with one env, ``env_name`` = the IDs joined
  by commas (or :attr:`allocate_error`).

With ``watch=True`` a background thread re-serves (if its socket is gone) and registers again
whenever ``kubelet.sock`` is (re)created, like a real plugin must after a kubelet restart; it
also lets the plugin start before the kubelet.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from pathlib import Path

import grpc

from vgpu.pb import deviceplugin_v1beta1_pb2 as pb
from vgpu.pb import deviceplugin_v1beta1_pb2_grpc as pb_grpc

__all__ = ["NullDevicePlugin"]

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
HEALTHY = "Healthy"

_PreferenceFn = Callable[[pb.ContainerPreferredAllocationRequest], Sequence[str]]
_Call = tuple[str, "pb.ContainerPreferredAllocationRequest | pb.ContainerAllocateRequest"]


def _identity(path: Path) -> tuple[int, int] | None:
    """(inode, ctime) of a socket file, None if there is none (inode numbers get reused)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_ctime_ns) if stat.S_ISSOCK(st.st_mode) else None


class _Servicer(pb_grpc.DevicePluginServicer):
    def __init__(self, plugin: NullDevicePlugin) -> None:
        self._p = plugin

    def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(
            get_preferred_allocation_available=self._p.preferred_available
        )

    def ListAndWatch(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        return self._p._list_and_watch(context)

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        return self._p._preferred(request, context)

    def Allocate(
        self, request: pb.AllocateRequest, context: grpc.ServicerContext
    ) -> pb.AllocateResponse:
        return self._p._allocate(request, context)

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()


class NullDevicePlugin:
    """A device plugin that advertises ``device_count`` devices and does nothing else."""

    def __init__(
        self,
        plugin_dir: Path,
        resource_name: str,
        device_count: int,
        socket_name: str,
        *,
        preferred_available: bool = True,
        register_options: pb.DevicePluginOptions | None = None,
        env_name: str | None = None,
        id_prefix: str = "null",
        topology: Mapping[str, Sequence[int]] | None = None,
        watch: bool = False,
        workers: int = 4,
    ) -> None:
        self.plugin_dir = Path(plugin_dir).absolute()
        self.resource_name = resource_name
        self.socket_name = socket_name
        self.socket_path = self.plugin_dir / socket_name
        self.kubelet_socket = self.plugin_dir / KUBELET_SOCKET
        self.preferred_available = preferred_available
        #: Options sent in the RegisterRequest (the kubelet ignores them); default: as served.
        self.register_options = register_options
        suffix = re.sub(r"[^A-Za-z0-9]", "_", resource_name).upper()
        self.env_name = env_name or f"NULL_{suffix}_DEVICES"
        self.watch = watch
        self._workers = max(2, workers)
        #: Hooks for tests: an error to return, or a custom preference.
        self.preferred_error: tuple[grpc.StatusCode, str] | None = None
        self.allocate_error: tuple[grpc.StatusCode, str] | None = None
        self.preference: _PreferenceFn | None = None
        self.allocate_delay_s = 0.0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._health = {f"{id_prefix}-{i}": HEALTHY for i in range(device_count)}
        self._topology = {k: list(v) for k, v in (topology or {}).items()}
        self._version = 0
        self._stream_gen = 0
        self._streams = 0
        self._stopping = True
        self._server: grpc.Server | None = None
        self._watcher: threading.Thread | None = None
        self._registered_kubelet: tuple[int, int] | None = None
        self._calls: list[_Call] = []
        self.registrations = 0

    # ---- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> NullDevicePlugin:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Serve, then register.  With ``watch``, a missing kubelet is waited for instead."""
        with self._lock:
            if not self._stopping:
                return
            self._stopping = False
        self._serve()
        if self.watch:
            if self.kubelet_socket.exists():
                with contextlib.suppress(grpc.RpcError):
                    self.register()
            self._watcher = threading.Thread(
                target=self._watch, name=f"nullplugin-watch-{self.socket_name}", daemon=True
            )
            self._watcher.start()
        else:
            self.register()

    def stop(self) -> None:
        """End the streams, stop serving and remove the socket.  Idempotent."""
        with self._lock:
            self._stopping = True
            server = self._server
            self._server = None
            self._cond.notify_all()
        if server is not None:
            server.stop(grace=0.2).wait(1.0)
        watcher = self._watcher
        self._watcher = None
        if watcher is not None:
            watcher.join(2.0)
        self._remove_own_socket()

    def register(self) -> None:
        """Register with the kubelet (raises ``grpc.RpcError`` on failure)."""
        inode = _identity(self.kubelet_socket)
        options = self.register_options or pb.DevicePluginOptions(
            get_preferred_allocation_available=self.preferred_available
        )
        with grpc.insecure_channel(f"unix://{self.kubelet_socket}") as channel:
            stub = pb_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
            register: grpc.UnaryUnaryMultiCallable[pb.RegisterRequest, pb.Empty] = stub.Register
            register(
                pb.RegisterRequest(
                    version=API_VERSION,
                    endpoint=self.socket_name,
                    resource_name=self.resource_name,
                    options=options,
                ),
                timeout=15.0,
                wait_for_ready=True,
            )
        with self._lock:
            self._registered_kubelet = inode
            self.registrations += 1

    def _serve(self) -> None:
        # Stop the old server first: gRPC unlinks a server's Unix socket path when it shuts
        # down, so stopping it after binding the new one would delete the new socket.
        with self._lock:
            old = self._server
            self._server = None
        if old is not None:
            old.stop(grace=None).wait(1.0)
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self._remove_own_socket()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self._workers))
        pb_grpc.add_DevicePluginServicer_to_server(  # type: ignore[no-untyped-call]
            _Servicer(self), server
        )
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        with self._lock:
            self._server = server

    def _remove_own_socket(self) -> None:
        if _identity(self.socket_path) is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)

    def _watch(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    return
                self._cond.wait(0.05)
                if self._stopping:
                    return
                registered = self._registered_kubelet
            # React to a (re)created kubelet.sock only: a starting kubelet deletes every socket
            # first and creates kubelet.sock last, so by then our socket is gone for good.
            # Reacting to our own socket vanishing would race with that cleanup.
            kubelet = _identity(self.kubelet_socket)
            if kubelet is None or kubelet == registered:
                continue
            try:
                if _identity(self.socket_path) is None:
                    self._serve()
                self.register()
            except grpc.RpcError:
                time.sleep(0.1)

    # ---- controls ---------------------------------------------------------------------------

    @property
    def device_ids(self) -> list[str]:
        with self._lock:
            return list(self._health)

    def set_devices(
        self, health: Mapping[str, str], topology: Mapping[str, Sequence[int]] | None = None
    ) -> None:
        """Replace the device list (ID -> health) and push it on every open stream."""
        with self._lock:
            self._health = dict(health)
            if topology is not None:
                self._topology = {k: list(v) for k, v in topology.items()}
            self._version += 1
            self._cond.notify_all()

    def end_stream(self) -> None:
        """Make every open ListAndWatch stream return (later streams work normally)."""
        with self._lock:
            self._stream_gen += 1
            self._cond.notify_all()

    def active_streams(self) -> int:
        with self._lock:
            return self._streams

    def calls(self) -> list[_Call]:
        """("GetPreferredAllocation" | "Allocate", the container request) in arrival order."""
        with self._lock:
            return list(self._calls)

    # ---- handlers ---------------------------------------------------------------------------

    def _message(self) -> pb.ListAndWatchResponse:
        # Caller holds self._lock.
        devices = []
        for dev_id, health in self._health.items():
            dev = pb.Device(ID=dev_id, health=health)
            for node in self._topology.get(dev_id, ()):
                dev.topology.nodes.append(pb.NUMANode(ID=node))
            devices.append(dev)
        return pb.ListAndWatchResponse(devices=devices)

    def _list_and_watch(self, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        def wake() -> None:
            with self._lock:
                self._cond.notify_all()

        context.add_callback(wake)
        with self._lock:
            gen = self._stream_gen
            self._streams += 1
        sent = -1
        try:
            while True:
                with self._lock:
                    while (
                        not self._stopping
                        and gen == self._stream_gen
                        and sent == self._version
                        and context.is_active()
                    ):
                        self._cond.wait(0.5)
                    if self._stopping or gen != self._stream_gen or not context.is_active():
                        return
                    sent = self._version
                    msg = self._message()
                yield msg
        finally:
            with self._lock:
                self._streams -= 1

    def _preferred(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        with self._lock:
            for creq in request.container_requests:
                copy = pb.ContainerPreferredAllocationRequest()
                copy.CopyFrom(creq)
                self._calls.append(("GetPreferredAllocation", copy))
            error = self.preferred_error
            preference = self.preference
        if error is not None:
            context.abort(error[0], error[1])
        responses = []
        for creq in request.container_requests:
            if preference is not None:
                ids = list(preference(creq))
            else:
                ids = list(dict.fromkeys([*creq.must_include_deviceIDs, *creq.available_deviceIDs]))
                ids = ids[: creq.allocation_size]
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=responses)

    def _allocate(
        self, request: pb.AllocateRequest, context: grpc.ServicerContext
    ) -> pb.AllocateResponse:
        with self._lock:
            for creq in request.container_requests:
                copy = pb.ContainerAllocateRequest()
                copy.CopyFrom(creq)
                self._calls.append(("Allocate", copy))
            error = self.allocate_error
            delay = self.allocate_delay_s
        if delay > 0:
            time.sleep(delay)
        if error is not None:
            context.abort(error[0], error[1])
        return pb.AllocateResponse(
            container_responses=[
                pb.ContainerAllocateResponse(envs={self.env_name: ",".join(creq.devices_ids)})
                for creq in request.container_requests
            ]
        )
