"""A gRPC service on a Unix socket: the kubelet's device-plugin and DRA
sockets are served the same way."""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc


class UnixServer:
    """One gRPC service on a Unix socket; the socket is removed at stop, unless
    another server's socket has taken its path meanwhile."""

    def __init__(
        self,
        socket_path: Path,
        add: Callable[[grpc.Server], None],
        name: str,
        workers: int = 8,
    ) -> None:
        self.socket_path = socket_path
        self.add = add
        self.name = name
        self.workers = workers
        self._server: grpc.Server | None = None
        self._inode: int | None = None

    def start(self) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        if self.socket_path.exists() or self.socket_path.is_socket():
            self.socket_path.unlink()
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix=self.name),
            maximum_concurrent_rpcs=self.workers * 4,
            options=[("grpc.max_receive_message_length", 16 * 1024 * 1024)],
        )
        self.add(server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._server = server
        try:
            self._inode = self.socket_path.stat().st_ino
        except OSError:
            self._inode = None

    def stop(self, grace_s: float = 0.5) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace_s).wait(grace_s + 1.0)
        self.unlink()

    def unlink(self) -> None:
        """Remove the socket file if it is still this server's; the
        connections already made stay."""
        try:
            if self._inode is not None and self.socket_path.stat().st_ino == self._inode:
                self.socket_path.unlink()
        except FileNotFoundError:
            pass
