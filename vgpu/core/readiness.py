"""Whether the API server has been reachable lately: the node daemon's
readiness. Pure: the caller says what time it is."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class ApiHealth:
    """The last contact with the API server: `ok` after every successful call or
    watch event, `failed` after every error (with its full text)."""

    down_since_s: float | None = None  # monotonic time of the first failure in a row
    last_error: str = ""
    failures: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def ok(self) -> None:
        with self._lock:
            self.down_since_s = None
            self.failures = 0

    def failed(self, now_s: float, error: str) -> None:
        with self._lock:
            if self.down_since_s is None:
                self.down_since_s = now_s
            self.last_error = error
            self.failures += 1

    def not_ready(self, now_s: float, unready_after_s: float) -> str:
        """'' while ready; else why not, with the last error (what /readyz says)."""
        with self._lock:
            since, error, failures = self.down_since_s, self.last_error, self.failures
        if since is None or now_s - since <= unready_after_s:
            return ""
        return (
            f"API server unreachable for {now_s - since:.0f}s ({failures} failed attempts, "
            f"limit api_unready_after_s={unready_after_s:g}); last error: {error}. The daemon "
            "still serves the kubelet, but cannot see pods or publish its inventory"
        )
