"""The scheduler extender's view of the Kubernetes API: watch-based caches of
Nodes (their vgpu-node inventory) and of Pods that ask for vgpu resources,
and the two writes of a bind (the assignment annotation, then the Binding).

Only JSON crosses into the rest of the extender as plain values (PodInfo,
NodeInventory); no `kubernetes` object or exception leaks (BindError,
callers' sinks). Nothing here is called on the filter or prioritize path.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote, urlsplit

from vgpu.adapters.httpwire import NoAnswer, read_response, request_bytes
from vgpu.adapters.kube import TERMINAL_PHASES, _raw_watch, container_specs, core_v1_api
from vgpu.core.annotations import (
    Assignment,
    NodeInventory,
    assignment_key,
    node_key,
    parse_assignment,
    parse_inventory,
    parse_placements,
    placements_key,
)
from vgpu.core.model import CardUuid
from vgpu.core.scheduling import PodInfo

log = logging.getLogger(__name__)

LIST_PAGE = 500
# Binding cycles run at once (kube-scheduler does not bound them): keep this
# many connections for reuse, and let no more Bindings than that be in flight
# (the others wait for a connection). At the client's default (5 per CPU) a
# burst of binds opened a connection (and a TLS handshake) per bind beyond it,
# and urllib3 logged a warning for each one it then discarded; on the real
# kube-scheduler, 1,000 pods at once had up to 287 Bindings in flight, each new
# connection's handshake slowing the API server and the extender further
# (binds took 0.6 s on average, up to 2.5 s).
BIND_CONNECTIONS = 64
MAX_ANSWER_BYTES = 2**20  # a Binding's answer is a Status of a few hundred bytes
AUTH_TTL_S = 1.0  # the bind's auth headers are asked of the client at most this often
ACTIVE_PODS = "status.phase!=Succeeded,status.phase!=Failed"


class BindError(Exception):
    """A bind's API write failed; the message says which and why.

    `maybe_landed`: the Binding was sent and no answer said it was refused (a
    timeout, a connection lost after the request went out, a 500, 502 or 504):
    the API server may still apply it. Otherwise it certainly did not land."""

    def __init__(self, message: str, maybe_landed: bool = False) -> None:
        super().__init__(message)
        self.maybe_landed = maybe_landed


def _may_go_on(status: int) -> bool:
    """Whether a write answered `status` may still be applied: a 500, 502 or 504
    can come while the API server (or etcd behind it) goes on with it ("Timeout:
    request did not complete within the allowed duration"); a 503 says it was
    not taken (unavailable, shutting down), a 4xx that it was refused."""
    return status >= 500 and status != HTTPStatus.SERVICE_UNAVAILABLE


class _AfterSending(Exception):
    """A failure once the request had (maybe partly) gone out: it may land."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Binder(Protocol):
    def bind(self, namespace: str, name: str, uid: str, node: str, assignment: str) -> None:
        """Annotate the pod with `assignment`, then bind it to `node`; BindError on failure."""
        ...

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod from the API server (None if it does not exist); BindError on failure."""
        ...


class ClusterSink(Protocol):
    """Where the caches deliver what they see."""

    def nodes_listed(self, nodes: dict[str, tuple[NodeInventory | None, str]]) -> None: ...

    def node_changed(self, name: str, inventory: NodeInventory | None, problem: str) -> None: ...

    def node_deleted(self, name: str) -> None: ...

    def pods_listed(self, pods: list[PodInfo]) -> None: ...

    def pod_changed(self, pod: PodInfo) -> None: ...

    def pod_deleted(self, uid: str) -> None: ...

    def synced(self, kind: str, ok: bool) -> None: ...


def node_inventory(node: dict[str, Any], domain: str) -> tuple[NodeInventory | None, str]:
    """A Node's published inventory, or None and why it is unusable."""
    text = ((node.get("metadata") or {}).get("annotations") or {}).get(node_key(domain))
    if text is None:
        return None, (
            f"no {node_key(domain)} annotation: vgpu serve is not running on this "
            f"node (or uses another resource domain than {domain})"
        )
    try:
        return parse_inventory(str(text)), ""
    except ValueError as exc:
        return None, f"unreadable {node_key(domain)} annotation: {exc}"


def pod_info(pod: dict[str, Any], domain: str) -> PodInfo:
    """The plain values the extender keeps of one pod (JSON as the API serves it)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    annotations = meta.get("annotations") or {}
    assignment: Assignment | None = None
    placements: dict[str, tuple[CardUuid, ...]] = {}
    text = annotations.get(assignment_key(domain))
    if isinstance(text, str):
        try:
            assignment = parse_assignment(text)
        except ValueError:
            assignment = None  # then the node decides, and its placements tell us
    text = annotations.get(placements_key(domain))
    if isinstance(text, str):
        try:
            placements = parse_placements(text)
        except ValueError:
            placements = {}
    phase = (pod.get("status") or {}).get("phase")
    specs = tuple(container_specs(pod, domain, assignment))  # the annotation parsed once
    return PodInfo(
        uid=str(meta.get("uid", "")),
        namespace=str(meta.get("namespace", "default")),
        name=str(meta.get("name", "")),
        node=str(spec.get("nodeName") or ""),
        active=phase not in TERMINAL_PHASES,
        specs=specs,
        assignment=assignment,
        placements=placements,
    )


def list_all(api: Any, kind: str) -> tuple[list[dict[str, Any]], str]:
    """Every Node, or every active Pod, page by page; and the list's resourceVersion."""
    items: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {"limit": LIST_PAGE, "_preload_content": False}
        if token:
            kwargs["_continue"] = token
        if kind == "nodes":
            reply = api.list_node(_request_timeout=30, **kwargs)
        else:
            reply = api.list_pod_for_all_namespaces(
                field_selector=ACTIVE_PODS, _request_timeout=30, **kwargs
            )
        data = json.loads(reply.data)
        items.extend(data.get("items") or [])
        meta = data.get("metadata") or {}
        token = meta.get("continue")
        if not token:
            return items, str(meta.get("resourceVersion", ""))


class KubeUnreachable(Exception):
    pass


def snapshot(
    kubeconfig: Path | None, domain: str
) -> tuple[dict[str, tuple[NodeInventory | None, str]], list[PodInfo]]:
    """One read of every vgpu Node and every active vgpu Pod (for `vgpu status --cluster`)."""
    try:
        api = core_v1_api(kubeconfig)
        nodes, _ = list_all(api, "nodes")
        pods, _ = list_all(api, "pods")
    except Exception as exc:  # config, HTTP and socket errors alike
        status = getattr(exc, "status", None)
        raise KubeUnreachable(
            f"HTTP {status}: {getattr(exc, 'reason', '')}" if status else f"{exc}"
        ) from None
    inventories = {
        str((n.get("metadata") or {}).get("name")): node_inventory(n, domain) for n in nodes
    }
    infos = [p for p in (pod_info(i, domain) for i in pods) if p.specs]
    return inventories, infos


class ClusterCache:
    """List+watch of Nodes and of active Pods; resumes with backoff, relists on 410."""

    def __init__(
        self,
        domain: str,
        kubeconfig: Path | None,
        sink: ClusterSink,
        backoff_max_s: float = 30.0,
        pod_seen: Callable[[str, PodInfo], None] | None = None,
    ) -> None:
        """`pod_seen(resourceVersion, info)` is told of every pod the watch
        decodes (the HTTP edge keeps pending ones, so filter need not decode
        the same pod again)."""
        self.domain = domain
        self.kubeconfig = kubeconfig
        self.sink = sink
        self.backoff_max_s = backoff_max_s
        self.pod_seen = pod_seen
        self._api: Any = None
        self._api_lock = threading.Lock()

    def _client(self) -> Any:
        with self._api_lock:
            if self._api is None:
                self._api = core_v1_api(self.kubeconfig)
            return self._api

    def start(self, stop: threading.Event) -> None:
        for kind in ("nodes", "pods"):
            threading.Thread(
                target=self._loop, args=(kind, stop), name=f"extender-{kind}", daemon=True
            ).start()

    # ------------------------------------------------------------ listing

    def _list(self, kind: str) -> tuple[list[dict[str, Any]], str]:
        return list_all(self._client(), kind)

    def _deliver_list(self, kind: str, items: Iterable[dict[str, Any]]) -> None:
        if kind == "nodes":
            self.sink.nodes_listed(
                {
                    str((n.get("metadata") or {}).get("name")): node_inventory(n, self.domain)
                    for n in items
                }
            )
        else:
            self.sink.pods_listed([p for p in (pod_info(i, self.domain) for i in items) if p.specs])

    def _deliver(self, kind: str, event: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        if kind == "nodes":
            name = str(meta.get("name"))
            if event == "DELETED":
                self.sink.node_deleted(name)
            else:
                inventory, problem = node_inventory(obj, self.domain)
                self.sink.node_changed(name, inventory, problem)
        elif event == "DELETED":
            self.sink.pod_deleted(str(meta.get("uid", "")))
        else:
            info = pod_info(obj, self.domain)
            if info.specs:
                self.sink.pod_changed(info)
                if self.pod_seen is not None:
                    self.pod_seen(str(meta.get("resourceVersion") or ""), info)

    def _error_text(self, exc: BaseException) -> str:
        from vgpu.adapters.kube_errors import api_error_text

        api = getattr(self, "_api", None)
        config = getattr(getattr(api, "api_client", None), "configuration", None)
        return api_error_text(exc, str(getattr(config, "host", "(not connected)")))

    # -------------------------------------------------------------- loop

    def _loop(self, kind: str, stop: threading.Event) -> None:
        from kubernetes.client.exceptions import ApiException

        backoff = 0.5
        version: str | None = None
        while not stop.is_set():
            try:
                if version is None:
                    items, version = self._list(kind)
                    self._deliver_list(kind, items)
                    self.sink.synced(kind, True)
                    log.info("%s cache synced: %d listed", kind, len(items))
                api = self._client()
                watch = _raw_watch()
                func = api.list_node if kind == "nodes" else api.list_pod_for_all_namespaces
                extra = {} if kind == "nodes" else {"field_selector": ACTIVE_PODS}
                for event in watch.stream(
                    func,
                    resource_version=version,
                    timeout_seconds=60,
                    allow_watch_bookmarks=True,
                    _request_timeout=75,
                    **extra,
                ):
                    if stop.is_set():
                        watch.stop()
                        break
                    raw = event.get("raw_object") or {}
                    etype = str(event.get("type"))
                    if etype == "ERROR":
                        if raw.get("code") == 410:
                            version = None
                            break
                        raise RuntimeError(f"watch error {raw.get('message')}")
                    version = (raw.get("metadata") or {}).get("resourceVersion", version)
                    if etype != "BOOKMARK":
                        self._deliver(kind, etype, raw)
                backoff = 0.5
            except ApiException as exc:
                if exc.status == 410:
                    version = None
                    continue
                self.sink.synced(kind, False)
                log.warning("%s watch: %s; retrying in %.1fs", kind, self._error_text(exc), backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
            except Exception as exc:  # urllib3, socket and client errors alike
                self.sink.synced(kind, False)
                log.warning("%s watch: %s; retrying in %.1fs", kind, self._error_text(exc), backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)


def _status_message(body: str | bytes | None) -> str:
    """The `message` of an API server's Status answer ("" if it has none)."""
    try:
        return str(json.loads(body or "{}").get("message") or "")
    except (ValueError, AttributeError):
        return ""


@dataclass(frozen=True)
class _PoolTarget:
    pool: Any  # urllib3 HTTP(S)ConnectionPool
    base: str  # the configuration's host URL it was made for
    base_path: str
    host: str  # the Host header


class KubeBinder:
    """A bind's one API write (a Binding carrying the assignment), bounded by `timeout_s`."""

    def __init__(
        self,
        kubeconfig: Path | None,
        domain: str,
        timeout_s: float,
        connections: int = BIND_CONNECTIONS,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.domain = domain
        self.timeout_s = timeout_s
        self.connections = connections
        self._api: Any = None
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(connections)  # Bindings in flight

    def _client(self) -> Any:
        with self._lock:
            if self._api is None:
                self._api = core_v1_api(self.kubeconfig, self.connections)
            return self._api

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            reply = fn()
        except ApiException as exc:
            detail = _status_message(exc.body)
            raise BindError(
                f"{what}: HTTP {exc.status}: {detail or exc.reason}",
                maybe_landed=_may_go_on(exc.status or 0),
            ) from None
        except Exception as exc:  # urllib3, socket and client errors alike
            from vgpu.adapters.kube_errors import api_error_text

            host = getattr(getattr(self._api, "api_client", None), "configuration", None)
            text = api_error_text(exc, str(getattr(host, "host", "(not connected)")))
            # Where the client failed is not known here: it may have been sent.
            raise BindError(f"{what}: {text}; the scheduler retries the pod", True) from None
        data = reply.data
        reply.release_conn()
        return data

    def read_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            data = self._call(
                f"reading pod {namespace}/{name}",
                lambda: self._client().read_namespaced_pod(
                    name, namespace, _preload_content=False, _request_timeout=self.timeout_s
                ),
            )
        except BindError as exc:
            if "HTTP 404" in str(exc):
                return None
            raise
        pod: dict[str, Any] = json.loads(data)
        return pod

    def bind(self, namespace: str, name: str, uid: str, node: str, assignment: str) -> None:
        """One API call: the Binding's own metadata.annotations carry the assignment,
        and the API server merges them into the pod in the same write as
        spec.nodeName (so the pod is never bound without its assignment)."""
        api = self._client()
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": uid,
                "annotations": {assignment_key(self.domain): assignment},
            },
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        what = f"binding pod {namespace}/{name} to {node}"
        target = self._target(api.api_client)
        if target is not None:
            self._bind_on_pool(what, api.api_client, target, namespace, name, body)
            return
        # The answer is a Status, not a Binding: never let the client decode it.
        self._call(what, lambda: self._post_binding(api, namespace, name, body))

    def _bind_on_pool(
        self,
        what: str,
        client: Any,
        target: _PoolTarget,
        namespace: str,
        name: str,
        body: dict[str, Any],
    ) -> None:
        """The Binding as one write on a connection of the client's own urllib3
        pool (its TLS settings and kept-alive connections), with the client's
        headers and auth (update_params_for_auth, at most once a second, see
        `_auth`); the Status answer read by httpwire. Through
        urllib3's request and response layers (and http.client's email-based
        header parser) a bind cost ~600 us of CPU in ~840 Python calls, and its
        head and body went out as two sends, waking the API server twice."""
        pool = target.pool
        path = (
            f"{target.base_path}/api/v1/namespaces/{quote(namespace, safe='')}"
            f"/pods/{quote(name, safe='')}/binding"
        )
        headers: dict[str, str] = {
            "Accept": "application/json",
            "Content-Type": "application/json",
            **{str(k): str(v) for k, v in client.default_headers.items()},
        }
        if client.cookie:
            headers["Cookie"] = str(client.cookie)
        headers.update(self._auth(client))
        if not self._slots.acquire(timeout=self.timeout_s):
            raise BindError(  # never sent
                f"{what}: {self.connections} Bindings were in flight for {self.timeout_s:g} s "
                "(the API server is slow); the scheduler retries the pod"
            )
        try:
            request = request_bytes("POST", path, target.host, headers, json.dumps(body).encode())
            try:
                status, data, resent = self._exchange(pool, request)
            finally:
                self._slots.release()
            if resent and status == 409 and self._landed(namespace, name, body):
                return  # the first write did land: the 409 is its own bind
        except Exception as exc:  # socket, TLS, urllib3 pool and malformed answers alike
            from vgpu.adapters.kube_errors import api_error_text

            sent = isinstance(exc, _AfterSending)
            cause = exc.cause if isinstance(exc, _AfterSending) else exc
            text = api_error_text(cause, str(client.configuration.host))
            raise BindError(f"{what}: {text}; the scheduler retries the pod", sent) from None
        if not 200 <= status <= 299:
            if status == HTTPStatus.UNAUTHORIZED:
                self._auth_headers = None  # the next bind asks the client again
            detail = _status_message(data)
            phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
            raise BindError(f"{what}: HTTP {status}: {detail or phrase}", _may_go_on(status))

    _auth_headers: tuple[float, dict[str, str]] | None = None

    def _auth(self, client: Any) -> dict[str, str]:
        """The auth headers from the client's own configuration, asked again at
        most once every AUTH_TTL_S (and after a 401): update_params_for_auth runs
        the kubeconfig loader's refresh hook, which rebuilds part of the client's
        configuration on every call (~50 us, a fifth of a bind's CPU). A rotated
        token file or a refreshed exec token is picked up within that second."""
        now = time.monotonic()
        cached = self._auth_headers
        if cached is not None and now < cached[0]:
            return cached[1]
        auth: dict[str, str] = {}
        client.update_params_for_auth(auth, [], ["BearerToken"], "", "POST", None)
        self._auth_headers = (now + AUTH_TTL_S, auth)
        return auth

    def _exchange(self, pool: Any, request: bytes) -> tuple[int, bytes, bool]:
        """(status, body, whether it was sent twice) over one of the pool's
        connections, given back to it after; any failure closes the connection.

        A kept-alive connection that ends before any byte of an answer was most
        likely closed by the server as idle just as the request went out (the
        pool's check for a dropped peer cannot see a close that is still on its
        way): the request is sent once more on a new connection. The server may
        have acted on the first one all the same; the caller checks a 409."""
        for attempt in (1, 2):
            conn = pool._get_conn(timeout=self.timeout_s)  # checked for a dropped peer
            try:
                fresh = conn.sock is None
                if fresh:
                    conn.timeout = self.timeout_s
                    conn.connect()
                conn.sock.settimeout(self.timeout_s)
                reader = conn.sock.makefile("rb")
                try:
                    conn.sock.sendall(request)
                    status, _, data, close = read_response(reader, MAX_ANSWER_BYTES)
                except (NoAnswer, BrokenPipeError, ConnectionResetError) as exc:
                    if fresh or attempt == 2:
                        raise _AfterSending(exc) from exc
                    conn.close()
                    continue
                except Exception as exc:  # timed out, or a malformed answer: sent
                    raise _AfterSending(exc) from exc
                finally:
                    reader.close()
                if close:
                    conn.close()
                return status, data, attempt == 2
            except BaseException:
                conn.close()
                raise
            finally:
                pool._put_conn(conn)
        raise AssertionError("unreachable")  # pragma: no cover

    def _landed(self, namespace: str, name: str, body: dict[str, Any]) -> bool:
        """Whether the pod is bound as `body` asked (node, uid and the assignment):
        after a resent Binding answered 409, the first one did it."""
        try:
            pod = self.read_pod(namespace, name)
        except BindError:
            return False
        if pod is None:
            return False
        meta, wanted = pod.get("metadata") or {}, body["metadata"]
        return (
            (pod.get("spec") or {}).get("nodeName") == body["target"]["name"]
            and meta.get("uid") == wanted["uid"]
            and all(
                (meta.get("annotations") or {}).get(k) == v
                for k, v in wanted["annotations"].items()
            )
        )

    def _post_binding(self, api: Any, namespace: str, name: str, body: dict[str, Any]) -> Any:
        """The Binding through the client's call_api (behind a proxy, or where the
        client has no urllib3 pool of its own); clients before the generator
        that has param_serialize (kubernetes < 33) take the generated method."""
        client = api.api_client
        if not hasattr(client, "param_serialize"):
            return api.create_namespaced_pod_binding(
                name, namespace, body, _preload_content=False, _request_timeout=self.timeout_s
            )
        request = client.param_serialize(
            method="POST",
            resource_path="/api/v1/namespaces/{namespace}/pods/{name}/binding",
            path_params={"namespace": namespace, "name": name},
            header_params={"Accept": "application/json", "Content-Type": "application/json"},
            body=body,
            auth_settings=["BearerToken"],
        )
        return client.call_api(*request, _request_timeout=self.timeout_s)

    _pool_target: _PoolTarget | None = None

    def _target(self, client: Any) -> _PoolTarget | None:
        """The client's own urllib3 connection pool for its API server, with the
        path and Host it needs, looked up once (and again if the manager closed
        the pool); one object, replaced whole, so binds running at once never
        see half of it. None where the client goes through a proxy (a
        ProxyManager), has no pool manager, or the pool lacks the connection
        checkout this adapter uses: then the client's call_api does it all."""
        import urllib3

        manager = getattr(getattr(client, "rest_client", None), "pool_manager", None)
        if type(manager) is not urllib3.PoolManager or not hasattr(
            client, "update_params_for_auth"
        ):
            return None
        base = str(client.configuration.host).rstrip("/")
        target = self._pool_target
        if target is None or target.base != base or target.pool.pool is None:
            pool = manager.connection_from_url(base)
            if not (hasattr(pool, "_get_conn") and hasattr(pool, "_put_conn")):
                return None
            url = urlsplit(base)
            target = self._pool_target = _PoolTarget(
                pool=pool,
                base=base,
                base_path=url.path.rstrip("/"),  # e.g. a proxy's /k8s/clusters/<id>
                host=url.netloc.rpartition("@")[2],
            )
        return target
