"""The kubelet's DRA health stream (v1alpha1.DRAResourceHealth/NodeWatchResources),
served on the DRA driver's socket: the full device list first, then again on
every change, and at least every RESEND_S so that the kubelet never takes a
quiet stream for a stale one (health_check_timeout_seconds)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Protocol

import grpc

from vgpu.core.dra import DeviceHealthReport
from vgpu.pb import drahealth_v1alpha1_pb2 as hpb
from vgpu.pb import drahealth_v1alpha1_pb2_grpc as hpb_grpc

log = logging.getLogger(__name__)

RESEND_S = 30.0
HEALTH_TIMEOUT_S = 90  # > 2 * RESEND_S: one lost message does not make a card Unknown
MAX_STREAMS = 2  # the kubelet opens one; each holds a worker of the DRA socket


class HealthCore(Protocol):
    def health(self) -> tuple[int, Sequence[DeviceHealthReport]]: ...

    def wait_health(self, version: int, timeout_s: float) -> int: ...


def health_message(reports: Sequence[DeviceHealthReport]) -> hpb.NodeWatchResourcesResponse:
    return hpb.NodeWatchResourcesResponse(
        devices=[
            hpb.DeviceHealth(
                device=hpb.DeviceIdentifier(pool_name=r.pool, device_name=r.device),
                health=hpb.HEALTHY if r.healthy else hpb.UNHEALTHY,
                last_updated_time=r.updated_s,
                health_check_timeout_seconds=HEALTH_TIMEOUT_S,
                message=r.message[:256],
            )
            for r in reports
        ]
    )


class HealthServicer(hpb_grpc.DRAResourceHealthServicer):
    def __init__(self, core: HealthCore, stopping: threading.Event) -> None:
        self.core = core
        self.stopping = stopping
        self._streams = 0
        self._lock = threading.Lock()

    def NodeWatchResources(
        self, request: hpb.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[hpb.NodeWatchResourcesResponse]:
        with self._lock:
            if self._streams >= MAX_STREAMS:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"already {MAX_STREAMS} health streams open; close one first",
                )
            self._streams += 1
        try:
            while context.is_active() and not self.stopping.is_set():
                version, reports = self.core.health()
                yield health_message(reports)
                self.core.wait_health(version, RESEND_S)
        finally:
            with self._lock:
                self._streams -= 1
