"""The kubelet's DRA edge: the DRAPlugin service (NodePrepareResources,
NodeUnprepareResources) and the plugin-watcher registration service, each on
its own Unix socket. Protobuf in, plain values to the daemon, protobuf out.

A problem with one claim is that claim's error string; the call itself fails
only on malformed input (INVALID_ARGUMENT) or a bug (INTERNAL, with an incident
ID in the log), so the kubelet retries exactly the claims that need it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from vgpu.adapters.unixgrpc import UnixServer
from vgpu.core.dra import ClaimRef, PreparedDevice
from vgpu.pb import dra_v1_pb2 as pb
from vgpu.pb import dra_v1_pb2_grpc as pb_grpc
from vgpu.pb import pluginregistration_v1_pb2 as reg
from vgpu.pb import pluginregistration_v1_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SUPPORTED_VERSIONS = ("v1.DRAPlugin",)
MAX_CLAIMS_PER_CALL = 1024  # far more than a pod can reference


@dataclass(frozen=True)
class Prepared:
    """One claim's answer: its devices, or an error for the kubelet to retry."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class DraCore(Protocol):
    """What the servicer needs from the daemon."""

    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, Prepared]: ...

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]: ...


class BadCall(Exception):
    """The call as a whole is malformed (INVALID_ARGUMENT)."""


def claim_refs(claims: Sequence[pb.Claim]) -> list[ClaimRef]:
    if len(claims) > MAX_CLAIMS_PER_CALL:
        raise BadCall(
            f"{len(claims)} claims in one call; at most {MAX_CLAIMS_PER_CALL} are accepted"
        )
    # Malformed claims (no uid, overlong names) are each claim's own error
    # (ClaimRef.check), answered under the uid as given.
    return [ClaimRef(c.namespace, c.uid, c.name) for c in claims]


def prepare_response(answers: Mapping[str, Prepared]) -> pb.NodePrepareResourcesResponse:
    out = pb.NodePrepareResourcesResponse()
    for uid, answer in answers.items():
        entry = out.claims[uid]
        if answer.error:
            entry.error = answer.error
            continue
        for d in answer.devices:
            device = entry.devices.add(
                request_names=[d.request],
                pool_name=d.pool,
                device_name=d.device,
                cdi_device_ids=list(d.cdi_ids),
            )
            if d.share_id is not None:
                device.share_id = d.share_id
    return out


class DraServicer(pb_grpc.DRAPluginServicer):
    def __init__(
        self,
        core: DraCore,
        on_call: Callable[[str, float, str], None] | None = None,
    ) -> None:
        self.core = core
        self.on_call = on_call

    def _guard(self, method: str, context: grpc.ServicerContext, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        outcome = "ok"
        try:
            return fn()
        except BadCall as exc:
            outcome = "InvalidRequest"
            log.warning("%s refused: %s", method, exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception:
            outcome = "internal"
            incident = uuid.uuid4().hex[:8]
            log.exception("%s failed unexpectedly (incident %s)", method, incident)
            context.abort(
                grpc.StatusCode.INTERNAL,
                f"vgpu hit an internal error in {method} (incident {incident}); see the vgpu "
                "daemon log on this node",
            )
        finally:
            if self.on_call is not None:
                self.on_call(method, time.perf_counter() - start, outcome)
        raise AssertionError("unreachable")  # pragma: no cover - abort raises

    def NodePrepareResources(
        self, request: pb.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> pb.NodePrepareResourcesResponse:
        def run() -> pb.NodePrepareResourcesResponse:
            return prepare_response(self.core.prepare(claim_refs(request.claims)))

        result: pb.NodePrepareResourcesResponse = self._guard("NodePrepareResources", context, run)
        return result

    def NodeUnprepareResources(
        self, request: pb.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> pb.NodeUnprepareResourcesResponse:
        def run() -> pb.NodeUnprepareResourcesResponse:
            out = pb.NodeUnprepareResourcesResponse()
            for uid, error in self.core.unprepare(claim_refs(request.claims)).items():
                out.claims[uid].error = error
            return out

        result: pb.NodeUnprepareResourcesResponse = self._guard(
            "NodeUnprepareResources", context, run
        )
        return result


class RegistrationServicer(reg_grpc.RegistrationServicer):
    """What the kubelet's plugin watcher asks through the registration socket."""

    def __init__(self, driver: str, endpoint: Path) -> None:
        self.driver = driver
        self.endpoint = endpoint
        self.registered = threading.Event()
        self.last_error = ""

    def GetInfo(self, request: reg.InfoRequest, context: grpc.ServicerContext) -> reg.PluginInfo:
        return reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=self.driver,
            endpoint=str(self.endpoint),
            supported_versions=list(SUPPORTED_VERSIONS),
        )

    def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: grpc.ServicerContext
    ) -> reg.RegistrationStatusResponse:
        if request.plugin_registered:
            log.info("registered with the kubelet as DRA driver %s", self.driver)
            self.last_error = ""
            self.registered.set()
        else:
            self.last_error = request.error[:500]
            log.error("the kubelet refused the registration of %s: %s", self.driver, request.error)
            self.registered.clear()
        return reg.RegistrationStatusResponse()


def dra_server(servicer: DraServicer, socket_path: Path, health: Any | None = None) -> UnixServer:
    """The DRA socket: DRAPlugin, and the health stream when `health` is given
    (a DRAResourceHealthServicer)."""

    def add(server: grpc.Server) -> None:
        pb_grpc.add_DRAPluginServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
        if health is not None:
            from vgpu.pb import drahealth_v1alpha1_pb2_grpc as hpb_grpc

            hpb_grpc.add_DRAResourceHealthServicer_to_server(health, server)  # type: ignore[no-untyped-call]

    return UnixServer(socket_path, add, "grpc-dra")


def registration_server(servicer: RegistrationServicer, socket_path: Path) -> UnixServer:
    def add(server: grpc.Server) -> None:
        reg_grpc.add_RegistrationServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]

    return UnixServer(socket_path, add, "grpc-registration", workers=2)
