"""One HTTP/1.1 request written whole, and its response read back, bounded.

Used where a request/response pair is on a hot path and the general client's
layers cost more than the exchange itself: the extender's Binding POST (on
the connections of the official client's own urllib3 pool) and the scheduler
stand-in's calls. http.client parses response headers through the email
package and urllib3 writes the head and the body in two sends; here the
request is one write and the response one bounded parse.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

MAX_LINE_BYTES = 65536
MAX_HEADERS = 100
MAX_CHUNK_LINE_BYTES = 1024


class Reader(Protocol):
    """A buffered byte stream: a socket's makefile("rb"), a server's rfile."""

    def readline(self, size: int, /) -> bytes: ...

    def read(self, size: int, /) -> bytes: ...


class WireError(ValueError):
    """The peer's answer is not a well-formed HTTP/1.1 response (or too large)."""


class HeaderError(WireError):
    """A header block over the bounds (`status` 431) or malformed (400)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class NoAnswer(ConnectionError):
    """The connection ended (closed or reset) before any byte of an answer: on a
    kept-alive connection, the server may have closed it as idle just as the
    request went out, and then never read it."""


def request_bytes(
    method: str, target: str, host: str, headers: Mapping[str, str], body: bytes
) -> bytes:
    """The request's head and body as one buffer (Content-Length from the body)."""
    head = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} has a line break")
        head.append(f"{name}: {value}")
    head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def _line(reader: Reader, limit: int, what: str) -> bytes:
    line = reader.readline(limit + 1)
    if len(line) > limit:
        raise WireError(f"{what} is longer than {limit} bytes")
    return line


def read_headers(reader: Reader) -> tuple[dict[str, str], bool]:
    """One header block, requests' and responses' alike: (the headers with
    lower-case names, whether the blank line that ends the block came; False
    where the peer's stream ended first). HeaderError past MAX_LINE_BYTES per
    line or MAX_HEADERS lines, on a line without a colon or with space around
    the name, and on two different Content-Length values."""
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADERS + 1):
        raw = reader.readline(MAX_LINE_BYTES + 1)
        if len(raw) > MAX_LINE_BYTES:
            raise HeaderError(431, f"header line too long (longer than {MAX_LINE_BYTES} bytes)")
        if raw in (b"\r\n", b"\n"):
            return headers, True
        if not raw:
            return headers, False
        name, sep, value = raw.decode("latin-1").partition(":")
        if not sep or not name.strip() or name != name.strip():
            raise HeaderError(400, f"malformed header line {raw[:100]!r}")
        key, value = name.lower(), value.strip()
        if key == "content-length" and headers.get(key, value) != value:
            raise HeaderError(400, "conflicting Content-Length headers")
        headers[key] = value
    raise HeaderError(431, f"more than {MAX_HEADERS} headers")


def read_response(reader: Reader, max_body_bytes: int) -> tuple[int, dict[str, str], bytes, bool]:
    """(status, headers with lower-case names, body, whether the connection must
    close afterwards). ConnectionError where the peer closed before an answer
    began or in the middle of one; WireError on a malformed or oversized one."""
    try:
        line = _line(reader, MAX_LINE_BYTES, "the status line")
    except ConnectionResetError:
        raise NoAnswer("the server reset the connection before answering") from None
    if not line:
        raise NoAnswer("the server closed the connection before answering")
    version, _, rest = line.decode("latin-1").partition(" ")
    if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
        raise WireError(f"bad status line {line[:100]!r}")
    status = int(rest[:3])
    headers, complete = read_headers(reader)
    if not complete:
        raise ConnectionError("the server closed the connection mid-answer")
    close = headers.get("connection", "").lower() == "close" or version == "HTTP/1.0"
    if status in (204, 304) or 100 <= status < 200:
        return status, headers, b"", close
    if headers.get("transfer-encoding", "").lower() == "chunked":
        chunks: list[bytes] = []
        total = 0
        while True:
            size_line = _line(reader, MAX_CHUNK_LINE_BYTES, "a chunk size line")
            try:
                size = int(size_line.split(b";")[0].strip(), 16)
            except ValueError:
                raise WireError(f"bad chunk size line {size_line[:100]!r}") from None
            if size == 0:
                break
            total += size
            if total > max_body_bytes:
                raise WireError(f"the body is longer than {max_body_bytes} bytes")
            chunk = reader.read(size)
            if len(chunk) != size:
                raise ConnectionError("the server closed the connection mid-answer")
            chunks.append(chunk)
            _line(reader, MAX_CHUNK_LINE_BYTES, "a chunk's end")
        for _ in range(MAX_HEADERS + 1):  # trailers
            if _line(reader, MAX_LINE_BYTES, "a trailer line") in (b"\r\n", b"\n", b""):
                break
        else:
            raise WireError(f"more than {MAX_HEADERS} trailer lines")
        return status, headers, b"".join(chunks), close
    if "content-length" in headers:
        text = headers["content-length"]
        if not text.isdigit():
            raise WireError(f"bad Content-Length {text[:40]!r}")
        length = int(text)
        if length > max_body_bytes:
            raise WireError(f"the body is longer than {max_body_bytes} bytes")
        data = reader.read(length)
        if len(data) != length:
            raise ConnectionError("the server closed the connection mid-answer")
        return status, headers, data, close
    # No length: the body runs to the end of the connection.
    data = reader.read(max_body_bytes + 1)
    if len(data) > max_body_bytes:
        raise WireError(f"the body is longer than {max_body_bytes} bytes")
    return status, headers, data, True
