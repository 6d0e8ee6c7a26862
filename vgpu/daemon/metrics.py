"""Prometheus metrics (prometheus-client) and /healthz on --metrics-address.

Per-card and per-container gauges are computed at scrape time from the
ledger, so nothing is updated on the Allocate path but two counters and a
histogram observation. The endpoint is unauthenticated, so per-container
series carry the opaque placement key, not the tenant's namespace, pod and
container names, unless `metrics_container_names` says the endpoint is
protected. The server is bounded (vgpu.adapters.httpserver): no client can
take the threads or descriptors the kubelet's calls need.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from vgpu.adapters.httpserver import BoundedHttpServer, HttpStats
from vgpu.core.model import Resource
from vgpu.core.readiness import ApiHealth

if TYPE_CHECKING:
    from vgpu.daemon.dra import DraDaemon
    from vgpu.daemon.wiring import Daemon


class LedgerCollector(Collector):
    def __init__(self, daemon: Daemon, container_names: bool, http: HttpStats) -> None:
        self.daemon = daemon
        self.container_names = container_names
        self.http = http

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        service = self.daemon.service
        unit = service.options.memory_unit_mib
        labels = ["uuid", "index", "model"]
        core = GaugeMetricFamily(
            "vgpu_card_core_allocated_percent", "Core percent sliced out of the card", labels=labels
        )
        mem = GaugeMetricFamily(
            "vgpu_card_memory_allocated_mib", "Memory sliced out of the card, MiB", labels=labels
        )
        total = GaugeMetricFamily("vgpu_card_memory_total_mib", "Card memory, MiB", labels=labels)
        health = GaugeMetricFamily(
            "vgpu_card_healthy", "1 when the card is in service, 0 when unhealthy", labels=labels
        )
        used = GaugeMetricFamily(
            "vgpu_card_memory_used_mib", "Real memory in use on the card (NVML), MiB", labels=labels
        )
        util = GaugeMetricFamily(
            "vgpu_card_utilization_percent",
            "Real compute utilisation of the card (NVML)",
            labels=labels,
        )
        who = ["namespace", "pod", "container"] if self.container_names else ["key"]
        ccore = GaugeMetricFamily(
            "vgpu_container_core_limit_percent",
            "Core percent limit of a container's slice (100 for whole cards)",
            labels=[*who, "uuid"],
        )
        cmem = GaugeMetricFamily(
            "vgpu_container_memory_limit_mib",
            "Per-card memory limit of a container's slice, MiB (0: no limit)",
            labels=[*who, "uuid"],
        )
        writable = GaugeMetricFamily(
            "vgpu_state_writable",
            "1 when the state directory takes writes, 0 while it refuses them",
            labels=["errno"],
        )
        unwritten = GaugeMetricFamily(
            "vgpu_state_unwritten_records",
            "Placements kept in memory only, waiting for the disk to take them",
        )
        dropped = CounterMetricFamily(
            "vgpu_metrics_http_dropped_connections",
            "Connections to this endpoint dropped to protect the daemon, by reason",
            labels=["reason"],
        )
        with service._lock:
            usages = service.ledger.usages()
            placements = list(service.ledger.placements.values())
            real = dict(service.readings)
            error = service.state_error
            waiting = len(service._unwritten)
        for usage in usages:
            card = usage.card
            lv = [card.uuid, str(card.index), card.name]
            core.add_metric(lv, usage.core_used)
            mem.add_metric(lv, usage.memory_used_units * unit)
            total.add_metric(lv, card.memory_mib)
            health.add_metric(lv, 1 if card.healthy else 0)
            reading = real.get(card.uuid)
            if reading is not None and reading.memory_used_mib is not None:
                used.add_metric(lv, reading.memory_used_mib)
            if reading is not None and reading.utilization_percent is not None:
                util.add_metric(lv, reading.utilization_percent)
        for p in placements:
            owner = p.owner
            if not self.container_names:
                names = [p.key]
            elif owner is not None:
                names = [owner.namespace, owner.pod, owner.container]
            else:
                names = ["", p.key, ""]
            for uuid in p.cards:
                ccore.add_metric([*names, uuid], p.core_percent)
                cmem.add_metric([*names, uuid], p.memory_mib)
        writable.add_metric([error.errno_name if error else ""], 0 if error else 1)
        unwritten.add_metric([], waiting)
        for reason, count in self.http.dropped.items():
            dropped.add_metric([reason], count)
        yield from (core, mem, total, health, used, util, ccore, cmem, writable, unwritten)
        yield dropped
        yield from arbiter_metrics(self.daemon, placements, who, self.container_names)


# The compute arbiter's view of each container (vgpu/daemon/arbiter.py), percent of a card.
ARBITER_GAUGES = {
    "guarantee_percent": "Compute share a container is guaranteed (its vcuda-core)",
    "cap_percent": "Burst cap: the most the arbiter lets a container use when others idle",
    "allowed_percent": "Compute share the arbiter allows a container right now",
    "achieved_percent": "Compute share a container achieved over the arbiter's last period",
}


def arbiter_metrics(
    daemon: Daemon | DraDaemon, placements: list[Any], who: list[str], container_names: bool
) -> Iterator[GaugeMetricFamily]:
    arbiter = getattr(daemon, "arbiter", None)
    views = arbiter.views() if arbiter is not None else {}
    families = {
        name: GaugeMetricFamily(f"vgpu_container_core_{name}", text, labels=who)
        for name, text in ARBITER_GAUGES.items()
    }
    for p in placements:
        view = views.get(p.key)
        if view is None:
            continue
        owner = p.owner
        if not container_names:
            names = [p.key]
        elif owner is not None:
            names = [owner.namespace, owner.pod, owner.container]
        else:
            names = ["", p.key, ""]
        for name, family in families.items():
            family.add_metric(names, getattr(view, name))
    yield from families.values()


class Metrics:
    def __init__(
        self,
        daemon: Daemon | DraDaemon,
        collector: Collector | None = None,
        container_names: bool = False,
    ) -> None:
        """`collector` gives the gauges; the device plugin's ledger by default."""
        self.daemon = daemon
        self.http = HttpStats()
        self.registry = CollectorRegistry()
        if collector is None:
            collector = LedgerCollector(cast("Daemon", daemon), container_names, self.http)
        self.registry.register(collector)
        self.calls = Counter(
            "vgpu_calls",
            "Kubelet calls by method, resource and outcome (ok or the refusal reason)",
            ["method", "resource", "outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "vgpu_call_duration_seconds",
            "Time to answer a kubelet call",
            ["method", "resource"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.5),
            registry=self.registry,
        )
        self.events = Counter(
            "vgpu_events",
            "State changes: registered, placement, release, card_unhealthy, card_healthy, ...",
            ["kind"],
            registry=self.registry,
        )
        self._server: BoundedHttpServer | None = None
        # Labelled children by their labels: `labels()` costs a lock and a
        # validation each time, on every kubelet call (issue 30).
        self._children: dict[tuple[int | str, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key: tuple[int | str, ...] = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def call(self, method: str, resource: Resource, seconds: float, outcome: str) -> None:
        self._child(self.calls, method, resource.value, outcome).inc()
        self._child(self.latency, method, resource.value).observe(seconds)

    def event(self, kind: str, fields: dict[str, Any]) -> None:
        self._child(self.events, kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def answer(self, path: str) -> tuple[int, str, bytes]:
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, self.render()
        if path == "/healthz":
            if self.daemon.stop.is_set():
                return 503, "text/plain", b"stopping\n"
            return 200, "text/plain", b"ok\n"
        if path == "/readyz":
            if self.daemon.stop.is_set():
                return 503, "text/plain", b"not ready: stopping\n"
            reason = self.not_ready()
            if reason:
                return 503, "text/plain", f"not ready: {reason}\n".encode()
            return 200, "text/plain", b"ok\n"
        return 404, "text/plain", b"not found\n"

    def not_ready(self) -> str:
        """'' while ready: the API server was reachable within api_unready_after_s."""
        limit = float(getattr(self.daemon.settings, "api_unready_after_s", 60.0))
        # The device plugin's pod cache, or DRA mode's claim cache.
        for source in ("pods", "claims"):
            health = getattr(getattr(self.daemon, source, None), "health", None)
            if isinstance(health, ApiHealth):
                return health.not_ready(time.monotonic(), limit)
        return ""  # no API server configured: nothing to wait for

    def serve(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self._server = BoundedHttpServer(
            host.strip("[]") or "0.0.0.0",
            int(port),
            self.answer,
            inline=("/healthz", "/readyz"),
        )
        self._server.stats = self.http
        self._server.start()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
