"""The scheduler extender's service: the ClusterBook behind a lock, fed by the
watch caches, answering filter, prioritize and bind.

filter and prioritize read only memory. With node_choice "extender" (the
default), filter answers the one node the policy picks and holds the pod's
room there (a pick), as kube-scheduler, seeing one feasible node, will bind
the pod there: the next pod's filter, which comes before this pod's bind,
then sees the room taken. A pick lasts until the bind, a later filter of the
same pod, the pod's deletion, or PICK_HOLD_S. bind serializes only the in-memory
part: under the book's lock it checks the pod still fits and records
an assumption (so parallel binding cycles never give the same room twice);
then, outside any lock, it makes one API call (a Binding whose metadata
carries the assignment annotation), and drops the assumption if it fails.
An assumption that succeeded is held until the pod cache shows the pod bound;
so is one whose Binding may still land (sent, then a timeout, a 500, 502 or
504), for at most UNSURE_HOLD_S, and the pod is not placed anew meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vgpu.adapters.extender_http import BindRequest, PodRequest
from vgpu.adapters.kube_cluster import Binder, BindError, pod_info
from vgpu.core.annotations import NodeInventory, format_assignment
from vgpu.core.errors import InvalidRequest
from vgpu.core.fit import NoRoom, PodPlan
from vgpu.core.model import ContainerSpec, Policy
from vgpu.core.scheduling import ClusterBook, FilterVerdict, NodeUnusable, PodInfo

log = logging.getLogger("vgpu.extender")

# How long a pick holds its room without a bind: kube-scheduler binds within
# its binding cycle (PreBind may wait for volumes); a pod it gave up on is
# filtered again (a new pick) or deleted (the watch drops it) long before.
PICK_HOLD_S = 30.0
# How long the room of a bind that may have landed (its Binding was sent, and
# timed out or got a 500, 502 or 504) stays held while the pod cache does not
# show the pod: the API server's default request timeout, after which it has
# given up.
UNSURE_HOLD_S = 60.0

NOT_SYNCED = (
    "vgpu extender: its caches are not synced with the API server yet (starting, or the API "
    "server is unreachable); the scheduler retries the pod"
)


@dataclass(frozen=True)
class _Pick:
    until: float  # monotonic seconds
    node: str
    specs: tuple[ContainerSpec, ...]
    plan: PodPlan


class ExtenderService:
    def __init__(
        self,
        domain: str,
        policy: Policy,
        binder: Binder,
        events: Callable[[str], None] | None = None,
        *,
        pick_node: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.domain = domain
        self.policy = policy
        # node_choice "extender": filter answers the one node the policy picks,
        # so kube-scheduler (one feasible node) skips scoring and prioritize.
        self.pick_node = pick_node
        self._clock = clock
        # pod uid -> (held until, node, specs, plan), oldest first
        self._picks: OrderedDict[str, _Pick] = OrderedDict()
        self.binder = binder
        self.events = events or (lambda kind: None)
        self.book = ClusterBook(domain)
        self._lock = threading.Lock()
        self._binding: set[str] = set()  # pod uids with a bind in flight
        # pod uid -> held until (monotonic s): binds that may still land, oldest first
        self._unsure: OrderedDict[str, float] = OrderedDict()
        self._synced: dict[str, bool] = {"nodes": False, "pods": False}
        self._ever_synced: dict[str, bool] = {"nodes": False, "pods": False}
        self._ready = False  # both were synced once: it never turns back

    # ------------------------------------------------------ cache sink

    def synced(self, kind: str, ok: bool) -> None:
        with self._lock:
            self._synced[kind] = ok
            self._ever_synced[kind] = self._ever_synced[kind] or ok
            self._ready = all(self._ever_synced.values())

    def ready(self) -> bool:
        """Both caches were complete once: answers come from them even while the API
        server is down (they only miss what happened since)."""
        return self._ready  # read on every request: one attribute, no lock

    def nodes_listed(self, nodes: dict[str, tuple[NodeInventory | None, str]]) -> None:
        with self._lock:
            for name in set(self.book.nodes) - set(nodes):
                self.book.remove_node(name)
            for name, (inventory, problem) in nodes.items():
                if inventory is not None or name in self.book.nodes:
                    self.book.set_node(name, inventory, problem)

    def node_changed(self, name: str, inventory: NodeInventory | None, problem: str) -> None:
        with self._lock:
            before = self.book.nodes.get(name)
            if inventory is None and before is None:
                return  # not a vgpu node: nothing to keep
            self.book.set_node(name, inventory, problem)
        if before is None or before.inventory != inventory:
            log.info(
                "node %s: %s",
                name,
                f"{len(inventory.cards)} card(s), {sum(c.healthy for c in inventory.cards)} healthy"
                if inventory is not None
                else problem,
            )

    def node_deleted(self, name: str) -> None:
        with self._lock:
            self.book.remove_node(name)

    def pods_listed(self, pods: list[PodInfo]) -> None:
        with self._lock:
            self.book.replace_pods(pods)
            self.book.warm()

    def pod_changed(self, pod: PodInfo) -> None:
        with self._lock:
            self.book.set_pod(pod)
            if pod.node:
                self._unsure.pop(pod.uid, None)  # where it landed is known now

    def pod_deleted(self, uid: str) -> None:
        with self._lock:
            self.book.remove_pod(uid)
            self._unsure.pop(uid, None)

    # ------------------------------------------------------------ verbs

    def filter(self, pod: PodRequest, nodes: Sequence[str]) -> FilterVerdict | str:
        if not pod.specs:  # asks no vgpu resource (no managedResources configured)
            return FilterVerdict(list(nodes), {}, {})
        if not self.ready():
            return NOT_SYNCED
        with self._lock:
            if self._still_unsure(pod.uid):
                return self._unsure_text(f"pod {pod.namespace}/{pod.name}")
            if not self.pick_node:
                return self.book.filter(pod.specs, nodes)
            self._expire_picks()
            self._drop_pick(pod.uid)  # a pod filtered again: its earlier pick is moot
            cached = self.book.pods.get(pod.uid)
            if cached is not None and cached.node:
                return self.book.filter(pod.specs, nodes)  # bound: hold nothing
            chosen = self.book.choose(pod.specs, nodes, self.policy)
            if chosen is None:
                verdict = self.book.filter(pod.specs, nodes)
                if not verdict.passed:
                    return verdict  # nothing fits: each node's reason
                chosen = self.book.pick(pod.specs, verdict.passed, self.policy)
            try:
                plan = self.book.plan(pod.specs, chosen)
            except (NodeUnusable, NoRoom, InvalidRequest):
                return self.book.filter(pod.specs, nodes)  # cannot happen for a node that fits
            self.book.assume(pod.uid, chosen, pod.specs, plan)
            self._picks[pod.uid] = _Pick(self._clock() + PICK_HOLD_S, chosen, pod.specs, plan)
            # The one node; the others are left out, neither failed nor unresolvable
            # (kube-scheduler reads those only when no node passes, to say why and
            # where preemption might help): the answer is the same size at 10 nodes
            # or 5,000, and no node that does not fit is judged or explained.
            return FilterVerdict([chosen], {}, {})

    def _expire_picks(self) -> None:
        """Give back the room of picks no bind came for (under _lock)."""
        now = self._clock()
        while self._picks:
            uid, pick = next(iter(self._picks.items()))
            if pick.until > now:
                return
            self._drop_pick(uid)

    def _drop_pick(self, uid: str) -> None:
        """Give back a pick's room (under _lock): nothing if `uid` has no pick."""
        if self._picks.pop(uid, None) is not None:
            self.book.forget(uid)

    def _still_unsure(self, uid: str) -> bool:
        """Whether a bind of `uid` may still land (under _lock); expired holds end
        here, giving their room back."""
        now = self._clock()
        while self._unsure:
            oldest, until = next(iter(self._unsure.items()))
            if until > now:
                break
            del self._unsure[oldest]
            self.book.forget(oldest)
        return uid in self._unsure

    @staticmethod
    def _unsure_text(who: str) -> str:
        return (
            f"vgpu: the last bind of {who} may still land (its Binding was sent and no "
            f"answer came back), so its room stays held until the pod cache shows the pod, "
            f"at most {UNSURE_HOLD_S:.0f} s; the scheduler retries the pod"
        )

    def prioritize(self, pod: PodRequest, nodes: Sequence[str]) -> list[tuple[str, int]]:
        if not pod.specs or not self.ready():
            return [(n, 0) for n in nodes]
        with self._lock:
            return self.book.prioritize(pod.specs, nodes, self.policy)

    def bind(self, request: BindRequest) -> str:
        who = f"pod {request.namespace}/{request.name}"
        if not self.ready():
            return NOT_SYNCED
        with self._lock:
            if request.uid in self._binding:
                return f"vgpu: a bind of {who} is already in progress; retry"
            self._binding.add(request.uid)
        try:
            return self._bind(request, who)
        finally:
            with self._lock:
                self._binding.discard(request.uid)

    def _bind(self, request: BindRequest, who: str) -> str:
        with self._lock:
            if self._still_unsure(request.uid):
                return self._unsure_text(who)
            cached = self.book.pods.get(request.uid)
        if cached is None:
            # Not in the cache yet (the watch lags the scheduler's own): ask once.
            try:
                raw = self.binder.read_pod(request.namespace, request.name)
            except BindError as exc:
                return f"vgpu: cannot bind {who}: {exc}"
            if raw is None:
                return f"vgpu: cannot bind {who}: it no longer exists"
            cached = pod_info(raw, self.domain)
            if cached.uid != request.uid:
                return f"vgpu: cannot bind {who}: its UID is now {cached.uid} (recreated)"
        if cached.node:
            return f"vgpu: {who} is already bound to node {cached.node}"
        # The critical section covers only the in-memory plan and assumption
        # (microseconds): the API call runs outside it, so binds to one node
        # proceed at once, and the assumption, made in the same section as the
        # plan, keeps any of them from being given the same room.
        with self._lock:
            pick = self._picks.pop(request.uid, None)
            if (
                pick is not None
                and pick.node == request.node
                and pick.specs == cached.specs
                and self.book.assumed.get(request.uid) == request.node
                and self.book.holds_cards(request.uid, request.node) == dict(pick.plan.cards)
            ):
                plan = pick.plan  # held since the filter: the pick becomes the bind's
            else:
                if pick is not None:
                    self.book.forget(request.uid)  # elsewhere: give the pick's room back
                try:
                    plan = self.book.plan(cached.specs, request.node)
                except (NodeUnusable, NoRoom, InvalidRequest) as exc:
                    why = exc.why if isinstance(exc, NoRoom) else str(exc)
                    self.events("bind_refused")
                    log.info("bind of %s to %s refused: %s", who, request.node, why)
                    return f"vgpu: {who} no longer fits on node {request.node}: {why}"
                self.book.assume(request.uid, request.node, cached.specs, plan)
        assignment = format_assignment(request.node, plan.cards)
        try:
            self.binder.bind(request.namespace, request.name, request.uid, request.node, assignment)
        except BindError as exc:
            with self._lock:
                if not exc.maybe_landed:
                    self.book.forget(request.uid)
                elif request.uid in self.book.assumed:
                    # It may land later, with this assignment: giving the room
                    # back now could give these cards to another pod as well.
                    # (Not assumed any more: the watch has shown the pod already.)
                    self._unsure[request.uid] = self._clock() + UNSURE_HOLD_S
            self.events("bind_failed")
            log.warning(
                "bind of %s to %s failed%s: %s",
                who,
                request.node,
                " and may still land (its room stays held)" if exc.maybe_landed else "",
                exc,
            )
            return f"vgpu: binding {who} to {request.node} failed: {exc}"
        self.events("bound")
        # One line per pod at debug: at hundreds of binds a second, info would
        # be mostly this line (vgpu_extender_binds{outcome="bound"} counts them).
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "bound %s to %s: %s",
                who,
                request.node,
                ", ".join(f"{c} -> {','.join(cards)}" for c, cards in sorted(plan.cards.items())),
            )
        return ""

    # ----------------------------------------------------------- views

    def counts(self) -> dict[str, int]:
        with self._lock:
            self._expire_picks()  # the gauge shows no room held past its time
            self._still_unsure("")
            # Picks are assumptions too; they are counted on their own. A pick
            # whose assumption is gone (the pod was deleted) holds nothing.
            picked = len(self._picks.keys() & self.book.assumed)
            return {
                "nodes": sum(1 for n in self.book.nodes.values() if n.inventory is not None),
                "pods": len(self.book.pods),
                "assumed": len(self.book.assumed) - picked,
                "picked": picked,
            }
