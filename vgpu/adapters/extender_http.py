"""kube-scheduler's HTTP extender protocol: JSON in, plain values, JSON out.

``POST /filter``, ``/prioritize`` and ``/bind`` (the verb is the last path
segment, so any urlPrefix path works) and ``GET /healthz``. The JSON uses
the Go field names of k8s.io/kube-scheduler/extender/v1 (no JSON tags):
ExtenderArgs ``{Pod, Nodes, NodeNames}``, ExtenderFilterResult ``{Nodes,
NodeNames, FailedNodes, FailedAndUnresolvableNodes, Error}``,
HostPriorityList ``[{Host, Score}]``, ExtenderBindingArgs ``{PodName,
PodNamespace, PodUID, Node}``, ExtenderBindingResult ``{Error}``. Both
nodeCacheCapable forms are accepted, and the filter result answers in the
form asked (names, or the passing Node objects).

Malformed input gets HTTP 400 with a message naming what is wrong; anything
unexpected gets HTTP 500 with an incident id in the log. The server never
dies on input.
"""

from __future__ import annotations

import contextlib
import email.utils
import json
import logging
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from json.encoder import encode_basestring_ascii
from typing import Any, Protocol, cast

from vgpu.adapters.httpwire import MAX_LINE_BYTES, HeaderError, read_headers
from vgpu.adapters.kube import container_specs
from vgpu.core.model import ContainerSpec
from vgpu.core.scheduling import MAX_SCORE, FilterVerdict, PodInfo

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024 * 1024  # a 5,000-node NodeList fits
WORKER_IDLE_S = 60.0  # a connection thread left without a connection this long ends
VERBS = ("filter", "prioritize", "bind")


@dataclass(frozen=True)
class PodRequest:
    """The pod being scheduled, as plain values."""

    uid: str
    namespace: str
    name: str
    specs: tuple[ContainerSpec, ...]


@dataclass(frozen=True)
class BindRequest:
    namespace: str
    name: str
    uid: str
    node: str


class ExtenderPort(Protocol):
    def filter(self, pod: PodRequest, nodes: Sequence[str]) -> FilterVerdict | str:
        """The verdict, or an error text (kube-scheduler fails the attempt and retries)."""
        ...

    def prioritize(self, pod: PodRequest, nodes: Sequence[str]) -> list[tuple[str, int]]: ...

    def bind(self, request: BindRequest) -> str:
        """'' when bound, else why not."""
        ...

    def ready(self) -> bool: ...


class BadRequest(Exception):
    pass


Observer = Callable[[str, float, str], None]  # verb, seconds, outcome


# ---------------------------------------------------------------- decoding


class _PodCache:
    """Decoded pods by (uid, resourceVersion): kube-scheduler sends the same pod
    to filter and then to prioritize, and the API server gives every change of
    a pod a new resourceVersion, so a hit is the same pod. Bounded."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._pods: dict[tuple[str, str], PodRequest] = {}

    def get(self, key: tuple[str, str] | None) -> PodRequest | None:
        if key is None:
            return None
        with self._lock:
            return self._pods.get(key)

    def put(self, key: tuple[str, str] | None, pod: PodRequest) -> None:
        if key is None:
            return
        with self._lock:
            if len(self._pods) >= self.size:
                self._pods.clear()
            self._pods[key] = pod


def _pod_key(meta: dict[str, Any]) -> tuple[str, str] | None:
    uid, version = meta.get("uid"), meta.get("resourceVersion")
    if isinstance(uid, str) and uid and isinstance(version, str) and version:
        return uid, version
    return None  # no resourceVersion: decode every time


def _pod(args: dict[str, Any], domain: str, cache: _PodCache | None = None) -> PodRequest:
    pod = args.get("Pod")
    if not isinstance(pod, dict):
        raise BadRequest("ExtenderArgs.Pod must be a Pod object")
    meta = pod.get("metadata")
    spec = pod.get("spec")
    if not isinstance(meta, dict) or not isinstance(spec, dict):
        raise BadRequest("ExtenderArgs.Pod needs metadata and spec objects")
    cache_key = _pod_key(meta) if cache is not None else None
    hit = cache.get(cache_key) if cache is not None else None
    if hit is not None and (hit.uid, hit.namespace, hit.name) == (
        meta.get("uid"),
        meta.get("namespace"),
        meta.get("name"),
    ):
        return hit
    for key in ("name", "namespace", "uid"):
        if not isinstance(meta.get(key), str) or not meta[key]:
            raise BadRequest(f"ExtenderArgs.Pod.metadata.{key} must be a non-empty string")
    for key in ("containers", "initContainers"):
        items = spec.get(key)
        if items is not None and (
            not isinstance(items, list) or not all(isinstance(c, dict) for c in items)
        ):
            raise BadRequest(f"ExtenderArgs.Pod.spec.{key} must be a list of containers")
        for c in items or []:
            resources = c.get("resources")
            if resources is not None and not isinstance(resources, dict):
                raise BadRequest(f"ExtenderArgs.Pod.spec.{key}[].resources must be an object")
            for part in ("limits", "requests"):
                value = (resources or {}).get(part)
                if value is not None and not isinstance(value, dict):
                    raise BadRequest(f"ExtenderArgs.Pod.spec.{key}[].resources.{part} must map")
    decoded = PodRequest(
        meta["uid"], meta["namespace"], meta["name"], tuple(container_specs(pod, domain))
    )
    if cache is not None:
        cache.put(cache_key, decoded)
    return decoded


def _nodes(args: dict[str, Any]) -> tuple[list[str], dict[str, Any] | None]:
    """Node names, and the Node objects by name when the full form was sent."""
    names = args.get("NodeNames")
    node_list = args.get("Nodes")
    if names is not None:
        # str.join takes only strings: a C loop over the names (a generator of
        # isinstance calls was a fifth of a filter's own time at 100 nodes, and
        # set(map(type, ...)) 16 us at the 420 names sent at 1,000 nodes).
        if not isinstance(names, list):
            raise BadRequest("ExtenderArgs.NodeNames must be a list of node names")
        try:
            "".join(names)
        except TypeError:
            raise BadRequest("ExtenderArgs.NodeNames must be a list of node names") from None
        return names, None
    if node_list is not None:
        items = node_list.get("items") if isinstance(node_list, dict) else None
        if not isinstance(items, list):
            raise BadRequest("ExtenderArgs.Nodes must be a NodeList with items")
        objects: dict[str, Any] = {}
        for node in items:
            name = (
                ((node or {}).get("metadata") or {}).get("name") if isinstance(node, dict) else None
            )
            if not isinstance(name, str) or not name:
                raise BadRequest("every node in ExtenderArgs.Nodes.items needs metadata.name")
            objects[name] = node
        return list(objects), objects
    raise BadRequest("ExtenderArgs needs NodeNames (nodeCacheCapable) or Nodes")


def _bind_args(args: dict[str, Any]) -> BindRequest:
    values = []
    for key in ("PodNamespace", "PodName", "PodUID", "Node"):
        value = args.get(key)
        if not isinstance(value, str) or not value:
            raise BadRequest(f"ExtenderBindingArgs.{key} must be a non-empty string")
        values.append(value)
    return BindRequest(*values)


# ------------------------------------------------------------------ server


class _Worker:
    """One connection thread: serves a connection, then waits for the next."""

    def __init__(self) -> None:
        self.wake = threading.Event()
        self.conn: tuple[Any, Any] | None = None


class _Server(ThreadingHTTPServer):
    """A thread per open connection, as ThreadingHTTPServer, but threads are
    kept: one whose connection closed waits WORKER_IDLE_S for the next.

    kube-scheduler's client keeps only two idle connections to an extender
    (Go's default per host), so binding cycles running at once open and close
    a connection for most binds (about 550 per 1,000 pods in a stream on the
    real scheduler): a new thread for each was ~6 % of the extender's CPU."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], edge: ExtenderHttp) -> None:
        self.edge = edge
        self._idle: list[_Worker] = []  # most recently idle last
        self._idle_lock = threading.Lock()
        self._closing = False
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._idle_lock:
            worker = self._idle.pop() if self._idle else None
        if worker is not None:
            worker.conn = (request, client_address)
            worker.wake.set()
            return
        worker = _Worker()
        worker.conn = (request, client_address)
        threading.Thread(
            target=self._work, args=(worker,), name="extender-conn", daemon=True
        ).start()

    def _work(self, worker: _Worker) -> None:
        while True:
            conn, worker.conn = worker.conn, None
            if conn is not None:
                self.process_request_thread(*conn)  # serves, then shuts the socket
            with self._idle_lock:
                if self._closing:
                    return
                worker.wake.clear()
                self._idle.append(worker)
            if not worker.wake.wait(WORKER_IDLE_S):
                with self._idle_lock:
                    if worker in self._idle:  # not handed a connection meanwhile
                        self._idle.remove(worker)
                        return
                worker.wake.wait()  # handed one just as the wait ended

    def server_close(self) -> None:
        super().server_close()
        with self._idle_lock:
            self._closing = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.wake.set()

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            return  # the client went away mid-answer: nothing to tell anyone
        log.error("extender HTTP connection failed", exc_info=exc)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "vgpu-extender"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        # Headers and body are two writes: on the kept-alive connections
        # kube-scheduler uses, Nagle's algorithm would hold the body back for
        # the client's delayed ACK, ~40 ms on every answer. Send at once.
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # http.server's own request parsing (an email.message header parser) and
    # its answers (status, Server and Date headers written line by line) were
    # a third of the extender's time per request: parse the request line and
    # the headers directly, in bounded amounts, and answer in one write.

    def handle_one_request(self) -> None:
        self._hdrs: dict[str, str] = {}
        try:
            line = self.rfile.readline(MAX_LINE_BYTES + 1)
        except (TimeoutError, ConnectionError):
            self.close_connection = True
            return
        if not line:
            self.close_connection = True
            return
        self.close_connection = True  # until the request is known to be well formed
        if len(line) > MAX_LINE_BYTES:
            self._send(414, b"request line too long\n", "text/plain")
            return
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
            self._send(400, b"bad request line: send METHOD PATH HTTP/1.1\n", "text/plain")
            return
        self.command, self.path, self.request_version = parts
        try:
            headers, _ = read_headers(self.rfile)
        except HeaderError as exc:
            self._send(exc.status, f"{exc}\n".encode(), "text/plain")
            return
        self._hdrs = headers
        connection = headers.get("connection", "").lower()
        self.close_connection = connection == "close" or (
            self.request_version == "HTTP/1.0" and connection != "keep-alive"
        )
        if headers.get("expect", "").lower() == "100-continue":
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self.command == "POST":
            self.do_POST()
        elif self.command == "GET":
            self.do_GET()
        else:
            self._drain()
            self._send(501, f"method {self.command!r} not supported\n".encode(), "text/plain")

    def do_GET(self) -> None:
        edge = cast(_Server, self.server).edge
        path = self.path.split("?", 1)[0].rstrip("/")
        if path.endswith("/healthz"):
            self._send(200, b"ok\n", "text/plain")
        elif path.endswith("/readyz"):
            ready = edge.port.ready()
            self._send(
                200 if ready else 503, b"ok\n" if ready else b"caches not synced\n", "text/plain"
            )
        elif path.endswith("/metrics") and edge.metrics is not None:
            body, ctype = edge.metrics()
            self._send(200, body, ctype)
        else:
            self._send(
                404, b"not found: POST /filter, /prioritize, /bind; GET /healthz\n", "text/plain"
            )

    def do_POST(self) -> None:
        edge = cast(_Server, self.server).edge
        verb = self.path.split("?", 1)[0].rstrip("/").rpartition("/")[2]
        if verb not in VERBS or edge.verbs is False:
            self._drain()
            self._send(
                404,
                f"unknown verb {verb!r}; use filter, prioritize or bind\n".encode(),
                "text/plain",
            )
            return
        started = time.perf_counter()
        outcome = "ok"
        try:
            body = self._body()
            try:
                args = json.loads(body)
            except ValueError as exc:
                raise BadRequest(f"the request body is not JSON: {exc}") from None
            if not isinstance(args, dict):
                raise BadRequest(f"the {verb} request must be a JSON object")
            self._send(200, edge.handle_bytes(verb, args), "application/json")
        except BadRequest as exc:
            outcome = "bad_request"
            self._send(400, f"{exc}\n".encode(), "text/plain")
        except _TooLarge as exc:
            outcome = "bad_request"
            self.close_connection = True
            self._send(exc.code, f"{exc}\n".encode(), "text/plain")
        except Exception:
            outcome = "internal"
            incident = uuid.uuid4().hex[:12]
            log.exception("extender %s failed (incident %s)", verb, incident)
            self._send(500, f"internal error, incident {incident}\n".encode(), "text/plain")
        finally:
            if edge.observe is not None:
                edge.observe(verb, time.perf_counter() - started, outcome)

    def _drain(self) -> None:
        length = self._hdrs.get("content-length")
        if length and length.isdigit() and int(length) <= MAX_BODY_BYTES:
            self.rfile.read(int(length))
        else:
            self.close_connection = True

    def _body(self) -> bytes:
        if self._hdrs.get("transfer-encoding"):
            raise _TooLarge(411, "send the body with a Content-Length")
        length = self._hdrs.get("content-length")
        if length is None or not length.isdigit():
            raise _TooLarge(411, "a Content-Length header is required")
        if int(length) > MAX_BODY_BYTES:
            raise _TooLarge(413, f"request body over {MAX_BODY_BYTES} bytes")
        return self.rfile.read(int(length))

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        close = "Connection: close\r\n" if self.close_connection else ""
        head = (
            f"HTTP/1.1 {code} {_reason(code)}\r\nServer: vgpu-extender\r\nDate: {_date()}\r\n"
            f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{close}\r\n"
        )
        self.wfile.write(head.encode("latin-1") + body)


_REASONS = {int(s): s.phrase for s in HTTPStatus}


def _reason(code: int) -> str:
    return _REASONS.get(code, "Unknown")


_date_cache: tuple[int, str] = (0, "")


def _date() -> str:
    """The Date header (RFC 9110 asks an origin server for one), formatted once a second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, email.utils.formatdate(now, usegmt=True))
    return _date_cache[1]


MAX_HOST_HEADS = 50_000  # cached HostPriorityList entry heads (node names)
_SCORE_TAILS = tuple(f"{n}}}" for n in range(MAX_SCORE + 1))  # the scores extenders give


def _json_bytes(answer: Any) -> bytes:
    return json.dumps(answer, separators=(",", ":")).encode()


class _TooLarge(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class ExtenderHttp:
    """The extender's HTTP face (verbs and /healthz), or, with `verbs=False`, a
    metrics-only face (/metrics and /healthz) for --metrics-address."""

    def __init__(
        self,
        port: ExtenderPort,
        domain: str,
        address: str,
        *,
        verbs: bool = True,
        observe: Observer | None = None,
        metrics: Callable[[], tuple[bytes, str]] | None = None,
    ) -> None:
        self.port = port
        self.domain = domain
        self.verbs = verbs
        self.observe = observe
        self.metrics = metrics
        self.pods = _PodCache()
        self._host_heads: dict[str, str] = {}
        host, _, port_text = address.rpartition(":")
        self._server = _Server((host.strip("[]") or "0.0.0.0", int(port_text)), self)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="extender-http",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:  # shutdown() waits for a serve_forever loop
            self._server.shutdown()
            self._thread = None
        self._server.server_close()

    def pod_seen(self, version: str, pod: PodInfo) -> None:
        """A pod the watch decoded: a pending one, without an assignment, is
        what filter would decode from the same pod at the same resourceVersion
        (the same `container_specs`), so filter can take it from here."""
        if version and not pod.node and pod.assignment is None:
            self.pods.put(
                (pod.uid, version), PodRequest(pod.uid, pod.namespace, pod.name, pod.specs)
            )

    # ------------------------------------------------------------ verbs

    def handle_bytes(self, verb: str, args: dict[str, Any]) -> bytes:
        """One request's JSON -> the answer's body (BadRequest for malformed input).
        A HostPriorityList is written directly (a list of one-key-pair objects per
        node was the costliest part of encoding it); the rest through json.dumps."""
        if verb == "bind":
            return _json_bytes({"Error": self.port.bind(_bind_args(args))})
        pod = _pod(args, self.domain, self.pods)
        names, objects = _nodes(args)
        if verb == "prioritize":
            return self._priority_list(self.port.prioritize(pod, names))
        return _json_bytes(self._filter_answer(pod, names, objects))

    def _priority_list(self, scores: Sequence[tuple[str, int]]) -> bytes:
        """A HostPriorityList's JSON, from each node's `{"Host":...,"Score":` written
        once (bounded) and the score's text: a third of formatting every entry."""
        heads = self._host_heads
        if len(heads) > MAX_HOST_HEADS:
            heads.clear()
        parts = []
        for host, score in scores:
            head = heads.get(host)
            if head is None:
                head = heads[host] = f'{{"Host":{encode_basestring_ascii(host)},"Score":'
            parts.append(
                head + (_SCORE_TAILS[score] if 0 <= score <= MAX_SCORE else f"{int(score)}}}")
            )
        return ("[" + ",".join(parts) + "]").encode()

    def _filter_answer(
        self, pod: PodRequest, names: list[str], objects: dict[str, Any] | None
    ) -> dict[str, Any]:
        verdict = self.port.filter(pod, names)
        if isinstance(verdict, str):
            return {
                "Nodes": None,
                "NodeNames": None,
                "FailedNodes": {},
                "FailedAndUnresolvableNodes": {},
                "Error": verdict,
            }
        return {
            "Nodes": (
                {"metadata": {}, "items": [objects[n] for n in verdict.passed]}
                if objects is not None
                else None
            ),
            "NodeNames": verdict.passed if objects is None else None,
            "FailedNodes": verdict.failed,
            "FailedAndUnresolvableNodes": verdict.unresolvable,
            "Error": "",
        }
