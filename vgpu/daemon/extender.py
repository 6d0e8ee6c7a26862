"""`vgpu extender`'s composition root: settings in, a running scheduler
extender out (a sibling of the node daemon in wiring.py, sharing only the
core's fit rules and the adapters).

    start-up   check settings, bind the HTTP port(s), start the Node and Pod
               watch caches (answers wait for their first sync)
    main loop  serve filter / prioritize / bind, keep the caches current
    shutdown   first SIGTERM/SIGINT: stop serving, exit 0; a second forces it
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from vgpu import __version__
from vgpu.adapters.extender_http import ExtenderHttp
from vgpu.adapters.kube_cluster import Binder, ClusterCache, KubeBinder
from vgpu.config import ExtenderSettings
from vgpu.core.errors import ConfigError
from vgpu.daemon.extender_service import ExtenderService
from vgpu.daemon.lifecycle import stop_on_signals

log = logging.getLogger("vgpu.extender")


class _BookCollector(Collector):
    def __init__(self, service: ExtenderService) -> None:
        self.service = service

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts = self.service.counts()
        yield GaugeMetricFamily(
            "vgpu_extender_nodes", "Nodes with a readable vgpu inventory", value=counts["nodes"]
        )
        yield GaugeMetricFamily(
            "vgpu_extender_pods", "Active pods asking for vgpu resources", value=counts["pods"]
        )
        yield GaugeMetricFamily(
            "vgpu_extender_assumed_pods",
            "Pods bound by the extender and not yet seen bound in the cache",
            value=counts["assumed"],
        )
        yield GaugeMetricFamily(
            "vgpu_extender_picked_pods",
            "Pods whose node the extender picked at filter, holding their room until the bind",
            value=counts["picked"],
        )
        yield GaugeMetricFamily(
            "vgpu_extender_ready",
            "1 once both caches synced with the API server",
            value=1 if self.service.ready() else 0,
        )


class ExtenderMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "vgpu_extender_requests",
            "Extender requests by verb and outcome",
            ["verb", "outcome"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "vgpu_extender_request_duration_seconds",
            "Extender answer time by verb",
            ["verb"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
            registry=self.registry,
        )
        self.binds = Counter(
            "vgpu_extender_binds",
            "Bind outcomes: bound, bind_refused (no longer fits), bind_failed (API write)",
            ["outcome"],
            registry=self.registry,
        )
        # The labelled children, looked up once (labels() takes a lock and
        # builds a key on every call, on every request).
        self._requests: dict[tuple[str, str], Counter] = {}
        self._durations: dict[str, Histogram] = {}

    def observe(self, verb: str, seconds: float, outcome: str) -> None:
        counter = self._requests.get((verb, outcome))
        if counter is None:
            counter = self._requests[verb, outcome] = self.requests.labels(verb, outcome)
        histogram = self._durations.get(verb)
        if histogram is None:
            histogram = self._durations[verb] = self.duration.labels(verb)
        counter.inc()
        histogram.observe(seconds)

    def event(self, kind: str) -> None:
        self.binds.labels(kind).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class Extender:
    """Everything `vgpu extender` runs."""

    def __init__(self, settings: ExtenderSettings, binder: Binder | None = None) -> None:
        if settings.kubeconfig is None and not os.environ.get("KUBERNETES_SERVICE_HOST"):
            raise ConfigError(
                "no API server configured: pass --kubeconfig FILE, or run in a cluster "
                "(the in-cluster service account is used there)"
            )
        self.settings = settings
        self.stop = threading.Event()
        domain = settings.resource_domain
        self.metrics = ExtenderMetrics()
        self.service = ExtenderService(
            domain,
            settings.policy,
            binder or KubeBinder(settings.kubeconfig, domain, settings.bind_timeout_s),
            events=self.metrics.event,
            pick_node=settings.node_choice == "extender",
        )
        self.metrics.registry.register(_BookCollector(self.service))
        self.http = self._serve(settings.listen, verbs=True)
        self.cache = ClusterCache(
            domain, settings.kubeconfig, self.service, pod_seen=self.http.pod_seen
        )
        self.metrics_http = (
            self._serve(settings.metrics_address, verbs=False) if settings.metrics_address else None
        )

    def _serve(self, address: str, verbs: bool) -> ExtenderHttp:
        try:
            return ExtenderHttp(
                self.service,
                self.settings.resource_domain,
                address,
                verbs=verbs,
                observe=self.metrics.observe if verbs else None,
                metrics=self.metrics.render,
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {address}: {exc.strerror or exc}; pick another "
                f"{'listen' if verbs else 'metrics_address'}"
            ) from None

    def start(self) -> None:
        log.info(
            "vgpu %s extender starting; effective settings: %s", __version__, self.settings.public()
        )
        self.cache.start(self.stop)
        self.http.start()
        if self.metrics_http is not None:
            self.metrics_http.start()
        host, port = self.http.address
        log.info(
            "serving filter, prioritize and bind on http://%s:%d (node_choice %s)",
            host,
            port,
            self.settings.node_choice,
        )

    def shutdown(self) -> None:
        self.stop.set()
        self.http.close()
        if self.metrics_http is not None:
            self.metrics_http.close()
        log.info("stopped")


def run(settings: ExtenderSettings) -> int:
    """Run until SIGTERM/SIGINT. Exit codes: 0 clean stop, 2 bad config."""
    try:
        extender = Extender(settings)
    except ConfigError as exc:
        print(f"vgpu extender: {exc.message}", file=sys.stderr)
        return 2
    stop_on_signals(extender.stop, log)
    extender.start()
    while not extender.stop.wait(1.0):
        pass
    extender.shutdown()
    return 0
