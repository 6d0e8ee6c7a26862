"""Kubernetes Events about a pod (core/v1), posted off the caller's thread.

The node daemon tells a pod's owner what it ignored (e.g. a malformed
`vcuda-core-limit` annotation) where `kubectl describe pod` shows it. Posting
is best effort: a queue drained by one thread, bounded, never blocking the
caller, errors logged and dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Protocol

log = logging.getLogger(__name__)

COMPONENT = "vgpu"
MAX_QUEUED = 256


class EventSink(Protocol):
    def warn(self, namespace: str, pod: str, pod_uid: str, reason: str, message: str) -> None:
        """Queue a Warning Event about a pod."""
        ...


class NoEvents:
    """Without an API server: the message goes to the log only."""

    def warn(self, namespace: str, pod: str, pod_uid: str, reason: str, message: str) -> None:
        log.warning("pod %s/%s: %s: %s", namespace, pod, reason, message)


class KubeEvents:
    """Posts Warning Events through a CoreV1Api (the pod cache's client), asked for
    only when the first Event is posted: building it imports the whole client,
    which must not land on the daemon's start-up."""

    def __init__(self, client: Callable[[], Any], node_name: str | None) -> None:
        self._client = client
        self._node = node_name or ""
        self._queue: queue.Queue[tuple[str, str, str, str, str]] = queue.Queue(MAX_QUEUED)

    def warn(self, namespace: str, pod: str, pod_uid: str, reason: str, message: str) -> None:
        log.warning("pod %s/%s: %s: %s", namespace, pod, reason, message)
        try:
            self._queue.put_nowait((namespace, pod, pod_uid, reason, message))
        except queue.Full:
            log.warning("event queue full: the Event for %s/%s is dropped", namespace, pod)

    def start(self, stop: threading.Event) -> None:
        threading.Thread(target=self._loop, args=(stop,), name="kube-events", daemon=True).start()

    def _loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self._post(*item)
            except Exception as exc:  # best effort: the log already has it
                log.warning("posting an Event for %s/%s failed: %s", item[0], item[1], exc)

    def _post(self, namespace: str, pod: str, pod_uid: str, reason: str, message: str) -> None:
        body = warning_event(namespace, pod, pod_uid, reason, message, self._node)
        self._client().create_namespaced_event(namespace, body)


def warning_event(
    namespace: str,
    pod: str,
    pod_uid: str,
    reason: str,
    message: str,
    node: str,
    container: str | None = None,
) -> dict[str, Any]:
    """The body of a core/v1 Warning Event about a pod (or one of its
    containers), as `kubectl describe pod` shows it."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    involved = {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": pod}
    involved["uid"] = pod_uid
    if container is not None:
        involved["fieldPath"] = f"spec.containers{{{container}}}"
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{pod}.", "namespace": namespace},
        "involvedObject": involved,
        "reason": reason,
        "message": message[:1024],
        "type": "Warning",
        "source": {"component": COMPONENT, "host": node},
        "reportingComponent": COMPONENT,
        "reportingInstance": node,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
