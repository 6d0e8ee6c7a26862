"""The composition root: settings in, a running daemon out.

Builds the adapters from Settings, wires them to the PluginService, and runs
the lifecycle as named tasks stopped by one flag:

    start-up   enumerate cards, recover placements, install the hook, serve,
               register with the kubelet
    main loop  backend watch, plugin-dir watch (kubelet restarts), pod cache,
               periodic reconcile, metrics
    shutdown   first SIGTERM/SIGINT: stop serving, remove sockets, exit 0;
               a second one forces the exit
    handover   a second daemon on the node (a rolling update's surge pod)
               asks the owner to hand over: docs/operations.md, "Upgrading
               without a gap"
"""

from __future__ import annotations

import logging
import os
import resource as rlimits
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from vgpu import __version__
from vgpu.adapters import budget
from vgpu.adapters.delivery import build_delivery
from vgpu.adapters.devnodes import HostDevices
from vgpu.adapters.dra.cdi import CdiDir
from vgpu.adapters.fs import ContainerStore, PluginDirWatcher, install_hook
from vgpu.adapters.gpus import BackendError, CardReading, GpuBackend, MockBackend
from vgpu.adapters.handoff import (
    HandoffError,
    HandoffServer,
    NodeLock,
    Outcome,
    accepted_fds,
    close_all,
    duplicate,
    request_handoff,
)
from vgpu.adapters.kube import (
    KubeNodePublisher,
    KubePodCache,
    NodePublisher,
    NoNodePublisher,
    NoPods,
    PodSource,
)
from vgpu.adapters.kubelet.checkpoint import CHECKPOINT_NAME
from vgpu.adapters.kubelet.servicer import (
    CallRelay,
    DevicePluginServicer,
    PluginServer,
    RegistrationError,
    device_list_message,
    register,
)
from vgpu.adapters.nvml import NvmlBackend
from vgpu.adapters.podresources import PodResourcesClient
from vgpu.config import Settings
from vgpu.core.errors import ConfigError, StateUnwritable
from vgpu.core.health import HealthEvent
from vgpu.core.model import Card, CardUuid, Resource
from vgpu.core.release import SETTLE_MAX_S
from vgpu.daemon.guard import UnallocatedGuard
from vgpu.daemon.lifecycle import stop_on_signals
from vgpu.daemon.service import PluginService, ServiceOptions, install_or_refuse
from vgpu.pb import deviceplugin_v1beta1_pb2 as pb

log = logging.getLogger("vgpu")

KUBELET_MESSAGE_LIMIT_BYTES = 4 * 1024 * 1024
MESSAGE_WARN_BYTES = 1024 * 1024
USAGE_INTERVAL_S = 5.0
BUDGET_CHECK_INTERVAL_S = 1.0  # how soon a grown budget file is cut back
STATE_RETRY_S = 1.0
STOP_TIMEOUT_S = 4.0
DEVICE_NODE_CHECK_S = 5.0  # how soon a card whose device node vanished turns unhealthy
START_SYNC_WAIT_S = 5.0  # longest start-up wait for the pod cache before registering
SPARES_WAIT_S = 0.25  # longest start-up wait for the directories made ahead
HANDOFF_ASK_TIMEOUT_S = 10.0  # longest wait for the owner's answer to a handover request
# How long a SIGTERMed owner keeps serving for a starting successor to ask for
# the node (within the chart's terminationGracePeriodSeconds of 30). Seen on
# the real kit under load: the new daemon asked 7 s after its container started.
HANDOFF_WAIT_S = 20.0
# After a handover the old daemon relays what the kubelet still sends it; it
# may exit once none came for RELAY_QUIET_S (at most RELAY_SETTLE_MAX_S): an
# exit under a call would leave the kubelet waiting on it for good.
RELAY_QUIET_S = 1.5
RELAY_SETTLE_MAX_S = 3.0
HANDOFF_FREEZE_S = 5.0  # longest wait for the calls under way when handing over


def socket_name(resource: Resource, alternate: bool = False) -> str:
    """A resource's socket in the device-plugin directory. Two daemons of a
    handover serve at the same time, so the newcomer takes the other name."""
    return f"vgpu-{resource.value}{'.2' if alternate else ''}.sock"


def build_backend(settings: Settings) -> GpuBackend:
    if settings.backend == "mock":
        assert settings.mock_gpus is not None
        return MockBackend(settings.mock_gpus)
    return NvmlBackend(ignored_xids=settings.ignored_xids)


def build_pods(settings: Settings, on_gone: Callable[[], None]) -> PodSource:
    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    if settings.kubeconfig is None and not in_cluster:
        log.warning(
            "no API server configured (no --kubeconfig, not in a cluster): containers are "
            "placed by the fallback rule, without pod information"
        )
        return NoPods()
    if not settings.node_name:
        raise ConfigError(
            "node_name is not set: pass --node-name or set NODE_NAME (downward API "
            "spec.nodeName) so vgpu can watch the pods of this node"
        )
    return KubePodCache(settings.node_name, settings.resource_domain, settings.kubeconfig, on_gone)


def hook_installer(settings: Settings) -> Callable[[], Path] | None:
    """What installs the hook library (both modes), None without one.

    A library that cannot be read is a configuration error (ConfigError naming
    the key); a disk that refuses the install is not: each mode retries it and
    refuses sliced containers by name meanwhile.
    """
    library, hook_dir = settings.hook_library, settings.hook_dir
    if library is None:
        return None
    try:
        library.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"cannot read the hook library {library}: {exc.strerror}; check hook_library"
        ) from exc
    return lambda: install_hook(library, hook_dir, __version__)


def watch_backend(
    backend: GpuBackend,
    stop: threading.Event,
    on_cards: Callable[[list[Card]], None],
    on_event: Callable[[HealthEvent], None],
) -> None:
    """The backend's health watch (both modes); a failure is logged, never raised."""
    try:
        backend.watch(stop, on_cards, on_event)
    except Exception:
        log.exception("the GPU backend watch failed; health is no longer watched")


def budget_watch(
    store: ContainerStore,
    stop: threading.Event,
    event: Callable[[str, dict[str, Any]], None],
) -> None:
    """A container's budget file must keep its one size (both modes): growth is
    an incident, logged and cut back, every BUDGET_CHECK_INTERVAL_S (one fstat
    per file)."""
    while not stop.wait(BUDGET_CHECK_INTERVAL_S):
        for key in store.record_keys():
            incident = budget.cut_back(store.paths(key).budget_file)
            if incident:
                log.warning("budget file of %s: %s", key, incident)
                event("budget_file_incident", {"key": key})


def usage_loop(
    backend: GpuBackend,
    stop: threading.Event,
    set_readings: Callable[[dict[CardUuid, CardReading]], None],
) -> None:
    """Real memory use and utilisation per card, every USAGE_INTERVAL_S (both modes)."""
    while True:
        try:
            set_readings(backend.readings())
        except Exception as exc:  # a backend hiccup must not end the loop
            log.warning("reading card usage failed: %s", exc)
        if stop.wait(USAGE_INTERVAL_S):
            return


def device_node_watch(check: Callable[[], None], stop: threading.Event) -> None:
    """Re-check the cards' device nodes on the host every DEVICE_NODE_CHECK_S (both modes)."""
    while not stop.wait(DEVICE_NODE_CHECK_S):
        try:
            check()
        except Exception:
            log.exception("checking the host's device nodes failed; will retry")


class Lifecycle(Protocol):
    """What `run` drives: the device plugin's Daemon or the DRA driver's."""

    stop: threading.Event
    # Set once the node was handed over to a successor: `run` then waits for
    # its own stop signal, serving nothing (an exit would restart the container).
    handed_off: threading.Event

    def start(self) -> None: ...

    def shutdown(self) -> None: ...


def build_node_publisher(settings: Settings, pods: PodSource) -> NodePublisher:
    """The Node annotator goes with the pod cache: both need the API server."""
    if not isinstance(pods, KubePodCache) or not settings.node_name:
        return NoNodePublisher()
    return KubeNodePublisher(settings.node_name, settings.kubeconfig, client=pods.client)


class Daemon:
    """Everything `vgpu serve` runs."""

    def __init__(self, settings: Settings, backend: GpuBackend | None = None) -> None:
        self.settings = settings
        self.backend = backend or build_backend(settings)
        self.stop = threading.Event()
        self.stopping = threading.Event()
        self.handed_off = threading.Event()
        self.store = ContainerStore(settings.state_dir, settings.memory_unit_mib)
        self.node_lock = NodeLock(settings.state_dir)
        self.handoff = HandoffServer(settings.state_dir, self.hand_off, self._handed)
        self.relay = CallRelay()
        self._ending = threading.Lock()  # a handover and a shutdown, one at a time
        self._ended = False
        self.socket_names = {r: socket_name(r) for r in Resource}
        # The kubelet's connections to a predecessor's sockets, kept open (handoff.py).
        self.kept_fds: list[int] = []
        # This daemon's own pod (downward API), to notice a surge pod at SIGTERM.
        self.pod_ref = (os.environ.get("POD_NAMESPACE", ""), os.environ.get("POD_NAME", ""))
        self._handoff_started = 0.0
        self._reconcile_now = threading.Event()
        self.pods = build_pods(settings, self._reconcile_now.set)
        self.node_publisher = build_node_publisher(settings, self.pods)
        self.podresources = PodResourcesClient(settings.pod_resources_socket)
        self.metrics: Any = None
        self.arbiter: Any = None  # vgpu.daemon.arbiter.Arbiter, once started
        self.service = PluginService(
            ServiceOptions(
                domain=settings.resource_domain,
                memory_unit_mib=settings.memory_unit_mib,
                policy=settings.policy,
                ignored_xids=settings.ignored_xids,
                api_wait_s=settings.api_wait_s,
                context_overhead_mib=settings.context_overhead_mib,
                hook_injection=settings.hook_injection,
                settle_s=min(settings.reconcile_interval_s, SETTLE_MAX_S),
            ),
            self.store,
            self.pods,
            self.podresources,
            node_file=settings.state_dir / "node.json",
            events=self._event,
            node_publisher=self.node_publisher,
        )
        self.service.devices = HostDevices(settings.host_dev_dir)
        self.guard: UnallocatedGuard | None = None
        if isinstance(self.pods, KubePodCache):
            self.guard = UnallocatedGuard(
                settings.resource_domain,
                self.pods,
                self.podresources,
                self.pods,
                settings.unallocated_policy,
                self._event,
                holding=self.service.holding_releases,
            )
        self.service.delivery = build_delivery(
            settings.device_list_strategy, CdiDir(settings.cdi_dir, settings.resource_domain)
        )
        self.options = pb.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        )
        self.servers: dict[Resource, PluginServer] = {}
        # Servers whose socket was removed under a kubelet that still streams
        # from them: kept serving (an ended stream would disconnect the new
        # registration, see handoff.py) until shutdown.
        self.retired: list[PluginServer] = []
        self._registered_with: tuple[int, int] | None = None
        self._register_lock = threading.Lock()
        self._next_attempt = 0.0
        self._backoff_s = 0.5
        self.registrations = 0
        self.watcher = PluginDirWatcher(
            settings.device_plugin_dir, self._socket_paths, self._on_kubelet_restart
        )
        self._threads: list[threading.Thread] = []
        self.service.registered_now = self._registered_with_current_kubelet
        self.service.kubelet_checkpoint = settings.device_plugin_dir / CHECKPOINT_NAME

    # ------------------------------------------------------------ events

    def _event(self, kind: str, fields: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.event(kind, fields)

    def _on_call(self, method: str, resource: Resource, seconds: float, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.call(method, resource, seconds, outcome)

    # ---------------------------------------------------------- start-up

    def _socket_paths(self) -> list[Path]:
        return [s.socket_path for s in self.servers.values()]

    def check_message_size(self) -> None:
        for resource in Resource:
            _, devices = self.service.device_list(resource)
            size = device_list_message(devices).ByteSize()
            if size > KUBELET_MESSAGE_LIMIT_BYTES * 0.9:
                raise ConfigError(
                    f"the {resource.value} device list would be {size / 2**20:.1f} MiB, over "
                    f"the kubelet's 4 MiB message limit; raise memory_unit_mib "
                    f"(now {self.settings.memory_unit_mib})"
                )
            if size > MESSAGE_WARN_BYTES:
                log.warning(
                    "the %s device list is %.2f MiB (kubelet limit 4 MiB): consider a larger "
                    "memory_unit_mib (now %d) to keep ListAndWatch cheap",
                    resource.value,
                    size / 2**20,
                    self.settings.memory_unit_mib,
                )

    def start(self) -> None:
        s = self.settings
        log.info("vgpu %s starting; effective settings: %s", __version__, s.public())
        cards = self.backend.cards()
        if not cards:
            log.warning("the %s backend found no cards; advertising nothing", self.backend.name)
        self.service.set_cards(cards)
        self.check_message_size()
        for card in cards:
            log.info(
                "card %d: %s %s, %d MiB, minor %d, NUMA %s",
                card.index,
                card.uuid,
                card.name,
                card.memory_mib,
                card.minor,
                card.numa_node,
            )
        # The pod cache first: importing the kubernetes client and listing the
        # node's pods take seconds, and an admission must never wait for them
        # (issue 19: the first admission after start waited 685 ms).
        self.pods.start(self.stop)
        self.node_publisher.start(self.stop)
        s.device_plugin_dir.mkdir(parents=True, exist_ok=True)
        self._await_pod_cache()
        # Everything above only reads; what follows writes the node's state
        # and serves its sockets, so it waits for the node to be ours.
        if not self._take_node():
            return
        self._start_handoff_server()
        try:
            self.store.prepare()
        except OSError as exc:
            # Serve anyway: placements are kept in memory and written once the
            # disk takes them; Allocate refuses with the disk's error meanwhile.
            log.error(
                "state directory %s unusable (%s); serving from memory until it is",
                self.store.root,
                os.strerror(exc.errno or 0),
            )
        self._install_hook()
        self.service.recover()
        # The directories made ahead, before the kubelet can call (bounded: a
        # successor adopts its predecessor's, and holds calls meanwhile).
        self.store.spares.wait_ready(SPARES_WAIT_S)
        if s.metrics_address:
            from vgpu.daemon.metrics import Metrics

            self.metrics = Metrics(self, container_names=s.metrics_container_names)
            self.metrics.serve(s.metrics_address)
        self._serve()
        self._try_register()
        self._spawn("backend-watch", self._watch_backend)
        self._spawn("plugin-dir-watch", self.watcher.run, self.stop, self._current_registration)
        self._spawn("reconcile", self._reconcile_loop)
        self._spawn("usage", self._usage_loop)
        self._spawn("budget-watch", self._budget_loop)
        self._spawn("state-retry", self._state_retry_loop)
        self._spawn("device-nodes", self._device_node_loop)
        self._start_arbiter()

    # ---------------------------------------------------------- handover

    def _take_node(self) -> bool:
        """Own the node: take its lock, asking a running owner to hand over
        first. False when stopped while waiting."""
        try:
            if self.node_lock.try_acquire():
                return True
        except OSError as exc:
            # The state directory is unusable; start-up serves from memory then.
            log.error("cannot take %s (%s); not checking for another daemon", exc.filename, exc)
            return True
        started = time.monotonic()
        # The owner's sockets are there: serve under the other names.
        plugin_dir = self.settings.device_plugin_dir
        self.socket_names = {
            r: socket_name(r, alternate=(plugin_dir / socket_name(r)).exists()) for r in Resource
        }
        log.warning(
            "another vgpu daemon owns this node (%s is locked); asking it to hand over",
            self.node_lock.path,
        )
        try:
            self.kept_fds = request_handoff(
                self.settings.state_dir,
                [self.socket_names[r] for r in Resource],
                HANDOFF_ASK_TIMEOUT_S,
            )
        except HandoffError as exc:
            log.warning("%s; waiting for it to stop", exc)

        def waiting(waited_s: float) -> None:
            log.warning("still waiting for the other vgpu daemon to leave (%.0f s)", waited_s)

        if not self.node_lock.acquire(self.stop, waiting):
            return False
        took_s = time.monotonic() - started
        log.info("took this node over in %.3f s", took_s)
        self._event("handoff", {"seconds": took_s})
        return True

    def _start_handoff_server(self) -> None:
        try:
            self.handoff.start()
        except OSError as exc:
            log.error(
                "cannot listen on %s (%s); an upgrade will stop this daemon before the new "
                "one starts",
                self.handoff.path,
                exc.strerror,
            )

    def hand_off(self, names: list[str]) -> Outcome:
        """Hand the node to a successor that will serve `names` (HandoffServer's
        thread): hold the kubelet's calls, stop every loop, write what is
        pending, release the lock. The streams stay open (handoff.py)."""
        with self._ending:
            if self._ended:
                return "the daemon is stopping", []
            if len(names) != len(Resource) or set(names) & set(self.socket_names.values()):
                return f"socket names {names} are not two names this daemon is not using", []
            self._ended = True
            self._handoff_started = time.monotonic()
            log.warning("a new vgpu daemon asks for this node: handing it over")
            self.handed_off.set()
            if not self.relay.freeze(HANDOFF_FREEZE_S):
                log.warning(
                    "calls still under way after %.0f s; handing over anyway", HANDOFF_FREEZE_S
                )
            self._stop_loops()
            fds = duplicate(accepted_fds(self._socket_paths()) + self.kept_fds)
            # The files only: the kubelet's connections stay. The next
            # newcomer then finds only the successor's names taken.
            for server in [*self.servers.values(), *self.retired]:
                server.unlink()
            self.node_lock.release()
            return None, fds

    def _handed(self, names: list[str]) -> None:
        """The successor has the node: relay the held calls to it."""
        plugin_dir = self.settings.device_plugin_dir
        self.relay.point_to({r: plugin_dir / n for r, n in zip(Resource, names, strict=True)})
        log.info(
            "handed this node over in %.3f s; relaying the kubelet's calls to %s until stopped",
            time.monotonic() - self._handoff_started,
            ", ".join(names),
        )

    def _stop_loops(self) -> None:
        """Every loop, timer and the metrics server, and write what is pending;
        the kubelet's sockets are not touched."""
        self.stop.set()
        self._reconcile_now.set()
        self.service.close()
        if self.metrics is not None:
            self.metrics.close()
        deadline = time.monotonic() + STOP_TIMEOUT_S / 2
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        try:
            self.service.flush_unwritten()
        except Exception:
            log.exception("writing the last unwritten records failed")
        self.podresources.close()
        self.store.close()

    def _successor_starting(self) -> str | None:
        namespace, name = self.pod_ref
        if not self.node_lock.held or not name:
            return None
        return self.pods.successor(namespace, name)

    def _device_node_loop(self) -> None:
        device_node_watch(self.service.check_device_nodes, self.stop)

    def _await_pod_cache(self) -> None:
        """Register only once the pod cache is synced (bounded): the first
        admission then finds its pod in memory, as fast as the tenth. An API
        server that does not answer in time only delays start-up by the bound;
        admissions then use the fallback rule until the cache syncs."""
        if not self.pods.enabled:
            return
        deadline = time.monotonic() + START_SYNC_WAIT_S
        seen = self.pods.version()
        while not self.pods.synced() and not self.stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning(
                    "the pod cache did not sync within %.0f s; registering anyway (admissions "
                    "use the fallback rule until it does)",
                    START_SYNC_WAIT_S,
                )
                return
            self.pods.wait_change(seen, min(left, 0.2))
            seen = self.pods.version()

    def _install_hook(self) -> None:
        """Install the hook library; a disk that refuses does not stop start-up."""
        self.service.hook_installer = hook_installer(self.settings)
        if self.service.hook_installer is None:
            return
        try:
            hook = install_or_refuse(self.service.hook_installer, str(self.settings.hook_dir))
        except StateUnwritable as error:
            log.error(
                "%s; sliced containers are refused until it can be installed, which is "
                "retried every %.0f s",
                error.message,
                STATE_RETRY_S,
            )
            self.service.state_error = error
            return
        self.service.options = replace(self.service.options, hook_path=hook)

    def _state_retry_loop(self) -> None:
        """Write what a full, read-only or descriptor-starved disk refused, as
        soon as it takes it again."""
        while not self.stop.wait(STATE_RETRY_S):
            try:
                if self.service.needs_retry():
                    self.service.flush_unwritten()
            except Exception:
                log.exception("retrying state writes failed; will retry")

    def _spawn(self, name: str, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _watch_backend(self) -> None:
        watch_backend(self.backend, self.stop, self.service.set_cards, self.service.on_event)

    def _serve(self, keep_streams: bool = False) -> None:
        if keep_streams:
            self.retired.extend(self.servers.values())
        else:
            for server in self.servers.values():
                server.stop(0)
        self.servers = {}
        for resource in Resource:
            servicer = DevicePluginServicer(
                self.service, resource, self.options, self.stopping, self._on_call, self.relay
            )
            server = PluginServer(
                servicer, self.settings.device_plugin_dir / self.socket_names[resource]
            )
            server.start()
            self.servers[resource] = server
        log.info("serving %s", ", ".join(str(p) for p in self._socket_paths()))

    def _current_registration(self) -> tuple[int, int] | None:
        if time.monotonic() < self._next_attempt:
            # Still backing off after a failed attempt: look registered.
            return self.watcher.kubelet_identity()
        return self._registered_with

    def _try_register(self) -> bool:
        with self._register_lock:
            identity = self.watcher.kubelet_identity()
            if identity is None:
                log.info("kubelet.sock not there yet; will register when the kubelet starts")
                return False
            try:
                for resource in Resource:
                    register(
                        self.settings.device_plugin_dir,
                        self.socket_names[resource],
                        self.service.resource_name(resource),
                        self.options,
                    )
            except RegistrationError as exc:
                self._registered_with = None
                self._next_attempt = time.monotonic() + self._backoff_s
                log.warning("%s; retrying in %.1fs", exc, self._backoff_s)
                self._backoff_s = min(self._backoff_s * 2, 10.0)
                return False
            self._registered_with = identity
            self.service.plugin_registered()
            self._backoff_s = 0.5
            self._next_attempt = 0.0
            self.registrations += 1
            self._event("registered", {})
            log.info(
                "registered %s and %s with the kubelet",
                self.service.resource_name(Resource.CORE),
                self.service.resource_name(Resource.MEMORY),
            )
            return True

    def _registered_with_current_kubelet(self) -> bool:
        """Registered, with the kubelet whose kubelet.sock is there now?"""
        registered = self._registered_with  # one read (called under the service's lock)
        return registered is not None and registered == self.watcher.kubelet_identity()

    def _on_kubelet_restart(self, why: str) -> None:
        if self.stop.is_set():
            return
        # Our socket removed under the kubelet we registered with: its streams
        # from the old servers are alive and must stay so.
        same_kubelet = self._registered_with_current_kubelet()
        self.service.kubelet_restarted(why)
        log.warning("kubelet restart noticed (%s): serving again and re-registering", why)
        if not same_kubelet:
            # A predecessor's connections and our old servers: the restarted
            # kubelet has dropped them.
            kept, self.kept_fds = self.kept_fds, []
            close_all(kept)
            for server in self.retired:
                server.stop(0)
            self.retired = []
        self._registered_with = None
        self._serve(keep_streams=same_kubelet)
        self._try_register()

    def _start_arbiter(self) -> None:
        """The compute arbiter (vgpu/daemon/arbiter.py): every card, every 100 ms."""
        from vgpu.daemon.arbiter import build_node_arbiter

        self.arbiter = build_node_arbiter(
            self.settings,
            self.backend,
            lambda: list(self.service.ledger.placements.values()),
            lambda key: self.store.paths(key).budget_file,
            self.pods,
            self.stop,
        )
        if self.arbiter is not None:
            self._spawn("arbiter", self.arbiter.run, self.stop)

    def _usage_loop(self) -> None:
        usage_loop(self.backend, self.stop, self.service.set_readings)

    def _budget_loop(self) -> None:
        budget_watch(self.store, self.stop, self._event)

    def _reconcile_loop(self) -> None:
        interval = self.settings.reconcile_interval_s
        while not self.stop.is_set():
            woke = self._reconcile_now.wait(interval)
            if self.stop.is_set():
                return
            self._reconcile_now.clear()
            try:
                self.service.reconcile("pod finished or deleted" if woke else "periodic check")
                if self.guard is not None:
                    self.guard.check()
            except Exception:
                log.exception("reconcile failed; will retry")

    # ---------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        successor = None if self.handed_off.is_set() else self._successor_starting()
        if successor:
            # A rolling update: the new daemon's pod is starting. Serve on until
            # it asks for the node, so no admission meets a node without devices.
            log.info(
                "pod %s will take over this node; serving until it asks (at most %.0f s)",
                successor,
                HANDOFF_WAIT_S,
            )
            if not self.handoff.done.wait(HANDOFF_WAIT_S):
                log.warning("%s did not ask within %.0f s; stopping", successor, HANDOFF_WAIT_S)
        with self._ending:
            if self._ended:
                self.handoff.close(unlink=False)
                if self.handed_off.is_set() and not self.relay.settle(
                    RELAY_QUIET_S, RELAY_SETTLE_MAX_S
                ):
                    log.warning("the kubelet still calls this daemon; leaving anyway")
                log.info("stopped (this node was handed over)")
                return
            self._ended = True
            self.handoff.close()
            self.stopping.set()  # the streams end: the kubelet turns the devices unhealthy
            self._stop_loops()
            for server in [*self.servers.values(), *self.retired]:
                server.stop(0.2)
            close_all(self.kept_fds)
            self.node_lock.release()
        log.info("stopped; sockets removed")


def raise_open_file_limit() -> None:
    """Use the whole hard limit of open files: a node with many containers, and
    metrics clients, must not run the kubelet path out of descriptors."""
    soft, hard = rlimits.getrlimit(rlimits.RLIMIT_NOFILE)
    want = hard if hard != rlimits.RLIM_INFINITY else 1 << 20
    if soft != rlimits.RLIM_INFINITY and soft < want:
        try:
            rlimits.setrlimit(rlimits.RLIMIT_NOFILE, (want, hard))
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, want, exc)


def run(settings: Settings, factory: Callable[[Settings], Lifecycle] = Daemon) -> int:
    """Run until SIGTERM/SIGINT. Exit codes: 0 clean stop, 2 bad config, 3 backend unusable."""
    raise_open_file_limit()
    daemon = factory(settings)
    signalled = threading.Event()
    stop_on_signals(daemon.stop, log, signalled)
    try:
        daemon.start()
    except ConfigError as exc:
        print(f"vgpu: {exc.message}", file=sys.stderr)
        daemon.shutdown()
        return 2
    except BackendError as exc:
        print(f"vgpu: {exc}", file=sys.stderr)
        daemon.shutdown()
        return 3
    while not daemon.stop.wait(1.0):
        pass
    daemon.shutdown()
    if daemon.handed_off.is_set():
        # Exiting before the stop signal would restart this container, which
        # would ask for the node back. Then leave without a gRPC shutdown: that
        # would end the kubelet's streams, which the successor keeps open.
        signalled.wait()
        logging.shutdown()
        os._exit(0)
    return 0
