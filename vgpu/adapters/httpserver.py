"""A small, bounded HTTP/1.1 server for /metrics and /healthz.

Anyone who can reach the port is a client, so no client may affect the
daemon's real work (the kubelet's calls):

* one event-loop thread reads every request: no thread per connection;
* a request head must arrive whole within `header_timeout_s` and fit in
  `max_header_bytes`, and the answer must be taken within `write_timeout_s`;
* at most `max_connections` are open (never more than a sixteenth of the
  process's open-file limit, so descriptors stay for the kubelet path) and at
  most `max_per_peer` from one address. A new connection over a limit evicts
  the oldest one still sending its request (that peer's first), so a flood of
  half-sent requests cannot lock a liveness probe out;
* slow answers (rendering /metrics) run on a pool of `workers` threads; the
  `inline` paths (/healthz) are answered on the loop itself, at once.

Every answer closes the connection (HTTP/1.1 "Connection: close"), except as
said below for POST with keep-alive.

For the admission webhook the same server also speaks TLS (`ssl_context`; the
handshake is bounded by `header_timeout_s`, and `set_ssl_context` swaps the
certificate for new connections without a restart) and takes POST bodies
(`post_handler`): a body must declare its Content-Length, fit in
`max_body_bytes` (else 413) and arrive whole within `body_timeout_s`. With
`keep_alive_s` > 0, a POST answered 200 keeps its connection for the next
request (at most `keep_alive_requests`, idle at most `keep_alive_s`), as the
API server reuses its connections to a webhook: no TLS handshake per review.
An idle kept connection is the first evicted when a limit is reached.
"""

from __future__ import annotations

import asyncio
import resource
import socket
import ssl
import threading
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

ACCEPT_BATCH = 8
LISTEN_BACKLOG = 128

# path -> (status, content type, body)
Handler = Callable[[str], tuple[int, str, bytes]]
# (path, body) -> (status, content type, body)
PostHandler = Callable[[str, bytes], tuple[int, str, bytes]]


@dataclass(frozen=True)
class HttpLimits:
    max_connections: int = 64
    max_per_peer: int = 16
    header_timeout_s: float = 5.0
    write_timeout_s: float = 10.0
    max_header_bytes: int = 8192
    workers: int = 2
    max_body_bytes: int = 0  # POST bodies (only with a post_handler)
    body_timeout_s: float = 10.0
    keep_alive_s: float = 0.0  # 0: every answer closes the connection
    keep_alive_requests: int = 1000


@dataclass
class _Conn:
    ident: int
    peer: str
    writer: asyncio.StreamWriter
    reading: bool = True


@dataclass
class HttpStats:
    """Connections dropped, by reason (exported as a metric)."""

    dropped: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("evicted", "timeout", "too_large", "refused"), 0)
    )
    open: int = 0


def connection_cap(wanted: int) -> int:
    """At most a sixteenth of the open-file limit goes to HTTP clients."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(2, min(wanted, soft // 16))


class BoundedHttpServer:
    def __init__(
        self,
        host: str,
        port: int,
        handler: Handler,
        inline: Collection[str] = (),
        limits: HttpLimits = HttpLimits(),
        ssl_context: ssl.SSLContext | None = None,
        post_handler: PostHandler | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.handler = handler
        self.inline = frozenset(inline)
        self.limits = limits
        self.max_connections = connection_cap(limits.max_connections)
        self.stats = HttpStats()
        self._conns: dict[int, _Conn] = {}  # insertion order: oldest first
        self._ids = 0
        self._pool = ThreadPoolExecutor(max_workers=limits.workers, thread_name_prefix="http")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self.post_handler = post_handler
        self._tls = ssl_context
        self._tls_current = ssl_context
        if ssl_context is not None:
            ssl_context.sni_callback = self._pick_context

    def set_ssl_context(self, context: ssl.SSLContext) -> None:
        """Serve new connections with `context` (a renewed certificate); open ones keep theirs."""
        self._tls_current = context

    def _pick_context(self, conn: Any, server_name: str | None, initial: ssl.SSLContext) -> None:
        current = self._tls_current
        if current is not None and current is not initial:
            conn.context = current

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Bind now (an error is raised here, not in the thread), then serve."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._sock = socket.create_server((self.host, self.port), family=family, backlog=128)
        self.port = self._sock.getsockname()[1]
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="metrics-http", daemon=True
        )
        self._thread.start()
        ready.wait(5.0)

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        assert self._sock is not None
        server = loop.run_until_complete(
            asyncio.start_server(
                self._serve,
                sock=self._sock,
                limit=self.limits.max_header_bytes,
                # How many connections asyncio accepts in one go, before any of
                # them is admitted or evicted: each holds a descriptor until then.
                backlog=ACCEPT_BATCH,
                ssl=self._tls,
                ssl_handshake_timeout=self.limits.header_timeout_s if self._tls else None,
            )
        )
        # The kernel's queue stays long: an overflow makes a client (a liveness
        # probe) wait a SYN retry of 1 s.
        self._sock.listen(LISTEN_BACKLOG)
        ready.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            for conn in list(self._conns.values()):
                conn.writer.transport.abort()
            tasks = asyncio.all_tasks(loop)
            if tasks:  # reads end at once; an answer being rendered gets a second
                loop.run_until_complete(asyncio.wait(tasks, timeout=1.0))
            loop.close()

    def close(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(2.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------- connections

    def _admit(self, conn: _Conn) -> bool:
        """Keep the connection counts within the limits; False: refuse this one."""
        same_peer = [c for c in self._conns.values() if c.peer == conn.peer]
        if len(same_peer) > self.limits.max_per_peer:
            victim = next((c for c in same_peer if c.reading and c is not conn), None)
            if victim is None:
                return False
            self._evict(victim)
        # The open-file limit may change while the daemon runs (prlimit).
        self.max_connections = connection_cap(self.limits.max_connections)
        if len(self._conns) > self.max_connections:
            victim = next((c for c in self._conns.values() if c.reading and c is not conn), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, conn: _Conn) -> None:
        """Cut a connection: its read ends at once and its task finishes by itself."""
        self.stats.dropped["evicted"] += 1
        self._conns.pop(conn.ident, None)
        conn.writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        self._ids += 1
        ident = self._ids
        conn = _Conn(ident, str(peer[0]) if peer else "?", writer)
        self._conns[ident] = conn
        self.stats.open = len(self._conns)
        try:
            if not self._admit(conn):
                self.stats.dropped["refused"] += 1
                return
            await self._answer(conn, reader, writer)
        except (ConnectionError, OSError):
            pass  # the client went away, or was cut
        finally:
            self._conns.pop(ident, None)
            self.stats.open = len(self._conns)
            writer.transport.abort()

    async def _answer(
        self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        served = 0
        while await self._answer_one(conn, reader, writer, served):
            served += 1

    async def _answer_one(
        self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, served: int
    ) -> bool:
        """One request; True when the connection stays open for another."""
        conn.reading = True
        timeout = self.limits.header_timeout_s if served == 0 else self.limits.keep_alive_s
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        except TimeoutError:
            if served == 0:
                self.stats.dropped["timeout"] += 1
            return False
        except asyncio.LimitOverrunError:
            self.stats.dropped["too_large"] += 1
            await self._send(writer, HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, b"", "HEAD")
            return False
        except asyncio.IncompleteReadError:
            return False
        conn.reading = False
        method, path = _request_line(head)
        if method == "POST" and self.post_handler is not None:
            keep = (
                self.limits.keep_alive_s > 0
                and served + 1 < self.limits.keep_alive_requests
                and not _wants_close(head)
            )
            return await self._answer_post(reader, writer, head, path, keep)
        if method not in ("GET", "HEAD"):
            await self._send(writer, HTTPStatus.METHOD_NOT_ALLOWED, b"GET only\n", method)
            return False
        route = path.split("?", 1)[0]
        if route in self.inline:
            status, ctype, body = self.handler(route)
        else:
            loop = asyncio.get_running_loop()
            status, ctype, body = await loop.run_in_executor(self._pool, self.handler, route)
        await self._send(writer, HTTPStatus(status), body, method, ctype)
        return False

    async def _answer_post(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        head: bytes,
        path: str,
        keep: bool,
    ) -> bool:
        assert self.post_handler is not None
        length = _content_length(head)
        if length is None:
            await self._send(writer, HTTPStatus.LENGTH_REQUIRED, b"Content-Length required\n", "")
            return False
        if length > self.limits.max_body_bytes:
            self.stats.dropped["too_large"] += 1
            msg = f"body over {self.limits.max_body_bytes} bytes\n".encode()
            await self._send(writer, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, msg, "")
            return False
        try:
            body = await asyncio.wait_for(reader.readexactly(length), self.limits.body_timeout_s)
        except TimeoutError:
            self.stats.dropped["timeout"] += 1
            return False
        except asyncio.IncompleteReadError:
            return False
        loop = asyncio.get_running_loop()
        handler = self.post_handler
        route = path.split("?", 1)[0]
        status, ctype, answer = await loop.run_in_executor(self._pool, handler, route, body)
        keep = keep and status == 200
        return await self._send(writer, HTTPStatus(status), answer, "POST", ctype, keep)

    async def _send(
        self,
        writer: asyncio.StreamWriter,
        status: HTTPStatus,
        body: bytes,
        method: str,
        ctype: str = "text/plain",
        keep: bool = False,
    ) -> bool:
        """Send the answer; True when it went out and the connection stays open."""
        head = (
            f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n"
            f"Connection: {'keep-alive' if keep else 'close'}\r\n\r\n"
        ).encode()
        writer.write(head if method == "HEAD" else head + body)
        writer.transport.set_write_buffer_limits(high=0)  # drain() waits for all of it
        try:
            await asyncio.wait_for(writer.drain(), self.limits.write_timeout_s)
        except TimeoutError:
            self.stats.dropped["timeout"] += 1
            return False
        return keep


def _request_line(head: bytes) -> tuple[str, str]:
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return "", ""
    return parts[0], parts[1]


def _content_length(head: bytes) -> int | None:
    """The declared body length; None when absent, malformed or chunked."""
    length: int | None = None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        key = name.strip().lower()
        if key == b"transfer-encoding":
            return None
        if key == b"content-length":
            text = value.strip()
            if not text.isdigit() or (length is not None and int(text) != length):
                return None
            length = int(text)
    return length


def _wants_close(head: bytes) -> bool:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"connection" and b"close" in value.lower():
            return True
    return head.split(b"\r\n", 1)[0].endswith(b"HTTP/1.0")
