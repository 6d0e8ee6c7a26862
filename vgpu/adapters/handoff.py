"""One daemon per node, and a handover between two of them (issue 29).

A rolling update that starts the new daemon before the old one leaves
(`maxSurge: 1`) briefly has two on a node. They share the state directory and
the kubelet's sockets, so exactly one may own them:

* `NodeLock` is an exclusive `flock` on `<state_dir>/daemon.lock`: the owner
  holds it for as long as it serves. The kernel drops it when the owner's
  process ends, however it ends.
* The owner listens on `<state_dir>/handoff.sock`. A newcomer that finds the
  lock taken asks there (`request_handoff`); the owner holds the kubelet's
  calls, writes what it has, releases the lock and answers `ok`, passing the
  kubelet's connections to its sockets along (SCM_RIGHTS). The newcomer
  takes the lock, recovers the placements and registers; the old daemon
  relays the calls it held to it.

Why the connections travel: on kubelet 1.36.2, a ListAndWatch stream that
ends after a newer registration of the same resource makes the kubelet
disconnect the newer registration and mark every device unhealthy until the
plugin registers again. So the old daemon's streams must never end: the
newcomer keeps a descriptor of each connection open (`kept`), and the old
daemon exits without closing them (os._exit, no gRPC shutdown). The kubelet
drops them itself when it restarts.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

LOCK_NAME = "daemon.lock"
SOCKET_NAME = "handoff.sock"
REQUEST = "take"
MAX_LINE_BYTES = 256
MAX_FDS = 256  # connections passed along in one handover


class HandoffError(Exception):
    """The owner could not be asked, or refused; the message says which."""


class NodeLock:
    """The exclusive lock that makes one daemon the node's owner."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Take the lock if nobody holds it; True when this process owns it now."""
        if self._fd is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Read-only: a file held open for writing would keep the state
        # directory's filesystem from being remounted read-only.
        fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def acquire(self, stop: threading.Event, on_wait: Callable[[float], None]) -> bool:
        """Wait for the lock until `stop` is set; `on_wait(waited_s)` every 10 s."""
        started = time.monotonic()
        next_note = started + 10.0
        while not self.try_acquire():
            if stop.wait(0.05):
                return False
            now = time.monotonic()
            if now >= next_note:
                on_wait(now - started)
                next_note = now + 10.0
        return True

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


# What the owner's hand_off(names) returns: why it cannot (None: done), and
# the descriptors to pass along (closed here once sent). `names` are the
# socket file names the newcomer will serve, in the device-plugin directory.
Outcome = tuple[str | None, list[int]]


class HandoffServer:
    """The owner's end: one request at a time on `<state_dir>/handoff.sock`.

    `hand_off()` does the handover; `handed()` runs once the answer is sent.
    On a refusal the asker waits for the lock instead. Only root reaches the
    socket (mode 0600 in the root-owned state directory).
    """

    def __init__(
        self,
        state_dir: Path,
        hand_off: Callable[[list[str]], Outcome],
        handed: Callable[[list[str]], None],
    ) -> None:
        self.path = state_dir / SOCKET_NAME
        self.hand_off = hand_off
        self.handed = handed
        self._started = False
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self.done = threading.Event()  # set once a handover completed

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_mask = os.umask(0o177)
        try:
            sock.bind(str(self.path))
        finally:
            os.umask(old_mask)
        sock.listen(4)
        sock.settimeout(0.2)
        self._sock = sock
        self._started = True
        self._thread = threading.Thread(target=self._run, name="handoff", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._closed.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                self._answer(conn)
            if self.done.is_set():
                return

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(2.0)
        try:
            line = _read_line(conn)
        except OSError:
            return
        words = line.decode(errors="replace").split()
        names = words[1:]
        if not words or words[0] != REQUEST or not names or not all(_plain(n) for n in names):
            with contextlib.suppress(OSError):
                conn.sendall(b"refused: send 'take' and the new daemon's socket names\n")
            return
        reason: str | None = "the daemon is stopping"
        fds: list[int] = []
        if not self._closed.is_set():
            try:
                reason, fds = self.hand_off(names)
            except Exception as exc:  # the asker must get an answer, whatever broke
                log.exception("handing the node over failed")
                reason = f"handing over failed: {exc}"
        try:
            if reason is None:
                socket.send_fds(conn, [b"ok\n"], fds[:MAX_FDS])
            else:
                conn.sendall(f"refused: {reason}\n".encode())
        except OSError as exc:
            log.error("could not answer the new daemon: %s", exc)
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if reason is None:
            self.done.set()
            self.handed(names)

    def close(self, unlink: bool = True) -> None:
        """Stop answering; `unlink` False when a successor's socket may be at the path."""
        self._closed.set()
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(1.0)
        if unlink and self._started and not self.done.is_set():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def _plain(name: str) -> bool:
    """A socket file name in the plugin directory: no path, no dot-dot."""
    return name.endswith(".sock") and "/" not in name and not name.startswith(".")


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n") and len(data) < MAX_LINE_BYTES:
        chunk = conn.recv(MAX_LINE_BYTES - len(data))
        if not chunk:
            break
        data += chunk
    return data


def request_handoff(state_dir: Path, names: list[str], timeout_s: float) -> list[int]:
    """Ask the node's owner to hand over to the sockets `names`. Returns the
    descriptors it passed along (the kubelet's connections, to keep open)
    once it has; else HandoffError."""
    path = state_dir / SOCKET_NAME
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(str(path))
            sock.sendall(" ".join([REQUEST, *names]).encode() + b"\n")
            answer, fds, _, _ = socket.recv_fds(sock, MAX_LINE_BYTES, MAX_FDS)
    except OSError as exc:
        raise HandoffError(f"cannot ask the running daemon at {path}: {exc}") from exc
    if answer != b"ok\n":
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        text = answer.decode(errors="replace").strip() or "no answer"
        raise HandoffError(f"the running daemon did not hand over ({text})")
    return list(fds)


def accepted_fds(paths: list[Path]) -> list[int]:
    """This process's descriptors of connections accepted on the Unix sockets
    `paths` (their listening sockets left out)."""
    names = {os.path.normpath(p) for p in paths}
    out: list[int] = []
    for conn in psutil.Process().net_connections(kind="unix"):
        # gRPC binds "unix:///abs/path", which the kernel reports as "///abs/path".
        laddr = conn.laddr
        if not (isinstance(laddr, str) and laddr and os.path.normpath(laddr) in names):
            continue
        try:
            with socket.socket(fileno=os.dup(conn.fd)) as probe:
                listening = probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        except OSError:
            continue
        if not listening:
            out.append(conn.fd)
    return out


def duplicate(fds: list[int]) -> list[int]:
    """Copies of `fds` that stay open whatever their owner does with its own."""
    out = []
    for fd in fds:
        with contextlib.suppress(OSError):
            out.append(os.dup(fd))
    return out


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def peers_gone(fds: list[int]) -> list[int]:
    """Which of the kept connection descriptors the kubelet has closed."""
    gone = []
    for fd in fds:
        try:
            with socket.socket(fileno=os.dup(fd)) as probe:
                probe.setblocking(False)
                if probe.recv(1, socket.MSG_PEEK) == b"":
                    gone.append(fd)
        except BlockingIOError:
            continue  # open, nothing to read: alive
        except OSError:
            gone.append(fd)
    return gone
