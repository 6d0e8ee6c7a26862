"""An in-process kubelet simulator speaking the real device-plugin gRPC API over Unix sockets.

It drives a device plugin (the vgpu daemon, or :class:`vgpu.sim.nullplugin.NullDevicePlugin`)
the way the kubelet's device manager does (see ``/work/shared/KUBELET.md``):

* It serves ``v1beta1.Registration`` on ``<plugin_dir>/kubelet.sock``.  Inside ``Register`` it
  dials the plugin's socket (10 s timeout), calls ``GetDevicePluginOptions`` and keeps *that*
  answer (not the options in the request), then consumes ``ListAndWatch`` on a background
  thread.  Every message replaces the resource's device list.  A new registration for the same
  resource replaces the old one; the old stream is left open (the kubelet does not close it).
  When a stream ends or fails, all of the resource's devices turn Unhealthy and the simulator
  never reconnects: the plugin has to register again.  A replaced registration's stream that
  ends does the same to the *current* registration (seen on kubelet 1.36.2: it disconnects
  the newer client, closing its stream, and marks the resource's devices Unhealthy until
  the plugin registers again).
* :meth:`KubeletSimulator.admit` admits one pod at a time: init containers first, then app
  containers; per container, resources in random (seeded) order unless ``resource_order`` is
  given; reuse of init-container IDs; ``GetPreferredAllocation`` (when the plugin advertises it)
  with the kubelet's arguments; preferred-then-arbitrary selection; one ``Allocate`` per
  container and resource with exactly one container request; the kubelet's merge of the answers
  (first one wins on a duplicate key).  No deadline on either call unless ``rpc_timeout_s``.
* :meth:`KubeletSimulator.restart` behaves like a starting kubelet: it deletes every socket in the
  plugin directory (the plugins' too) and serves ``kubelet.sock`` again.  Allocations survive
  (the kubelet's checkpoint); resources have no devices until their plugin registers again.
* Optionally it serves ``v1.PodResourcesLister`` (List, Get, GetAllocatableResources).

Plugins may be started before the simulator: nothing is needed here for that, the plugin just
has to register once ``kubelet.sock`` exists (the real kubelet behaves the same way).

Differences from the real kubelet, on purpose:

* :meth:`KubeletSimulator.remove_pod` frees a pod's IDs at once; the kubelet frees them lazily,
  at the next admission.  The outcome of every later admission is the same.
* :meth:`KubeletSimulator.allocatable` is "healthy and not held by an active pod" (what is free
  for the next admission), while the node's status allocatable counts healthy devices only.
* The Allocate answers of a container are merged in call order.  The kubelet merges them in Go
  map order (random) when the container starts; with answers that agree this makes no
  difference, which is exactly what plugins must guarantee.
* Resources are never dropped after 5 minutes without a plugin; restartable init containers
  (sidecars), topology-manager alignment and ``PreStartContainer`` are not simulated.
* A resource that never registered fails admission with "cannot allocate unregistered device".
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from vgpu.pb import deviceplugin_v1beta1_pb2 as pb
from vgpu.pb import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from vgpu.pb import podresources_v1_pb2 as pr
from vgpu.pb import podresources_v1_pb2_grpc as pr_grpc
from vgpu.sim import checkpoint

__all__ = [
    "API_VERSION",
    "KUBELET_SOCKET",
    "Admission",
    "ContainerResult",
    "KubeletSimulator",
    "SimContainer",
    "SimPod",
]

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
#: The kubelet's gRPC client keeps the default 4 MiB receive limit for ListAndWatch.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
#: Unix socket paths are limited to 108 bytes including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
#: NUMA node id the kubelet records for devices without topology (pod-resources List).
NODE_WITHOUT_TOPOLOGY = -1

CALL_PREFERRED = "GetPreferredAllocation"
CALL_ALLOCATE = "Allocate"
CALL_CHECKPOINT = "checkpoint write"

_POLL_S = 0.05


# --------------------------------------------------------------------------------------------
# Pods and results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimContainer:
    """One container: extended resource name -> requested count (request == limit)."""

    name: str
    requests: Mapping[str, int] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for resource, count in self.requests.items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"{self.name}: request for {resource} must be an int >= 0")
        object.__setattr__(self, "requests", dict(self.requests))


@dataclass(frozen=True)
class SimPod:
    """A pod.  An empty ``uid`` is replaced by a fresh uuid4."""

    name: str
    containers: Sequence[SimContainer]
    init_containers: Sequence[SimContainer] = ()
    namespace: str = "default"
    uid: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "containers", tuple(self.containers))
        object.__setattr__(self, "init_containers", tuple(self.init_containers))
        if not self.uid:
            object.__setattr__(self, "uid", str(uuid.uuid4()))
        names = [c.name for c in (*self.init_containers, *self.containers)]
        if len(set(names)) != len(names):
            raise ValueError(f"pod {self.name}: duplicate container names {names}")

    @classmethod
    def new(
        cls,
        name: str,
        containers: Sequence[SimContainer],
        init_containers: Sequence[SimContainer] = (),
        namespace: str = "default",
        uid: str = "",
    ) -> SimPod:
        """Build a pod; the uid is a fresh uuid4 unless given."""
        return cls(name, containers, init_containers, namespace, uid or str(uuid.uuid4()))

    @classmethod
    def single(cls, name: str, requests: Mapping[str, int], namespace: str = "default") -> SimPod:
        """A pod with one app container named ``main``."""
        return cls.new(name, [SimContainer("main", requests)], namespace=namespace)


@dataclass
class ContainerResult:
    """What one container got, merged like the kubelet merges the Allocate answers."""

    name: str
    init: bool = False
    device_ids: dict[str, list[str]] = field(default_factory=dict)
    responses: dict[str, pb.ContainerAllocateResponse] = field(default_factory=dict)
    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[pb.Mount] = field(default_factory=list)
    devices: list[pb.DeviceSpec] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: list[str] = field(default_factory=list)
    #: Conflicting duplicates that were dropped (the kubelet only logs them).
    clashes: list[str] = field(default_factory=list)
    #: ("GetPreferredAllocation" | "Allocate", resource) in call order.
    calls: list[tuple[str, str]] = field(default_factory=list)

    def merge(self, resource: str, resp: pb.ContainerAllocateResponse) -> None:
        """Merge one resource's answer; on a duplicate key the first one wins."""
        for key, value in resp.envs.items():
            if key in self.envs:
                if self.envs[key] != value:
                    self.clashes.append(
                        f"env {key}: kept {self.envs[key]!r}, dropped {value!r} from {resource}"
                    )
                continue
            self.envs[key] = value
        seen_mounts = {m.container_path: m for m in self.mounts}
        for mount in resp.mounts:
            old_mount = seen_mounts.get(mount.container_path)
            if old_mount is not None:
                if (old_mount.host_path, old_mount.read_only) != (mount.host_path, mount.read_only):
                    self.clashes.append(
                        f"mount {mount.container_path}: kept {old_mount.host_path!r}, "
                        f"dropped {mount.host_path!r} from {resource}"
                    )
                continue
            copy = pb.Mount()
            copy.CopyFrom(mount)
            self.mounts.append(copy)
            seen_mounts[copy.container_path] = copy
        seen_devs = {d.container_path: d for d in self.devices}
        for dev in resp.devices:
            old_dev = seen_devs.get(dev.container_path)
            if old_dev is not None:
                if old_dev.host_path != dev.host_path:
                    self.clashes.append(
                        f"device {dev.container_path}: kept {old_dev.host_path!r}, "
                        f"dropped {dev.host_path!r} from {resource}"
                    )
                continue
            dcopy = pb.DeviceSpec()
            dcopy.CopyFrom(dev)
            self.devices.append(dcopy)
            seen_devs[dcopy.container_path] = dcopy
        for key, value in resp.annotations.items():
            if key in self.annotations:
                if self.annotations[key] != value:
                    self.clashes.append(
                        f"annotation {key}: kept {self.annotations[key]!r}, "
                        f"dropped {value!r} from {resource}"
                    )
                continue
            self.annotations[key] = value
        for cdi in resp.cdi_devices:
            if cdi.name not in self.cdi_devices:
                self.cdi_devices.append(cdi.name)


@dataclass
class Admission:
    """The outcome of :meth:`KubeletSimulator.admit`."""

    pod: SimPod
    ok: bool
    containers: list[ContainerResult]
    error: str | None = None
    code: grpc.StatusCode | None = None
    latencies_s: dict[str, list[float]] = field(default_factory=dict)

    def container(self, name: str) -> ContainerResult:
        for result in self.containers:
            if result.name == name:
                return result
        raise KeyError(name)


class _AdmissionError(Exception):
    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


# --------------------------------------------------------------------------------------------
# Internal state
# --------------------------------------------------------------------------------------------


class _PluginClient:
    """Typed view of the generated DevicePlugin stub."""

    def __init__(self, channel: grpc.Channel) -> None:
        stub = pb_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
        self.get_options: grpc.UnaryUnaryMultiCallable[pb.Empty, pb.DevicePluginOptions] = (
            stub.GetDevicePluginOptions
        )
        self.list_and_watch: grpc.UnaryStreamMultiCallable[pb.Empty, pb.ListAndWatchResponse] = (
            stub.ListAndWatch
        )
        self.preferred: grpc.UnaryUnaryMultiCallable[
            pb.PreferredAllocationRequest, pb.PreferredAllocationResponse
        ] = stub.GetPreferredAllocation
        self.allocate: grpc.UnaryUnaryMultiCallable[pb.AllocateRequest, pb.AllocateResponse] = (
            stub.Allocate
        )


class _Conn:
    """One registration: the channel to the plugin and its ListAndWatch stream."""

    def __init__(self, resource: str, endpoint: str, channel: grpc.Channel) -> None:
        self.resource = resource
        self.endpoint = endpoint
        self.channel = channel
        self.client = _PluginClient(channel)
        self.call: grpc.CallIterator[pb.ListAndWatchResponse] | None = None
        self.thread: threading.Thread | None = None
        self.messages = 0
        self.closed = False

    def close(self) -> None:
        self.closed = True
        if self.call is not None:
            self.call.cancel()  # type: ignore[no-untyped-call]
        self.channel.close()


@dataclass
class _Resource:
    name: str
    registrations: int = 0
    options: pb.DevicePluginOptions | None = None
    devices: dict[str, str] = field(default_factory=dict)
    topology: dict[str, list[int]] = field(default_factory=dict)
    messages: int = 0
    max_message_bytes: int = 0
    conn: _Conn | None = None
    replaced: list[_Conn] = field(default_factory=list)  # older registrations, still open


@dataclass
class _PodState:
    pod: SimPod
    #: container -> resource -> IDs, in allocation order.
    containers: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    #: resource -> IDs held by init containers and not yet reused by an app container.
    reusable: dict[str, list[str]] = field(default_factory=dict)
    #: (container, resource) -> the Allocate response, serialized (the checkpoint keeps it).
    responses: dict[tuple[str, str], bytes] = field(default_factory=dict)


def _is_extended_resource_name(name: str) -> bool:
    domain, sep, short = name.partition("/")
    if not sep or not domain or not short or "/" in short:
        return False
    return not (domain == "kubernetes.io" or domain.endswith(".kubernetes.io"))


def _check_socket_path(path: Path) -> None:
    if len(str(path).encode()) > MAX_SOCKET_PATH_BYTES:
        raise ValueError(f"socket path longer than {MAX_SOCKET_PATH_BYTES} bytes: {path}")


def _remove_socket(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()


# --------------------------------------------------------------------------------------------
# gRPC services
# --------------------------------------------------------------------------------------------


class _RegistrationService(pb_grpc.RegistrationServicer):
    def __init__(self, sim: KubeletSimulator, epoch: int) -> None:
        self._sim = sim
        self._epoch = epoch

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        self._sim._register(request, context, self._epoch)
        return pb.Empty()


class _PodResourcesService(pr_grpc.PodResourcesListerServicer):
    def __init__(self, sim: KubeletSimulator) -> None:
        self._sim = sim

    def List(
        self, request: pr.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> pr.ListPodResourcesResponse:
        return pr.ListPodResourcesResponse(pod_resources=self._sim._pod_resources())

    def Get(
        self, request: pr.GetPodResourcesRequest, context: grpc.ServicerContext
    ) -> pr.GetPodResourcesResponse:
        for item in self._sim._pod_resources():
            if item.name == request.pod_name and item.namespace == request.pod_namespace:
                return pr.GetPodResourcesResponse(pod_resources=item)
        context.abort(
            grpc.StatusCode.NOT_FOUND,
            f"pod {request.pod_name} in namespace {request.pod_namespace} not found",
        )

    def GetAllocatableResources(
        self, request: pr.AllocatableResourcesRequest, context: grpc.ServicerContext
    ) -> pr.AllocatableResourcesResponse:
        return pr.AllocatableResourcesResponse(devices=self._sim._allocatable_devices())


# --------------------------------------------------------------------------------------------
# The simulator
# --------------------------------------------------------------------------------------------


class KubeletSimulator:
    """A kubelet device manager over real gRPC.  All public methods are thread-safe.

    Admissions are serialized (the kubelet admits one pod at a time); the plugin RPCs run
    without holding the state lock, so device updates keep flowing during a slow Allocate.
    """

    def __init__(
        self,
        plugin_dir: Path,
        pod_resources_socket: Path | None = None,
        *,
        seed: int | None = None,
        call_preferred: bool = True,
        dial_timeout_s: float = 10.0,
        rpc_timeout_s: float | None = None,
        workers: int = 8,
        write_checkpoint: bool = True,
    ) -> None:
        self.plugin_dir = Path(plugin_dir).absolute()
        #: Like the kubelet: the checkpoint is rewritten (fsync'ed) after every allocation.
        self.write_checkpoint = write_checkpoint
        self.checkpoint_path = self.plugin_dir / checkpoint.CHECKPOINT_NAME
        self.checkpoint_bytes = 0  # size of the last checkpoint written
        self.socket_path = self.plugin_dir / KUBELET_SOCKET
        self.pod_resources_socket = (
            Path(pod_resources_socket).absolute() if pod_resources_socket is not None else None
        )
        _check_socket_path(self.socket_path)
        if self.pod_resources_socket is not None:
            _check_socket_path(self.pod_resources_socket)
        self.call_preferred = call_preferred
        self.dial_timeout_s = dial_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self._workers = max(2, workers)
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._admit_lock = threading.Lock()
        self._seq = 0
        self._epoch = 0
        self._serving = False
        self._reg_server: grpc.Server | None = None
        self._pr_server: grpc.Server | None = None
        self._resources: dict[str, _Resource] = {}
        self._pods: dict[str, _PodState] = {}
        self._threads: list[threading.Thread] = []
        # A restarting kubelet's pod-resources answers (see restart()): empty
        # until _podres_blank_until, then only every other pod until
        # _podres_partial_until (monotonic times).
        self._podres_blank_until = 0.0
        self._podres_partial_until = 0.0
        # Set by restart(): admissions wait for the plugins to register again.
        self._restarted = threading.Event()
        self._restarted.set()

    # ---- lifecycle -----------------------------------------------------------------------

    def __enter__(self) -> KubeletSimulator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Serve Registration on ``plugin_dir/kubelet.sock`` (and pod-resources if configured)."""
        with self._lock:
            if self._serving:
                return
            self.plugin_dir.mkdir(parents=True, exist_ok=True)
            self._serve_pod_resources()
            self._serve_registration()

    def _serve_pod_resources(self) -> None:
        # Caller holds self._lock.
        if self.pod_resources_socket is None or self._pr_server is not None:
            return
        self.pod_resources_socket.parent.mkdir(parents=True, exist_ok=True)
        _remove_socket(self.pod_resources_socket)
        server = self._new_server()
        pr_grpc.add_PodResourcesListerServicer_to_server(  # type: ignore[no-untyped-call]
            _PodResourcesService(self), server
        )
        server.add_insecure_port(f"unix://{self.pod_resources_socket}")
        server.start()
        self._pr_server = server

    def stop(self) -> None:
        """Close everything and remove the sockets this simulator created.  Idempotent.

        Pods and their allocations are kept; a later :meth:`start` sees no devices until the
        plugins register again (like :meth:`restart`, without deleting the plugins' sockets).
        """
        with self._lock:
            self._epoch += 1
            self._serving = False
            conns = self._take_conns()
            self._forget_devices()
            servers = [s for s in (self._reg_server, self._pr_server) if s is not None]
            self._reg_server = None
            self._pr_server = None
            self._cond.notify_all()
        self._shutdown(conns, servers)
        _remove_socket(self.socket_path)
        if self.pod_resources_socket is not None:
            _remove_socket(self.pod_resources_socket)

    def restart(
        self,
        *,
        podres_blank_s: float = 0.0,
        podres_partial_s: float = 0.0,
        register_delay_s: float = 0.0,
        down_s: float = 0.0,
    ) -> None:
        """Behave like a starting kubelet (as a real kubelet 1.36 does it, KUBELET.md).

        Stops serving and closes every plugin connection and stream; `down_s`
        later (nothing answers meanwhile) it serves its pod-resources API again
        on a re-created socket: for `podres_blank_s` its List is empty and for
        `podres_partial_s` more it lists only every other pod, although every
        container still runs (the new kubelet has not loaded its pods yet).
        `register_delay_s` later it
        deletes every socket file in ``plugin_dir`` (the plugins' too) and
        serves ``kubelet.sock`` again; until then the old ``kubelet.sock`` file
        stays. Allocations survive (the checkpoint); every resource has no
        devices until its plugin re-registers, and admissions wait for that
        (at most 10 s), as pods admitted after a restart get Allocate as usual.
        The restart comes between two admissions (one under way finishes first).
        """
        with self._admit_lock:
            with self._lock:
                self._epoch += 1
                self._serving = False
                self._restarted.clear()
                conns = self._take_conns()
                servers = [s for s in (self._reg_server, self._pr_server) if s is not None]
                self._reg_server = None
                self._pr_server = None
                self._forget_devices()
            self._shutdown(conns, servers)
            if down_s > 0:
                time.sleep(down_s)
            now = time.monotonic()
            with self._lock:
                self._podres_blank_until = now + podres_blank_s
                self._podres_partial_until = now + podres_blank_s + podres_partial_s
                self._serve_pod_resources()
            if register_delay_s > 0:
                time.sleep(register_delay_s)
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(self.plugin_dir):
                    with contextlib.suppress(OSError):
                        if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                            os.unlink(entry.path)
            with self._lock:
                self._serve_registration()

    def _new_server(self) -> grpc.Server:
        return grpc.server(futures.ThreadPoolExecutor(max_workers=self._workers))

    def _serve_registration(self) -> None:
        # Caller holds self._lock.
        _remove_socket(self.socket_path)
        server = self._new_server()
        pb_grpc.add_RegistrationServicer_to_server(  # type: ignore[no-untyped-call]
            _RegistrationService(self, self._epoch), server
        )
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._reg_server = server
        self._serving = True
        self._bump()

    def _forget_devices(self) -> None:
        # Caller holds self._lock.
        for res in self._resources.values():
            res.devices.clear()
            res.topology.clear()
            res.options = None
        self._bump()

    def _take_conns(self) -> list[_Conn]:
        # Caller holds self._lock.
        conns: list[_Conn] = []
        for res in self._resources.values():
            if res.conn is not None:
                res.conn.closed = True
                conns.append(res.conn)
                res.conn = None
            for old in res.replaced:
                old.closed = True
                conns.append(old)
            res.replaced.clear()
        self._bump()
        return conns

    def _shutdown(self, conns: list[_Conn], servers: list[grpc.Server]) -> None:
        for conn in conns:
            conn.close()
        events = [server.stop(grace=0.2) for server in servers]
        for event in events:
            event.wait(1.0)
        with self._lock:
            threads = [t for t in self._threads if t.is_alive()]
            self._threads = threads
        deadline = time.monotonic() + 1.0
        for thread in threads:
            if any(thread is c.thread for c in conns):
                thread.join(max(0.0, deadline - time.monotonic()))

    def _bump(self) -> None:
        # Caller holds self._lock.
        self._seq += 1
        self._cond.notify_all()

    # ---- registration and ListAndWatch -----------------------------------------------------

    def _register(
        self, request: pb.RegisterRequest, context: grpc.ServicerContext, epoch: int
    ) -> None:
        if request.version != API_VERSION:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"requested device plugin API version {request.version!r} is not supported "
                f"by kubelet; supported versions are [{API_VERSION}]",
            )
        if not _is_extended_resource_name(request.resource_name):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"invalid name of device plugin resource: {request.resource_name!r}",
            )
        if not request.endpoint:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty endpoint")
        path = self.plugin_dir / request.endpoint
        channel = grpc.insecure_channel(
            f"unix://{path}",
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                # A fresh subchannel per registration: no connection backoff inherited from
                # an earlier dial of the same socket path (e.g. before a kubelet restart).
                ("grpc.use_local_subchannel_pool", 1),
            ],
        )
        try:
            grpc.channel_ready_future(channel).result(timeout=self.dial_timeout_s)
        except grpc.FutureTimeoutError:
            channel.close()
            context.abort(
                grpc.StatusCode.UNKNOWN,
                f"failed to dial device plugin at {path}: context deadline exceeded",
            )
        conn = _Conn(request.resource_name, request.endpoint, channel)
        try:
            options = conn.client.get_options(pb.Empty(), timeout=self.rpc_timeout_s)
        except grpc.RpcError as err:
            channel.close()
            context.abort(
                grpc.StatusCode.UNKNOWN,
                f"failed to get device plugin options: {err.code().name}: {err.details()}",
            )
        conn.call = conn.client.list_and_watch(pb.Empty())
        thread = threading.Thread(
            target=self._consume,
            args=(conn,),
            name=f"kubelet-sim-law-{request.resource_name}",
            daemon=True,
        )
        conn.thread = thread
        with self._lock:
            if epoch != self._epoch or not self._serving:
                stale = True
            else:
                stale = False
                res = self._resources.setdefault(
                    request.resource_name, _Resource(request.resource_name)
                )
                if res.conn is not None:
                    res.replaced.append(res.conn)
                res.conn = conn
                res.registrations += 1
                res.options = options
                self._threads.append(thread)
                thread.start()
                self._bump()
        if stale:
            conn.close()
            context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet is restarting")

    def _consume(self, conn: _Conn) -> None:
        call = conn.call
        assert call is not None
        # Any end counts the same: a clean return, a gRPC error (e.g. RESOURCE_EXHAUSTED for a
        # message over 4 MiB) or a cancellation.
        with contextlib.suppress(Exception):
            for msg in call:
                self._on_message(conn, msg)
        self._on_stream_end(conn)

    def _on_message(self, conn: _Conn, msg: pb.ListAndWatchResponse) -> None:
        size = msg.ByteSize()
        with self._lock:
            res = self._resources.get(conn.resource)
            if res is None or res.conn is not conn or conn.closed:
                return
            res.devices = {d.ID: d.health for d in msg.devices}
            res.topology = {d.ID: [n.ID for n in d.topology.nodes] for d in msg.devices}
            res.messages += 1
            res.max_message_bytes = max(res.max_message_bytes, size)
            conn.messages += 1
            self._bump()

    def _on_stream_end(self, conn: _Conn) -> None:
        with self._lock:
            res = self._resources.get(conn.resource)
            current: _Conn | None = None
            if res is not None and conn in res.replaced and not conn.closed:
                # The kubelet looks its client up by resource name, so the end
                # of a replaced stream disconnects the current registration.
                res.replaced.remove(conn)
                res.devices = dict.fromkeys(res.devices, UNHEALTHY)
                conn.closed = True
                current, res.conn = res.conn, None
                if current is not None:
                    current.closed = True
                self._bump()
                stale_end = True
            else:
                stale_end = False
        if stale_end:
            conn.channel.close()
            if current is not None:
                current.close()
            return
        with self._lock:
            res = self._resources.get(conn.resource)
            if res is None or res.conn is not conn or conn.closed:
                return
            # The kubelet marks every device unhealthy and never reconnects.
            res.devices = dict.fromkeys(res.devices, UNHEALTHY)
            res.conn = None
            conn.closed = True
            self._bump()
        conn.channel.close()

    # ---- queries ----------------------------------------------------------------------------

    def registrations(self, resource: str) -> int:
        """How many times ``resource`` registered successfully (across restarts)."""
        with self._lock:
            res = self._resources.get(resource)
            return res.registrations if res is not None else 0

    def options(self, resource: str) -> pb.DevicePluginOptions | None:
        """The GetDevicePluginOptions answer of the current registration."""
        with self._lock:
            res = self._resources.get(resource)
            if res is None or res.options is None:
                return None
            copy = pb.DevicePluginOptions()
            copy.CopyFrom(res.options)
            return copy

    def devices(self, resource: str) -> dict[str, str]:
        """ID -> "Healthy"/"Unhealthy" from the latest ListAndWatch message."""
        with self._lock:
            res = self._resources.get(resource)
            return dict(res.devices) if res is not None else {}

    def topology(self, resource: str) -> dict[str, list[int]]:
        """ID -> NUMA node IDs from the latest ListAndWatch message."""
        with self._lock:
            res = self._resources.get(resource)
            return {k: list(v) for k, v in res.topology.items()} if res is not None else {}

    def stream_messages(self, resource: str) -> int:
        """ListAndWatch messages received for ``resource`` (all registrations together)."""
        with self._lock:
            res = self._resources.get(resource)
            return res.messages if res is not None else 0

    def max_message_bytes(self, resource: str) -> int:
        """Largest ListAndWatch message received for ``resource``, in bytes."""
        with self._lock:
            res = self._resources.get(resource)
            return res.max_message_bytes if res is not None else 0

    def connected(self, resource: str) -> bool:
        """A live registration whose stream has delivered at least one message."""
        with self._lock:
            res = self._resources.get(resource)
            return res is not None and res.conn is not None and res.conn.messages > 0

    def capacity(self, resource: str) -> int:
        """Advertised devices, healthy or not."""
        with self._lock:
            res = self._resources.get(resource)
            return len(res.devices) if res is not None else 0

    def allocatable(self, resource: str) -> int:
        """Healthy devices not held by an active pod."""
        with self._lock:
            return len(self._available(resource))

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
        """Poll ``predicate`` (woken by every state change, at least every 50 ms)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                seq = self._seq
            if predicate():
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with self._cond:
                if self._seq == seq:
                    self._cond.wait(min(remaining, _POLL_S))

    def wait_registered(self, resources: Iterable[str], timeout_s: float = 10.0) -> bool:
        """Wait until each resource is registered and its first ListAndWatch message arrived."""
        wanted = list(resources)
        return self.wait_for(lambda: all(self.connected(r) for r in wanted), timeout_s)

    def allocated(self, pod_uid: str | None = None) -> dict[str, dict[str, dict[str, list[str]]]]:
        """uid -> container -> resource -> IDs, for active pods (init containers included)."""
        with self._lock:
            return {
                uid: {c: {r: list(ids) for r, ids in rs.items()} for c, rs in st.containers.items()}
                for uid, st in self._pods.items()
                if pod_uid is None or uid == pod_uid
            }

    def active_pods(self) -> list[SimPod]:
        with self._lock:
            return [st.pod for st in self._pods.values()]

    def remove_pod(self, uid: str) -> None:
        """The pod was deleted or finished: its IDs are free again, at once."""
        with self._lock:
            if self._pods.pop(uid, None) is not None:
                self._bump()

    # ---- the checkpoint ------------------------------------------------------------------------

    def checkpoint_payload(self) -> bytes:
        """The checkpoint as the kubelet would write it now: every registered ID of every
        resource, and each active container's IDs and Allocate response per resource."""
        with self._lock:
            entries = []
            for uid, st in self._pods.items():
                for name, per_resource in st.containers.items():
                    for resource, ids in per_resource.items():
                        res = self._resources.get(resource)
                        by_node: dict[int, list[str]] = {}
                        for dev in ids:
                            topo = (res.topology.get(dev) if res is not None else None) or [
                                NODE_WITHOUT_TOPOLOGY
                            ]
                            by_node.setdefault(topo[0], []).append(dev)
                        entries.append(
                            checkpoint.Entry(
                                uid,
                                name,
                                resource,
                                by_node,
                                st.responses.get((name, resource), b""),
                            )
                        )
            registered = {r: list(res.devices) for r, res in self._resources.items()}
        return checkpoint.encode(entries, registered)

    def save_checkpoint(self) -> int:
        """Rewrite the checkpoint file (temp file, fsync, rename); returns its size."""
        payload = self.checkpoint_payload()
        checkpoint.write(self.checkpoint_path, payload)
        self.checkpoint_bytes = len(payload)
        return len(payload)

    def load_checkpoint(self, pods: Sequence[SimPod], path: Path | None = None) -> int:
        """Start from a kubelet checkpoint (e.g. one written by an older plugin version):
        the entries of `pods` (matched by UID; the checkpoint has no names) become active
        allocations, as after a kubelet restart. Returns the number of entries loaded."""
        entries, _ = checkpoint.decode((path or self.checkpoint_path).read_bytes())
        by_uid = {p.uid: p for p in pods}
        loaded = 0
        with self._lock:
            for e in entries:
                pod = by_uid.get(e.pod_uid)
                if pod is None:
                    continue
                st = self._pods.setdefault(pod.uid, _PodState(pod))
                ids = [d for n in sorted(e.device_ids) for d in e.device_ids[n]]
                st.containers.setdefault(e.container, {})[e.resource] = ids
                st.responses[(e.container, e.resource)] = e.alloc_resp
                loaded += 1
            self._bump()
        return loaded

    def readmission_problems(self) -> list[str]:
        """What re-admitting the active pods would refuse, as after a kubelet restart:
        every recorded ID must still be advertised, and healthy."""
        problems = []
        with self._lock:
            for st in self._pods.values():
                for name, per_resource in st.containers.items():
                    for resource, ids in per_resource.items():
                        res = self._resources.get(resource)
                        devices = res.devices if res is not None else {}
                        bad = [d for d in ids if devices.get(d) != HEALTHY]
                        if bad:
                            problems.append(
                                f"pod {st.pod.namespace}/{st.pod.name} container {name}: "
                                f"{resource} IDs not advertised or unhealthy: {bad[:3]}"
                            )
        return problems

    def _held(self, resource: str) -> set[str]:
        # Caller holds self._lock.
        held: set[str] = set()
        for st in self._pods.values():
            for per_resource in st.containers.values():
                held.update(per_resource.get(resource, ()))
        return held

    def _available(self, resource: str) -> list[str]:
        # Caller holds self._lock.
        res = self._resources.get(resource)
        if res is None:
            return []
        held = self._held(resource)
        return sorted(i for i, h in res.devices.items() if h == HEALTHY and i not in held)

    # ---- admission ---------------------------------------------------------------------------

    def admit(self, pod: SimPod, resource_order: Sequence[str] | None = None) -> Admission:
        """Admit ``pod`` like the kubelet's device manager.  Never raises on plugin errors.

        ``resource_order`` fixes the order in which each container's resources are handled
        (resources not listed follow, sorted); without it the order is a seeded shuffle per
        container, as Go's map iteration is random.
        """
        with self._admit_lock:
            if not self._restarted.is_set():
                # A restarted kubelet admits new pods once their plugins registered again.
                known = set(self._resources)
                self.wait_for(
                    lambda: all(
                        self._resources[r].options is not None and self._resources[r].devices
                        for r in known
                    ),
                    10.0,
                )
                self._restarted.set()
            with self._lock:
                if pod.uid in self._pods:
                    raise ValueError(f"pod {pod.namespace}/{pod.name} ({pod.uid}) already admitted")
                state = _PodState(pod)
                self._pods[pod.uid] = state
                self._bump()
            admission = Admission(pod=pod, ok=True, containers=[])
            try:
                containers = itertools.chain(
                    ((c, True) for c in pod.init_containers), ((c, False) for c in pod.containers)
                )
                for container, is_init in containers:
                    result = ContainerResult(name=container.name, init=is_init)
                    admission.containers.append(result)
                    self._admit_container(
                        state, container, is_init, result, resource_order, admission
                    )
            except _AdmissionError as err:
                admission.ok = False
                admission.error = err.message
                admission.code = err.code
                with self._lock:
                    # The pod is Failed: it holds nothing.
                    if self._pods.get(pod.uid) is state:
                        del self._pods[pod.uid]
                    self._bump()
            return admission

    def admit_without_plugin(self, pod: SimPod) -> Admission:
        """Admit ``pod`` with no plugin call at all, as the real kubelet does for a pod
        asking an extended resource whose plugin has not registered with it yet while
        the Node still shows capacity (seen on a re-created node): no Allocate, no env,
        no mounts. Pod-resources lists its containers holding no device."""
        with self._admit_lock, self._lock:
            if pod.uid in self._pods:
                raise ValueError(f"pod {pod.namespace}/{pod.name} ({pod.uid}) already admitted")
            self._pods[pod.uid] = _PodState(pod)
            self._bump()
        return Admission(
            pod=pod,
            ok=True,
            containers=[ContainerResult(name=c.name) for c in pod.containers],
        )

    def _order(
        self, requests: Mapping[str, int], resource_order: Sequence[str] | None
    ) -> list[str]:
        wanted = sorted(r for r, n in requests.items() if n > 0)
        if resource_order is None:
            with self._lock:
                self._rng.shuffle(wanted)
            return wanted
        first = [r for r in dict.fromkeys(resource_order) if r in wanted]
        return first + [r for r in wanted if r not in first]

    def _admit_container(
        self,
        state: _PodState,
        container: SimContainer,
        is_init: bool,
        result: ContainerResult,
        resource_order: Sequence[str] | None,
        admission: Admission,
    ) -> None:
        for resource in self._order(container.requests, resource_order):
            needed = container.requests[resource]
            taken, conn, available, use_preferred = self._take_reusable(state, resource, needed)
            if len(taken) < needed and use_preferred:
                req = pb.PreferredAllocationRequest(
                    container_requests=[
                        pb.ContainerPreferredAllocationRequest(
                            available_deviceIDs=sorted(set(available) | set(taken)),
                            must_include_deviceIDs=list(taken),
                            allocation_size=needed,
                        )
                    ]
                )
                result.calls.append((CALL_PREFERRED, resource))
                resp = self._call(conn, CALL_PREFERRED, admission, req)
                assert isinstance(resp, pb.PreferredAllocationResponse)
                free = set(available)
                if resp.container_responses:
                    for dev in resp.container_responses[0].deviceIDs:
                        if len(taken) >= needed:
                            break
                        if dev in free and dev not in taken:
                            taken.append(dev)
            if len(taken) < needed:
                rest = [d for d in available if d not in taken]
                with self._lock:
                    self._rng.shuffle(rest)
                taken.extend(rest[: needed - len(taken)])
            result.calls.append((CALL_ALLOCATE, resource))
            areq = pb.AllocateRequest(
                container_requests=[pb.ContainerAllocateRequest(devices_ids=taken)]
            )
            aresp = self._call(conn, CALL_ALLOCATE, admission, areq)
            assert isinstance(aresp, pb.AllocateResponse)
            if not aresp.container_responses:
                raise _AdmissionError(f"no containers return in allocation response {aresp}")
            answer = pb.ContainerAllocateResponse()
            answer.CopyFrom(aresp.container_responses[0])
            result.device_ids[resource] = list(taken)
            result.responses[resource] = answer
            result.merge(resource, answer)
            with self._lock:
                state.containers.setdefault(container.name, {})[resource] = list(taken)
                state.responses[(container.name, resource)] = answer.SerializeToString()
                reusable = state.reusable.setdefault(resource, [])
                if is_init:
                    reusable.extend(d for d in taken if d not in reusable)
                else:
                    reusable[:] = [d for d in reusable if d not in taken]
                self._bump()
            if self.write_checkpoint:
                start = time.perf_counter()
                self.save_checkpoint()
                admission.latencies_s.setdefault(CALL_CHECKPOINT, []).append(
                    time.perf_counter() - start
                )
        with self._lock:
            state.containers.setdefault(container.name, {})

    def _take_reusable(
        self, state: _PodState, resource: str, needed: int
    ) -> tuple[list[str], _Conn, list[str], bool]:
        """Pick from reusable IDs; check availability.  Returns (taken, conn, available, pref)."""
        with self._lock:
            res = self._resources.get(resource)
            if res is None:
                raise _AdmissionError(f"cannot allocate unregistered device {resource}")
            reusable = list(state.reusable.get(resource, ()))
            self._rng.shuffle(reusable)
            taken = reusable[:needed]
            available: list[str] = []
            if len(taken) < needed:
                available = [d for d in self._available(resource) if d not in taken]
                missing = needed - len(taken)
                if len(available) < missing:
                    raise _AdmissionError(
                        f"requested number of devices unavailable for {resource}. "
                        f"Requested: {missing}, Available: {len(available)}"
                    )
            conn = res.conn
            if conn is None:
                raise _AdmissionError(f"endpoint for {resource} is not connected (stopped)")
            use_preferred = (
                self.call_preferred
                and len(taken) < needed
                and res.options is not None
                and res.options.get_preferred_allocation_available
            )
            return taken, conn, available, use_preferred

    def _call(
        self,
        conn: _Conn,
        kind: str,
        admission: Admission,
        request: pb.PreferredAllocationRequest | pb.AllocateRequest,
    ) -> pb.PreferredAllocationResponse | pb.AllocateResponse:
        start = time.perf_counter()
        try:
            if isinstance(request, pb.PreferredAllocationRequest):
                return conn.client.preferred(request, timeout=self.rpc_timeout_s)
            return conn.client.allocate(request, timeout=self.rpc_timeout_s)
        except grpc.RpcError as err:
            details = err.details() or ""
            raise _AdmissionError(details or f"{kind} failed", err.code()) from err
        except ValueError as err:  # e.g. the channel was closed by a re-registration
            raise _AdmissionError(f"{kind} failed: {err}", grpc.StatusCode.CANCELLED) from err
        finally:
            admission.latencies_s.setdefault(kind, []).append(time.perf_counter() - start)

    # ---- pod-resources ------------------------------------------------------------------------

    def _container_devices(
        self, per_resource: Mapping[str, list[str]]
    ) -> list[pr.ContainerDevices]:
        # Caller holds self._lock.  Like the kubelet: one entry per resource and NUMA node;
        # devices without topology are grouped under node -1.
        out: list[pr.ContainerDevices] = []
        for resource, ids in per_resource.items():
            res = self._resources.get(resource)
            by_node: dict[int, list[str]] = {}
            for dev in ids:
                nodes = (res.topology.get(dev) if res is not None else None) or [
                    NODE_WITHOUT_TOPOLOGY
                ]
                for node in nodes:
                    by_node.setdefault(node, []).append(dev)
            for node in sorted(by_node):
                out.append(
                    pr.ContainerDevices(
                        resource_name=resource,
                        device_ids=by_node[node],
                        topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=node)]),
                    )
                )
        return out

    def _pod_resources(self) -> list[pr.PodResources]:
        now = time.monotonic()
        with self._lock:
            out: list[pr.PodResources] = []
            if now < self._podres_blank_until:
                return out  # a new kubelet that has not loaded its pods yet
            states = list(self._pods.values())
            if now < self._podres_partial_until:
                states = states[::2]  # ... and one that has loaded some of them
            for st in states:
                containers = [
                    pr.ContainerResources(
                        name=c.name, devices=self._container_devices(st.containers.get(c.name, {}))
                    )
                    for c in st.pod.containers
                ]
                out.append(
                    pr.PodResources(
                        name=st.pod.name, namespace=st.pod.namespace, containers=containers
                    )
                )
            return out

    def _allocatable_devices(self) -> list[pr.ContainerDevices]:
        with self._lock:
            out: list[pr.ContainerDevices] = []
            for name in sorted(self._resources):
                res = self._resources[name]
                for dev in sorted(d for d, h in res.devices.items() if h == HEALTHY):
                    nodes = res.topology.get(dev) or []
                    if not nodes:
                        out.append(pr.ContainerDevices(resource_name=name, device_ids=[dev]))
                    for node in nodes:
                        out.append(
                            pr.ContainerDevices(
                                resource_name=name,
                                device_ids=[dev],
                                topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=node)]),
                            )
                        )
            return out
