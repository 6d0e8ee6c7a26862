"""The node daemon as compute arbiter: one control loop over this node's cards.

Every period (<= 100 ms) and for each card that holds fractional slices, the
arbiter reads the SM utilisation of every host pid on the card (NVML, the same
call the hook makes), adds it up per container (the host pids the container's
hooks recorded in their budget-file slots: this works across containers and
PID namespaces), runs the pure allocation of vgpu/core/arbiter.py and writes
each container's allowed share, with a fresh heartbeat sequence, into its
budget file. The hook's throttle follows that share; when the writes stop
(this daemon gone, or stuck) each hook falls back to its guarantee within
VGPU_ARBITER_STALE_MS (hooks/vgpu_shared.h), so a dead daemon never unlimits
anyone.

A container on several cards gets the smallest of its per-card allowances:
its hook runs one throttle for all its launches.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vgpu.adapters import budget
from vgpu.adapters.kube import KubePodCache, PodSource
from vgpu.adapters.kube_events import KubeEvents, NoEvents
from vgpu.config import Settings
from vgpu.core.arbiter import CARD_PERCENT, Settled, arbitrate_period, burst_cap
from vgpu.core.model import CardUuid, Owner, Placement
from vgpu.daemon.pidteller import HostPidTeller

log = logging.getLogger(__name__)

PERIOD_S = 0.1
# Per card: SM utilisation per host pid since the last call; {} = no new sample,
# None = this card cannot tell (the arbiter then writes nothing for it and its
# containers' hooks keep their guarantees).
ProcessUtilization = Callable[[CardUuid], Mapping[int, float] | None]


@dataclass(frozen=True)
class Arbitrated:
    """One container the arbiter looks after."""

    key: str
    budget_file: Path
    cards: tuple[CardUuid, ...]
    guarantee_percent: int
    cap_percent: int


@dataclass(frozen=True)
class ShareView:
    """What the arbiter decided for one container in its last period (percent)."""

    guarantee_percent: float
    cap_percent: float
    allowed_percent: float
    achieved_percent: float
    share_percent: float


@dataclass
class _State:
    allowed: dict[CardUuid, float] = field(default_factory=dict)
    share: dict[CardUuid, float] = field(default_factory=dict)
    settled: dict[CardUuid, Settled | None] = field(default_factory=dict)
    waits: int | None = None  # the hooks' throttle_waits counter last period


class Arbiter:
    """The per-node control loop (one thread, every card each period)."""

    def __init__(
        self,
        utilization: ProcessUtilization,
        containers: Callable[[], Sequence[Arbitrated]],
        period_s: float = PERIOD_S,
        on_period: Callable[[float, Mapping[str, ShareView]], None] | None = None,
        teller: HostPidTeller | None = None,
    ) -> None:
        self._utilization = utilization
        self._teller = teller
        self._containers = containers
        self.period_s = period_s
        self._on_period = on_period
        self._state: dict[str, _State] = {}
        self._views: dict[str, ShareView] = {}
        self._lock = threading.Lock()
        # A restarted daemon must not repeat the sequence a hook saw last.
        self._seq = int(time.time() * 1000) & ((1 << 40) - 1)
        self._refused: set[str] = set()

    def views(self) -> dict[str, ShareView]:
        with self._lock:
            return dict(self._views)

    def run(self, stop: threading.Event) -> None:
        next_at = time.monotonic()
        while not stop.is_set():
            try:
                self.step()
            except Exception:  # one bad period must not end arbitration
                log.exception("compute arbiter period failed")
            next_at += self.period_s
            delay = next_at - time.monotonic()
            if delay < 0:
                next_at = time.monotonic()
                delay = 0
            if stop.wait(delay):
                return

    def step(self) -> None:
        """One period: read, decide, write."""
        containers = [
            c for c in self._containers() if 0 < c.guarantee_percent < CARD_PERCENT and c.cards
        ]
        if self._teller is not None:  # before the pids are read: the newly told count now
            self._teller.tell([c.budget_file for c in containers])
        keys = {c.key for c in containers}
        for gone in set(self._state) - keys:
            del self._state[gone]
        self._refused &= keys
        by_card: dict[CardUuid, list[Arbitrated]] = {}
        for c in containers:
            for card in c.cards:
                by_card.setdefault(card, []).append(c)
        # Cards that cannot tell per-process utilisation are left alone, files unread.
        utils = {card: self._utilization(card) for card in by_card}
        seen = {c.key: c for card, ms in by_card.items() if utils[card] is not None for c in ms}
        pids = {key: budget.live_host_pids(c.budget_file) for key, c in seen.items()}
        throttled: dict[str, bool | None] = {}
        for key, c in seen.items():
            state = self._state.setdefault(key, _State())
            waits = budget.throttle_waits(c.budget_file)
            throttled[key] = None if waits is None or state.waits is None else waits != state.waits
            state.waits = waits
        allowed: dict[str, list[float]] = {}
        achieved_of: dict[str, float] = {}
        share_of: dict[str, float] = {}
        for card, members in by_card.items():
            util = utils[card]
            if util is None:
                continue
            achieved = [sum(util.get(p, 0.0) for p in pids[c.key] or ()) for c in members]
            states = [self._state.setdefault(c.key, _State()) for c in members]
            guarantees = [float(c.guarantee_percent) for c in members]
            caps = [float(max(c.cap_percent, c.guarantee_percent)) for c in members]
            period = arbitrate_period(
                guarantees,
                caps,
                achieved,
                [s.allowed.get(card, g) for s, g in zip(states, guarantees, strict=True)],
                [s.share.get(card, g) for s, g in zip(states, guarantees, strict=True)],
                [throttled[c.key] for c in members],
                [s.settled.get(card) for s in states],
            )
            shares, allowances = period.shares, period.allowed
            for c, s, a, sh, ach, st in zip(
                members, states, allowances, shares, achieved, period.settled, strict=True
            ):
                s.allowed[card] = a
                s.share[card] = sh
                s.settled[card] = st
                allowed.setdefault(c.key, []).append(a)
                achieved_of[c.key] = max(achieved_of.get(c.key, 0.0), ach)
                share_of[c.key] = max(share_of.get(c.key, 0.0), sh)
        views: dict[str, ShareView] = {}
        for c in containers:
            if c.key not in allowed:
                continue
            value = min(allowed[c.key])
            cap = max(c.cap_percent, c.guarantee_percent)
            self._seq += 1
            try:
                budget.write_arbiter(
                    c.budget_file,
                    self._seq,
                    round(value * 100),
                    c.guarantee_percent * 100,
                    cap * 100,
                    round(achieved_of[c.key] * 100),
                )
            except budget.OldFormat as exc:
                if c.key not in self._refused:
                    self._refused.add(c.key)
                    log.warning("compute arbiter: %s", exc)
                continue
            views[c.key] = ShareView(
                guarantee_percent=float(c.guarantee_percent),
                cap_percent=float(cap),
                allowed_percent=value,
                achieved_percent=achieved_of[c.key],
                share_percent=share_of[c.key],
            )
        with self._lock:
            self._views = views
        if self._on_period is not None:
            self._on_period(time.monotonic(), views)


# ---- the node daemon's view: its placements, their caps and budget files ----


class CapSource:
    """Each placed container's burst cap, from its pod's annotations (through the
    API cache: a change takes effect on the next period) or the cluster default.
    A bad annotation is reported once per pod and value (an Event naming it) and
    ignored."""

    def __init__(
        self,
        annotations: Callable[[str, str], Mapping[str, str]],
        domain: str,
        default_percent: int | None,
        warn: Callable[[str, str, str, str, str], None],
    ) -> None:
        self._annotations = annotations
        self._domain = domain
        self._default = default_percent
        self._warn = warn
        self._said: set[tuple[str, str, str]] = set()

    def cap(self, owner: Owner, guarantee_percent: int) -> int:
        try:
            annotations = self._annotations(owner.namespace, owner.pod)
        except Exception:  # the cache is the only source; no answer = no annotation
            annotations = {}
        choice = burst_cap(
            annotations, self._domain, owner.container, guarantee_percent, self._default
        )
        for problem in choice.problems:
            said = (owner.pod_uid or f"{owner.namespace}/{owner.pod}", owner.container, problem)
            if said not in self._said:
                self._said.add(said)
                self._warn(owner.namespace, owner.pod, owner.pod_uid, "InvalidCoreLimit", problem)
        return choice.cap_percent

    def placement_cap(self, placement: Placement) -> int:
        """The cap of a placed container (its guarantee while its owner is unknown)."""
        if placement.owner is None:
            return placement.core_percent
        return self.cap(placement.owner, placement.core_percent)


def placed_containers(
    placements: Callable[[], Sequence[Placement]],
    budget_file: Callable[[str], Path],
    cap: Callable[[Placement], int],
) -> Callable[[], list[Arbitrated]]:
    """The arbiter's container list from a daemon's placements: fractional
    compute slices only (whole cards and memory-only slices are not arbitrated).
    `cap` gives each one's burst cap: from the pod's annotations in device-plugin
    mode (CapSource.placement_cap), from the claim's opaque config in DRA mode."""

    def containers() -> list[Arbitrated]:
        out = []
        for p in placements():
            if p.whole or not 0 < p.core_percent < CARD_PERCENT:
                continue
            out.append(Arbitrated(p.key, budget_file(p.key), p.cards, p.core_percent, cap(p)))
        return out

    return containers


def arbiter_utilization(backend: object) -> ProcessUtilization | None:
    """The backend's per-process utilisation reader, or None (logged) where it has
    none (e.g. a mock file without it): no arbiter then, and hooks keep their
    guarantees as fixed caps. Both daemons (device plugin, DRA) start theirs so."""
    utilization: ProcessUtilization | None = getattr(backend, "process_utilization", None)
    if utilization is None:
        log.info(
            "compute arbiter off: the %s backend has no per-process utilisation; "
            "each container's compute limit stays its guarantee",
            getattr(backend, "name", "?"),
        )
    return utilization


def build_node_arbiter(
    settings: Settings,
    backend: object,
    placements: Callable[[], Sequence[Placement]],
    budget_file: Callable[[str], Path],
    pods: PodSource,
    stop: threading.Event,
) -> Arbiter | None:
    """The node daemon's arbiter, or None where the backend cannot read
    per-process utilisation (the mock backend): hooks then keep their guarantees."""
    utilization = arbiter_utilization(backend)
    if utilization is None:
        return None
    events: KubeEvents | NoEvents = NoEvents()
    if isinstance(pods, KubePodCache):
        events = KubeEvents(pods.client, settings.node_name)
        events.start(stop)
    caps = CapSource(
        pods.annotations, settings.resource_domain, settings.default_core_limit_percent, events.warn
    )
    return Arbiter(
        utilization,
        placed_containers(placements, budget_file, caps.placement_cap),
        teller=HostPidTeller.for_node(
            settings.host_proc_dir, getattr(backend, "process_memory", None)
        ),
    )
