"""Prometheus metrics (prometheus-client) and /healthz on --metrics-address.

Per-card and per-container gauges are computed at scrape time from the
ledger, so nothing is updated on the Allocate path but two counters and a
histogram observation.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, cast

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from vgpu.core.model import Resource

if TYPE_CHECKING:
    from vgpu.daemon.dra import DraDaemon
    from vgpu.daemon.wiring import Daemon


class LedgerCollector(Collector):
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def collect(self) -> Iterator[GaugeMetricFamily]:
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
        ccore = GaugeMetricFamily(
            "vgpu_container_core_limit_percent",
            "Core percent limit of a container's slice (100 for whole cards)",
            labels=["namespace", "pod", "container", "uuid"],
        )
        cmem = GaugeMetricFamily(
            "vgpu_container_memory_limit_mib",
            "Per-card memory limit of a container's slice, MiB (0: no limit)",
            labels=["namespace", "pod", "container", "uuid"],
        )
        with service._lock:
            usages = service.ledger.usages()
            placements = list(service.ledger.placements.values())
            real = dict(service.readings)
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
            names = [owner.namespace, owner.pod, owner.container] if owner else ["", p.key, ""]
            for uuid in p.cards:
                ccore.add_metric([*names, uuid], p.core_percent)
                cmem.add_metric([*names, uuid], p.memory_mib)
        yield from (core, mem, total, health, used, util, ccore, cmem)


class Metrics:
    def __init__(self, daemon: Daemon | DraDaemon, collector: Collector | None = None) -> None:
        """`collector` gives the gauges; the device plugin's ledger by default."""
        self.daemon = daemon
        self.registry = CollectorRegistry()
        if collector is None:
            collector = LedgerCollector(cast("Daemon", daemon))
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
        self._server: ThreadingHTTPServer | None = None

    def call(self, method: str, resource: Resource, seconds: float, outcome: str) -> None:
        self.calls.labels(method, resource.value, outcome).inc()
        self.latency.labels(method, resource.value).observe(seconds)

    def event(self, kind: str, fields: dict[str, Any]) -> None:
        self.events.labels(kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def serve(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] == "/metrics":
                    body, ctype, code = metrics.render(), CONTENT_TYPE_LATEST, 200
                elif self.path == "/healthz":
                    ok = not metrics.daemon.stop.is_set()
                    body, ctype, code = (
                        (b"ok\n" if ok else b"stopping\n"),
                        "text/plain",
                        (200 if ok else 503),
                    )
                else:
                    body, ctype, code = b"not found\n", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer((host.strip("[]") or "0.0.0.0", int(port)), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True).start()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
