"""The guard against containers that escaped allocation (device-plugin mode).

Every reconcile interval it compares this node's Running pods (the API
server's pod cache) with the kubelet's pod-resources record: a container that
asks vcuda resources but holds no vgpu device (vgpu.core.guard) was admitted
by a kubelet that never called Allocate, and runs without limits. Each gets a
Warning Event on its pod and counts in vgpu_events_total
{kind="unallocated_container"}; with unallocated_policy evict its pod is
evicted through the Eviction API. A container is judged on two checks in a
row, so a pod cache a moment behind the kubelet condemns no one, and none
while the kubelet restarts (its List is empty or partial for a moment: the
release hold of vgpu.core.release).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from vgpu.adapters.kube import KubeUnavailable, PodSource
from vgpu.adapters.podresources import PodResourcesClient, PodResourcesUnavailable
from vgpu.core.guard import Escapee, escaped
from vgpu.core.model import Resource

log = logging.getLogger("vgpu")

REASON = "UnallocatedVgpuContainer"


class GuardSink(Protocol):
    """Where the guard reports (the API server)."""

    def warn(
        self, namespace: str, pod: str, uid: str, container: str, reason: str, text: str
    ) -> None: ...

    def evict(self, namespace: str, pod: str) -> None: ...


class UnallocatedGuard:
    def __init__(
        self,
        domain: str,
        pods: PodSource,
        podresources: PodResourcesClient,
        sink: GuardSink,
        policy: str = "warn",
        events: Callable[[str, dict[str, Any]], None] | None = None,
        holding: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.domain = domain
        self.pods = pods
        self.podresources = podresources
        self.sink = sink
        self.policy = policy
        self.events = events or (lambda kind, fields: None)
        self.holding = holding
        self._suspects: set[tuple[str, str]] = set()  # seen once: (pod uid, container)
        self._reported: set[tuple[str, str]] = set()
        self._evicted: set[str] = set()

    def check(self) -> list[Escapee]:
        """One comparison; returns the containers acted on now."""
        if not self.pods.synced() or self.holding() is not None:
            self._suspects.clear()  # judged again on two checks once it is over
            return []
        running = self.pods.running()  # first: a container running now was allocated before
        if not running:
            self._suspects.clear()
            return []
        try:
            listing = self.podresources.list({r.full_name(self.domain) for r in Resource})
        except PodResourcesUnavailable:
            return []
        holding = {(i.namespace, i.pod, i.container) for i in listing if i.device_ids}
        found = escaped(running, holding)
        seen = {(e.pod_uid, e.container) for e in found}
        acted = []
        for escapee in found:
            ident = (escapee.pod_uid, escapee.container)
            if ident in self._suspects and ident not in self._reported:
                acted.append(escapee)
                self._report(escapee)
        self._suspects = seen
        self._reported &= seen
        self._evicted &= {e.pod_uid for e in found}
        return acted

    def _report(self, escapee: Escapee) -> None:
        text = escapee.message(self.domain)
        pod = f"{escapee.namespace}/{escapee.pod}"
        log.error("unallocated container %s/%s: %s", pod, escapee.container, text)
        self.events("unallocated_container", {"pod": pod})
        try:
            self.sink.warn(
                escapee.namespace, escapee.pod, escapee.pod_uid, escapee.container, REASON, text
            )
            self._reported.add((escapee.pod_uid, escapee.container))
        except KubeUnavailable as exc:
            log.warning("%s; retried at the next check", exc)
        if self.policy != "evict" or escapee.pod_uid in self._evicted:
            return
        try:
            self.sink.evict(escapee.namespace, escapee.pod)
        except KubeUnavailable as exc:
            log.warning("%s; retried at the next check", exc)
            return
        self._evicted.add(escapee.pod_uid)
        log.warning("evicted %s (unallocated_policy: evict)", pod)
        self.events("unallocated_evicted", {"pod": pod})
