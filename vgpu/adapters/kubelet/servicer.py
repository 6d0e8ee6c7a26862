"""The device-plugin gRPC edge: protobuf in, plain values to the daemon, protobuf out.

Domain errors become the right status code with their message; anything
unexpected becomes INTERNAL with a generic message and a logged traceback.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import grpc

from vgpu.adapters.unixgrpc import UnixServer
from vgpu.core.contract import ContainerEdits
from vgpu.core.errors import (
    ApiUnavailable,
    DiskFull,
    HandedOver,
    InsufficientCapacity,
    InvalidRequest,
    PlacementConflict,
    StateIOError,
    StateReadOnly,
    TooManyOpenFiles,
    UnknownCard,
    UnknownDevice,
    VgpuError,
    state_error,
)
from vgpu.core.model import Resource
from vgpu.pb import deviceplugin_v1beta1_pb2 as pb
from vgpu.pb import deviceplugin_v1beta1_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
MAX_WATCH_STREAMS = 4  # per resource; the kubelet needs one
MAX_IDS_PER_REQUEST = 100_000  # more IDs than any node advertises
MAX_CONTAINER_REQUESTS = 8  # per call; the kubelet sends exactly one


@dataclass(frozen=True)
class DeviceView:
    device_id: str
    healthy: bool
    numa_node: int | None


# One container's Allocate answer, as plain values: the limit contract.
AllocationAnswer = ContainerEdits


@dataclass(frozen=True)
class PreferredRequest:
    """One container request of GetPreferredAllocation."""

    available: Sequence[str]
    must_include: Sequence[str]
    size: int


class PluginCore(Protocol):
    """What the servicer needs from the daemon (one instance serves both resources)."""

    def device_list(self, resource: Resource) -> tuple[int, Sequence[DeviceView]]: ...

    def wait_devices(self, version: int, timeout_s: float) -> int: ...

    def preferred(
        self, resource: Resource, requests: Sequence[PreferredRequest]
    ) -> list[list[str]]: ...

    def allocate(self, resource: Resource, device_ids: Sequence[str]) -> AllocationAnswer: ...

    def prestart(self, resource: Resource, device_ids: Sequence[str]) -> None: ...


# Why these codes: RESOURCE_EXHAUSTED where something runs out and comes back
# by itself (room on a card, disk space, file descriptors); FAILED_PRECONDITION
# where the node is in a state that needs a change first (a card gone or held
# whole, a read-only disk); UNAVAILABLE where a dependency cannot be reached or
# failed in a way that may pass (the pod-resources API, an I/O error).
_STATUS: list[tuple[type[VgpuError], grpc.StatusCode]] = [
    (UnknownCard, grpc.StatusCode.FAILED_PRECONDITION),
    (UnknownDevice, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (InsufficientCapacity, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PlacementConflict, grpc.StatusCode.FAILED_PRECONDITION),
    (DiskFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TooManyOpenFiles, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StateReadOnly, grpc.StatusCode.FAILED_PRECONDITION),
    (StateIOError, grpc.StatusCode.UNAVAILABLE),
    (ApiUnavailable, grpc.StatusCode.UNAVAILABLE),
    (HandedOver, grpc.StatusCode.UNAVAILABLE),
]


def status_for(error: VgpuError) -> grpc.StatusCode:
    for kind, code in _STATUS:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.FAILED_PRECONDITION


T = TypeVar("T")


def device_list_message(devices: Sequence[DeviceView]) -> pb.ListAndWatchResponse:
    return pb.ListAndWatchResponse(
        devices=[
            pb.Device(
                ID=d.device_id,
                health="Healthy" if d.healthy else "Unhealthy",
                topology=(
                    pb.TopologyInfo(nodes=[pb.NUMANode(ID=d.numa_node)])
                    if d.numa_node is not None
                    else None
                ),
            )
            for d in devices
        ]
    )


RELAY_WAIT_S = 30.0  # longest a call waits for the successor to be named
RELAY_CALL_S = 30.0  # longest the successor may take to answer a relayed call


class CallRelay:
    """What a daemon that hands its node over does with the kubelet's calls.

    `freeze()` lets the calls under way finish and holds every later one, and
    every ListAndWatch stream stays open and silent: a stream that ends after
    the successor registered would make the kubelet disconnect the successor
    (seen on kubelet 1.36.2). Once `point_to()` names the successor's sockets,
    held and later calls are relayed there and answered with its answer.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._frozen = False
        self._running = 0
        self._targets: dict[Resource, Path] | None = None
        self._channels: dict[Resource, grpc.Channel] = {}
        self._never = threading.Event()
        self._relaying = 0
        self._last_relay = time.monotonic()

    @property
    def frozen(self) -> bool:
        return self._frozen

    @contextlib.contextmanager
    def call(self) -> Iterator[bool]:
        """Around one call; yields True when it must be relayed."""
        with self._cond:
            relay = self._frozen
            if not relay:
                self._running += 1
        try:
            yield relay
        finally:
            if not relay:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()

    def freeze(self, timeout_s: float) -> bool:
        """Hold new calls; True once none is under way (False on timeout)."""
        with self._cond:
            self._frozen = True
            return self._cond.wait_for(lambda: self._running == 0, timeout_s)

    def point_to(self, targets: dict[Resource, Path]) -> None:
        with self._cond:
            self._targets = dict(targets)
            # The kubelet calls this daemon until the successor has registered:
            # quiet is counted from now, not from this daemon's start (an owner
            # stopped before its successor asked left the moment it handed
            # over, and a call sent to its sockets in between was never
            # answered, the successor holding the connection open).
            self._last_relay = time.monotonic()
            self._cond.notify_all()

    def settle(self, quiet_s: float, max_s: float) -> bool:
        """Wait until no relayed call is under way and none came for `quiet_s`
        (the kubelet talks to the successor now), at most `max_s`; the old
        daemon may exit then. True when settled."""
        deadline = time.monotonic() + max_s
        with self._cond:
            while True:
                now = time.monotonic()
                quiet_until = self._last_relay + quiet_s
                if self._relaying == 0 and now >= quiet_until:
                    return True
                if now >= deadline:
                    return False
                self._cond.wait(min(deadline, max(quiet_until, now + 0.05)) - now)

    def hold_stream(self) -> None:
        """A frozen ListAndWatch waits here, sending nothing."""
        self._never.wait(5.0)

    def relay(self, method: str, resource: Resource, request: object) -> object:
        """Send one call to the successor; its answer, or its error as a VgpuError."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._targets is not None, RELAY_WAIT_S):
                raise HandedOver(
                    f"this vgpu daemon is handing the node over and the new daemon did not "
                    f"take it within {RELAY_WAIT_S:.0f} s; see both daemons' logs on this node"
                )
            targets = self._targets
            assert targets is not None
            channel = self._channels.get(resource)
            if channel is None:
                channel = grpc.insecure_channel(f"unix://{targets[resource]}")
                self._channels[resource] = channel
            self._relaying += 1
        stub = pb_grpc.DevicePluginStub(channel)  # type: ignore[no-untyped-call]
        try:
            # wait_for_ready: the successor's socket appears once it has the placements.
            answer: object = getattr(stub, method)(
                request, timeout=RELAY_CALL_S, wait_for_ready=True
            )
            return answer
        except grpc.RpcError as exc:
            raise _RelayedError(exc.code(), exc.details() or "") from exc
        finally:
            with self._cond:
                self._relaying -= 1
                self._last_relay = time.monotonic()
                self._cond.notify_all()


class _RelayedError(Exception):
    """The successor's own refusal, passed on with its code."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class DevicePluginServicer(pb_grpc.DevicePluginServicer):
    """Serves one resource; built per socket."""

    def __init__(
        self,
        core: PluginCore,
        resource: Resource,
        options: pb.DevicePluginOptions,
        stopping: threading.Event,
        on_call: Callable[[str, Resource, float, str], None] | None = None,
        relay: CallRelay | None = None,
    ) -> None:
        self.core = core
        self.resource = resource
        self.options = options
        self.stopping = stopping
        self.on_call = on_call
        self.relay = relay
        self._streams = 0
        self._lock = threading.Lock()
        self._cache: tuple[int, pb.ListAndWatchResponse] | None = None

    def _guard(
        self,
        method: str,
        context: grpc.ServicerContext,
        fn: Callable[[], T],
        request: object = None,
    ) -> T:
        start = time.perf_counter()
        outcome = "ok"
        try:
            try:
                with self._calls() as relayed:
                    if relayed:
                        outcome = "relayed"
                        assert self.relay is not None
                        return self.relay.relay(method, self.resource, request)  # type: ignore[return-value]
                    return fn()
            except OSError as os_error:
                # An OS error the daemon did not name itself (e.g. EMFILE opening
                # a file): still a named refusal, never a generic INTERNAL.
                raise state_error(
                    os_error.errno,
                    str(os_error.filename or "?"),
                    f"answer {method}",
                    os_error.strerror or "",
                ) from os_error
        except _RelayedError as exc:
            outcome = "relayed_error"
            context.abort(exc.code, exc.details)
        except VgpuError as exc:
            outcome = type(exc).__name__
            code = status_for(exc)
            log.warning(
                "%s %s refused (%s): %s", method, self.resource.value, code.name, exc.message
            )
            context.abort(code, exc.message)
        except Exception:
            outcome = "internal"
            incident = uuid.uuid4().hex[:8]
            log.exception(
                "%s %s failed unexpectedly (incident %s)", method, self.resource.value, incident
            )
            context.abort(
                grpc.StatusCode.INTERNAL,
                f"vgpu hit an internal error in {method} (incident {incident}); see the vgpu "
                "daemon log on this node",
            )
        finally:
            if self.on_call is not None:
                self.on_call(method, self.resource, time.perf_counter() - start, outcome)
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

    def _calls(self) -> contextlib.AbstractContextManager[bool]:
        return self.relay.call() if self.relay is not None else contextlib.nullcontext(False)

    def GetDevicePluginOptions(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> pb.DevicePluginOptions:
        return self.options

    def _message(self) -> tuple[int, pb.ListAndWatchResponse]:
        version, devices = self.core.device_list(self.resource)
        cached = self._cache
        if cached is None or cached[0] != version:
            cached = (version, device_list_message(devices))
            self._cache = cached
        return cached

    def ListAndWatch(
        self, request: pb.Empty, context: grpc.ServicerContext
    ) -> Iterator[pb.ListAndWatchResponse]:
        with self._lock:
            if self._streams >= MAX_WATCH_STREAMS:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"already {MAX_WATCH_STREAMS} ListAndWatch streams open for "
                    f"{self.resource.value}; close one first",
                )
            self._streams += 1
        try:
            sent = -1
            while context.is_active() and not self.stopping.is_set():
                if self.relay is not None and self.relay.frozen:
                    self.relay.hold_stream()  # open and silent for good (CallRelay)
                    continue
                version, message = self._message()
                if version != sent:
                    yield message
                    sent = version
                # Woken on every change and at shutdown; the timeout only
                # bounds how long a cancelled stream lingers.
                self.core.wait_devices(sent, 5.0)
        finally:
            with self._lock:
                self._streams -= 1

    def _check_count(self, ids: Sequence[str], what: str) -> None:
        if len(ids) > MAX_IDS_PER_REQUEST:
            raise InvalidRequest(
                f"{what} has {len(ids)} IDs, more than this node could ever advertise "
                f"({MAX_IDS_PER_REQUEST})"
            )

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        def run() -> pb.PreferredAllocationResponse:
            if not request.container_requests:
                raise InvalidRequest("GetPreferredAllocation carried no container request")
            if len(request.container_requests) > MAX_CONTAINER_REQUESTS:
                raise InvalidRequest(
                    f"GetPreferredAllocation carried {len(request.container_requests)} container"
                    f" requests; at most {MAX_CONTAINER_REQUESTS} are accepted (the kubelet sends"
                    " one)"
                )
            requests = []
            for creq in request.container_requests:
                self._check_count(creq.available_deviceIDs, "available_deviceIDs")
                self._check_count(creq.must_include_deviceIDs, "must_include_deviceIDs")
                requests.append(
                    PreferredRequest(
                        list(creq.available_deviceIDs),
                        list(creq.must_include_deviceIDs),
                        creq.allocation_size,
                    )
                )
            out = pb.PreferredAllocationResponse()
            for ids in self.core.preferred(self.resource, requests):
                out.container_responses.add(deviceIDs=ids)
            return out

        return self._guard("GetPreferredAllocation", context, run, request)

    def Allocate(
        self, request: pb.AllocateRequest, context: grpc.ServicerContext
    ) -> pb.AllocateResponse:
        def run() -> pb.AllocateResponse:
            if not request.container_requests:
                raise InvalidRequest("Allocate carried no container request")
            if len(request.container_requests) > MAX_CONTAINER_REQUESTS:
                raise InvalidRequest(
                    f"Allocate carried {len(request.container_requests)} container requests; at "
                    f"most {MAX_CONTAINER_REQUESTS} are accepted (the kubelet sends one)"
                )
            out = pb.AllocateResponse()
            for creq in request.container_requests:
                self._check_count(creq.devices_ids, "devices_ids")
                answer = self.core.allocate(self.resource, list(creq.devices_ids))
                resp = out.container_responses.add()
                resp.envs.update(answer.envs)
                resp.annotations.update(answer.annotations)
                for m in answer.mounts:
                    resp.mounts.add(
                        container_path=m.container_path,
                        host_path=m.host_path,
                        read_only=m.read_only,
                    )
                for d in answer.devices:
                    resp.devices.add(
                        container_path=d.container_path,
                        host_path=d.host_path,
                        permissions=d.permissions,
                    )
                for name in answer.cdi_devices:
                    resp.cdi_devices.add(name=name)
            return out

        return self._guard("Allocate", context, run, request)

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        def run() -> pb.PreStartContainerResponse:
            self._check_count(request.devices_ids, "devices_ids")
            self.core.prestart(self.resource, list(request.devices_ids))
            return pb.PreStartContainerResponse()

        return self._guard("PreStartContainer", context, run, request)


class PluginServer(UnixServer):
    """One resource's gRPC server on its Unix socket in the device-plugin directory."""

    def __init__(self, servicer: DevicePluginServicer, socket_path: Path, workers: int = 8) -> None:
        self.servicer = servicer

        def add(server: grpc.Server) -> None:
            pb_grpc.add_DevicePluginServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]

        super().__init__(socket_path, add, f"grpc-{servicer.resource.value}", workers)


class RegistrationError(Exception):
    pass


def register(
    plugin_dir: Path,
    endpoint: str,
    resource_name: str,
    options: pb.DevicePluginOptions,
    timeout_s: float = 5.0,
) -> None:
    """Register one resource with the kubelet (kubelet.sock in plugin_dir)."""
    target = f"unix://{plugin_dir / 'kubelet.sock'}"
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.RegistrationStub(channel)  # type: ignore[no-untyped-call]
        try:
            stub.Register(
                pb.RegisterRequest(
                    version=API_VERSION,
                    endpoint=endpoint,
                    resource_name=resource_name,
                    options=options,
                ),
                timeout=timeout_s,
            )
        except grpc.RpcError as exc:
            raise RegistrationError(
                f"registering {resource_name} with the kubelet failed: {exc.code().name}: "
                f"{exc.details()}"
            ) from exc
