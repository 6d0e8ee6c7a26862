"""A fake Kubernetes API server over real HTTP, for tests and ``vgpu demo``.

Only the standard library is used (and vgpu's pure core, for quantities).  The
server speaks enough of the core/v1 API for the official ``kubernetes`` Python
client to list, get, watch and patch Pods and Nodes against it:

* ``GET /api``, ``/api/v1``, ``/apis``, ``/version``
* ``GET /api/v1/pods`` and ``/api/v1/namespaces/{ns}/pods`` (list or
  ``watch=true``), with ``fieldSelector`` / ``labelSelector``
* ``GET|PATCH /api/v1/namespaces/{ns}/pods/{name}``
* ``GET /api/v1/nodes`` (list or watch) and ``GET|PATCH /api/v1/nodes/{name}``
* ``resource.k8s.io/v1`` (DRA): DeviceClass, ResourceSlice (cluster-scoped) and
  ResourceClaim (namespaced): create, get, list, watch, update (PUT, with
  resourceVersion conflicts), patch, delete, deletecollection, field selectors
  (``spec.nodeName``, ``spec.driver``, ``spec.pool.name`` on slices), the claims'
  ``status`` subresource (status is written there only), discovery under
  ``/apis``, and the server's ResourceSlice validation (capacity request
  policies: default and max on min's step grid, min + step within the value)
* ``POST /api/v1/namespaces/{ns}/pods/{name}/binding`` (what a scheduler, or a
  scheduler extender with a bind verb, calls to bind a pod to a node); the
  Binding's own ``metadata.annotations`` and ``metadata.labels`` are merged into
  the pod in the same write as ``spec.nodeName``, as the real registry does
* ``POST /api/v1/namespaces/{ns}/pods/{name}/eviction`` (policy/v1 Eviction: the
  pod is deleted at once, no disruption budgets; :attr:`FakeApiServer.evictions`)
* ``POST /api/v1/namespaces/{ns}/events`` (core/v1 Event, kept in
  :meth:`FakeApiServer.events`)

Resource versions come from one global, monotonically increasing counter.  Watch
events are kept in a bounded history so that a watch can resume from a
``resourceVersion``; a version older than the history window is answered with an
``ERROR`` event carrying a 410 ``Expired`` Status, as the real server does.

Fault injection: :meth:`FakeApiServer.set_down` makes every request answer 503 and
cuts open watches at once (the connection is dropped mid-stream, like a crashed
server); :meth:`FakeApiServer.set_delay` delays every answer.

Every thread the server starts is named with the prefix :data:`THREAD_PREFIX`, so
tests can check that none is left after :meth:`FakeApiServer.stop`.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import re
import select
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["THREAD_PREFIX", "FakeApiServer", "make_node", "make_pod"]

THREAD_PREFIX = "vgpu-fake-apiserver"
"""Name prefix of every thread the fake API server starts."""

JSON = dict[str, Any]

_INITIAL_RV = 1000
_WAIT_SLICE_S = 0.25  # how often an idle watch checks whether its client went away
_DEFAULT_IMAGE = "registry.k8s.io/pause:3.9"

# resource (URL plural) -> (kind, namespaced)
_RESOURCES: dict[str, tuple[str, bool]] = {"pods": ("Pod", True), "nodes": ("Node", False)}

# The resource.k8s.io/v1 group (DRA): resource (URL plural) -> (kind, namespaced).
DRA_GROUP = "resource.k8s.io"
DRA_GROUP_VERSION = f"{DRA_GROUP}/v1"
_DRA_RESOURCES: dict[str, tuple[str, bool]] = {
    "deviceclasses": ("DeviceClass", False),
    "resourceslices": ("ResourceSlice", False),
    "resourceclaims": ("ResourceClaim", True),
}
_ALL_RESOURCES = {**_RESOURCES, **_DRA_RESOURCES}


def _api_version(resource: str) -> str:
    return DRA_GROUP_VERSION if resource in _DRA_RESOURCES else "v1"


# The field selectors the real API server accepts, per resource.
_FIELD_LABELS: dict[str, frozenset[str]] = {
    "pods": frozenset(
        {
            "metadata.name",
            "metadata.namespace",
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        }
    ),
    "nodes": frozenset({"metadata.name", "spec.unschedulable"}),
    "deviceclasses": frozenset({"metadata.name"}),
    "resourceslices": frozenset(
        {"metadata.name", "spec.nodeName", "spec.driver", "spec.pool.name"}
    ),
    "resourceclaims": frozenset({"metadata.name", "metadata.namespace"}),
}

_REASONS: dict[int, str] = {
    400: "BadRequest",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    503: "ServiceUnavailable",
}

_MERGE_PATCH = "application/merge-patch+json"
_STRATEGIC_PATCH = "application/strategic-merge-patch+json"
_JSON_PATCH = "application/json-patch+json"


def _now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, message: str, reason: str | None = None, **details: str) -> JSON:
    """A ``v1.Status`` failure object."""
    body: JSON = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or _REASONS.get(code, ""),
        "code": code,
    }
    if details:
        body["details"] = dict(details)
    return body


class _ApiError(Exception):
    """Answered to the client as a ``Status`` object with this HTTP code."""

    def __init__(self, code: int, message: str, reason: str | None = None, **details: str):
        super().__init__(message)
        self.code = code
        self.body = _status(code, message, reason, **details)


class _Abort(Exception):
    """The connection must be dropped at once (server down or stopping)."""


# --------------------------------------------------------------------------- selectors


def _field_value(obj: JSON, path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            return ""
        cur = cur.get(part)
    if cur is None:
        return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


@dataclass(frozen=True)
class _Selector:
    namespace: str | None = None
    # (field path, op, value); op is "=" or "!="
    fields: tuple[tuple[str, str, str], ...] = ()
    # (label key, op, values); op is "=", "!=", "in", "notin", "exists" or "!exists"
    labels: tuple[tuple[str, str, frozenset[str]], ...] = ()

    def matches(self, obj: JSON) -> bool:
        meta = obj.get("metadata") or {}
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        for path, op, value in self.fields:
            if (_field_value(obj, path) == value) != (op == "="):
                return False
        labels: dict[str, str] = meta.get("labels") or {}
        for key, op, values in self.labels:
            present = key in labels
            actual = labels.get(key)
            if op in ("=", "in"):
                ok = present and actual in values
            elif op in ("!=", "notin"):
                ok = not present or actual not in values
            elif op == "exists":
                ok = present
            else:
                ok = not present
            if not ok:
                return False
        return True


_LABEL_KEY = r"[A-Za-z0-9][-A-Za-z0-9_./]*"
_SET_TERM = re.compile(rf"({_LABEL_KEY})\s+(in|notin)\s+\(([^)]*)\)")
_EQ_TERM = re.compile(rf"({_LABEL_KEY})\s*(==|!=|=)\s*([-A-Za-z0-9_.]*)")
_EXISTS_TERM = re.compile(rf"(!?)\s*({_LABEL_KEY})")


def _parse_field_selector(resource: str, text: str) -> tuple[tuple[str, str, str], ...]:
    terms: list[tuple[str, str, str]] = []
    for raw in text.split(","):
        term = raw.strip()
        if not term:
            continue
        if "!=" in term:
            key, value = term.split("!=", 1)
            op = "!="
        elif "==" in term:
            key, value = term.split("==", 1)
            op = "="
        elif "=" in term:
            key, value = term.split("=", 1)
            op = "="
        else:
            raise _ApiError(400, f"invalid field selector: {term!r}")
        key = key.strip()
        if key not in _FIELD_LABELS[resource]:
            raise _ApiError(
                400, f'field label not supported: "{key}" for {_ALL_RESOURCES[resource][0]}'
            )
        terms.append((key, op, value.strip()))
    return tuple(terms)


def _parse_label_selector(text: str) -> tuple[tuple[str, str, frozenset[str]], ...]:
    terms: list[tuple[str, str, frozenset[str]]] = []
    for raw in re.split(r",(?![^()]*\))", text):
        term = raw.strip()
        if not term:
            continue
        if m := _SET_TERM.fullmatch(term):
            values = frozenset(v.strip() for v in m.group(3).split(",") if v.strip())
            terms.append((m.group(1), m.group(2), values))
        elif m := _EQ_TERM.fullmatch(term):
            op = "=" if m.group(2) in ("=", "==") else "!="
            terms.append((m.group(1), op, frozenset({m.group(3)})))
        elif m := _EXISTS_TERM.fullmatch(term):
            terms.append((m.group(2), "!exists" if m.group(1) else "exists", frozenset()))
        else:
            raise _ApiError(400, f"unable to parse requirement: {term!r}")
    return tuple(terms)


# --------------------------------------------------------------------------- patches


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch; ``null`` deletes a key."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result: JSON = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


def _pointer(path: Any) -> list[str]:
    if not isinstance(path, str) or (path and not path.startswith("/")):
        raise _ApiError(422, f"invalid JSON pointer: {path!r}")
    if not path:
        return []
    return [t.replace("~1", "/").replace("~0", "~") for t in path[1:].split("/")]


def _walk(doc: Any, tokens: list[str]) -> Any:
    cur = doc
    for tok in tokens:
        if isinstance(cur, dict) and tok in cur:
            cur = cur[tok]
        elif isinstance(cur, list) and tok.isdigit() and int(tok) < len(cur):
            cur = cur[int(tok)]
        else:
            raise _ApiError(422, f"path not found: /{'/'.join(tokens)}")
    return cur


def _pointer_get(doc: Any, tokens: list[str]) -> Any:
    return _walk(doc, tokens)


def _pointer_add(doc: Any, tokens: list[str], value: Any, *, replace: bool) -> Any:
    if not tokens:
        return copy.deepcopy(value)
    parent = _walk(doc, tokens[:-1])
    last = tokens[-1]
    if isinstance(parent, dict):
        if replace and last not in parent:
            raise _ApiError(422, f"replace of missing key: {last!r}")
        parent[last] = copy.deepcopy(value)
    elif isinstance(parent, list):
        if last == "-" and not replace:
            parent.append(copy.deepcopy(value))
        elif last.isdigit() and int(last) <= len(parent) - (1 if replace else 0):
            if replace:
                parent[int(last)] = copy.deepcopy(value)
            else:
                parent.insert(int(last), copy.deepcopy(value))
        else:
            raise _ApiError(422, f"bad array index: {last!r}")
    else:
        raise _ApiError(422, "patch target is not a container")
    return doc


def _pointer_remove(doc: Any, tokens: list[str]) -> Any:
    if not tokens:
        raise _ApiError(422, "cannot remove the whole document")
    parent = _walk(doc, tokens[:-1])
    last = tokens[-1]
    if isinstance(parent, dict) and last in parent:
        return parent.pop(last)
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent.pop(int(last))
    raise _ApiError(422, f"remove of missing path: /{'/'.join(tokens)}")


def _json_patch(doc: Any, ops: list[Any]) -> Any:
    """RFC 6902 JSON patch (add, remove, replace, test, move, copy)."""
    for op in ops:
        if not isinstance(op, dict):
            raise _ApiError(400, "JSON patch operations must be objects")
        name = op.get("op")
        tokens = _pointer(op.get("path"))
        if name == "add":
            doc = _pointer_add(doc, tokens, op.get("value"), replace=False)
        elif name == "replace":
            doc = _pointer_add(doc, tokens, op.get("value"), replace=True)
        elif name == "remove":
            _pointer_remove(doc, tokens)
        elif name == "test":
            if _pointer_get(doc, tokens) != op.get("value"):
                raise _ApiError(422, f"test failed at {op.get('path')!r}")
        elif name in ("move", "copy"):
            source = _pointer(op.get("from"))
            value = (
                _pointer_remove(doc, source)
                if name == "move"
                else copy.deepcopy(_pointer_get(doc, source))
            )
            doc = _pointer_add(doc, tokens, value, replace=False)
        else:
            raise _ApiError(400, f"unknown JSON patch op: {name!r}")
    return doc


# --------------------------------------------------------------------------- watches


@dataclass(frozen=True)
class _Event:
    rv: int
    resource: str
    type: str  # ADDED | MODIFIED | DELETED
    obj: JSON  # state after the change (never mutated once recorded)
    prev: JSON | None  # state before a MODIFIED, to detect selector transitions


@dataclass
class _WatchState:
    resource: str
    selector: _Selector
    cursor: int
    deadline: float | None
    next_bookmark: float | None
    initial: list[JSON] = field(default_factory=list)
    finished: bool = False


# --------------------------------------------------------------------------- HTTP plumbing


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], api: FakeApiServer) -> None:
        self.api = api
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(
            target=self._serve_connection,
            args=(request, client_address),
            name=f"{THREAD_PREFIX}-conn",
            daemon=True,
        )
        self.api._track(thread, request)
        thread.start()

    def _serve_connection(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self.api._untrack(threading.current_thread())

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError | _Abort):
            return  # client went away, server down or stopping: expected
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "vgpu-fake-apiserver/1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: without this, Nagle's
        # algorithm and the client's delayed ACK hold each answer ~40 ms.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self) -> None:
        self._dispatch()

    def do_PATCH(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def do_PUT(self) -> None:
        self._dispatch()

    def do_DELETE(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        api = cast(_HTTPServer, self.server).api
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length > 0 else b""
        try:
            api._begin_request(self.command, self.path)
            result = api._route(
                self.command, self.path, self.headers.get("Content-Type") or "", body
            )
        except _Abort:
            self.close_connection = True
            return
        except _ApiError as err:
            close = err.code == 503
            self._send_json(err.code, err.body, close=close)
            return
        if isinstance(result, _WatchState):
            self._stream_watch(api, result)
        else:
            self._send_json(*result)

    def _send_json(self, code: int, body: JSON, *, close: bool = False) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            peek: bytes = self.connection.recv(1, socket.MSG_PEEK)
            return peek == b""
        except OSError:
            return True

    def _stream_watch(self, api: FakeApiServer, state: _WatchState) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for batch in api._watch_iter(state, self._client_gone):
                lines = [json.dumps(ev, separators=(",", ":")).encode() + b"\n" for ev in batch]
                self._write_chunk(b"".join(lines))
            if self._client_gone():
                self.close_connection = True
                return
            self._write_chunk(b"")  # terminating chunk: a clean end of the stream
        except (_Abort, OSError):
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)


# --------------------------------------------------------------------------- the server


class FakeApiServer:
    """An in-memory core/v1 API server (Pods, Nodes) served over real HTTP/1.1."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        history_size: int = 1000,
        bookmark_interval_s: float = 1.0,
    ) -> None:
        if history_size < 1:
            raise ValueError("history_size must be >= 1")
        self._host = host
        self._port = port
        self._history_size = history_size
        self._bookmark_interval_s = bookmark_interval_s
        lock = threading.RLock()
        self._cond = threading.Condition(lock)
        # Watches wait on their own resource's condition (same lock): a write
        # wakes the watches of its resource, as the API server's watch cache
        # dispatches per resource, not every open watch (a node watch does not
        # wake for each pod write). Changes that concern every watch (down,
        # stop, compaction) wake them all (_wake_all).
        self._watch_conds = {r: threading.Condition(lock) for r in _ALL_RESOURCES}
        self._rv = _INITIAL_RV
        self._floor = _INITIAL_RV  # a watch may resume from any rv >= floor
        self._history: collections.deque[_Event] = collections.deque()
        self._store: dict[str, dict[tuple[str, str], JSON]] = {r: {} for r in _ALL_RESOURCES}
        self._events: list[JSON] = []  # core/v1 Events posted (bounded)
        self._events_seq = 0
        self.evictions: list[tuple[str, str]] = []  # (namespace, pod) evicted
        self._down = False
        self._delay_s = 0.0
        self._driver_access: _DriverAccess | None = None  # None: every client is an admin
        self._stopping = threading.Event()
        self._log: list[tuple[str, str]] = []
        self._conns: dict[threading.Thread, socket.socket] = {}
        self._conn_lock = threading.Lock()
        self._httpd: _HTTPServer | None = None
        self._serve_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Bind and serve in a daemon thread (``port=0`` picks a free port)."""
        if self._httpd is not None:
            raise RuntimeError("FakeApiServer already started")
        self._stopping.clear()
        httpd = _HTTPServer((self._host, self._port), self)
        self._httpd = httpd
        self._port = httpd.server_address[1]
        self._serve_thread = threading.Thread(
            target=httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"{THREAD_PREFIX}-accept",
            daemon=True,
        )
        self._serve_thread.start()

    def stop(self) -> None:
        """Stop serving: cut open watches and keep-alive connections, join all threads."""
        httpd = self._httpd
        if httpd is None:
            return
        self._stopping.set()
        with self._cond:
            self._wake_all()
        httpd.shutdown()
        httpd.server_close()
        if self._serve_thread is not None:
            self._serve_thread.join(timeout=1.0)
        with self._conn_lock:
            conns = list(self._conns.items())
        for _, sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + 1.0
        for thread, _ in conns:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._httpd = None
        self._serve_thread = None

    def __enter__(self) -> FakeApiServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:41234`` (the real port once started)."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    def write_kubeconfig(self, path: Path) -> None:
        """Write a kubeconfig (no auth) pointing at :attr:`url`."""
        server = json.dumps(self.url)  # a JSON string is a valid YAML double-quoted scalar
        path.write_text(
            "apiVersion: v1\n"
            "kind: Config\n"
            "clusters:\n"
            "- name: vgpu-sim\n"
            "  cluster:\n"
            f"    server: {server}\n"
            "users:\n"
            "- name: vgpu-sim\n"
            "  user: {}\n"
            "contexts:\n"
            "- name: vgpu-sim\n"
            "  context:\n"
            "    cluster: vgpu-sim\n"
            "    user: vgpu-sim\n"
            "    namespace: default\n"
            "current-context: vgpu-sim\n",
            encoding="utf-8",
        )

    # ------------------------------------------------------------------ fault injection

    def set_down(self, down: bool) -> None:
        """While down every request answers 503 and open watches are cut at once."""
        with self._cond:
            self._down = down
            self._wake_all()

    def set_delay(self, delay_s: float) -> None:
        """Every request waits ``delay_s`` seconds before it is answered."""
        with self._cond:
            self._delay_s = max(0.0, delay_s)

    def set_driver_status_access(
        self,
        rules: list[JSON] | None,
        *,
        node: str | None = None,
        user: str = "system:serviceaccount:vgpu-system:vgpu",
    ) -> None:
        """Answer every client as a ServiceAccount holding the RBAC ``rules``
        (a ClusterRole's ``rules``), its token bound to a pod on ``node`` (None:
        an unbound token), for the one check Kubernetes 1.36 added to
        ResourceClaim status writes (DRAResourceClaimGranularStatusAuthorization,
        beta, on by default): changing a driver's ``status.devices`` entries needs
        verb ``associated-node:<update|patch>`` (a token bound to the node the
        claim is allocated on) or ``arbitrary-node:<update|patch>`` on
        ``resourceclaims/driver`` with that driver as resource name; without it
        the write is refused with 422 ``status.devices: Forbidden``. Seen on
        kube-apiserver 1.36.2 (../shared/realk8s, issue 29): the chart's
        ``resourceclaims/status`` ``update`` alone got that 422; with
        ``associated-node:update`` the pod-bound token's write went through.
        ``None`` (the default): every client is a cluster admin, as the
        credential-less kubeconfig of :meth:`write_kubeconfig` suggests."""
        with self._cond:
            self._driver_access = None if rules is None else _DriverAccess(tuple(rules), node, user)

    def compact(self) -> None:
        """Forget the watch history, like an etcd compaction: resuming older rvs gets 410."""
        with self._cond:
            self._history.clear()
            self._floor = self._rv
            self._wake_all()

    @property
    def request_count(self) -> int:
        """Total requests received (including those answered 503 while down)."""
        with self._cond:
            return len(self._log)

    def requests(self) -> list[tuple[str, str]]:
        """A copy of the ``(method, path?query)`` request log."""
        with self._cond:
            return list(self._log)

    @property
    def resource_version(self) -> int:
        """The current global resourceVersion."""
        with self._cond:
            return self._rv

    # ------------------------------------------------------------------ the store

    def add_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        """Store a pod (emits ADDED) and return the stored copy."""
        return self._add("pods", pod)

    def update_pod(
        self, namespace: str, name: str, mutate: Callable[[dict[str, Any]], None]
    ) -> dict[str, Any]:
        """Apply ``mutate`` to a copy of the pod and store it (emits MODIFIED).

        ``mutate`` runs under the server lock; name, namespace and uid cannot change.
        A mutation that changes nothing does not bump the resourceVersion.
        """
        return self._update("pods", (namespace, name), mutate)

    def set_pod_phase(self, namespace: str, name: str, phase: str) -> dict[str, Any]:
        def mutate(pod: dict[str, Any]) -> None:
            status = pod.get("status")
            if not isinstance(status, dict):
                status = pod["status"] = {}
            status["phase"] = phase

        return self._update("pods", (namespace, name), mutate)

    def events(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """The core/v1 Events posted so far (oldest first)."""
        with self._cond:
            return [
                copy.deepcopy(e)
                for e in self._events
                if namespace is None or e["metadata"]["namespace"] == namespace
            ]

    def _record_event(self, namespace: str, body: bytes) -> JSON:
        event = _json_body(body)
        meta = event.get("metadata") or {}
        involved = event.get("involvedObject") or {}
        problems = []
        if not meta.get("name") and not meta.get("generateName"):
            problems.append("metadata.name: Required value")
        if meta.get("namespace", namespace) != namespace:
            problems.append("metadata.namespace: does not match the namespace of the request")
        if not involved.get("kind") or not involved.get("name"):
            problems.append("involvedObject: kind and name are required")
        if involved.get("namespace", namespace) != namespace:
            problems.append("involvedObject.namespace: does not match event.namespace")
        if event.get("type") not in ("Normal", "Warning"):
            problems.append("type: Unsupported value: must be Normal or Warning")
        if not event.get("reason"):
            problems.append("reason: Required value")
        if problems:
            raise _ApiError(422, f"Event is invalid: {'; '.join(problems)}")
        with self._cond:
            self._events_seq += 1
            meta = {**meta, "namespace": namespace}
            if not meta.get("name"):
                meta["name"] = f"{meta['generateName']}{self._events_seq:05d}"
            meta["uid"] = str(uuid.uuid4())
            stored = {**event, "metadata": meta}
            self._events.append(stored)
            del self._events[:-1000]
            return copy.deepcopy(stored)

    def _evict(self, namespace: str, name: str, body: bytes) -> JSON:
        eviction = _json_body(body)
        if eviction.get("kind") not in (None, "Eviction"):
            raise _ApiError(400, "the body must be a policy/v1 Eviction")
        given = (eviction.get("metadata") or {}).get("name")
        if given and given != name:
            raise _ApiError(400, f"name in URL does not match name in Eviction object: {given}")
        if self._get("pods", (namespace, name)) is None:
            raise _ApiError(404, f'pods "{name}" not found', name=name, kind="pods")
        self._delete("pods", (namespace, name))
        with self._cond:
            self.evictions.append((namespace, name))
        return {"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}

    def delete_pod(self, namespace: str, name: str) -> None:
        """Remove a pod at once (emits DELETED); ``KeyError`` if it does not exist."""
        self._delete("pods", (namespace, name))

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get("pods", (namespace, name))

    def pods(self) -> list[dict[str, Any]]:
        return self._list("pods")

    def pods_view(self) -> list[dict[str, Any]]:
        """The stored pods themselves, not copies: shared and read-only, as an
        informer's cache hands them out to kube-scheduler. Safe because every
        write stores a new object (copy on write) instead of changing one in
        place; a caller must never change what it gets."""
        return self._view("pods")

    def add_node(self, node: dict[str, Any]) -> dict[str, Any]:
        """Store a node (emits ADDED) and return the stored copy."""
        return self._add("nodes", node)

    def get_node(self, name: str) -> dict[str, Any] | None:
        return self._get("nodes", ("", name))

    # ------------------------------------------------------------------ DRA objects

    def add_object(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Store a resource.k8s.io/v1 object (``deviceclasses``, ``resourceslices``,
        ``resourceclaims``; emits ADDED) and return the stored copy."""
        if resource not in _DRA_RESOURCES:
            raise ValueError(f"not a resource.k8s.io/v1 resource: {resource}")
        if resource == "resourceslices":
            _check_slice(obj)
        return self._add(resource, obj)

    def get_object(self, resource: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        return self._get(resource, (namespace, name))

    def objects(self, resource: str) -> list[dict[str, Any]]:
        return self._list(resource)

    def update_object(
        self,
        resource: str,
        name: str,
        mutate: Callable[[dict[str, Any]], None],
        namespace: str = "",
    ) -> dict[str, Any]:
        """Apply ``mutate`` to a copy and store it (emits MODIFIED), like a controller's
        update or a status write."""
        return self._update(resource, (namespace, name), mutate)

    def delete_object(self, resource: str, name: str, namespace: str = "") -> None:
        self._delete(resource, (namespace, name))

    # ------------------------------------------------------------------ webhook objects
    # Secrets (v1) and the admissionregistration.k8s.io/v1 webhook configurations:
    # get, list, create (409 AlreadyExists), replace and merge-patch (409 Conflict
    # on a stale metadata.resourceVersion), delete (objects owned by the deleted
    # one, by ownerReference uid, are garbage-collected at once). No watch.

    def _webhook_store(self) -> dict[tuple[str, str, str], JSON]:
        store: dict[tuple[str, str, str], JSON] | None = getattr(self, "_wh_objects", None)
        if store is None:
            store = {}
            self._wh_objects: dict[tuple[str, str, str], JSON] = store
        return store

    def add_webhook_object(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Store a Secret or webhook configuration (as ``kubectl create`` would)."""
        meta = obj.get("metadata") or {}
        return self._wh_create(resource, str(meta.get("namespace", "")), copy.deepcopy(obj))

    def get_webhook_object(
        self, resource: str, name: str, namespace: str = ""
    ) -> dict[str, Any] | None:
        with self._cond:
            obj = self._webhook_store().get((resource, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def delete_webhook_object(self, resource: str, name: str, namespace: str = "") -> None:
        with self._cond:
            obj = self._webhook_store().pop((resource, namespace, name), None)
            if obj is None:
                raise KeyError(f"{resource} {namespace}/{name} not found")
            uid = obj["metadata"]["uid"]
            for key, other in list(self._webhook_store().items()):
                owners = other["metadata"].get("ownerReferences") or []
                if any(o.get("uid") == uid for o in owners):
                    del self._webhook_store()[key]

    def _wh_create(self, resource: str, namespace: str, obj: JSON) -> JSON:
        kind, api_version = _WEBHOOK_RESOURCES[resource]
        meta = obj.get("metadata")
        if not isinstance(meta, dict) or not meta.get("name"):
            raise _ApiError(422, f"{kind} is invalid: metadata.name: Required value")
        obj["kind"], obj["apiVersion"] = kind, api_version
        if resource == "secrets":
            meta["namespace"] = namespace
        key = (resource, namespace, str(meta["name"]))
        with self._cond:
            if key in self._webhook_store():
                raise _ApiError(
                    409,
                    f'{resource} "{key[2]}" already exists',
                    reason="AlreadyExists",
                    name=key[2],
                    kind=resource,
                )
            self._rv += 1
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = _now_rfc3339()
            meta["resourceVersion"] = str(self._rv)
            self._webhook_store()[key] = obj
            return copy.deepcopy(obj)

    def _wh_replace(self, key: tuple[str, str, str], new: JSON) -> JSON:
        with self._cond:
            cur = self._webhook_store().get(key)
            if cur is None:
                raise _ApiError(404, f'{key[0]} "{key[2]}" not found', name=key[2], kind=key[0])
            meta = new.get("metadata")
            if not isinstance(meta, dict):
                meta = new["metadata"] = {}
            wanted = meta.get("resourceVersion")
            if wanted is not None and wanted != cur["metadata"]["resourceVersion"]:
                raise _ApiError(
                    409,
                    f'Operation cannot be fulfilled on {key[0]} "{key[2]}": the object has '
                    "been modified; please apply your changes to the latest version and try again",
                    name=key[2],
                    kind=key[0],
                )
            for pinned in ("name", "namespace", "uid", "creationTimestamp"):
                if pinned in cur["metadata"]:
                    meta[pinned] = cur["metadata"][pinned]
            new["kind"], new["apiVersion"] = cur["kind"], cur["apiVersion"]
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            self._webhook_store()[key] = new
            return copy.deepcopy(new)

    def _route_webhook_objects(
        self, method: str, resource: str, namespace: str, name: str, body: bytes
    ) -> tuple[int, JSON]:
        if not name:
            if method == "POST":
                return 201, self._wh_create(resource, namespace, _json_body(body))
            if method == "GET":
                kind, api_version = _WEBHOOK_RESOURCES[resource]
                with self._cond:
                    items = [
                        copy.deepcopy(o)
                        for (r, ns, _), o in sorted(self._webhook_store().items())
                        if r == resource and (not namespace or ns == namespace)
                    ]
                    rv = str(self._rv)
                return 200, {
                    "kind": f"{kind}List",
                    "apiVersion": api_version,
                    "metadata": {"resourceVersion": rv},
                    "items": items,
                }
            raise _ApiError(405, f"{method} is not supported on a {resource} collection")
        key = (resource, namespace, name)
        if method == "GET":
            obj = self.get_webhook_object(resource, name, namespace)
            if obj is None:
                raise _ApiError(404, f'{resource} "{name}" not found', name=name, kind=resource)
            return 200, obj
        if method == "PUT":
            return 200, self._wh_replace(key, _json_body(body))
        if method == "PATCH":
            patch = _json_body(body)
            with self._cond:
                cur = self.get_webhook_object(resource, name, namespace)
                if cur is None:
                    raise _ApiError(404, f'{resource} "{name}" not found', name=name, kind=resource)
                return 200, self._wh_replace(key, _merge_patch(cur, patch))
        if method == "DELETE":
            obj = self.get_webhook_object(resource, name, namespace)
            if obj is None:
                raise _ApiError(404, f'{resource} "{name}" not found', name=name, kind=resource)
            self.delete_webhook_object(resource, name, namespace)
            return 200, obj
        raise _ApiError(405, f"{method} is not supported on {resource}")

    # ------------------------------------------------------------------ store internals

    def _record(self, resource: str, etype: str, obj: JSON, prev: JSON | None) -> None:
        """Append an event for ``obj`` (already stamped with ``self._rv``). Lock held."""
        if len(self._history) >= self._history_size:
            self._floor = self._history.popleft().rv
        self._history.append(_Event(self._rv, resource, etype, copy.deepcopy(obj), prev))
        self._cond.notify_all()
        self._watch_conds[resource].notify_all()

    def _wake_all(self) -> None:
        """Wake every waiter, watches of all resources included. Lock held."""
        self._cond.notify_all()
        for cond in self._watch_conds.values():
            cond.notify_all()

    def _add(self, resource: str, obj: JSON) -> JSON:
        kind, namespaced = _ALL_RESOURCES[resource]
        new = copy.deepcopy(obj)
        new["apiVersion"] = _api_version(resource)
        new["kind"] = kind
        meta = new.get("metadata")
        if not isinstance(meta, dict) or not meta.get("name"):
            raise ValueError(f"{kind} needs metadata.name")
        if namespaced:
            meta["namespace"] = meta.get("namespace") or "default"
        else:
            meta.pop("namespace", None)
        meta["uid"] = meta.get("uid") or str(uuid.uuid4())
        meta["creationTimestamp"] = meta.get("creationTimestamp") or _now_rfc3339()
        if resource == "pods":
            spec = new.get("spec")
            if not isinstance(spec, dict):
                spec = new["spec"] = {}
            spec.setdefault("containers", [])
            status = new.get("status")
            if not isinstance(status, dict):
                status = new["status"] = {}
            status["phase"] = status.get("phase") or "Pending"
        key = (meta.get("namespace", ""), meta["name"])
        with self._cond:
            if key in self._store[resource]:
                raise ValueError(f'{resource} "{key[1]}" already exists')
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            self._store[resource][key] = new
            self._record(resource, "ADDED", new, None)
            return copy.deepcopy(new)

    def _commit(self, resource: str, key: tuple[str, str], cur: JSON, new: JSON) -> JSON:
        """Store ``new`` in place of ``cur`` (emits MODIFIED unless unchanged). Lock held."""
        meta = new.get("metadata")
        if not isinstance(meta, dict):
            meta = new["metadata"] = {}
        old_meta = cur["metadata"]
        for pinned in ("name", "namespace", "uid", "creationTimestamp", "resourceVersion"):
            if pinned in old_meta:
                meta[pinned] = old_meta[pinned]
            else:
                meta.pop(pinned, None)
        new["apiVersion"] = cur["apiVersion"]
        new["kind"] = cur["kind"]
        if new == cur:
            return copy.deepcopy(cur)
        self._rv += 1
        meta["resourceVersion"] = str(self._rv)
        self._store[resource][key] = new
        self._record(resource, "MODIFIED", new, cur)
        return copy.deepcopy(new)

    def _update(self, resource: str, key: tuple[str, str], mutate: Callable[[JSON], None]) -> JSON:
        with self._cond:
            cur = self._store[resource].get(key)
            if cur is None:
                raise KeyError(f"{resource} {key[0]}/{key[1]} not found")
            new = copy.deepcopy(cur)
            mutate(new)
            return self._commit(resource, key, cur, new)

    def _delete(self, resource: str, key: tuple[str, str]) -> None:
        with self._cond:
            cur = self._store[resource].pop(key, None)
            if cur is None:
                raise KeyError(f"{resource} {key[0]}/{key[1]} not found")
            self._rv += 1
            gone = copy.deepcopy(cur)
            gone["metadata"]["resourceVersion"] = str(self._rv)
            self._record(resource, "DELETED", gone, None)

    def _get(self, resource: str, key: tuple[str, str]) -> JSON | None:
        with self._cond:
            obj = self._store[resource].get(key)
            return copy.deepcopy(obj) if obj is not None else None

    def _list(self, resource: str) -> list[JSON]:
        with self._cond:
            return [copy.deepcopy(o) for _, o in sorted(self._store[resource].items())]

    def _view(self, resource: str) -> list[JSON]:
        """The stored objects themselves (see pods_view): shared, read-only."""
        with self._cond:
            return [o for _, o in sorted(self._store[resource].items())]

    # ------------------------------------------------------------------ HTTP side

    def _track(self, thread: threading.Thread, sock: socket.socket) -> None:
        with self._conn_lock:
            self._conns[thread] = sock

    def _untrack(self, thread: threading.Thread) -> None:
        with self._conn_lock:
            self._conns.pop(thread, None)

    def _begin_request(self, method: str, target: str) -> None:
        """Log the request, apply the delay, refuse it while down."""
        with self._cond:
            self._log.append((method, target))
            delay = self._delay_s
        if self._stopping.is_set():
            raise _Abort
        if delay > 0 and self._stopping.wait(delay):
            raise _Abort
        with self._cond:
            if self._down:
                raise _ApiError(503, "the fake API server is down")

    def _route(
        self, method: str, target: str, ctype: str, body: bytes
    ) -> tuple[int, JSON] | _WatchState:
        split = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        segs = [unquote(s) for s in split.path.split("/") if s]
        if method == "GET" and segs in (["api"], ["apis"], ["version"], ["api", "v1"]):
            return 200, self._discovery(segs)
        if segs[:2] == ["apis", DRA_GROUP]:
            return self._route_dra(method, segs[2:], query, ctype, body)
        webhook_objects = _webhook_object_route(segs)
        if webhook_objects is not None:
            return self._route_webhook_objects(method, *webhook_objects, body)
        if segs[:2] != ["api", "v1"] or len(segs) < 3:
            raise _ApiError(404, "the server could not find the requested resource")
        rest = segs[2:]
        namespace: str | None = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        resource = rest[0]
        if rest[0] == "pods" and len(rest) == 3 and rest[2] == "binding" and namespace:
            if method != "POST":
                raise _ApiError(405, f"{method} is not supported on pods/binding")
            return 201, self._bind(namespace, rest[1], body)
        if rest[0] == "pods" and len(rest) == 3 and rest[2] == "eviction" and namespace:
            if method != "POST":
                raise _ApiError(405, f"{method} is not supported on pods/eviction")
            return 201, self._evict(namespace, rest[1], body)
        if rest == ["events"] and namespace and method == "POST":
            return 201, self._record_event(namespace, body)
        if resource not in _RESOURCES or len(rest) > 2:
            raise _ApiError(404, "the server could not find the requested resource")
        namespaced = _RESOURCES[resource][1]
        if namespace is not None and not namespaced:
            raise _ApiError(404, "the server could not find the requested resource")
        if len(rest) == 1:
            if method != "GET":
                raise _ApiError(405, f"{method} is not supported on a {resource} collection")
            if query.get("watch", "").lower() in ("true", "1"):
                return self._open_watch(resource, namespace, query)
            return 200, self._list_response(resource, namespace, query)
        name = rest[1]
        if namespaced and namespace is None:
            raise _ApiError(404, "the server could not find the requested resource")
        key = (namespace or "", name)
        if method == "GET":
            obj = self._get(resource, key)
            if obj is None:
                raise _ApiError(404, f'{resource} "{name}" not found', name=name, kind=resource)
            return 200, obj
        if method == "PATCH":
            return 200, self._patch(resource, key, ctype, body)
        raise _ApiError(405, f"{method} is not supported on {resource}")

    def _discovery(self, segs: list[str]) -> JSON:
        if segs == ["api"]:
            return {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{self._host}:{self._port}"}
                ],
            }
        if segs == ["apis"]:
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [_dra_group()]}
        if segs == ["version"]:
            return {
                "major": "1",
                "minor": "31",
                "gitVersion": "v1.31.0-vgpu-fake",
                "gitCommit": "0000000000000000000000000000000000000000",
                "gitTreeState": "clean",
                "buildDate": "1970-01-01T00:00:00Z",
                "goVersion": "go1.22.0",
                "compiler": "gc",
                "platform": "linux/amd64",
            }
        return {
            "kind": "APIResourceList",
            "groupVersion": "v1",
            "resources": [
                {
                    "name": resource,
                    "singularName": kind.lower(),
                    "namespaced": namespaced,
                    "kind": kind,
                    "verbs": ["get", "list", "watch", "patch"],
                }
                for resource, (kind, namespaced) in _RESOURCES.items()
            ],
        }

    # ------------------------------------------------------------------ resource.k8s.io/v1

    def _route_dra(
        self, method: str, segs: list[str], query: dict[str, str], ctype: str, body: bytes
    ) -> tuple[int, JSON] | _WatchState:
        """``/apis/resource.k8s.io[/v1[/...]]``: discovery, then the three DRA resources."""
        if not segs:
            if method != "GET":
                raise _ApiError(405, f"{method} is not supported on an API group")
            return 200, _dra_group()
        if segs[0] != "v1":
            raise _ApiError(404, f"the server could not find the requested resource ({segs[0]})")
        rest = segs[1:]
        if not rest:
            if method != "GET":
                raise _ApiError(405, f"{method} is not supported on an API group version")
            return 200, _dra_resource_list()
        namespace: str | None = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        resource = rest[0]
        if resource not in _DRA_RESOURCES or len(rest) > 3:
            raise _ApiError(404, "the server could not find the requested resource")
        kind, namespaced = _DRA_RESOURCES[resource]
        if (namespace is not None) != namespaced and (len(rest) > 1 or method != "GET"):
            raise _ApiError(404, "the server could not find the requested resource")
        if namespace is not None and not namespaced:
            raise _ApiError(404, "the server could not find the requested resource")
        if len(rest) == 1:
            return self._dra_collection(method, resource, namespace, query, body)
        key = (namespace or "", rest[1])
        if len(rest) == 3:
            if rest[2] != "status" or resource != "resourceclaims":
                raise _ApiError(404, "the server could not find the requested resource")
            return self._dra_status(method, resource, key, ctype, body)
        if method == "GET":
            obj = self._get(resource, key)
            if obj is None:
                raise _ApiError(404, f'{resource} "{key[1]}" not found', name=key[1], kind=kind)
            return 200, obj
        if method == "PUT":
            return 200, self._dra_replace(resource, key, _json_body(body), status=False)
        if method == "PATCH":
            if resource == "resourceclaims":
                # the status subresource is written through /status only
                with self._cond:
                    cur = self._store[resource].get(key)
                    status = copy.deepcopy(cur.get("status")) if cur else None
                patched = self._patch(resource, key, ctype, body)
                if patched.get("status") != status:
                    return 200, self._dra_replace(
                        resource, key, {**patched, "status": status}, status=True
                    )
                return 200, patched
            patched = self._patch(resource, key, ctype, body)
            if resource == "resourceslices":
                _check_slice(patched)
            return 200, patched
        if method == "DELETE":
            obj = self._get(resource, key)
            if obj is None:
                raise _ApiError(404, f'{resource} "{key[1]}" not found', name=key[1], kind=kind)
            self._delete(resource, key)
            return 200, obj
        raise _ApiError(405, f"{method} is not supported on {resource}")

    def _dra_collection(
        self,
        method: str,
        resource: str,
        namespace: str | None,
        query: dict[str, str],
        body: bytes,
    ) -> tuple[int, JSON] | _WatchState:
        if method == "GET":
            if query.get("watch", "").lower() in ("true", "1"):
                return self._open_watch(resource, namespace, query)
            return 200, self._list_response(resource, namespace, query)
        if method == "POST":
            obj = _json_body(body)
            kind = _DRA_RESOURCES[resource][0]
            if obj.get("kind", kind) != kind or obj.get("apiVersion", DRA_GROUP_VERSION) != (
                DRA_GROUP_VERSION
            ):
                raise _ApiError(400, f"expected {DRA_GROUP_VERSION} {kind} in the body")
            meta = obj.setdefault("metadata", {})
            if not isinstance(meta, dict):
                raise _ApiError(422, "metadata must be an object")
            if namespace is not None:
                meta["namespace"] = namespace
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:5]}"
            for pinned in ("uid", "resourceVersion", "creationTimestamp"):
                meta.pop(pinned, None)
            if resource == "resourceslices":
                _check_slice(obj)
            obj.pop("status", None)  # status is written through the subresource
            try:
                return 201, self._add(resource, obj)
            except ValueError as err:
                code = 409 if "already exists" in str(err) else 422
                raise _ApiError(code, str(err), "AlreadyExists" if code == 409 else None) from None
        if method == "DELETE":  # deletecollection, by field and label selector
            selector = self._selector(resource, namespace, query)
            with self._cond:
                keys = [k for k, o in self._store[resource].items() if selector.matches(o)]
                for key in keys:
                    self._delete(resource, key)
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        raise _ApiError(405, f"{method} is not supported on a {resource} collection")

    def _dra_replace(
        self,
        resource: str,
        key: tuple[str, str],
        obj: JSON,
        *,
        status: bool,
        check: Callable[[JSON, JSON], None] | None = None,
    ) -> JSON:
        """PUT: the whole object (status kept) or, with ``status``, the status only;
        ``check(current, new)`` may refuse the write (lock held)."""
        meta = obj.get("metadata")
        if not isinstance(meta, dict):
            raise _ApiError(422, "metadata must be an object")
        if meta.get("name", key[1]) != key[1]:
            raise _ApiError(400, "the name in the body does not match the URL")
        if resource == "resourceslices":
            _check_slice(obj)
        with self._cond:
            cur = self._store[resource].get(key)
            if cur is None:
                raise _ApiError(404, f'{resource} "{key[1]}" not found', name=key[1], kind=resource)
            wanted = meta.get("resourceVersion")
            if wanted and wanted != cur["metadata"]["resourceVersion"]:
                raise _ApiError(
                    409,
                    f'Operation cannot be fulfilled on {resource} "{key[1]}": the object has '
                    "been modified; please apply your changes to the latest version and try again",
                    name=key[1],
                    kind=resource,
                )
            new = copy.deepcopy(cur)
            if status:
                if obj.get("status") is None:
                    new.pop("status", None)
                else:
                    new["status"] = copy.deepcopy(obj["status"])
            else:
                kept = new.get("status")
                new = copy.deepcopy(obj)
                if kept is not None:
                    new["status"] = kept
                else:
                    new.pop("status", None)
            if check is not None:
                check(cur, new)
            return self._commit(resource, key, cur, new)

    def _claim_status_check(self, verb: str) -> Callable[[JSON, JSON], None]:
        """What the API server checks on a ResourceClaim status write (``verb``:
        update for PUT, patch for PATCH), as kube-apiserver 1.36.2 answered
        (issue 29): every status.devices entry names an allocated device (driver,
        pool, device and shareID), once; its ``data`` is a JSON object; each
        condition has type, status, reason and lastTransitionTime; and the
        writer may change the entries of each driver it changes
        (:meth:`set_driver_status_access`). 422 with the real wording if not.
        A condition's lastTransitionTime is stored as the real server's
        metav1.Time writes it back: RFC 3339 in UTC with ``Z``, whole seconds."""

        def check(cur: JSON, new: JSON) -> None:
            name = str(new.get("metadata", {}).get("name") or cur["metadata"]["name"])
            _normalize_condition_times(new)
            problems = _device_status_problems(new)
            if problems:
                raise _ApiError(422, _invalid_claim(name, problems), reason="Invalid")
            access = self._driver_access
            if access is None:
                return
            for driver in _modified_drivers(cur, new):
                problem = access.refusal(driver, verb, new, cur)
                if problem:
                    raise _ApiError(422, _invalid_claim(name, [problem]), reason="Invalid")

        return check

    def _dra_status(
        self, method: str, resource: str, key: tuple[str, str], ctype: str, body: bytes
    ) -> tuple[int, JSON]:
        if method == "GET":
            obj = self._get(resource, key)
            if obj is None:
                raise _ApiError(404, f'{resource} "{key[1]}" not found', name=key[1])
            return 200, obj
        if method == "PUT":
            return 200, self._dra_replace(
                resource,
                key,
                _json_body(body),
                status=True,
                check=self._claim_status_check("update"),
            )
        if method == "PATCH":
            with self._cond:
                cur = self._store[resource].get(key)
                if cur is None:
                    raise _ApiError(404, f'{resource} "{key[1]}" not found', name=key[1])
                spec = copy.deepcopy(cur.get("spec"))
            patched = self._patch(
                resource, key, ctype, body, check=self._claim_status_check("patch")
            )
            if patched.get("spec") != spec:  # only the status may change here
                return 200, self._dra_replace(
                    resource, key, {**patched, "spec": spec}, status=False
                )
            return 200, patched
        raise _ApiError(405, f"{method} is not supported on {resource}/status")

    def _selector(self, resource: str, namespace: str | None, query: dict[str, str]) -> _Selector:
        return _Selector(
            namespace=namespace,
            fields=_parse_field_selector(resource, query.get("fieldSelector", "")),
            labels=_parse_label_selector(query.get("labelSelector", "")),
        )

    def _list_response(self, resource: str, namespace: str | None, query: dict[str, str]) -> JSON:
        selector = self._selector(resource, namespace, query)
        with self._cond:
            items = [
                copy.deepcopy(obj)
                for _, obj in sorted(self._store[resource].items())
                if selector.matches(obj)
            ]
            rv = self._rv
        for item in items:  # the real server omits kind/apiVersion on list items
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return {
            "kind": f"{_ALL_RESOURCES[resource][0]}List",
            "apiVersion": _api_version(resource),
            "metadata": {"resourceVersion": str(rv)},
            "items": items,
        }

    def _patch(
        self,
        resource: str,
        key: tuple[str, str],
        ctype: str,
        body: bytes,
        check: Callable[[JSON, JSON], None] | None = None,
    ) -> JSON:
        media = ctype.split(";", 1)[0].strip().lower()
        try:
            patch = json.loads(body or b"null")
        except ValueError as err:
            raise _ApiError(400, f"invalid JSON patch body: {err}") from None
        apply: Callable[[JSON], Any]
        if media in (_MERGE_PATCH, _STRATEGIC_PATCH):
            if not isinstance(patch, dict):
                raise _ApiError(400, "a merge patch must be a JSON object")
            merge: JSON = patch

            def apply(doc: JSON) -> Any:
                return _merge_patch(doc, merge)

        elif media == _JSON_PATCH:
            if not isinstance(patch, list):
                raise _ApiError(400, "a JSON patch must be a JSON array")
            ops: list[Any] = patch

            def apply(doc: JSON) -> Any:
                return _json_patch(doc, ops)

        else:
            raise _ApiError(415, f"the body of the request was in an unknown format: {media}")
        with self._cond:
            cur = self._store[resource].get(key)
            if cur is None:
                raise _ApiError(404, f'{resource} "{key[1]}" not found', name=key[1], kind=resource)
            new = apply(copy.deepcopy(cur))
            if not isinstance(new, dict):
                raise _ApiError(422, "the patched object is not a JSON object")
            meta = new.get("metadata")
            wanted = meta.get("resourceVersion") if isinstance(meta, dict) else None
            if wanted is not None and wanted != cur["metadata"]["resourceVersion"]:
                raise _ApiError(
                    409,
                    f'Operation cannot be fulfilled on {resource} "{key[1]}": the object has '
                    "been modified; please apply your changes to the latest version and try again",
                    name=key[1],
                    kind=resource,
                )
            if check is not None:
                check(cur, new)
            return self._commit(resource, key, cur, new)

    def _bind(self, namespace: str, name: str, body: bytes) -> JSON:
        """pods/binding, as the real registry does it: set spec.nodeName once."""
        try:
            binding = json.loads(body or b"null")
        except ValueError as err:
            raise _ApiError(400, f"invalid Binding body: {err}") from None
        if not isinstance(binding, dict):
            raise _ApiError(400, "a Binding must be a JSON object")
        raw_meta = binding.get("metadata")
        meta: JSON = raw_meta if isinstance(raw_meta, dict) else {}
        if meta.get("name") not in (None, name):
            raise _ApiError(400, "name in URL does not match name in Binding object")
        raw_target = binding.get("target")
        target: JSON = raw_target if isinstance(raw_target, dict) else {}
        node = target.get("name")
        if not isinstance(node, str) or not node or target.get("kind") not in (None, "", "Node"):
            raise _ApiError(422, 'Binding.core "' + name + '" is invalid: target.name: Required')
        carried = _binding_metadata(meta, name)
        with self._cond:
            key = (namespace, name)
            cur = self._store["pods"].get(key)
            if cur is None:
                raise _ApiError(404, f'pods "{name}" not found', name=name, kind="pods")
            uid = meta.get("uid")
            if uid and uid != cur["metadata"]["uid"]:
                raise _ApiError(
                    409,
                    f'Operation cannot be fulfilled on pods/binding "{name}": Precondition '
                    f"failed: UID in precondition: {uid}, UID in object meta: "
                    f"{cur['metadata']['uid']}",
                    name=name,
                    kind="pods/binding",
                )
            bound = (cur.get("spec") or {}).get("nodeName")
            if bound:
                raise _ApiError(
                    409,
                    f'Operation cannot be fulfilled on pods/binding "{name}": pod {name} is '
                    f'already assigned to node "{bound}"',
                    name=name,
                    kind="pods/binding",
                )
            new = copy.deepcopy(cur)
            new.setdefault("spec", {})["nodeName"] = node
            # The Binding's own annotations and labels are merged into the pod
            # in this same write (the registry's setPodNodeAndMetadata).
            for field_name, merged in carried.items():
                if merged:
                    new["metadata"].setdefault(field_name, {}).update(merged)
            status = new.setdefault("status", {})
            conditions = [
                c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"
            ]
            conditions.append(
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": _now_rfc3339()}
            )
            status["conditions"] = conditions
            self._commit("pods", key, cur, new)
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "code": 201,
        }

    def wait_for_change(self, since_rv: int, timeout_s: float) -> int:
        """Wait until the resourceVersion moves past ``since_rv`` (or the timeout); return it."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._rv != since_rv or self._stopping.is_set(), max(0.0, timeout_s)
            )
            return self._rv

    def update_node(self, name: str, mutate: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Apply ``mutate`` to a copy of the node and store it (emits MODIFIED)."""
        return self._update("nodes", ("", name), mutate)

    def delete_node(self, name: str) -> None:
        self._delete("nodes", ("", name))

    def nodes(self) -> list[dict[str, Any]]:
        return self._list("nodes")

    def nodes_view(self) -> list[dict[str, Any]]:
        """The stored nodes, shared and read-only, as pods_view() gives pods."""
        return self._view("nodes")

    def _open_watch(
        self, resource: str, namespace: str | None, query: dict[str, str]
    ) -> _WatchState:
        selector = self._selector(resource, namespace, query)
        timeout_s: float | None = None
        if query.get("timeoutSeconds"):
            try:
                timeout_s = float(query["timeoutSeconds"])
            except ValueError:
                raise _ApiError(400, "invalid timeoutSeconds") from None
        now = time.monotonic()
        bookmarks = query.get("allowWatchBookmarks", "").lower() in ("true", "1")
        rv_text = query.get("resourceVersion", "")
        with self._cond:
            state = _WatchState(
                resource=resource,
                selector=selector,
                cursor=self._rv,
                deadline=now + timeout_s if timeout_s is not None and timeout_s > 0 else None,
                next_bookmark=now + self._bookmark_interval_s if bookmarks else None,
            )
            if rv_text in ("", "0"):
                # "any version": synthetic ADDED for the current state, then live events
                state.initial = [
                    {"type": "ADDED", "object": copy.deepcopy(obj)}
                    for _, obj in sorted(self._store[resource].items())
                    if selector.matches(obj)
                ]
                return state
            try:
                state.cursor = int(rv_text)
            except ValueError:
                raise _ApiError(400, f"invalid resourceVersion: {rv_text!r}") from None
            if state.cursor < self._floor:
                state.initial = [self._expired_event(state.cursor)]
                state.finished = True
            return state

    def _expired_event(self, rv: int) -> JSON:
        return {
            "type": "ERROR",
            "object": _status(410, f"too old resource version: {rv} ({self._floor})", "Expired"),
        }

    def _pending(self, state: _WatchState) -> list[JSON]:
        """Events after ``state.cursor`` that this watch should see. Lock held."""
        newer: list[_Event] = []
        for event in reversed(self._history):
            if event.rv <= state.cursor:
                break
            newer.append(event)
        state.cursor = self._rv
        out: list[JSON] = []
        for event in reversed(newer):
            if event.resource != state.resource:
                continue
            now = state.selector.matches(event.obj)
            if event.type == "MODIFIED" and event.prev is not None:
                before = state.selector.matches(event.prev)
                etype = {
                    (True, True): "MODIFIED",
                    (True, False): "DELETED",
                    (False, True): "ADDED",
                }.get((before, now))
            else:
                etype = event.type if now else None
            if etype is not None:
                out.append({"type": etype, "object": event.obj})
        return out

    def _watch_iter(
        self, state: _WatchState, client_gone: Callable[[], bool]
    ) -> Iterator[list[JSON]]:
        """Batches of watch events; raises :class:`_Abort` when down or stopping."""
        if state.initial:
            yield state.initial
        if state.finished:
            return
        kind = _ALL_RESOURCES[state.resource][0]
        while True:
            with self._cond:
                while True:
                    if self._stopping.is_set() or self._down:
                        raise _Abort
                    if state.cursor < self._floor:
                        out = [self._expired_event(state.cursor)]
                        state.finished = True
                        break
                    out = self._pending(state)
                    if out:
                        break
                    now = time.monotonic()
                    if state.deadline is not None and now >= state.deadline:
                        return
                    if state.next_bookmark is not None and now >= state.next_bookmark:
                        state.next_bookmark = now + self._bookmark_interval_s
                        meta = {"resourceVersion": str(state.cursor)}
                        out = [
                            {
                                "type": "BOOKMARK",
                                "object": {
                                    "kind": kind,
                                    "apiVersion": _api_version(state.resource),
                                    "metadata": meta,
                                },
                            }
                        ]
                        break
                    wait = _WAIT_SLICE_S
                    for limit in (state.deadline, state.next_bookmark):
                        if limit is not None:
                            wait = min(wait, limit - now)
                    self._watch_conds[state.resource].wait(max(wait, 0.001))
                    if client_gone():
                        return
            yield out
            if state.finished:
                return


# --------------------------------------------------------------------------- resource.k8s.io


def _dra_group() -> JSON:
    version = {"groupVersion": DRA_GROUP_VERSION, "version": "v1"}
    return {
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": DRA_GROUP,
        "versions": [version],
        "preferredVersion": version,
    }


def _dra_resource_list() -> JSON:
    resources: list[JSON] = []
    for resource, (kind, namespaced) in _DRA_RESOURCES.items():
        resources.append(
            {
                "name": resource,
                "singularName": kind.lower(),
                "namespaced": namespaced,
                "kind": kind,
                "verbs": [
                    "create",
                    "delete",
                    "deletecollection",
                    "get",
                    "list",
                    "patch",
                    "update",
                    "watch",
                ],
            }
        )
    resources.append(
        {
            "name": "resourceclaims/status",
            "singularName": "",
            "namespaced": True,
            "kind": "ResourceClaim",
            "verbs": ["get", "patch", "update"],
        }
    )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": DRA_GROUP_VERSION,
        "resources": resources,
    }


def _json_body(body: bytes) -> JSON:
    try:
        obj = json.loads(body or b"null")
    except ValueError as err:
        raise _ApiError(400, f"invalid JSON body: {err}") from None
    if not isinstance(obj, dict):
        raise _ApiError(400, "the body must be a JSON object")
    return obj


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_ATTRIBUTE_TYPES = ("bool", "int", "string", "version")
_NODE_SELECTION = ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")


@dataclass(frozen=True)
class _DriverAccess:
    """The client's RBAC rules and token node, for resourceclaims/driver."""

    rules: tuple[JSON, ...]
    node: str | None
    user: str

    def _allows(self, verb: str, driver: str) -> bool:
        for rule in self.rules:
            names = rule.get("resourceNames") or []
            if (
                {DRA_GROUP, "*"} & set(rule.get("apiGroups") or [])
                and {"resourceclaims/driver", "*"} & set(rule.get("resources") or [])
                and {verb, "*"} & set(rule.get("verbs") or [])
                and (not names or driver in names)
            ):
                return True
        return False

    def refusal(self, driver: str, verb: str, new: JSON, cur: JSON) -> str:
        """The field error refusing the write of `driver`'s entries; empty if allowed."""
        node = _allocated_node(new) or _allocated_node(cur)
        verbs = [f"arbitrary-node:{verb}"]
        if self.node is not None and self.node == node:
            verbs.insert(0, f"associated-node:{verb}")
        if any(self._allows(v, driver) for v in verbs):
            return ""
        namespace = new.get("metadata", {}).get("namespace") or cur["metadata"].get("namespace")
        return (
            'status.devices: Forbidden: changing status.devices requires resource="resourceclaims'
            f'/driver", verb="[{" ".join(verbs)}]" permission: resourceclaims.{DRA_GROUP} '
            f'"{driver}" is forbidden: User "{self.user}" cannot {verbs[0]} resource '
            f'"resourceclaims/driver" in API group "{DRA_GROUP}" in the namespace "{namespace}"'
        )


def _allocated_node(claim: JSON) -> str | None:
    """The one node a claim's allocation selects (matchFields metadata.name)."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    for term in (allocation.get("nodeSelector") or {}).get("nodeSelectorTerms") or []:
        for field_ in term.get("matchFields") or []:
            values = field_.get("values") or []
            if field_.get("key") == "metadata.name" and len(values) == 1:
                return str(values[0])
    return None


def _device_key(entry: Any) -> tuple[str, str, str, str]:
    e = entry if isinstance(entry, dict) else {}
    return (
        str(e.get("driver", "")),
        str(e.get("pool", "")),
        str(e.get("device", "")),
        str(e.get("shareID") or ""),
    )


def _modified_drivers(cur: JSON, new: JSON) -> list[str]:
    """The drivers whose status.devices entries differ between two claims."""

    def by_driver(obj: JSON) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for entry in (obj.get("status") or {}).get("devices") or []:
            out.setdefault(_device_key(entry)[0], []).append(json.dumps(entry, sort_keys=True))
        return {k: sorted(v) for k, v in out.items()}

    before, after = by_driver(cur), by_driver(new)
    return sorted(d for d in set(before) | set(after) if before.get(d) != after.get(d))


def _device_status_problems(claim: JSON) -> list[str]:
    """The API server's validation of a claim's status.devices (field errors)."""
    status = claim.get("status") or {}
    allocation = (status.get("allocation") or {}).get("devices") or {}
    allocated = {_device_key(r) for r in allocation.get("results") or []}
    problems: list[str] = []
    seen: set[tuple[str, str, str, str]] = set()
    for i, entry in enumerate(status.get("devices") or []):
        where = f"status.devices[{i}]"
        key = _device_key(entry)
        shown = json.dumps(
            dict(zip(("Driver", "Pool", "Device", "ShareID"), key, strict=True)),
            separators=(",", ":"),
        )
        if key in seen:
            problems.append(f"{where}: Duplicate value: {shown}")
        elif key not in allocated:
            problems.append(
                f"{where}: Invalid value: {shown}: must be an allocated device in the claim"
            )
        seen.add(key)
        if not isinstance(entry, dict):
            continue
        if entry.get("data") is not None and not isinstance(entry["data"], dict):
            problems.append(
                f'{where}.data: Invalid value: "<value omitted>": must be a valid JSON object'
            )
        for j, cond in enumerate(entry.get("conditions") or []):
            c = cond if isinstance(cond, dict) else {}
            at = f"{where}.conditions[{j}]"
            for required in ("type", "status"):
                if not c.get(required):
                    problems.append(f"{at}.{required}: Required value")
            if c.get("status") and c["status"] not in ("True", "False", "Unknown"):
                problems.append(
                    f'{at}.status: Unsupported value: "{c["status"]}": supported values: '
                    '"False", "True", "Unknown"'
                )
            for required in ("lastTransitionTime", "reason"):
                if not c.get(required):
                    problems.append(f"{at}.{required}: Required value")
    return problems


def _normalize_condition_times(claim: JSON) -> None:
    """status.devices[].conditions[].lastTransitionTime as metav1.Time stores it
    (e.g. the kubernetes client's ``+00:00`` comes back as ``Z``); 400 if unparsable."""
    for entry in (claim.get("status") or {}).get("devices") or []:
        for cond in (entry.get("conditions") or []) if isinstance(entry, dict) else []:
            raw = cond.get("lastTransitionTime") if isinstance(cond, dict) else None
            if not isinstance(raw, str) or not raw:
                continue
            try:
                when = datetime.fromisoformat(raw)
            except ValueError:
                raise _ApiError(
                    400, f'parsing time "{raw}" as "2006-01-02T15:04:05Z07:00": cannot parse'
                ) from None
            if when.tzinfo is None:
                raise _ApiError(400, f'parsing time "{raw}": missing the time zone')
            cond["lastTransitionTime"] = when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _invalid_claim(name: str, problems: list[str]) -> str:
    listed = problems[0] if len(problems) == 1 else f"[{', '.join(problems)}]"
    return f'ResourceClaim.{DRA_GROUP} "{name}" is invalid: {listed}'


def _check_slice(obj: JSON) -> None:
    """The API server's validation of a ResourceSlice that vgpu relies on (422 if not)."""
    # Imported here: the pure core, not an SDK; the rest of the fake is stdlib only.
    from vgpu.core.dra import CapacityRule
    from vgpu.core.errors import InvalidRequest

    problems: list[str] = []
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        raise _ApiError(422, "ResourceSlice.spec: Required value")
    if not spec.get("driver"):
        problems.append("spec.driver: Required value")
    pool = spec.get("pool") or {}
    if not pool.get("name"):
        problems.append("spec.pool.name: Required value")
    if not isinstance(pool.get("generation"), int) or pool["generation"] < 0:
        problems.append("spec.pool.generation: must be >= 0")
    if not isinstance(pool.get("resourceSliceCount"), int) or pool["resourceSliceCount"] < 1:
        problems.append("spec.pool.resourceSliceCount: must be greater than zero")
    if sum(1 for k in _NODE_SELECTION if spec.get(k)) != 1:
        problems.append(f"spec: exactly one of {', '.join(_NODE_SELECTION)} is required")
    devices = spec.get("devices") or []
    if len(devices) > 128:
        problems.append("spec.devices: Too many: must have at most 128 items")
    names: set[str] = set()
    for i, device in enumerate(devices):
        where = f"spec.devices[{i}]"
        name = str(device.get("name", ""))
        if not _DNS_LABEL.match(name):
            problems.append(f"{where}.name: Invalid value: {name!r}: must be a DNS label")
        if name in names:
            problems.append(f"{where}.name: Duplicate value: {name!r}")
        names.add(name)
        attributes = device.get("attributes") or {}
        capacity = device.get("capacity") or {}
        if len(attributes) + len(capacity) > 32:
            problems.append(f"{where}: at most 32 attributes and capacities combined")
        for key, value in attributes.items():
            set_types = [t for t in _ATTRIBUTE_TYPES if isinstance(value, dict) and t in value]
            if len(set_types) != 1:
                problems.append(f"{where}.attributes[{key}]: exactly one value must be set")
        problems += _taint_problems(where, device.get("taints"))
        for key, raw in capacity.items():
            try:
                errors = CapacityRule.from_json(raw).errors()
            except InvalidRequest as exc:
                errors = [exc.message]
            problems += [f"{where}.capacity[{key}].requestPolicy: {e}" for e in errors]
    if problems:
        raise _ApiError(422, f"ResourceSlice is invalid: {'; '.join(problems)}")


_TAINT_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_TAINT_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def _taint_problems(where: str, taints: Any) -> list[str]:
    """resource.k8s.io/v1 DeviceTaint: key (qualified name), value (label value),
    effect NoSchedule, NoExecute or None; at most 16 per device."""
    if taints is None:
        return []
    if not isinstance(taints, list) or len(taints) > 16:
        return [f"{where}.taints: must be a list of at most 16 items"]
    problems = []
    for j, taint in enumerate(taints):
        at = f"{where}.taints[{j}]"
        if not isinstance(taint, dict) or set(taint) - {"key", "value", "effect", "timeAdded"}:
            problems.append(f"{at}: only key, value, effect and timeAdded are allowed")
            continue
        if not _TAINT_KEY.match(str(taint.get("key", ""))):
            problems.append(f"{at}.key: Invalid value: must be a qualified name")
        if not _TAINT_VALUE.match(str(taint.get("value", ""))):
            problems.append(f"{at}.value: Invalid value: must be a valid label value")
        if taint.get("effect") not in ("NoSchedule", "NoExecute", "None"):
            problems.append(f"{at}.effect: Unsupported value: {taint.get('effect')!r}")
    return problems


# --------------------------------------------------------------------------- helpers


def make_node(
    name: str,
    *,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    allocatable: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A v1 Node dict for :meth:`FakeApiServer.add_node` (capacity = allocatable)."""
    meta: JSON = {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}}
    if annotations:
        meta["annotations"] = dict(annotations)
    resources = dict(allocatable or {})
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": meta,
        "spec": {},
        "status": {"capacity": dict(resources), "allocatable": resources},
    }


def make_pod(
    name: str,
    *,
    node: str | None,
    namespace: str = "default",
    containers: list[dict[str, Any]] | None = None,
    init_containers: list[dict[str, Any]] | None = None,
    phase: str = "Pending",
    creation_timestamp: str | None = None,
    annotations: dict[str, str] | None = None,
    scheduler_name: str | None = None,
) -> dict[str, Any]:
    """A v1 Pod dict bound to ``node`` (None: unbound, for a scheduler to place), ready for
    :meth:`FakeApiServer.add_pod`.

    ``containers`` items look like ``{"name": "main", "resources": {"limits": {...}}}``;
    missing names become ``c0``, ``c1``... and a pause image is filled in.  Without
    ``containers`` the pod has one container ``main`` with no resources.
    """

    def fill(items: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
        out = []
        for i, item in enumerate(items):
            c = copy.deepcopy(item)
            c.setdefault("name", f"{prefix}{i}")
            c.setdefault("image", _DEFAULT_IMAGE)
            out.append(c)
        return out

    meta: JSON = {"name": name, "namespace": namespace}
    if annotations:
        meta["annotations"] = dict(annotations)
    if creation_timestamp is not None:
        meta["creationTimestamp"] = creation_timestamp
    spec: JSON = {
        "containers": fill(containers if containers is not None else [{"name": "main"}], "c"),
    }
    if node is not None:
        spec["nodeName"] = node
    if scheduler_name is not None:
        spec["schedulerName"] = scheduler_name
    if init_containers:
        spec["initContainers"] = fill(init_containers, "init")
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": spec,
        "status": {"phase": phase},
    }


# Secrets and webhook configurations: resource -> (kind, apiVersion).
_ADMISSION_GROUP = "admissionregistration.k8s.io"
_WEBHOOK_RESOURCES: dict[str, tuple[str, str]] = {
    "secrets": ("Secret", "v1"),
    "mutatingwebhookconfigurations": ("MutatingWebhookConfiguration", f"{_ADMISSION_GROUP}/v1"),
    "validatingwebhookconfigurations": (
        "ValidatingWebhookConfiguration",
        f"{_ADMISSION_GROUP}/v1",
    ),
}


def _webhook_object_route(segs: list[str]) -> tuple[str, str, str] | None:
    """(resource, namespace, name) for a Secret or webhook-configuration path, else None."""
    namespaced = segs[:2] == ["api", "v1"] and len(segs) in (5, 6)
    if namespaced and segs[2] == "namespaces" and segs[4] == "secrets":
        return "secrets", segs[3], segs[5] if len(segs) == 6 else ""
    group = segs[:3] == ["apis", _ADMISSION_GROUP, "v1"] and len(segs) in (4, 5)
    if group and segs[3] in _WEBHOOK_RESOURCES and segs[3] != "secrets":
        return segs[3], "", segs[4] if len(segs) == 5 else ""
    return None


def _binding_metadata(meta: JSON, name: str) -> dict[str, dict[str, str]]:
    """A Binding's metadata.annotations and metadata.labels, checked as the API
    server validates object metadata (string to string); 422 otherwise."""
    out: dict[str, dict[str, str]] = {}
    for field_name in ("annotations", "labels"):
        value = meta.get(field_name)
        if value is None:
            out[field_name] = {}
            continue
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and k and isinstance(v, str) for k, v in value.items()
        ):
            raise _ApiError(
                422,
                f'Binding.core "{name}" is invalid: metadata.{field_name}: Invalid value: '
                "must be a map of non-empty string keys to string values",
            )
        out[field_name] = dict(value)
    return out
