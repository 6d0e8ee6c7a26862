"""The DRA service: cards and health in, the node's ResourceSlice out; prepared
claims (limit configs, CDI specs, records) for the kubelet's DRA calls.

It implements the DRA edge's DraCore port. Prepare reads the claim (cache,
then the API) without the lock, then decides and writes under it: the claim
record first, then the limit configs and the CDI spec, so a crash at any point
leaves a record to finish from (the next prepare, or start-up) or to undo.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vgpu.adapters.devnodes import HostDevices
from vgpu.adapters.dra.cdi import CdiDir, spec_document
from vgpu.adapters.dra.kube import ClaimLookupError, ClaimSource, ClaimUsers, SlicePort
from vgpu.adapters.dra.plugin import Prepared
from vgpu.adapters.dra.state import ClaimRecord, ClaimStore, sweep_temp_files
from vgpu.adapters.fs import ContainerStore
from vgpu.adapters.gpus import CardReading
from vgpu.adapters.kube_events import EventSink, NoEvents
from vgpu.adapters.nodefile import node_document, write_node_file
from vgpu.core.arbiter import CARD_PERCENT, default_core_cap
from vgpu.core.contract import (
    ContainerEdits,
    container_edits,
    wanted_nodes,
    with_hook_injection,
)
from vgpu.core.dra import (
    AllocatedDevice,
    ClaimRef,
    ClaimView,
    DeviceHealthReport,
    Grant,
    PreparedDevice,
    allocation_signature,
    cdi_device_names,
    claim_containers,
    claim_core_limit,
    claim_key,
    claim_view,
    device_name,
    device_status,
    driver_name,
    grants,
    health_reports,
    slice_devices,
)
from vgpu.core.errors import InvalidRequest, VgpuError
from vgpu.core.health import HealthEvent, HealthTracker, describe_xid
from vgpu.core.model import Card, CardUuid, Owner, Placement
from vgpu.daemon.service import install_or_refuse

log = logging.getLogger("vgpu")


def _cap_text(cap: int | None) -> str:
    return f" (burst cap {cap}%)" if cap is not None else ""


@dataclass(frozen=True)
class DraOptions:
    domain: str
    node: str
    memory_unit_mib: int
    ignored_xids: tuple[int, ...]
    hook_path: Path | None = None
    context_overhead_mib: int = 0  # per-card context estimate passed to the hook
    hook_injection: str = "ld-so-preload"  # also mount /etc/ld.so.preload (or "env" only)
    default_core_limit_percent: int | None = None  # burst cap without a claim coreLimit

    @property
    def driver(self) -> str:
        return driver_name(self.domain)


class DraService:
    def __init__(
        self,
        options: DraOptions,
        store: ContainerStore,
        records: ClaimStore,
        cdi: CdiDir,
        claims: ClaimSource,
        slices: SlicePort,
        node_file: Path | None = None,
        clock: Callable[[], float] = time.time,
        events: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.options = options
        self.store = store
        self.records = records
        self.cdi = cdi
        self.claims = claims
        self.slices = slices
        self.node_file = node_file
        self.clock = clock
        self.events = events or (lambda kind, fields: None)
        self.tracker = HealthTracker(options.ignored_xids)
        self.cards: dict[CardUuid, Card] = {}
        self.prepared: dict[str, ClaimRecord] = {}
        self.readings: dict[CardUuid, CardReading] = {}
        self._lock = threading.RLock()  # cards, prepared, the lock table: never held for I/O
        self._claim_locks: dict[str, threading.Lock] = {}
        self.hook_installer: Callable[[], Path] | None = None
        self._hook_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="prepare")
        # The host's device nodes (None: none checked, none named); set by the daemon.
        self.devices: HostDevices | None = None
        # The kubelet's health stream: a version bumped on every publish.
        self._health = threading.Condition()
        self._health_version = 0
        self._health_since: dict[str, tuple[bool, int]] = {}
        self._closed = False
        # Pods (which containers use a claim) and claim status; None: neither.
        self.users: ClaimUsers | None = None
        self._status_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="claim-status")
        # Warning Events about a claim's pod (a bad coreLimit); the log only by default.
        self.warn: EventSink = NoEvents()
        self._caps: dict[str, int] = {}  # placement key -> burst cap, of prepared claims

    # ------------------------------------------------------------ cards

    def set_cards(self, cards: Sequence[Card]) -> None:
        with self._lock:
            before = self.cards
            self.cards = {c.uuid: self._judge_nodes(self.tracker.judge(c)) for c in cards}
            for card in self.cards.values():
                self._log_health(before.get(card.uuid), card)
            for uuid in set(before) - set(self.cards):
                log.error("card %s disappeared; its device leaves the ResourceSlice", uuid)
                self.events("card_gone", {"card": uuid})
            self._publish()

    def on_event(self, event: HealthEvent) -> None:
        with self._lock:
            card = self.cards.get(event.card)
            if card is None:
                return
            updated = self.tracker.apply(card, event)
            if updated is card:
                return
            self.cards = {**self.cards, card.uuid: updated}
            self._log_health(card, updated)
            self._publish()

    def _judge_nodes(self, card: Card) -> Card:
        return card if self.devices is None else self.devices.judge(card)

    def check_device_nodes(self) -> None:
        """Re-check every card's own device node (periodic); publish on change."""
        with self._lock:
            before = self.cards
            after = {u: self._judge_nodes(c) for u, c in before.items()}
            if all(after[u] is before[u] for u in before):
                return
            self.cards = after
            for card in after.values():
                self._log_health(before[card.uuid], card)
            self._publish()

    def _log_health(self, before: Card | None, after: Card) -> None:
        if before is None and after.problem:
            log.error("card %s (%s) unhealthy: %s", after.uuid, device_name(after), after.problem)
        if before is None or before.healthy == after.healthy:
            return
        if after.healthy:
            log.info(
                "card %s (%s) is healthy again, published again", after.uuid, device_name(after)
            )
            self.events("card_healthy", {"card": after.uuid})
        else:
            why = (
                f"XID {after.xid} ({describe_xid(after.xid)})"
                if after.xid
                else after.problem or "unhealthy"
            )
            log.error(
                "card %s (%s) unhealthy: %s; tainted NoSchedule in the ResourceSlice; claims "
                "on it: %s",
                after.uuid,
                device_name(after),
                why,
                ", ".join(self._claims_on(after.uuid)) or "none",
            )
            self.events("card_unhealthy", {"card": after.uuid, "xid": after.xid})

    def _claims_on(self, uuid: CardUuid) -> list[str]:
        return [
            r.claim.shown
            for r in self.prepared.values()
            if any(uuid in p.cards for p in r.placements)
        ]

    def _publish(self) -> None:
        devices = slice_devices(
            list(self.cards.values()),
            self.options.memory_unit_mib,
            taint_key=f"{self.options.driver}/unhealthy",
        )
        self.slices.publish(devices)
        self._write_node_file()
        now = int(self.clock())
        with self._health:
            self._health_since = {
                uuid: (card.healthy, now)
                if self._health_since.get(uuid, (None, 0))[0] != card.healthy
                else self._health_since[uuid]
                for uuid, card in self.cards.items()
            }
            self._health_version += 1
            self._health.notify_all()

    def health(self) -> tuple[int, list[DeviceHealthReport]]:
        """(version, every card's health) for the kubelet's DRA health stream."""
        with self._lock:
            cards = list(self.cards.values())
        with self._health:
            since = {uuid: at for uuid, (_, at) in self._health_since.items()}
            version = self._health_version
        return version, health_reports(cards, self.options.node, since)

    def wait_health(self, version: int, timeout_s: float) -> int:
        """Block until the health changes from `version` (or the timeout, or close)."""
        with self._health:
            self._health.wait_for(
                lambda: self._health_version != version or self._closed, timeout_s
            )
            return self._health_version

    def close(self) -> None:
        """Shutdown: every health stream ends at once."""
        with self._health:
            self._closed = True
            self._health.notify_all()

    def set_readings(self, readings: dict[CardUuid, CardReading]) -> None:
        with self._lock:
            if readings == self.readings:
                return
            self.readings = dict(readings)
            self._write_node_file()

    def _write_node_file(self) -> None:
        if self.node_file is None:
            return
        document = node_document(
            self.cards.values(),
            self.readings,
            domain=self.options.domain,
            memory_unit_mib=self.options.memory_unit_mib,
            now_s=self.clock(),
            extra={"mode": "dra", "driver": self.options.driver},
        )
        write_node_file(self.node_file, document)

    # ---------------------------------------------------------- prepare

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, Prepared]:
        """Each claim on its own (a pod's claims in parallel: their files are
        disjoint, and most of the time goes to fsync, which frees the GIL)."""
        unique = list({ref.uid: ref for ref in claims}.values())
        if len(unique) == 1:
            return {unique[0].uid: self._answer(unique[0])}
        return dict(zip([r.uid for r in unique], self._pool.map(self._answer, unique), strict=True))

    def _answer(self, ref: ClaimRef) -> Prepared:
        try:
            ref.check()
            return Prepared(devices=self._prepare_one(ref))
        except VgpuError as exc:
            return self._refuse(ref, exc.message)
        except ClaimLookupError as exc:
            return self._refuse(ref, str(exc))
        except OSError as exc:
            return self._refuse(
                ref,
                f"cannot write the claim's files ({exc.strerror or exc}); check the state "
                f"directory and {self.cdi.directory} on this node",
            )

    def _claim_lock(self, uid: str) -> threading.Lock:
        """One lock per claim: its prepare and unprepare never overlap."""
        with self._lock:
            lock = self._claim_locks.get(uid)
            if lock is None:
                lock = self._claim_locks[uid] = threading.Lock()
            return lock

    def _refuse(self, ref: ClaimRef, message: str) -> Prepared:
        log.warning("cannot prepare claim %s (%s): %s", ref.shown, ref.uid[:64], message)
        self.events("prepare_error", {"claim": ref.uid})
        return Prepared(error=message)

    def _prepare_one(self, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
        view = claim_view(self.claims.get(ref.namespace, ref.name, ref.uid))
        mine = [r for r in view.results if r.driver == self.options.driver]
        pod = None
        if self.users is not None and view.pods:
            pod = self.users.pod(ref.namespace, view.pods[0][0])
        signature = allocation_signature(mine)
        with self._claim_lock(ref.uid):
            with self._lock:
                known = self.prepared.get(ref.uid)
                cards = {device_name(c): c for c in self.cards.values()}
            if known is not None and known.signature == signature:
                self._ensure_files(known)
                return known.devices
            given = grants(
                view.results,
                driver=self.options.driver,
                pool=self.options.node,
                cards=cards,
                memory_unit_mib=self.options.memory_unit_mib,
            )
            for grant in given:
                for card in grant.cards:
                    if not card.healthy:
                        why = f"XID {card.xid}" if card.xid else "reported unhealthy"
                        raise InvalidRequest(
                            f"request {grant.request!r} got {device_name(card)} ({card.uuid}), "
                            f"which is unhealthy ({why}); delete the pod so that its claim is "
                            "allocated on a healthy card"
                        )
            if any(not grant.whole for grant in given):
                self.ensure_hook()
            caps, problems = self._core_caps(view, given)
            record = self._record(ref, view, mine, given, cards, signature, pod, caps)
            if known is not None:  # allocated anew under the same UID: drop the old files
                self._remove_files(known, keep=record)
            self.records.write(record)  # first: a crash from here on leaves a record
            self._write_files(record)
            with self._lock:
                self._remember(record, known)
        self._write_status(ref, record)
        self._warn_core_limits(ref, view, record, problems)
        for grant in given:
            log.info(
                "prepared claim %s request %s for pod %s on %s: %s",
                ref.shown,
                grant.request,
                ", ".join(name for name, _ in view.pods) or "(none yet)",
                ",".join(device_name(c) for c in grant.cards),
                "whole card"
                if grant.whole
                else f"core {grant.core_percent}%{_cap_text(record.core_cap(grant.request))}, "
                f"memory {grant.memory_mib} MiB",
            )
        self.events("prepared", {"claim": ref.uid})
        return record.devices

    def _record(
        self,
        ref: ClaimRef,
        view: ClaimView,
        mine: list[AllocatedDevice],
        given: list[Grant],
        cards: Mapping[str, Card],
        signature: str,
        pod: dict[str, Any] | None = None,
        core_caps: tuple[tuple[str, int], ...] = (),
    ) -> ClaimRecord:
        now = self.clock()
        placements: dict[str, Placement] = {}
        for grant in given:
            owner = None
            if view.pods:  # the pod (and its containers) that use the request, as in config.json
                name, uid = view.pods[0]
                containers = claim_containers(pod, ref.name, grant.request)
                owner = Owner(ref.namespace, name, ",".join(containers), uid)
            placements[grant.request] = Placement(
                key=claim_key(ref.uid, grant.request),
                cards=tuple(c.uuid for c in grant.cards),
                ids={},
                core_percent=grant.core_percent,
                memory_mib=grant.memory_mib,
                owner=owner,
                created_s=now,
            )
        hook = self.options.hook_path
        edits: dict[str, ContainerEdits] = {}
        devices = []
        for result, name in zip(mine, cdi_device_names(ref.uid, mine), strict=True):
            placement = placements[result.request]
            paths = self.store.paths(placement.key)
            card = cards[result.device]
            nodes = wanted_nodes([card])
            edits[name] = with_hook_injection(
                container_edits(
                    placement,
                    [card],
                    config_dir=str(paths.config_dir),
                    shared_dir=str(paths.shared_dir),
                    hook_path=str(hook) if hook is not None else None,
                    context_overhead_mib=self.options.context_overhead_mib,
                    present_nodes=self.devices.present(nodes) if self.devices is not None else (),
                ),
                str(hook) if hook is not None else None,
                self.options.hook_injection,
            )
            devices.append(
                PreparedDevice(
                    request=result.request,
                    pool=result.pool,
                    device=result.device,
                    cdi_ids=(self.cdi.qualified(name),),
                    share_id=result.share_id,
                )
            )
        return ClaimRecord(
            claim=ref,
            pods=view.pods,
            signature=signature,
            placements=tuple(placements.values()),
            devices=tuple(devices),
            cdi_file=self.cdi.file_name(ref.uid),
            cdi_spec=spec_document(self.cdi.kind, edits),
            created_s=now,
            core_caps=core_caps,
        )

    # ------------------------------------------------------- burst caps

    def _core_caps(
        self, view: ClaimView, given: Sequence[Grant]
    ) -> tuple[tuple[tuple[str, int], ...], list[tuple[str, str]]]:
        """Each fractional request's burst cap from the allocation's opaque config
        (fixed from here on: a claim's config cannot change once allocated), and
        the (request, problem) of every coreLimit that was ignored."""
        caps: list[tuple[str, int]] = []
        problems: list[tuple[str, str]] = []
        for grant in given:
            if grant.whole or not 0 < grant.core_percent < CARD_PERCENT:
                continue
            choice = claim_core_limit(
                view.config,
                self.options.domain,
                grant.request,
                grant.core_percent,
                self.options.default_core_limit_percent,
            )
            caps.append((grant.request, choice.cap_percent))
            problems += [(grant.request, problem) for problem in choice.problems]
        return tuple(caps), problems

    def _warn_core_limits(
        self,
        ref: ClaimRef,
        view: ClaimView,
        record: ClaimRecord,
        problems: Sequence[tuple[str, str]],
    ) -> None:
        """A Warning Event InvalidCoreLimit on the claim's pod for each ignored
        coreLimit, naming the claim, the request and the value (posted once per
        preparation; a claim's config never changes afterwards)."""
        for request, problem in problems:
            message = (
                f"ResourceClaim {ref.shown}, request {request!r}: {problem}; "
                f"its burst cap is {record.core_cap(request)}%"
            )
            if view.pods:
                pod, pod_uid = view.pods[0]
                self.warn.warn(ref.namespace, pod, pod_uid, "InvalidCoreLimit", message)
            else:
                log.warning("%s", message)

    def _remember(self, record: ClaimRecord, replaced: ClaimRecord | None = None) -> None:
        """Record a prepared claim and its caps (under self._lock)."""
        if replaced is not None:
            self._forget(replaced)
        self.prepared[record.claim.uid] = record
        for request, cap in record.core_caps:
            self._caps[claim_key(record.claim.uid, request)] = cap

    def _forget(self, record: ClaimRecord) -> None:
        for p in record.placements:
            self._caps.pop(p.key, None)

    def core_cap(self, placement: Placement) -> int:
        """The burst cap of a prepared request, for the compute arbiter: the one
        its claim's config gave, else (a record from before caps were kept) the
        cluster default, else its guarantee."""
        with self._lock:
            cap = self._caps.get(placement.key)
        if cap is None:
            return default_core_cap(placement.core_percent, self.options.default_core_limit_percent)
        return max(cap, placement.core_percent)

    def placements(self) -> list[Placement]:
        """Every prepared request's placement (the compute arbiter's containers)."""
        with self._lock:
            return [p for r in self.prepared.values() for p in r.placements]

    def _write_status(self, ref: ClaimRef, record: ClaimRecord) -> None:
        """The claim's status.devices (a Ready condition since the preparation;
        card UUID and granted limits in `data`), written in the background: the
        kubelet does not wait for it."""
        users = self.users
        if users is None:
            return
        by_request = {p.key: p for p in record.placements}
        with self._lock:
            uuids = {device_name(c): c.uuid for c in self.cards.values()}
        prepared_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created_s))
        entries = []
        for device in record.devices:
            placement = by_request[claim_key(ref.uid, device.request)]
            entries.append(
                device_status(
                    self.options.driver,
                    device,
                    uuids.get(device.device, ""),
                    placement.core_percent,
                    placement.memory_mib,
                    prepared_at,
                )
            )
        self._status_pool.submit(users.write, ref.namespace, ref.name, ref.uid, entries)

    def _write_files(self, record: ClaimRecord) -> None:
        for placement in record.placements:
            self.store.write(placement)
        self.cdi.write(record.cdi_file, record.cdi_spec)

    def _ensure_files(self, record: ClaimRecord) -> None:
        """Rewrite what a crash or a reboot (the CDI dir is often tmpfs) took away."""
        for placement in record.placements:
            if not self.store.paths(placement.key).config_file.exists():
                self.store.write(placement)
                log.warning(
                    "re-created the limit config %s of claim %s", placement.key, record.claim.shown
                )
        if self.cdi.read(record.cdi_file) != record.cdi_spec:
            self.cdi.write(record.cdi_file, record.cdi_spec)
            log.warning("re-wrote the CDI spec %s of claim %s", record.cdi_file, record.claim.shown)

    def _remove_files(self, record: ClaimRecord, keep: ClaimRecord | None = None) -> None:
        kept = {p.key for p in keep.placements} if keep is not None else set()
        if keep is None or keep.cdi_file != record.cdi_file:
            self.cdi.remove(record.cdi_file)
        for placement in record.placements:
            if placement.key not in kept:
                self.store.discard(placement.key)

    # -------------------------------------------------------- unprepare

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        out: dict[str, str] = {}
        for ref in claims:
            with self._claim_lock(ref.uid):
                with self._lock:
                    record = self.prepared.get(ref.uid)
                if record is None:
                    out[ref.uid] = ""  # never prepared here, or already undone
                    continue
                try:
                    self._remove_files(record)
                    self.records.remove(ref.uid)  # last: until here a retry finds the record
                except OSError as exc:
                    out[ref.uid] = f"cannot remove the claim's files: {exc.strerror or exc}"
                    log.warning("cannot unprepare claim %s: %s", ref.shown, exc)
                    continue
                with self._lock:
                    del self.prepared[ref.uid]
                    self._forget(record)
                    self._claim_locks.pop(ref.uid, None)
            out[ref.uid] = ""
            if self.users is not None:  # our status.devices entries go with the preparation
                self._status_pool.submit(self.users.write, ref.namespace, ref.name, ref.uid, [])
            log.info("unprepared claim %s (%s)", record.claim.shown, ref.uid)
            self.events("unprepared", {"claim": ref.uid})
        return out

    def ensure_hook(self) -> None:
        """Install the hook library if start-up could not (a full or read-only
        disk); StateUnwritable names the cause, and the claim is refused with it."""
        if self.hook_installer is None or self.options.hook_path is not None:
            return
        with self._hook_lock:
            if self.options.hook_path is not None:
                return
            hook = install_or_refuse(self.hook_installer)
            self.options = replace(self.options, hook_path=hook)

    # ---------------------------------------------------------- start-up

    def recover(self) -> None:
        """Load the prepared claims, finish or repair their files, sweep orphans."""
        self.store.prepare()
        sweep_temp_files(self.records.root)
        sweep_temp_files(self.cdi.directory, self.cdi.prefix)
        records, bad = self.records.load_all()
        with self._lock:
            for record in records:
                self._remember(record)
                try:
                    self._ensure_files(record)
                except OSError as exc:
                    log.warning("cannot repair claim %s: %s", record.claim.shown, exc)
            keys = {p.key for r in records for p in r.placements}
            for key in self.store.record_keys():
                if key not in keys:
                    self.store.discard(key)
                    log.info("removed orphaned limit config %s", key)
            files = {r.cdi_file for r in records}
            for name in self.cdi.names():
                if name not in files:
                    self.cdi.remove(name)
                    log.info("removed orphaned CDI spec %s", name)
        log.info(
            "recovered %d prepared claim(s) from %s (%d unreadable)",
            len(records),
            self.records.root,
            len(bad),
        )
        self.events("recovery", {"claims": len(records), "unreadable": len(bad)})
