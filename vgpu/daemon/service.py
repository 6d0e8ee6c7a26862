"""The plugin service: the ledger behind a lock, fed by the kubelet's calls,
the GPU backend, the pod cache and the kubelet's pod-resources API.

It implements the servicer's PluginCore port for both resources.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vgpu.adapters.delivery import Delivery, EnvvarDelivery
from vgpu.adapters.devnodes import HostDevices
from vgpu.adapters.fs import ContainerStore
from vgpu.adapters.gpus import CardReading
from vgpu.adapters.kube import NodePublisher, NoNodePublisher, PodSource
from vgpu.adapters.kubelet import checkpoint
from vgpu.adapters.kubelet.servicer import (
    AllocationAnswer,
    DeviceView,
    PreferredRequest,
)
from vgpu.adapters.nodefile import node_document, write_node_file
from vgpu.adapters.podresources import PodResourcesClient, PodResourcesUnavailable
from vgpu.core.annotations import format_inventory, node_key, placements_key
from vgpu.core.contract import (
    ContainerEdits,
    container_edits,
    wanted_nodes,
    with_hook_injection,
)
from vgpu.core.errors import ApiUnavailable, InsufficientCapacity, StateUnwritable, state_error
from vgpu.core.health import HealthEvent, HealthTracker, describe_xid
from vgpu.core.model import (
    CORE_UNITS_PER_CARD,
    Card,
    CardUuid,
    DeviceId,
    Owner,
    Placement,
    Policy,
    Resource,
)
from vgpu.core.packing import Ledger, placement_key
from vgpu.core.release import ReleaseGate
from vgpu.core.reuse import Holder, KubeletListing, judge_holder

log = logging.getLogger("vgpu")

OWNER_SYNC_DELAY_S = 0.3
LIST_RETRY_S = 1.0  # a pod-resources List that failed after answering is retried this soon
ANNOTATE_RETRY_S = 30.0  # re-queue a pod annotation the cache does not show after this
EMPTY_ANSWER = ContainerEdits(envs={})  # a container's second answer that adds nothing


@dataclass(frozen=True)
class ServiceOptions:
    domain: str
    memory_unit_mib: int
    policy: Policy
    ignored_xids: tuple[int, ...]
    api_wait_s: float
    hook_path: Path | None = None  # installed library on the host
    context_overhead_mib: int = 0  # per-card context estimate passed to the hook
    hook_injection: str = "ld-so-preload"  # also mount /etc/ld.so.preload (or "env" only)
    # How long the kubelet's answers must be stable after its (re)start before
    # anything is released: one reconcile period (vgpu.core.release).
    settle_s: float = 10.0


def install_or_refuse(installer: Callable[[], Path], where: str | None = None) -> Path:
    """Run a hook-library installer (both modes); a disk that refuses it is a
    StateUnwritable naming the cause and `where` (else the file it failed on)."""
    try:
        hook = installer()
    except OSError as exc:
        raise state_error(
            exc.errno,
            where or str(exc.filename or "the hook directory"),
            "install the hook library",
            exc.strerror or "",
        ) from exc
    log.info("hook library installed as %s", hook)
    return hook


class PluginService:
    def __init__(
        self,
        options: ServiceOptions,
        store: ContainerStore,
        pods: PodSource,
        podresources: PodResourcesClient | None,
        node_file: Path | None = None,
        clock: Callable[[], float] = time.time,
        events: Callable[[str, dict[str, Any]], None] | None = None,
        node_publisher: NodePublisher | None = None,
    ) -> None:
        self.options = options
        self.node_publisher = node_publisher or NoNodePublisher()
        self._inventory: str | None = None
        self.store = store
        self.pods = pods
        self.podresources = podresources
        self.node_file = node_file
        self.clock = clock
        self.events = events or (lambda kind, fields: None)
        self.ledger = Ledger(
            [],
            memory_unit_mib=options.memory_unit_mib,
            policy=options.policy,
            domain=options.domain,
        )
        self.tracker = HealthTracker(options.ignored_xids)
        self._lock = threading.RLock()
        self._dev_cond = threading.Condition()
        self._dev_version = 0
        self._views: dict[Resource, tuple[DeviceView, ...]] = {r: () for r in Resource}
        self._owner_timer: threading.Timer | None = None
        self._podres_warned = False
        self._api_degraded = False
        self._closed = False
        self.readings: dict[CardUuid, CardReading] = {}
        self._annotated: dict[tuple[str, str, str], float] = {}  # (ns, pod, value) -> queued
        # State the disk would not take: kept in memory (the ledger) and written
        # again by flush_unwritten() until the disk takes it.
        self.state_error: StateUnwritable | None = None
        self._unwritten: set[str] = set()
        self._podres_error = ""
        # Installs the hook library when start-up could not (e.g. a full disk).
        self.hook_installer: Callable[[], Path] | None = None
        # (key, pods the kubelet listed) at the Allocate of an in-flight
        # container placed without pod information: see _blind_pairing().
        self._blind_pods: tuple[str, frozenset[tuple[str, str]]] | None = None
        # The host's device nodes (None: none are checked, none named) and the
        # device list strategy; the composition root sets both.
        self.devices: HostDevices | None = None
        self.delivery: Delivery = EnvvarDelivery()
        self._legacy_published = 0  # ledger.legacy_version the device lists show
        # (key, resources answered, answer) of the last container: _deduplicated().
        self._last_answer: tuple[str, frozenset[Resource], AllocationAnswer] | None = None
        # When a placement may be released (vgpu.core.release); monotonic times.
        self.release_gate = ReleaseGate(settle_s=options.settle_s)
        self._podres_identity: tuple[int, int] | None = None
        self._podres_answered = False  # has the kubelet's List ever answered?
        self._recovered = 0  # placements recovered at start-up
        self._hold_logged = ""
        self._followup_timer: threading.Timer | None = None
        # Is the daemon registered with the kubelet running now? The composition
        # root sets it (the kubelet.sock it registered with is the one there now).
        self.registered_now: Callable[[], bool] = lambda: True
        # The kubelet's device checkpoint (the composition root sets it): the
        # saved Allocate answers name the directories running containers mount.
        self.kubelet_checkpoint: Path | None = None

    def _republish_if_legacy_changed(self) -> None:
        """A slice held under a legacy ID was released (or one arrived): the
        advertised lists switch that slice's ID. Called under the lock."""
        if self.ledger.legacy_version != self._legacy_published:
            self._publish()

    # ------------------------------------------------------------ cards

    def resource_name(self, resource: Resource) -> str:
        return resource.full_name(self.options.domain)

    def _judge(self, card: Card) -> Card:
        """Apply the XID filter and the device-node check to a card as the
        backend reported it."""
        return self._judge_nodes(self.tracker.judge(card))

    def _judge_nodes(self, card: Card) -> Card:
        return card if self.devices is None else self.devices.judge(card)

    def check_device_nodes(self) -> None:
        """Re-check every card's own device node (periodic): a card whose node
        went missing turns unhealthy with the reason, and back once it is there."""
        with self._lock:
            before = dict(self.ledger.cards)
            after = [self._judge_nodes(c) for c in before.values()]
            if all(a is before[a.uuid] for a in after):
                return
            self.ledger.set_cards(after)
            for card in after:
                self._log_health(before[card.uuid], card)
            self._publish()

    def set_cards(self, cards: Sequence[Card]) -> None:
        with self._lock:
            before = dict(self.ledger.cards)
            judged = [self._judge(c) for c in cards]
            self.ledger.set_cards(judged)
            for card in judged:
                self._log_health(before.get(card.uuid), card)
            for uuid in set(before) - {c.uuid for c in judged}:
                log.error("card %s disappeared; %s", uuid, self._victims(uuid))
                self.events("card_gone", {"card": uuid})
            self._publish()

    def on_event(self, event: HealthEvent) -> None:
        with self._lock:
            card = self.ledger.cards.get(event.card)
            if card is None:
                return
            updated = self.tracker.apply(card, event)
            if updated is card:
                return
            self.ledger.set_cards(
                [updated if c.uuid == card.uuid else c for c in self.ledger.cards.values()]
            )
            self._log_health(card, updated)
            self._publish()

    def _victims(self, uuid: CardUuid) -> str:
        placements = self.ledger.placements_on(uuid)
        if not placements:
            return "no container is on it"
        names = [
            f"{p.owner.namespace}/{p.owner.pod}/{p.owner.container}" if p.owner else p.key
            for p in placements
        ]
        return f"containers still on it: {', '.join(names)}"

    def _log_health(self, before: Card | None, after: Card) -> None:
        if before is None and after.problem:
            log.error("card %s (index %d) unhealthy: %s", after.uuid, after.index, after.problem)
        if before is None or before.healthy == after.healthy:
            return
        if after.healthy:
            log.info(
                "card %s (index %d) is healthy again, back in service", after.uuid, after.index
            )
            self.events("card_healthy", {"card": after.uuid})
        else:
            why = (
                f"XID {after.xid} ({describe_xid(after.xid)})"
                if after.xid
                else after.problem or "reported unhealthy"
            )
            log.error(
                "card %s (index %d) unhealthy: %s; nothing new is placed on it; %s",
                after.uuid,
                after.index,
                why,
                self._victims(after.uuid),
            )
            self.events("card_unhealthy", {"card": after.uuid, "xid": after.xid})

    def _publish(self) -> None:
        """Rebuild the advertised lists (only on change) and wake ListAndWatch."""
        self._legacy_published = self.ledger.legacy_version
        views: dict[Resource, tuple[DeviceView, ...]] = {}
        for resource in Resource:
            views[resource] = tuple(
                DeviceView(device_id, card.healthy, card.numa_node)
                for card in sorted(self.ledger.cards.values(), key=lambda c: c.index)
                for device_id in self.ledger.advertised(card, resource)
            )
        with self._dev_cond:
            self._views = views
            self._dev_version += 1
            self._dev_cond.notify_all()
        self._write_node_file()
        self._publish_inventory()

    def _publish_inventory(self) -> None:
        """The <domain>/vgpu-node annotation for the scheduler extender, on change only."""
        value = format_inventory(
            list(self.ledger.cards.values()), self.options.memory_unit_mib, self.options.policy
        )
        if value != self._inventory:
            self._inventory = value
            self.node_publisher.publish({node_key(self.options.domain): value})

    def device_list(self, resource: Resource) -> tuple[int, Sequence[DeviceView]]:
        with self._dev_cond:
            return self._dev_version, self._views[resource]

    def set_readings(self, readings: dict[CardUuid, CardReading]) -> None:
        """Real usage per card from the backend; rewrites node.json on change only."""
        with self._lock:
            if readings == self.readings:
                return
            self.readings = dict(readings)
            self._write_node_file()

    def close(self) -> None:
        """Shutdown: no more owner syncs; every ListAndWatch stream re-checks at once."""
        self._closed = True
        for timer in (self._owner_timer, self._followup_timer):
            if timer is None:
                continue
            timer.cancel()
            if timer.is_alive() and timer is not threading.current_thread():
                timer.join(2.0)  # a reconcile under way: let it finish its RPC
        with self._dev_cond:
            self._dev_cond.notify_all()

    def wait_devices(self, version: int, timeout_s: float) -> int:
        with self._dev_cond:
            self._dev_cond.wait_for(lambda: self._dev_version != version or self._closed, timeout_s)
            return self._dev_version

    def _write_node_file(self) -> None:
        if self.node_file is None:
            return
        document = node_document(
            self.ledger.cards.values(),
            self.readings,
            domain=self.options.domain,
            memory_unit_mib=self.options.memory_unit_mib,
            now_s=self.clock(),
        )
        write_node_file(self.node_file, document)

    # --------------------------------------------------------- admission

    def _candidates(
        self, resource: Resource, size: int, deadline: float, req: PreferredRequest | None = None
    ) -> list[Any]:
        """Pods that may be the one being admitted; waits (bounded) for the cache.

        The kubelet learns of a pod from the API server at about the time we
        do, so a pod missing from the cache usually arrives within
        milliseconds. We wait until `deadline` at most (api_wait_s per call)
        for it, or for the cache to sync; during an outage only the first
        admission waits, later ones use the fallback rule at once until the
        cache is back.
        """
        seen = self.pods.version()
        specs = self.pods.candidates()
        if not self.pods.enabled or self.options.api_wait_s <= 0:
            return specs
        with self._lock:
            if not self.ledger.needs_pod_info(resource, size, specs):
                return specs
            if req is not None:
                # A placement whose IDs the kubelet offers as free is dead (e.g. a
                # pod half-admitted before a kubelet restart, admitted anew now):
                # its pod is pending again, and must not be waited for in vain.
                for key in self.ledger.release_offered(resource, req.available, req.must_include):
                    self._forget(key, "the kubelet offers its IDs as free")
                if not self.ledger.needs_pod_info(resource, size, specs):
                    return specs
        if not self.pods.synced() and self._api_degraded:
            return specs
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                if not self.pods.synced():
                    self._api_degraded = True
                    log.warning(
                        "pod cache not synced with the API server; placing by the fallback rule "
                        "until it is back"
                    )
                else:
                    log.warning(
                        "no pending pod on this node asks %s=%d; placing it by the fallback rule",
                        self.resource_name(resource),
                        size,
                    )
                return specs
            # Wait for a change since the version the specs were read at: a pod
            # arriving between the two reads is never missed.
            self.pods.wait_change(seen, min(left, 0.5))
            seen = self.pods.version()
            specs = self.pods.candidates()
            if self.pods.synced():
                self._api_degraded = False
                with self._lock:
                    if not self.ledger.needs_pod_info(resource, size, specs):
                        return specs

    def preferred(
        self, resource: Resource, requests: Sequence[PreferredRequest]
    ) -> list[list[str]]:
        """Answer one GetPreferredAllocation (the kubelet sends one container request)."""
        with self._lock:
            for req in requests:  # refuse malformed input before waiting for pods
                self.ledger.check_preferred(resource, req.must_include, req.size)
        deadline = time.monotonic() + self.options.api_wait_s
        return [self._preferred_one(resource, req, deadline) for req in requests]

    def _preferred_one(
        self, resource: Resource, req: PreferredRequest, deadline: float
    ) -> list[str]:
        candidates = self._candidates(resource, req.size, deadline, req)
        self._attribute_in_flight(candidates)
        blind = self._blind_pairing()
        for attempt in (1, 2, 3):
            try:
                with self._lock:
                    ids, released = self.ledger.preferred(
                        resource, req.available, req.must_include, req.size, candidates, blind
                    )
                    for key in released:
                        self._forget(key, "the kubelet offers its IDs as free")
                return list(ids)
            except InsufficientCapacity as exc:
                final = attempt == 3 or (attempt == 2 and not self._await_second_sighting())
                if final:
                    with self._lock:
                        self.ledger.note_refused()
                    raise  # counted by the gRPC edge (vgpu_calls_total outcome)
                # Re-check with the kubelet first: a pod deleted a moment ago
                # must not cause a wrongful refusal.
                if self.reconcile("re-check before refusing") < 0 and self.podresources:
                    raise ApiUnavailable(
                        f"{exc.message} vgpu could not ask the kubelet whether a pod just "
                        f"finished ({self._podres_error}), so slices freed a moment ago may "
                        "still be counted: check that the kubelet runs and that its "
                        f"pod-resources socket {self.podresources.socket_path} is mounted"
                    ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _await_second_sighting(self) -> bool:
        """Before a refusal: a placement the kubelet no longer lists waits for its
        second sighting (vgpu.core.release); wait for it (at most the grace, and
        never during a restart hold) so that a pod deleted a moment ago does
        not cause a wrongful refusal. False when none waits."""
        with self._lock:
            if self.holding_releases() is not None:
                return False
            due = self.release_gate.due_in(time.monotonic())
        if due is None or due > self.release_gate.grace_s:
            return False
        time.sleep(due + 0.01)
        return True

    def _attribute_in_flight(self, candidates: list[Any]) -> None:
        """An in-flight container placed without pod information, or matched to
        one of several pods asking the same: ask the kubelet (local pod-resources,
        only in this case) which container holds its IDs, so that its second
        resource is paired, and its limits and owner taken, by fact rather than
        by guess. The kubelet lists a container from its first Allocate on."""
        with self._lock:
            held = self.ledger.unattributed_pending()
        if not held or not candidates or self.podresources is None:
            return
        names = {self.resource_name(r) for r in Resource}
        try:
            listing = self.podresources.list(names)
        except PodResourcesUnavailable:
            return
        for item in listing:
            if held & set(item.device_ids):
                with self._lock:
                    self.ledger.attribute_pending(
                        item.namespace, item.pod, item.container, candidates
                    )
                return

    def allocate(self, resource: Resource, device_ids: Sequence[str]) -> AllocationAnswer:
        candidates = self.pods.candidates()
        reused = self._judge_held(resource, device_ids)
        blind = self._blind_pairing()
        with self._lock:
            known = self.ledger.placements.copy()
            placement = self.ledger.allocate(
                resource,
                device_ids,
                candidates,
                now_s=self.clock(),
                reused=reused,
                blind_pairing=blind,
            )
            if known.get(placement.key) != placement:
                try:
                    self._ensure_hook(placement)
                    if placement.key not in known:
                        self._clear_directory(placement.key)
                    # One durable write per container, before its last answer:
                    # the record written at its first resource is replaced at
                    # its second (same key) moments later (ContainerStore.write).
                    complete = not self.ledger.awaits_more(placement.key)
                    self._write(placement, durable=complete, complete=complete)
                except StateUnwritable:
                    self.ledger.release(placement.key)
                    if placement.key in known:
                        self.ledger.restore(known[placement.key])
                    else:
                        self.store.discard(placement.key)  # nothing half-written stays
                    raise
                # One line per container, once its placement is complete (the
                # first of its two resources only at debug: ~0.06 ms a line on
                # the Allocate path).
                level = logging.INFO if complete else logging.DEBUG
                if log.isEnabledFor(level):
                    log.log(
                        level,
                        "placed %s on %s: core %d%%, memory %s (%s)",
                        placement.key,
                        ",".join(placement.cards),
                        placement.core_percent,
                        f"{placement.memory_mib} MiB" if placement.memory_mib else "no limit",
                        f"{self.resource_name(resource)} x{len(device_ids)}",
                    )
                self.events("placement", {"key": placement.key, "resource": resource.value})
            self._republish_if_legacy_changed()
            answer = self._deduplicated(placement.key, resource, self.answer(placement))
            # A container placed without pod information, at its first resource.
            blind_key = self.ledger.blind_pending_key()
            first = blind_key == placement.key and len(placement.ids) == 1
        if blind_key is not None and first:
            pods = self._listed_pods()
            self._blind_pods = (blind_key, pods) if pods is not None else None
        self._schedule_owner_sync()
        return answer

    def _deduplicated(
        self, key: str, resource: Resource, answer: AllocationAnswer
    ) -> AllocationAnswer:
        """The answer for a container's second resource is empty when the first
        resource's answer already said exactly this: the kubelet merges the
        answers of a container's resources (so the container gets the same
        contract) and saves each in its checkpoint (so it stays half as big).
        Called under the lock."""
        last = self._last_answer
        if last is not None and last[0] == key and resource not in last[1] and last[2] == answer:
            self._last_answer = (key, last[1] | {resource}, answer)
            return EMPTY_ANSWER
        # A new container (also one reusing its init container's placement).
        self._last_answer = (key, frozenset({resource}), answer)
        return answer

    def _listed_pods(self) -> frozenset[tuple[str, str]] | None:
        if self.podresources is None:
            return None
        try:
            listing = self.podresources.snapshot({self.resource_name(r) for r in Resource})
        except PodResourcesUnavailable:
            return None
        return frozenset(listing.pods)

    def _blind_pairing(self) -> bool:
        """May this call be the other resource of the in-flight container placed
        without pod information? Only if the kubelet lists no pod it did not list
        at that container's Allocate: it admits one pod at a time and lists a pod
        from the start of its admission, so a new pod means the call may be
        another pod's, which must never be paired with (and given the
        directory of) this one. Asks the pod-resources API only in this case."""
        with self._lock:
            key = self.ledger.blind_pending_key()
        if key is None:
            return True
        seen = self._blind_pods
        if seen is None or seen[0] != key:
            return False
        now = self._listed_pods()
        return now is not None and now <= seen[1]

    def _judge_held(self, resource: Resource, device_ids: Sequence[str]) -> frozenset[str]:
        """IDs a placement still holds arrive for a new container: settle each holder
        by fact (see vgpu.core.reuse) before placing. Dead ones are released and
        their directories discarded; returns the init containers' placements this
        container reuses. Asks the kubelet's pod-resources API only in this case."""
        with self._lock:
            holders = self.ledger.holders_among(device_ids)
        if not holders:
            return frozenset()
        listing: KubeletListing | None = None
        if self.podresources is not None:
            try:
                listing = self.podresources.snapshot({self.resource_name(r) for r in Resource})
            except PodResourcesUnavailable as exc:
                log.warning("pod-resources API unavailable (%s) while judging held IDs", exc)
        reused: set[str] = set()
        with self._lock:
            gone = self._gone_pods()
            held = self.holding_releases()
            for key in holders:
                placement = self.ledger.placements.get(key)
                if placement is None:
                    continue
                pod_gone = placement.owner is not None and placement.owner.pod_uid in gone
                verdict, why = judge_holder(
                    placement,
                    settled=self.ledger.is_settled(key),
                    listing=listing,
                    pod_gone=pod_gone,
                )
                if verdict is Holder.DEAD and not pod_gone and held is not None:
                    # A kubelet that has just restarted may hand out IDs it has
                    # not reloaded yet: keep the holder (and its directory).
                    # Otherwise the kubelet allocating the IDs again is its own
                    # word that they are free, whatever a pod cache shows (a
                    # kept record would count the slice twice).
                    verdict, why = Holder.UNKNOWN, f"{why}, but releases are held: {held}"
                if verdict is Holder.REUSED:
                    reused.add(key)
                    log.info(
                        "%s IDs of %s arrive again: %s; the new container shares it",
                        self.resource_name(resource),
                        key,
                        why,
                    )
                elif verdict is Holder.DEAD:
                    self.ledger.release(key)
                    self._forget(key, f"its IDs arrive for a new container and {why}")
                else:
                    log.warning(
                        "%s IDs of %s arrive for a new container and %s; keeping it, the new "
                        "container gets a placement of its own",
                        self.resource_name(resource),
                        key,
                        why,
                    )
        return frozenset(reused)

    def _clear_directory(self, key: str) -> None:
        """A new placement starts from an empty directory: whatever a released
        placement left under the same key is moved away first."""
        failed = self.store.discard(key)
        if failed is not None:
            path = self.store.paths(key).config_dir
            error = state_error(
                failed.errno,
                str(path),
                "move an old directory out of the way",
                failed.strerror or "",
            )
            self._note_state(error)
            raise error from failed

    def _write(self, placement: Placement, durable: bool = True, complete: bool = True) -> None:
        """Write a placement's record; a named StateUnwritable when the disk refuses."""
        try:
            self.store.write(placement, durable=durable, complete=complete)
        except OSError as exc:
            error = state_error(
                exc.errno,
                str(exc.filename or self.store.paths(placement.key).config_dir),
                f"write the config of {placement.key}",
                exc.strerror or "",
            )
            self._note_state(error)
            raise error from exc
        self._unwritten.discard(placement.key)
        if not self._unwritten:
            self._note_state(None)

    def _write_or_defer(self, placement: Placement) -> None:
        """Off the admission path: keep the state in memory when the disk refuses,
        and write it again later (flush_unwritten)."""
        try:
            self._write(placement)
        except StateUnwritable:
            self._unwritten.add(placement.key)

    def _note_state(self, error: StateUnwritable | None) -> None:
        """One log line (and event) per change of the state directory's health."""
        before = self.state_error
        self.state_error = error
        if error is None:
            if before is not None:
                log.info("the state directory takes writes again (was: %s)", before.errno_name)
                self.events("state_writable", {})
        elif before is None or before.errno_name != error.errno_name:
            log.error("state not written: %s", error.message)
            self.events("state_unwritable", {"errno": error.errno_name})

    def needs_retry(self) -> bool:
        """Is there state the disk refused (records, or the hook library) to retry?"""
        with self._lock:
            hook_missing = self.hook_installer is not None and self.options.hook_path is None
            return bool(self._unwritten) or self.state_error is not None or hook_missing

    def flush_unwritten(self) -> int:
        """Write again what the disk refused before; returns how many records are left."""
        with self._lock:
            for key in sorted(self._unwritten):
                placement = self.ledger.placements.get(key)
                if placement is None:
                    self._unwritten.discard(key)
                    continue
                try:
                    self._write(placement)
                except StateUnwritable:
                    return len(self._unwritten)  # still refused: try again later
            if self.hook_installer is not None and self.options.hook_path is None:
                try:
                    self._install_hook()
                except StateUnwritable:
                    return 0
            self._note_state(None)
            return 0

    def _ensure_hook(self, placement: Placement) -> None:
        """A sliced container needs the hook library on the host; install it now
        if start-up could not (refused with the disk's error otherwise)."""
        if placement.whole or self.hook_installer is None or self.options.hook_path is not None:
            return
        self._install_hook()

    def _install_hook(self) -> None:
        assert self.hook_installer is not None
        try:
            hook = install_or_refuse(self.hook_installer)
        except StateUnwritable as error:
            self._note_state(error)
            raise
        self.options = replace(self.options, hook_path=hook)

    def answer(self, placement: Placement) -> AllocationAnswer:
        paths = self.store.paths(placement.key)
        hook = self.options.hook_path
        cards = [self.ledger.cards.get(c) for c in placement.cards]
        nodes = wanted_nodes([c for c in cards if c is not None])
        edits = container_edits(
            placement,
            cards,
            config_dir=str(paths.config_dir),
            shared_dir=str(paths.shared_dir),
            hook_path=str(hook) if hook is not None else None,
            context_overhead_mib=self.options.context_overhead_mib,
            present_nodes=self.devices.present(nodes) if self.devices is not None else (),
        )
        edits = with_hook_injection(
            edits, str(hook) if hook is not None else None, self.options.hook_injection
        )
        return self.delivery.deliver(placement.key, edits, placement.cards)

    def prestart(self, resource: Resource, device_ids: Sequence[str]) -> None:
        """Re-create a container's config directory or budget file if it went
        missing: the saved Allocate answer mounts both."""
        ids = frozenset(device_ids)
        with self._lock:
            for placement in self.ledger.placements.values():
                if placement.ids.get(resource) == ids:
                    paths = self.store.paths(placement.key)
                    if not paths.config_file.exists() or not paths.budget_file.is_file():
                        self._write(placement)
                        log.warning("re-created the missing config of %s", placement.key)
                    return

    # ------------------------------------------------------- reconciling

    def _forget(self, key: str, why: str) -> None:
        # A rename now (one syscall, under the lock: the same IDs, hence the
        # same key, may be placed again at once); the rmtree in the background.
        self.store.discard(key)
        self.delivery.forget(key)
        log.info("released %s: %s", key, why)
        self.events("release", {"key": key})
        self._republish_if_legacy_changed()

    def _schedule_owner_sync(self) -> None:
        if self.podresources is None or self._closed:
            return
        timer = self._owner_timer
        if timer is not None and timer.is_alive():
            return
        timer = threading.Timer(OWNER_SYNC_DELAY_S, self.reconcile, args=("learn owners",))
        timer.daemon = True
        self._owner_timer = timer
        timer.start()

    def kubelet_restarted(
        self, why: str, reregister: bool = True, age_s: float | None = None
    ) -> None:
        """A kubelet (re)start was noticed (by any path): hold every release until
        the daemon is registered with the new kubelet and its answers are stable
        for one settle period (vgpu.core.release)."""
        now = time.monotonic()
        started = None if age_s is None else now - max(age_s, 0.0)
        with self._lock:
            began = self.release_gate.restart(now, why, reregister, started)
        if began:
            log.warning(
                "kubelet restart noticed (%s): no placement is released until vgpu is "
                "registered with it and its pod-resources answers are stable for %.0f s",
                why,
                self.options.settle_s,
            )
            self.events("kubelet_restart", {"why": why})
        # Look again soon: the settle period counts from the first answer after
        # the registration, which must not wait for the next periodic check.
        self._schedule_followup(LIST_RETRY_S)

    def plugin_registered(self) -> None:
        """The composition root registered both resources with the kubelet."""
        with self._lock:
            self.release_gate.note_registered(time.monotonic())
            held = self.release_gate.hold_since is not None
        if held:
            self._schedule_followup(LIST_RETRY_S)

    def holding_releases(self) -> str | None:
        """Why releases are held now (a kubelet restart), or None."""
        with self._lock:
            return self.release_gate.holding(time.monotonic(), self.registered_now())

    def _note_podres_socket(self) -> None:
        """The socket the last List answered on: a new one means a new kubelet;
        the first one seen, if created less than a settle period ago, too
        (only where placements were recovered: nothing else predates it)."""
        assert self.podresources is not None
        identity = self.podresources.last_identity
        before, self._podres_identity = self._podres_identity, identity
        if identity is None or identity == before:
            return
        age_s = time.time() - identity[1] / 1e9
        if before is not None:
            self.kubelet_restarted("the kubelet's pod-resources socket was re-created", age_s=age_s)
            return
        if age_s < self.options.settle_s and self._recovered:
            self.kubelet_restarted(
                f"the kubelet started {max(age_s, 0.0):.1f} s ago", reregister=False
            )

    def _schedule_followup(self, delay_s: float) -> None:
        """A placement awaits its second sighting, or a restart hold may end:
        look again once it is due. (Called by the follow-up itself too: it
        then schedules the next one.)"""
        if self._closed:
            return
        timer = self._followup_timer
        if timer is not None and timer.is_alive() and timer is not threading.current_thread():
            return  # one is due no later than this sighting's
        timer = threading.Timer(delay_s + 0.05, self.reconcile, args=("follow-up",))
        timer.daemon = True
        self._followup_timer = timer
        timer.start()

    def reconcile(self, reason: str) -> int:
        """Re-check every placement against the kubelet's pod-resources record.

        Releases placements of pods that are gone, adopts live allocations we
        have no record of, learns owners, and removes orphaned directories.
        A release needs what vgpu.core.release says: no kubelet restart under
        way, two agreeing sightings, and an API server that does not show the
        pod running here. Returns the number of placements released (-1 when
        the kubelet cannot be asked).
        """
        if self.podresources is None:
            return -1
        names = {self.resource_name(r): r for r in Resource}
        try:
            listing = self.podresources.list(set(names))
        except PodResourcesUnavailable as exc:
            self._podres_error = str(exc)
            with self._lock:
                self.release_gate.list_failed(time.monotonic())
            if self._podres_answered:
                # It answered before: the kubelet is stopping or restarting. Look
                # again in a second (not at the next periodic check), so that the
                # new kubelet's answers start counting as soon as it serves.
                self.kubelet_restarted(
                    f"the kubelet's pod-resources API stopped answering: {exc}", reregister=False
                )
            if not self._podres_warned:
                log.warning(
                    "pod-resources API unavailable (%s); finished pods are noticed "
                    "only when the kubelet offers their IDs again",
                    exc,
                )
                self._podres_warned = True
            return -1
        self._podres_warned = False
        self._podres_answered = True
        self._note_podres_socket()
        by_container: dict[tuple[str, str, str], dict[Resource, set[DeviceId]]] = {}
        live: set[DeviceId] = set()
        for item in listing:
            listed = {DeviceId(d) for d in item.device_ids}
            live |= listed
            slot = by_container.setdefault((item.namespace, item.pod, item.container), {})
            slot.setdefault(names[item.resource], set()).update(listed)
        released_count = 0
        annotate: dict[tuple[str, str], None] = {}
        alive = self.pods.alive() if self.pods.enabled else None
        staying = self.pods.staying() if self.pods.enabled else None
        recorded = self._checkpointed_ids(live)  # off the lock: it reads a file
        with self._lock:
            now = time.monotonic()
            registered = self.registered_now()
            gate = self.release_gate

            def pod_leaving(container: Any) -> bool:
                return staying is not None and f"{container[0]}/{container[1]}" not in staying

            gate.listed(now, by_container, registered, pod_leaving)
            held = gate.holding(now, registered)
            if (held or "") != self._hold_logged:
                if held:
                    log.info("releases held: %s", held)
                else:
                    log.info("releases resume: the kubelet answers steadily again")
                self._hold_logged = held or ""
            if self.pods.enabled and self.pods.synced():
                # Claims only matter while a pod is pending; drop the rest so
                # the set does not grow with every pod the node ever ran.
                self.ledger.prune_claims({s.ident for s in self.pods.candidates()})
            gone = self._gone_pods()
            if recorded:
                self.ledger.mark_settled(
                    p.key for p in self.ledger.placements.values() if p.all_ids() & recorded
                )
            asked: set[str] = set()

            def may_release(placement: Placement) -> bool:
                asked.add(placement.key)
                if held is not None:
                    return False
                if alive is not None and _owner_alive(placement.owner, alive):
                    gate.present(placement.key)
                    return False
                return gate.confirm_missing(placement.key, now)

            for placement in self.ledger.reconcile(live, self.clock(), gone, may_release):
                released_count += 1
                self._forget(placement.key, f"no live container holds it ({reason})")
            gate.forget_except(asked & set(self.ledger.placements))
            for (namespace, pod, container), held_ids in by_container.items():
                self._adopt_or_name(namespace, pod, container, held_ids, annotate)
            self._republish_if_legacy_changed()
            keep = set(self.ledger.placements)
            if held is None:  # a record may yet be claimed while the kubelet settles
                for key in self.store.record_keys():
                    if key not in keep:
                        self.store.discard(key)
                        log.info("removed orphaned config directory %s", key)
                for name in self.delivery.sweep(keep):
                    log.info("removed orphaned CDI spec %s", name)
            followup = gate.due_in(now)
        if followup is not None:
            self._schedule_followup(followup)
        # Every live pod, not only those whose owner changed now: most owners
        # are known at Allocate already. _annotate skips what is up to date.
        for namespace, pod, _ in by_container:
            annotate[(namespace, pod)] = None
        for namespace, pod in annotate:
            self._annotate(namespace, pod)
        live_pods = set(annotate)
        self._annotated = {k: v for k, v in self._annotated.items() if k[:2] in live_pods}
        return released_count

    def _gone_pods(self) -> set[str]:
        """UIDs of placement owners the (synced) pod cache no longer holds: deleted,
        finished or replaced by a namesake. Empty while the cache is not synced."""
        if not self.pods.enabled or not self.pods.synced():
            return set()
        gone = set()
        for placement in self.ledger.placements.values():
            owner = placement.owner
            if (
                owner is not None
                and owner.pod_uid
                and self.pods.uid_of(owner.namespace, owner.pod) != owner.pod_uid
            ):
                gone.add(owner.pod_uid)
        return gone

    def _adopt_or_name(
        self,
        namespace: str,
        pod: str,
        container: str,
        ids: dict[Resource, set[DeviceId]],
        annotate: dict[tuple[str, str], None],
    ) -> None:
        known = [self.ledger.lookup(d) for r in ids for d in ids[r]]
        if any(k is None for k in known):
            return  # IDs of a card we no longer advertise; keep what we have
        holders = {k for r in ids for d in ids[r] for k in self.ledger.holders_of(d)}
        uid = self.pods.uid_of(namespace, pod)
        owner = Owner(namespace, pod, container, uid)
        if not holders:
            placement = self._rebuild(ids, owner)
            self.ledger.restore(placement)
            self._write_or_defer(placement)
            log.warning(
                "adopted %s/%s/%s from the kubelet's record as %s (no state of ours for it)",
                namespace,
                pod,
                container,
                placement.key,
            )
            annotate[(namespace, pod)] = None
            return
        for key in holders:
            placement = self.ledger.placements[key]
            if placement.owner is not None and placement.owner.pod_uid and not uid:
                owner = replace(owner, pod_uid=placement.owner.pod_uid)
            updated = self.ledger.set_owner(key, owner)
            if updated is not None:
                self._write_or_defer(updated)
                annotate[(namespace, pod)] = None

    def _rebuild(self, ids: dict[Resource, set[DeviceId]], owner: Owner) -> Placement:
        core_ids = frozenset(ids.get(Resource.CORE, set()))
        mem_ids = frozenset(ids.get(Resource.MEMORY, set()))
        cards: list[CardUuid] = []
        for device_id in sorted(core_ids | mem_ids):
            found = self.ledger.lookup(device_id)
            if found is not None and found[0] not in cards:
                cards.append(found[0])
        whole = len(core_ids) >= CORE_UNITS_PER_CARD
        # The kubelet's saved answer mounts the directory of the key it got at
        # the container's first Allocate: take that key from its checkpoint, so
        # that the running container finds its files where it mounted them.
        # Without it: the key of a directory still there, else the core IDs'.
        mounted = self._mounted_key(core_ids | mem_ids)
        keys = [placement_key(i) for i in (core_ids, mem_ids) if i]
        existing = set(self.store.record_keys())
        key = mounted or next((k for k in keys if k in existing), keys[0])
        return Placement(
            key=key,
            cards=tuple(cards),
            ids={r: frozenset(v) for r, v in ids.items() if v},
            core_percent=CORE_UNITS_PER_CARD if whole else len(core_ids),
            memory_mib=0 if whole else len(mem_ids) * self.options.memory_unit_mib,
            owner=owner,
            created_s=self.clock(),
        )

    def _checkpointed_ids(self, live: set[DeviceId]) -> set[str]:
        """Placements the kubelet has never listed are kept 30 s (our answer may
        not have reached it). Its checkpoint, rewritten after every allocation,
        says whether it did: the IDs it records settle them, so they go by the
        usual rules once their pod does (a restart may have hidden them from
        every List while they ran). Read only when a placement older than the
        grace (a young one is listed as usual) was never listed; not under the
        lock (a checkpoint is megabytes on a big node)."""
        if self.kubelet_checkpoint is None:
            return set()
        now_s = self.clock()
        with self._lock:
            waiting = any(
                not self.ledger.is_settled(p.key)
                and now_s - p.created_s >= self.release_gate.grace_s
                and not p.all_ids() & live
                for p in self.ledger.placements.values()
            )
        if not waiting:
            return set()
        try:
            entries = checkpoint.read(self.kubelet_checkpoint)
        except (OSError, ValueError):
            return set()
        return {d for e in entries for d in e.ids()}

    def _mounted_key(self, ids: frozenset[DeviceId]) -> str | None:
        """The key the kubelet's checkpoint says the container holding `ids`
        mounts, unless another placement holds that key."""
        if self.kubelet_checkpoint is None:
            return None
        try:
            entries = checkpoint.read(self.kubelet_checkpoint)
        except (OSError, ValueError) as exc:
            log.warning("cannot read the kubelet's checkpoint %s: %s", self.kubelet_checkpoint, exc)
            return None
        key = checkpoint.mounted_key(entries, ids, self.store.root)
        return key if key is not None and key not in self.ledger.placements else None

    def _annotate(self, namespace: str, pod: str) -> None:
        with self._lock:
            mine = {
                p.owner.container: {
                    "cards": list(p.cards),
                    "core": p.core_percent,
                    "memory_mib": p.memory_mib,
                    "key": p.key,
                }
                for p in self.ledger.placements.values()
                if p.owner is not None and p.owner.namespace == namespace and p.owner.pod == pod
            }
        if not mine:
            return
        key = placements_key(self.options.domain)
        value = json.dumps(mine, sort_keys=True)
        if self.pods.annotations(namespace, pod).get(key) == value:
            return  # the API server has it (as the pod cache sees it)
        queued_s = self._annotated.get((namespace, pod, value))
        now = time.monotonic()
        if queued_s is not None and now - queued_s < ANNOTATE_RETRY_S:
            return  # queued a moment ago; the patch may still be on its way
        self._annotated[(namespace, pod, value)] = now
        self.pods.annotate(namespace, pod, {key: value})

    def recover(self) -> None:
        """Rebuild the ledger from our records, then check them with the kubelet."""
        placements, bad = self.store.recover()
        self._recovered = len(placements)
        with self._lock:
            for placement in placements:
                self.ledger.restore(placement)
            # Every Allocate of the previous run either reached the kubelet or
            # failed: a recovered placement the kubelet does not list is dead.
            self.ledger.mark_settled(p.key for p in placements)
            for placement in placements:
                try:
                    # Rewrites a CDI spec that a reboot took away (cdi_dir is often tmpfs).
                    self.answer(placement)
                except OSError as exc:
                    log.warning("cannot hand %s over again: %s", placement.key, exc)
            self._republish_if_legacy_changed()
        log.info(
            "recovered %d placement(s) from %s (%d unreadable)",
            len(placements),
            self.store.root,
            len(bad),
        )
        self.events("recovery", {"placements": len(placements), "unreadable": len(bad)})
        if self.reconcile("start-up") < 0:
            log.warning(
                "could not check the recovered placements with the kubelet; keeping them all"
            )


def _owner_alive(owner: Owner | None, alive: frozenset[str]) -> bool:
    """Does the API server show the owner's pod bound here and not terminated?
    By UID when known (a namesake is another pod), else by name."""
    if owner is None:
        return False
    if owner.pod_uid:
        return owner.pod_uid in alive
    return f"{owner.namespace}/{owner.pod}" in alive
