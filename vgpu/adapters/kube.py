"""The Kubernetes API behind one small module: a watch-based cache of the
pods bound to this node, and pod annotation patches.

Only this module imports the `kubernetes` client; its exceptions never leak
(callers see KubeUnavailable). Nothing here is called on the Allocate path
except `candidates()`, which reads the in-memory cache.
"""

from __future__ import annotations

import decimal
import functools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from vgpu.adapters.kube_errors import api_error_text
from vgpu.adapters.kube_events import warning_event
from vgpu.core.annotations import Assignment, assignment_key, parse_assignment
from vgpu.core.model import CardUuid, ContainerSpec, Request, Resource
from vgpu.core.readiness import ApiHealth

log = logging.getLogger(__name__)

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


class KubeUnavailable(Exception):
    pass


class PodSource(Protocol):
    """What the daemon needs to know about pods."""

    enabled: bool  # False: no API server configured at all

    def candidates(self) -> list[ContainerSpec]:
        """Containers of pods on this node still being admitted (phase Pending), in the
        order the kubelet admits them: as the pods were bound here, then oldest first."""
        ...

    def synced(self) -> bool:
        """True while the cache is complete and the watch is running."""
        ...

    def version(self) -> int:
        """A counter that moves on every cache change."""
        ...

    def wait_change(self, since: int, timeout_s: float) -> bool:
        """Wait until version() differs from `since` (True) or the timeout (False)."""
        ...

    def annotate(self, namespace: str, pod: str, annotations: dict[str, str | None]) -> None:
        """Queue a patch of the pod's annotations (best effort, off the hot path)."""
        ...

    def annotations(self, namespace: str, pod: str) -> dict[str, str]: ...

    def uid_of(self, namespace: str, pod: str) -> str:
        """The pod's UID if cached, else ''."""
        ...

    def alive(self) -> frozenset[str] | None:
        """UIDs and `namespace/name`s of the pods the API server shows bound to
        this node and not terminated (deleting ones included: their containers
        may still run); None while the cache is not synced (nothing is known)."""
        ...

    def staying(self) -> frozenset[str] | None:
        """`namespace/name`s of the alive() pods that are not being deleted;
        None while the cache is not synced."""
        ...

    def running(self) -> list[ContainerSpec]:
        """Containers of this node's Running pods that ask for our resources."""
        ...

    def successor(self, namespace: str, name: str) -> str | None:
        """The name of a newer pod of the same controller (a DaemonSet's surge
        pod) on this node, not terminated nor being deleted; None if none, or
        when nothing is known."""
        ...

    def start(self, stop: threading.Event) -> None: ...


class NoPods:
    """No API server configured: every admission uses the fallback rule."""

    enabled = False

    def candidates(self) -> list[ContainerSpec]:
        return []

    def synced(self) -> bool:
        return False

    def version(self) -> int:
        return 0

    def wait_change(self, since: int, timeout_s: float) -> bool:
        return False

    def annotate(self, namespace: str, pod: str, annotations: dict[str, str | None]) -> None:
        return None

    def annotations(self, namespace: str, pod: str) -> dict[str, str]:
        return {}

    def uid_of(self, namespace: str, pod: str) -> str:
        return ""

    def alive(self) -> frozenset[str] | None:
        return None

    def staying(self) -> frozenset[str] | None:
        return None

    def running(self) -> list[ContainerSpec]:
        return []

    def successor(self, namespace: str, name: str) -> str | None:
        return None

    def start(self, stop: threading.Event) -> None:
        return None


def _controller_uid(meta: dict[str, Any]) -> str | None:
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller"):
            uid = ref.get("uid")
            return uid if isinstance(uid, str) else None
    return None


def successor_pod(pods: list[dict[str, Any]], namespace: str, name: str) -> str | None:
    """Among `pods` (one node's), a newer pod of the same controller as
    `namespace/name`, not terminated nor being deleted."""
    own = next(
        (
            p.get("metadata") or {}
            for p in pods
            if (p.get("metadata") or {}).get("namespace") == namespace
            and (p.get("metadata") or {}).get("name") == name
        ),
        None,
    )
    if own is None:
        return None
    owner = _controller_uid(own)
    if owner is None:
        return None
    created = str(own.get("creationTimestamp") or "")
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("name") == name or meta.get("namespace") != namespace:
            continue
        if _controller_uid(meta) != owner or meta.get("deletionTimestamp"):
            continue
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        # RFC 3339 in UTC at one-second resolution: text order is time order;
        # a pod of the same second counts (it cannot be older than the owner's
        # own pod in a rolling update, which creates it after).
        if str(meta.get("creationTimestamp") or "") >= created:
            return str(meta.get("name"))
    return None


def parse_units(value: Any) -> tuple[int, str]:
    """An extended-resource quantity as the kubelet counts it, and what is wrong with it.

    Parsed by the kubernetes client's own quantity parser, exactly as the API
    server writes quantities ("1k" for 1000, "1Ki", "1e3"). Returns the units
    the kubelet asks for (its Value(): rounded up) and "" when the value is a
    non-negative whole number, else the problem ("not a whole number", ...).
    """
    if type(value) is str or type(value) is int:
        # The same few quantities arrive on every watch event and extender call.
        return _parse_units_cached(value)
    return _parse_units(value)


@functools.lru_cache(maxsize=4096, typed=True)
def _parse_units_cached(value: str | int) -> tuple[int, str]:
    return _parse_units(value)


def _parse_units(value: Any) -> tuple[int, str]:
    from kubernetes.utils.quantity import parse_quantity

    try:
        number = parse_quantity(value)
    except (ValueError, TypeError, ArithmeticError) as exc:
        return 0, f"is not a Kubernetes quantity ({exc})"
    if number < 0:
        return 0, "is negative"
    units = int(number.to_integral_value(rounding=decimal.ROUND_CEILING))
    if number != units:
        return units, "is not a whole number (extended resources are integers)"
    return units, ""


_UNPARSED: Any = object()


def container_specs(
    pod: dict[str, Any], domain: str, assignment: Assignment | None = _UNPARSED
) -> list[ContainerSpec]:
    """The containers of one pod (as API JSON) that ask for our resources.
    `assignment`: its assignment annotation, where the caller parsed it already
    (None: absent or unreadable)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    created = meta.get("creationTimestamp")
    try:
        created_s = (
            datetime.fromisoformat(str(created).replace("Z", "+00:00")).timestamp()
            if created
            else 0.0
        )
    except ValueError:
        created_s = 0.0
    core_name = Resource.CORE.full_name(domain)
    mem_name = Resource.MEMORY.full_name(domain)
    assigned = _assigned_cards(meta, spec, domain, assignment)
    out = []
    order = 0
    for init, key in ((True, "initContainers"), (False, "containers")):
        for container in spec.get(key) or []:
            order += 1
            resources = container.get("resources") or {}
            limits = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
            name = str(container.get("name", ""))
            units: dict[str, int] = {}
            problems = []
            for resource_name in (core_name, mem_name):
                raw = limits.get(resource_name, 0)
                units[resource_name], problem = parse_units(raw)
                if problem:
                    problems.append(
                        f"container {meta.get('namespace', 'default')}/{meta.get('name', '')}/"
                        f"{name} asks {resource_name}={raw!r}, which {problem}: write a whole "
                        f"number, e.g. '{resource_name}: {max(1, units[resource_name])}'"
                    )
            request = Request(units[core_name], units[mem_name])
            if not request.resources:
                continue
            out.append(
                ContainerSpec(
                    pod_uid=str(meta.get("uid", "")),
                    namespace=str(meta.get("namespace", "default")),
                    pod=str(meta.get("name", "")),
                    container=name,
                    request=request,
                    created_s=created_s,
                    init=init,
                    order=order,
                    assigned=assigned.get(str(container.get("name", ""))),
                    problem="; ".join(problems),
                )
            )
    return out


def _assigned_cards(
    meta: dict[str, Any],
    spec: dict[str, Any],
    domain: str,
    assignment: Assignment | None = _UNPARSED,
) -> dict[str, tuple[CardUuid, ...]]:
    """The extender's assignment, if it names the node the pod is bound to."""
    if assignment is _UNPARSED:
        text = (meta.get("annotations") or {}).get(assignment_key(domain))
        if not isinstance(text, str):
            return {}
        try:
            assignment = parse_assignment(text)
        except ValueError as exc:
            log.debug("pod %s/%s: ignoring %s", meta.get("namespace"), meta.get("name"), exc)
            return {}
    if assignment is None:
        return {}
    if assignment.node != spec.get("nodeName"):
        return {}  # bound elsewhere than the extender chose (e.g. by another scheduler)
    return dict(assignment.containers)


def api_client(kubeconfig: Path | None, pool_connections: int = 0) -> Any:
    """An ApiClient for the kubeconfig file, or the in-cluster service account;
    no client-side retries (callers decide what a failure means).
    `pool_connections`: kept-alive connections to hold for reuse, where more
    calls than the client's default (5 per CPU) run at once."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if kubeconfig is not None:
        config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    else:
        config.load_incluster_config(client_configuration=cfg)
    cfg.retries = False
    if pool_connections > (cfg.connection_pool_maxsize or 0):
        cfg.connection_pool_maxsize = pool_connections
    return client.ApiClient(cfg)


def core_v1_api(kubeconfig: Path | None, pool_connections: int = 0) -> Any:
    """A CoreV1Api for the kubeconfig file, or the in-cluster service account."""
    from kubernetes import client

    return client.CoreV1Api(api_client(kubeconfig, pool_connections))


def _rv_number(meta: dict[str, Any]) -> int:
    """A resourceVersion as a number for ordering (etcd's are; 0 when not)."""
    try:
        return int(str(meta.get("resourceVersion", "")))
    except ValueError:
        return 0


def _raw_watch() -> Any:
    """A client Watch that hands out raw dicts: we read only the JSON, and
    building a model object per event costs CPU and memory for nothing."""
    from kubernetes import watch

    class RawWatch(watch.Watch):  # type: ignore[misc]
        def get_return_type(self, func: Any) -> None:
            return None

    return RawWatch()


class KubePodCache:
    """List+watch of pods with spec.nodeName=<node>; resumes with backoff."""

    enabled = True

    def __init__(
        self,
        node_name: str,
        domain: str,
        kubeconfig: Path | None,
        on_pod_gone: Callable[[], None] | None = None,
        backoff_max_s: float = 30.0,
    ) -> None:
        self.node_name = node_name
        self.domain = domain
        self.kubeconfig = kubeconfig
        self.on_pod_gone = on_pod_gone
        self.backoff_max_s = backoff_max_s
        self._pods: dict[str, dict[str, Any]] = {}  # uid -> pod JSON
        self._specs: dict[str, list[ContainerSpec]] = {}
        self._arrival: dict[str, int] = {}  # uid -> resourceVersion when first seen
        self._cond = threading.Condition()
        self._synced = False
        self._version = 0
        self._sorted: list[ContainerSpec] | None = None  # candidates(), until a change
        self._patches: queue.Queue[tuple[str, str, dict[str, str | None]]] = queue.Queue()
        self._api: Any = None
        self.health = ApiHealth()  # the daemon's /readyz reads it

    # ------------------------------------------------------------ client

    def address(self) -> str:
        """The API server's URL, for messages."""
        if self._api is not None:
            return str(self._api.api_client.configuration.host)
        return f"of kubeconfig {self.kubeconfig}" if self.kubeconfig else "(in-cluster)"

    def _failed(self, exc: BaseException, backoff: float) -> None:
        text = api_error_text(exc, self.address())
        self.health.failed(time.monotonic(), text)
        log.warning(
            "watching pods of node %s: %s; retrying in %.1fs", self.node_name, text, backoff
        )

    def _client(self) -> Any:
        if self._api is None:
            self._api = core_v1_api(self.kubeconfig)
        return self._api

    def client(self) -> Any:
        """The CoreV1Api this cache uses (one client per daemon: it is not small)."""
        return self._client()

    # ------------------------------------------------------------- reads

    def candidates(self) -> list[ContainerSpec]:
        # The kubelet admits pods as they reach it from its own watch of this node
        # (sorting only pods that arrive together by creation time), i.e. in the
        # order they were bound here: by the resourceVersion we first saw them at
        # (a pending pod's is its binding's), then by creation time.
        with self._cond:
            cached = self._sorted
            if cached is None:
                specs = [s for specs in self._specs.values() for s in specs]
                arrival = self._arrival
                cached = self._sorted = sorted(
                    specs,
                    key=lambda s: (
                        arrival.get(s.pod_uid, 0),
                        s.created_s,
                        s.namespace,
                        s.pod,
                        s.order,
                    ),
                )
        # Sorted once per change of the cache, not at each of the kubelet's calls.
        return list(cached)

    def synced(self) -> bool:
        return self._synced

    def version(self) -> int:
        with self._cond:
            return self._version

    def wait_change(self, since: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._version != since, timeout_s)

    def annotations(self, namespace: str, pod: str) -> dict[str, str]:
        with self._cond:
            for obj in self._pods.values():
                meta = obj.get("metadata") or {}
                if meta.get("namespace") == namespace and meta.get("name") == pod:
                    return dict(meta.get("annotations") or {})
        return {}

    def uid_of(self, namespace: str, pod: str) -> str:
        with self._cond:
            for uid, obj in self._pods.items():
                meta = obj.get("metadata") or {}
                if meta.get("namespace") == namespace and meta.get("name") == pod:
                    return uid
        return ""

    def alive(self) -> frozenset[str] | None:
        if not self._synced:
            return None
        with self._cond:
            out = set(self._pods)
            for obj in self._pods.values():
                meta = obj.get("metadata") or {}
                out.add(f"{meta.get('namespace', '')}/{meta.get('name', '')}")
        return frozenset(out)

    def successor(self, namespace: str, name: str) -> str | None:
        if not self._synced:
            return None
        with self._cond:
            pods = list(self._pods.values())
        return successor_pod(pods, namespace, name)

    def staying(self) -> frozenset[str] | None:
        if not self._synced:
            return None
        with self._cond:
            metas = [obj.get("metadata") or {} for obj in self._pods.values()]
        return frozenset(
            f"{meta.get('namespace', '')}/{meta.get('name', '')}"
            for meta in metas
            if not meta.get("deletionTimestamp")
        )

    # ------------------------------------------------------------ writes

    def annotate(self, namespace: str, pod: str, annotations: dict[str, str | None]) -> None:
        self._patches.put((namespace, pod, annotations))

    # --------------------------------------------------------- lifecycle

    def running(self) -> list[ContainerSpec]:
        """Containers of this node's Running pods that ask for our resources."""
        with self._cond:
            pods = [
                obj
                for obj in self._pods.values()
                if (obj.get("status") or {}).get("phase") == "Running"
                and not (obj.get("metadata") or {}).get("deletionTimestamp")
            ]
        return [spec for obj in pods for spec in container_specs(obj, self.domain)]

    def warn(
        self, namespace: str, pod: str, uid: str, container: str, reason: str, text: str
    ) -> None:
        """A Warning Event on the pod (KubeUnavailable when the API refuses it)."""
        body = warning_event(namespace, pod, uid, reason, text, self.node_name or "", container)
        try:
            self._client().create_namespaced_event(namespace, body, _request_timeout=5)
        except Exception as exc:
            raise KubeUnavailable(f"cannot post an event on {namespace}/{pod}: {exc}") from None

    def evict(self, namespace: str, pod: str) -> None:
        """Evict the pod through the Eviction API (honours disruption budgets)."""
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": pod, "namespace": namespace},
        }
        try:
            self._client().create_namespaced_pod_eviction(pod, namespace, body, _request_timeout=5)
        except Exception as exc:
            raise KubeUnavailable(f"cannot evict {namespace}/{pod}: {exc}") from None

    def start(self, stop: threading.Event) -> None:
        threading.Thread(
            target=self._watch_loop, args=(stop,), name="kube-watch", daemon=True
        ).start()
        threading.Thread(
            target=self._patch_loop, args=(stop,), name="kube-patch", daemon=True
        ).start()

    def _apply(self, kind: str, obj: dict[str, Any]) -> bool:
        """Fold one pod into the cache; True when a pod left (deleted or finished)."""
        meta = obj.get("metadata") or {}
        uid = str(meta.get("uid", ""))
        phase = (obj.get("status") or {}).get("phase")
        gone = kind == "DELETED" or phase in TERMINAL_PHASES
        with self._cond:
            if gone:
                existed = self._pods.pop(uid, None) is not None
                self._specs.pop(uid, None)
                self._arrival.pop(uid, None)
            else:
                existed = False
                if uid not in self._arrival:
                    self._arrival[uid] = _rv_number(meta)
                self._pods[uid] = obj
                if phase == "Pending" and not meta.get("deletionTimestamp"):
                    self._specs[uid] = container_specs(obj, self.domain)
                else:
                    self._specs.pop(uid, None)
            self._sorted = None
            self._version += 1
            self._cond.notify_all()
        return gone and (existed or kind == "DELETED")

    def _watch_loop(self, stop: threading.Event) -> None:
        from kubernetes.client.exceptions import ApiException

        backoff = 0.5
        resource_version: str | None = None
        selector = f"spec.nodeName={self.node_name}"
        while not stop.is_set():
            try:
                api = self._client()
                if resource_version is None:
                    reply = api.list_pod_for_all_namespaces(
                        field_selector=selector, _preload_content=False, _request_timeout=10
                    )
                    data = json.loads(reply.data)
                    listed = {
                        str((i.get("metadata") or {}).get("uid", "")) for i in data.get("items", [])
                    }
                    with self._cond:
                        self._pods.clear()
                        self._specs.clear()
                        self._sorted = None
                        self._arrival = {u: n for u, n in self._arrival.items() if u in listed}
                    for item in data.get("items", []):
                        self._apply("ADDED", item)
                    resource_version = data["metadata"]["resourceVersion"]
                    self.health.ok()
                    self._synced = True
                    if self.on_pod_gone:
                        self.on_pod_gone()
                    log.info(
                        "pod cache synced: %d pods on node %s", len(self._pods), self.node_name
                    )
                w = _raw_watch()
                for event in w.stream(
                    api.list_pod_for_all_namespaces,
                    field_selector=selector,
                    resource_version=resource_version,
                    timeout_seconds=60,
                    allow_watch_bookmarks=True,
                    _request_timeout=75,
                ):
                    if stop.is_set():
                        w.stop()
                        break
                    self.health.ok()
                    raw = event.get("raw_object") or {}
                    kind = event.get("type")
                    if kind == "ERROR":
                        code = raw.get("code")
                        if code == 410:
                            resource_version = None
                            break
                        raise KubeUnavailable(f"watch error {raw.get('message')}")
                    resource_version = (raw.get("metadata") or {}).get(
                        "resourceVersion", resource_version
                    )
                    if kind == "BOOKMARK":
                        continue
                    if self._apply(str(kind), raw) and self.on_pod_gone:
                        self.on_pod_gone()
                self.health.ok()  # the watch ended by its timeout: the server answered
                backoff = 0.5
            except ApiException as exc:
                if exc.status == 410:
                    resource_version = None
                    continue
                self._synced = False
                resource_version = None  # list again: resync, and be ready once it answers
                self._failed(exc, backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
            except Exception as exc:  # urllib3, socket and client errors alike
                self._synced = False
                resource_version = None  # list again: resync, and be ready once it answers
                self._failed(exc, backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)

    def _patch_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                namespace, pod, annotations = self._patches.get(timeout=0.5)
            except queue.Empty:
                continue
            for attempt in range(5):
                try:
                    reply = self._client().patch_namespaced_pod(
                        pod,
                        namespace,
                        {"metadata": {"annotations": annotations}},
                        _request_timeout=5,
                        _preload_content=False,  # the answer is unused: no model objects
                    )
                    reply.read()  # drain, so the connection goes back to the pool
                    reply.release_conn()
                    break
                except Exception as exc:
                    status = getattr(exc, "status", None)
                    if status == 404:
                        break
                    log.debug(
                        "annotating %s/%s failed (%s), attempt %d",
                        namespace,
                        pod,
                        api_error_text(exc, self.address()),
                        attempt,
                    )
                    if stop.wait(min(2**attempt * 0.5, 10)):
                        return


class NodePublisher(Protocol):
    """Publishes annotations on this node's Node object."""

    def publish(self, annotations: dict[str, str]) -> None:
        """Queue the latest value (best effort, off the hot path; older values are dropped)."""
        ...

    def start(self, stop: threading.Event) -> None: ...


class NoNodePublisher:
    """No API server configured: nothing is published."""

    def publish(self, annotations: dict[str, str]) -> None:
        return None

    def start(self, stop: threading.Event) -> None:
        return None


class KubeNodePublisher:
    """Patches annotations on one Node when they change; retries with backoff.

    Only the latest value is kept: a change while the API server is down is
    published once it is back. Before patching, the Node is read, and a value
    already there is not written again (a restarted daemon patches nothing).
    """

    def __init__(
        self,
        node_name: str,
        kubeconfig: Path | None,
        backoff_max_s: float = 30.0,
        client: Callable[[], Any] | None = None,
    ):
        self.node_name = node_name
        self.kubeconfig = kubeconfig
        self.backoff_max_s = backoff_max_s
        self._shared_client = client
        self._cond = threading.Condition()
        self._wanted: dict[str, str] | None = None
        self._api: Any = None
        self.patches = 0

    def publish(self, annotations: dict[str, str]) -> None:
        with self._cond:
            self._wanted = dict(annotations)
            self._cond.notify_all()

    def start(self, stop: threading.Event) -> None:
        def wake() -> None:
            stop.wait()
            with self._cond:
                self._cond.notify_all()

        threading.Thread(target=wake, name="node-publish-stop", daemon=True).start()
        threading.Thread(target=self._loop, args=(stop,), name="node-publish", daemon=True).start()

    def _loop(self, stop: threading.Event) -> None:
        backoff = 0.5
        while not stop.is_set():
            with self._cond:
                self._cond.wait_for(lambda: self._wanted is not None or stop.is_set())
                wanted, self._wanted = self._wanted, None
            if wanted is None:
                return
            try:
                self._patch(wanted)
                backoff = 0.5
            except Exception as exc:  # client, urllib3 and socket errors alike
                address = (
                    str(self._api.api_client.configuration.host)
                    if self._api is not None
                    else "(not connected)"
                )
                log.warning(
                    "cannot annotate node %s: %s; retrying in %.1fs",
                    self.node_name,
                    api_error_text(exc, address),
                    backoff,
                )
                with self._cond:
                    if self._wanted is None:
                        self._wanted = wanted  # unless a newer value came meanwhile
                if stop.wait(backoff):
                    return
                backoff = min(backoff * 2, self.backoff_max_s)

    def _patch(self, wanted: dict[str, str]) -> None:
        if self._api is None:
            shared = self._shared_client
            self._api = shared() if shared is not None else core_v1_api(self.kubeconfig)
        reply = self._api.read_node(self.node_name, _preload_content=False, _request_timeout=5)
        current = (json.loads(reply.data).get("metadata") or {}).get("annotations") or {}
        if all(current.get(k) == v for k, v in wanted.items()):
            return
        reply = self._api.patch_node(
            self.node_name,
            {"metadata": {"annotations": wanted}},
            _request_timeout=5,
            _preload_content=False,
        )
        reply.read()
        reply.release_conn()
        self.patches += 1
        log.info("published %s on node %s", ", ".join(sorted(wanted)), self.node_name)
