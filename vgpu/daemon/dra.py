"""DRA mode's composition root (`vgpu serve --mode dra`): settings in, a running
DRA driver out. A sibling of wiring.Daemon (the device plugin), sharing the GPU
backends, health, the state directory, the limit contract and the hook install.

    start-up   enumerate cards, recover prepared claims (repair or sweep their
               files), install the hook, start the claim cache and the slice
               publisher, serve the DRA socket, then the registration socket
    main loop  backend watch (health -> ResourceSlice), socket watch (serve
               again when a socket is removed), usage readings
    shutdown   first SIGTERM/SIGINT: stop serving, remove both sockets, exit 0.
               The ResourceSlice stays: the kubelet wipes a driver's slices
               about 30 s after its registration socket goes, so a restart
               within that window does not churn the scheduler.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from vgpu import __version__
from vgpu.adapters.devnodes import HostDevices
from vgpu.adapters.dra.cdi import CdiDir
from vgpu.adapters.dra.health import HealthServicer
from vgpu.adapters.dra.kube import (
    ClaimCache,
    ClaimSource,
    ClaimStatusWriter,
    SlicePort,
    SlicePublisher,
)
from vgpu.adapters.dra.plugin import (
    DraServicer,
    RegistrationServicer,
    dra_server,
    registration_server,
)
from vgpu.adapters.dra.state import ClaimStore
from vgpu.adapters.fs import ContainerStore
from vgpu.adapters.gpus import GpuBackend
from vgpu.adapters.kube import core_v1_api
from vgpu.adapters.kube_events import KubeEvents
from vgpu.adapters.unixgrpc import UnixServer
from vgpu.config import Settings
from vgpu.core.dra import device_name, driver_name
from vgpu.core.errors import ConfigError, StateUnwritable
from vgpu.daemon.arbiter import Arbiter, arbiter_utilization, placed_containers
from vgpu.daemon.draservice import DraOptions, DraService
from vgpu.daemon.pidteller import HostPidTeller
from vgpu.daemon.wiring import (
    budget_watch,
    build_backend,
    device_node_watch,
    hook_installer,
    run,
    usage_loop,
    watch_backend,
)

log = logging.getLogger("vgpu")

SOCKET_CHECK_S = 0.25
STOP_TIMEOUT_S = 4.0


class DraCollector(Collector):
    """Per-card and per-claim gauges, computed at scrape time."""

    def __init__(self, service: DraService, daemon: DraDaemon | None = None) -> None:
        self.service = service
        self.daemon = daemon  # its compute arbiter's per-request gauges

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["uuid", "index", "model"]
        health = GaugeMetricFamily("vgpu_card_healthy", "1 in service, 0 unhealthy", labels=labels)
        core = GaugeMetricFamily(
            "vgpu_card_core_allocated_percent", "Core percent of prepared claims", labels=labels
        )
        mem = GaugeMetricFamily(
            "vgpu_card_memory_allocated_mib", "Memory of prepared claims, MiB", labels=labels
        )
        claims = GaugeMetricFamily("vgpu_dra_prepared_claims", "Claims prepared on this node")
        with self.service._lock:
            cards = list(self.service.cards.values())
            records = list(self.service.prepared.values())
        for card in cards:
            placements = [p for r in records for p in r.placements if card.uuid in p.cards]
            lv = [card.uuid, str(card.index), card.name]
            health.add_metric(lv, 1 if card.healthy else 0)
            core.add_metric(lv, sum(p.core_percent for p in placements))
            mem.add_metric(
                lv, sum(p.memory_mib or (card.memory_mib if p.whole else 0) for p in placements)
            )
        claims.add_metric([], len(records))
        reads = GaugeMetricFamily(
            "vgpu_dra_claim_reads",
            "Claims read at prepare time, from the watch cache or the API server",
            labels=["source"],
        )
        for source, attribute in (("cache", "hits"), ("api", "fetches")):
            count = getattr(self.service.claims, attribute, None)
            if isinstance(count, int):
                reads.add_metric([source], count)
        yield from (health, core, mem, claims, reads)
        if self.daemon is not None:
            from vgpu.daemon.metrics import arbiter_metrics

            placements = [p for r in records for p in r.placements]
            yield from arbiter_metrics(self.daemon, placements, ["key"], False)


class DraDaemon:
    """Everything `vgpu serve --mode dra` runs."""

    def __init__(
        self,
        settings: Settings,
        backend: GpuBackend | None = None,
        claims: ClaimSource | None = None,
        slices: SlicePort | None = None,
    ) -> None:
        s = settings
        self.settings = s
        self.backend = backend or build_backend(s)
        self.stop = threading.Event()
        self.handed_off = threading.Event()  # never set: the DRA driver rolls one at a time
        self.driver = driver_name(s.resource_domain)
        node = s.node_name or ""
        dra_dir = s.state_dir / "dra"
        self.metrics: Any = None
        self.claims = claims or ClaimCache(self.driver, node, s.kubeconfig)
        self.slices = slices or SlicePublisher(self.driver, node, s.kubeconfig)
        self.service = DraService(
            DraOptions(
                domain=s.resource_domain,
                node=node,
                memory_unit_mib=s.memory_unit_mib,
                ignored_xids=s.ignored_xids,
                context_overhead_mib=s.context_overhead_mib,
                hook_injection=s.hook_injection,
                default_core_limit_percent=s.default_core_limit_percent,
            ),
            ContainerStore(dra_dir, s.memory_unit_mib),
            ClaimStore(dra_dir, s.memory_unit_mib),
            CdiDir(s.cdi_dir, s.resource_domain),
            self.claims,
            self.slices,
            node_file=s.state_dir / "node.json",
            events=self._event,
        )
        self.service.devices = HostDevices(s.host_dev_dir)
        self.events: KubeEvents | None = None
        if claims is None:  # a real API server (tests inject their own ports)
            self.service.users = ClaimStatusWriter(self.driver, s.kubeconfig)
            self.events = KubeEvents(self._core_api, node)
            self.service.warn = self.events
        self._core: Any = None
        self.arbiter: Arbiter | None = None
        self.dra_socket = s.dra_plugin_dir() / "dra.sock"
        self.registration_socket = s.kubelet_registry_dir / f"{self.driver}-reg.sock"
        self.registration = RegistrationServicer(self.driver, self.dra_socket)
        self.servicer = DraServicer(self.service, self._on_call)
        self.stopping = threading.Event()
        self.health = HealthServicer(self.service, self.stopping)
        self.servers: list[UnixServer] = []
        self._threads: list[threading.Thread] = []

    def _event(self, kind: str, fields: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.event(kind, fields)

    def _core_api(self) -> Any:
        """The CoreV1Api Events go through, built on the first one (it is not small)."""
        if self._core is None:
            self._core = core_v1_api(self.settings.kubeconfig)
        return self._core

    def _on_call(self, method: str, seconds: float, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.calls.labels(method, "dra", outcome).inc()
            self.metrics.latency.labels(method, "dra").observe(seconds)

    # ---------------------------------------------------------- start-up

    def check(self) -> None:
        s = self.settings
        if not s.node_name:
            raise ConfigError(
                "node_name is not set: DRA mode publishes the node's ResourceSlice under its "
                "name; pass --node-name or set NODE_NAME (downward API spec.nodeName)"
            )
        if s.kubeconfig is None and not os.environ.get("KUBERNETES_SERVICE_HOST"):
            raise ConfigError(
                "DRA mode needs the API server (ResourceSlices, ResourceClaims): pass "
                "--kubeconfig FILE or run in a cluster"
            )
        for path in (self.dra_socket, self.registration_socket):
            if len(str(path).encode()) > 107:
                raise ConfigError(f"socket path {path} is longer than 107 bytes; use a shorter dir")

    def start(self) -> None:
        s = self.settings
        log.info("vgpu %s starting in DRA mode; effective settings: %s", __version__, s.public())
        self.check()
        cards = self.backend.cards()
        if not cards:
            log.warning("the %s backend found no cards; publishing no device", self.backend.name)
        for card in cards:
            log.info(
                "card %d (%s): %s %s, %d MiB, minor %d, NUMA %s",
                card.index,
                device_name(card),
                card.uuid,
                card.name,
                card.memory_mib,
                card.minor,
                card.numa_node,
            )
        self.service.set_cards(cards)
        self.service.hook_installer = hook_installer(s)
        try:
            self.service.ensure_hook()
        except StateUnwritable as exc:
            log.error("%s; sliced claims are refused until then (retried at each prepare)", exc)
        try:
            self.service.recover()
        except OSError as exc:
            # Serve anyway: each claim's prepare names the disk's error until it recovers.
            log.error(
                "cannot recover prepared claims from %s (%s); serving, and prepares that need "
                "the disk are refused by name until it takes writes",
                s.state_dir,
                os.strerror(exc.errno or 0),
            )
        self.claims.start(self.stop)
        self.slices.start(self.stop)
        if self.events is not None:
            self.events.start(self.stop)
        if s.metrics_address:
            from vgpu.daemon.metrics import Metrics

            self.metrics = Metrics(self, DraCollector(self.service, self))
            self.metrics.serve(s.metrics_address)
        self._serve()
        self._spawn("backend-watch", self._watch_backend)
        self._spawn("socket-watch", self._watch_sockets)
        self._spawn("usage", self._usage_loop)
        self._spawn("device-nodes", device_node_watch, self.service.check_device_nodes, self.stop)
        self._spawn("budget-watch", budget_watch, self.service.store, self.stop, self._event)
        self._start_arbiter()

    def _start_arbiter(self) -> None:
        """The compute arbiter, as in device-plugin mode (vgpu/daemon/arbiter.py),
        over the prepared claims' fractional requests, each capped by its claim's
        opaque config (fixed at prepare)."""
        utilization = arbiter_utilization(self.backend)
        if utilization is None:
            return
        store = self.service.store
        self.arbiter = Arbiter(
            utilization,
            placed_containers(
                self.service.placements,
                lambda key: store.paths(key).budget_file,
                self.service.core_cap,
            ),
            teller=HostPidTeller.for_node(
                self.settings.host_proc_dir, getattr(self.backend, "process_memory", None)
            ),
        )
        self._spawn("arbiter", self.arbiter.run, self.stop)

    def _spawn(self, name: str, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _serve(self) -> None:
        """The DRA socket first: the kubelet dials it as soon as it reads GetInfo."""
        for server in self.servers:
            server.stop(0)
        self.servers = [
            dra_server(self.servicer, self.dra_socket, self.health),
            registration_server(self.registration, self.registration_socket),
        ]
        for server in self.servers:
            server.start()
        log.info(
            "serving DRA driver %s on %s; registration socket %s",
            self.driver,
            self.dra_socket,
            self.registration_socket,
        )

    def _watch_sockets(self) -> None:
        """Serve again when a socket is removed (a kubelet or an operator cleaning up)."""
        while not self.stop.wait(SOCKET_CHECK_S):
            missing = [s.socket_path for s in self.servers if not s.socket_path.is_socket()]
            if missing and not self.stop.is_set():
                log.warning("socket %s was removed: serving again", ", ".join(map(str, missing)))
                self._serve()

    def _watch_backend(self) -> None:
        watch_backend(self.backend, self.stop, self.service.set_cards, self.service.on_event)

    def _usage_loop(self) -> None:
        usage_loop(self.backend, self.stop, self.service.set_readings)

    # ---------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        self.stop.set()
        self.stopping.set()
        self.service.close()
        for server in self.servers:
            server.stop(0.2)
        if self.metrics is not None:
            self.metrics.close()
        deadline = time.monotonic() + STOP_TIMEOUT_S / 2
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        log.info("stopped; DRA sockets removed (the ResourceSlice stays for the kubelet to wipe)")


def run_dra(settings: Settings) -> int:
    """`vgpu serve --mode dra`: exit codes as for the device plugin."""
    return run(settings, DraDaemon)
