"""The scheduler extender's decisions: per-card use across the cluster, and
filter, prioritize and bind choices made with the node's own fit rules.

Pure and I/O-free. The extender feeds it what its watch caches see (nodes
with their published inventory, pods asking for vgpu resources with their
annotations) and its own in-flight assumptions, and holds a lock around it.

What a pod holds on a node, per container, from the best source known:

1. the node daemon's ``vgpu-placements`` annotation (the truth after
   admission);
2. else the extender's ``vgpu-assignment`` annotation, when it names the node
   the pod is bound to;
3. else (a pod bound by another scheduler, not admitted yet) the card the
   node's own policy would choose now.

A pod the extender has bound but the cache does not show bound yet is an
*assumption*: counted on its node until the cache shows it (bound anywhere)
or the bind fails. Finished and deleted pods hold nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from vgpu.core import fit
from vgpu.core.annotations import Assignment, NodeInventory, node_key
from vgpu.core.errors import InvalidRequest
from vgpu.core.fit import CardUsage, Hold, NoRoom, PodPlan
from vgpu.core.model import CORE_UNITS_PER_CARD, CardUuid, ContainerSpec, Policy, Request

MAX_SCORE = 10  # kube-scheduler's MaxExtenderPriority


@dataclass(frozen=True)
class PodInfo:
    """A pod that asks for vgpu resources, as the extender's cache keeps it."""

    uid: str
    namespace: str
    name: str
    node: str  # spec.nodeName; '' while unbound
    active: bool  # False once Succeeded or Failed
    specs: tuple[ContainerSpec, ...]
    assignment: Assignment | None = None
    placements: Mapping[str, tuple[CardUuid, ...]] = field(default_factory=dict)

    def cards_known(self) -> dict[str, tuple[CardUuid, ...]]:
        """Each container's card(s) where known: placements, else the assignment."""
        out: dict[str, tuple[CardUuid, ...]] = {}
        assigned = (
            self.assignment.containers
            if self.assignment is not None and self.assignment.node == self.node
            else {}
        )
        for spec in self.specs:
            # Annotations are writable by the pod's owner: a card list that is
            # not the container's own size is ignored, so that a forged one
            # counts no more than the pod's request (the node's policy places it).
            size = spec.request.whole_cards or 1
            for cards in (self.placements.get(spec.container), assigned.get(spec.container)):
                if cards and len(cards) == size and len(set(cards)) == size:
                    out[spec.container] = cards
                    break
        return out


class NodeUnusable(Exception):
    """The node cannot take vgpu pods at all (no inventory, no healthy card)."""


@dataclass(frozen=True)
class FilterVerdict:
    passed: list[str]
    failed: dict[str, str]  # preemption might help
    unresolvable: dict[str, str]  # it cannot


@dataclass(frozen=True)
class CardView:
    """One card for `vgpu status --cluster`."""

    usage: CardUsage
    pods: tuple[tuple[str, str, str], ...]  # (namespace, pod, container)


class _Node:
    """One node's cards and what every pod holds there."""

    def __init__(self, name: str, inventory: NodeInventory | None, problem: str) -> None:
        self.name = name
        self.inventory = inventory
        self.problem = problem
        self.holds: dict[str, Mapping[CardUuid, Hold]] = {}  # pod uid -> card -> hold
        self.cards_of: dict[str, Mapping[str, tuple[CardUuid, ...]]] = {}  # uid -> container
        self._totals: dict[CardUuid, list[int]] = {}  # card -> [core, mem, whole, holders]
        self._usages: tuple[CardUsage, ...] | None = None
        self._rooms: tuple[tuple[int, int, float, int, int], ...] | None = None
        self.fullness_sum = 0.0  # sum of each healthy card's fullness / 2 (set by rooms())
        self.healthy_count = 0
        self.empty_units: list[int] = []  # memory units of each healthy empty card
        # Answers for this node as it is now, per pod shape: filter verdicts and
        # prioritize scores. Cleared on every change of what the node holds.
        self.memo: dict[int, Any] = {}  # ClusterBook._memo_key -> answer
        self._profile: tuple[Any, ...] | None = None
        # The book's per-shape ranks hold an entry for this node: dropped on change.
        self.ranks: dict[int, dict[str, float]] = {}

    @property
    def unit(self) -> int:
        return self.inventory.memory_unit_mib if self.inventory else 256

    def profile(self) -> tuple[Any, ...]:
        """The node's cards as the fit rules see them when all are free."""
        if self._profile is None:
            inv = self.inventory
            unit = self.unit
            self._profile = (
                unit,
                inv.policy if inv else None,
                tuple((c.memory_units(unit), c.numa_node) for c in inv.cards if c.healthy)
                if inv
                else (),
            )
        return self._profile

    @property
    def healthy_cards(self) -> int:
        return len(self.profile()[2])

    def add(self, uid: str, plan: PodPlan) -> None:
        self.remove(uid)
        self.holds[uid] = dict(plan.holds)
        self.cards_of[uid] = dict(plan.cards)
        for card, hold in plan.holds.items():
            total = self._totals.setdefault(card, [0, 0, 0, 0])
            total[0] += hold.core
            total[1] += hold.memory_units
            total[2] += int(hold.whole)
            total[3] += hold.holders
        self._changed()

    def _changed(self) -> None:
        self._usages = self._rooms = None
        self.memo.clear()
        for ranks in self.ranks.values():
            ranks.pop(self.name, None)

    def remove(self, uid: str) -> None:
        holds = self.holds.pop(uid, None)
        self.cards_of.pop(uid, None)
        if holds is None:
            return
        for card, hold in holds.items():
            total = self._totals[card]
            total[0] -= hold.core
            total[1] -= hold.memory_units
            total[2] -= int(hold.whole)
            total[3] -= hold.holders
            if not any(total):
                del self._totals[card]
        self._changed()

    def usages(self) -> tuple[CardUsage, ...]:
        if self._usages is None:
            cards = self.inventory.cards if self.inventory else ()
            out = []
            for card in cards:
                core, mem, whole, holders = self._totals.get(card.uuid, (0, 0, 0, 0))
                out.append(CardUsage(card, min(core, CORE_UNITS_PER_CARD), mem, whole > 0, holders))
            self._usages = tuple(out)
        return self._usages

    def rooms(self) -> tuple[tuple[int, int, float, int, int], ...]:
        """(core free, memory free, fullness, index, memory units) of each healthy card
        not held whole: what the slice fast path of filter and prioritize reads."""
        if self._rooms is None:
            unit = self.unit
            rooms = []
            fullness = 0.0
            healthy = 0
            self.empty_units = []
            for u in self.usages():
                if not u.card.healthy:
                    continue
                healthy += 1
                fullness += u.fullness(unit) / 2
                if u.empty:
                    self.empty_units.append(u.card.memory_units(unit))
                if not u.exclusive:
                    rooms.append(
                        (
                            u.core_free(),
                            u.memory_free_units(unit),
                            u.fullness(unit),
                            u.card.index,
                            u.card.memory_units(unit),
                        )
                    )
            self._rooms = tuple(rooms)
            self.fullness_sum = fullness
            self.healthy_count = healthy
        return self._rooms

    def check_usable(self) -> NodeInventory:
        if self.inventory is None:
            raise NodeUnusable(self.problem)
        if not self.healthy_cards:
            raise NodeUnusable(
                "no healthy vgpu card on this node"
                if self.inventory.cards
                else "this node's vgpu daemon found no cards"
            )
        return self.inventory


def _slices(specs: Sequence[ContainerSpec]) -> list[Request] | None:
    """The requests of a pod whose containers are all app containers asking a
    fractional or memory-only slice (no init containers, no whole cards)."""
    out = []
    for spec in specs:
        request = spec.request
        if spec.init or request.whole_cards or (request.core_percent and not request.memory_units):
            return None
        out.append(request)
    return out or None


def _greedy(node: _Node, requests: Sequence[Request], binpack: bool) -> tuple[float, float] | None:
    """fit.place_pod for slices only, on the node's room index: each request in
    turn to the card fit.choose_fractional would take (the fullest that fits
    under binpack, the emptiest under spread, then the lowest index). Returns
    the chosen cards' mean fullness after (0-1) and the fullness the pod adds
    (0-2 per card), or None when a request fits no card."""
    if len(requests) == 1:  # the common case, without copying the index
        core, mem = requests[0].core_percent, requests[0].memory_units
        found: tuple[float, int, float, int] | None = None
        for core_free, mem_free, fullness, index, units in node.rooms():
            if core_free >= core and mem_free >= mem:
                key = (-fullness if binpack else fullness, index, fullness, units)
                if found is None or key < found:
                    found = key
        if found is None:
            return None
        step = core / CORE_UNITS_PER_CARD + mem / max(1, found[3])
        return (found[2] + step) / 2, step
    # core free, memory free, fullness, index, units
    rooms: list[list[Any]] = [list(r) for r in node.rooms()]
    touched: dict[int, float] = {}
    added = 0.0
    for request in requests:
        core, mem = request.core_percent, request.memory_units
        best = -1
        best_key: tuple[float, float] = (0.0, 0.0)
        for i, room in enumerate(rooms):
            if room[0] < core or room[1] < mem:
                continue
            rank = (-room[2] if binpack else room[2], room[3])
            if best < 0 or rank < best_key:
                best, best_key = i, rank
        if best < 0:
            return None
        room = rooms[best]
        units = max(1, room[4])
        room[0] -= core
        room[1] -= mem
        # From the integer amounts, as fit.choose_fractional computes it: a float
        # sum of steps can split a tie that the lowest index should break.
        after = (CORE_UNITS_PER_CARD - room[0]) / CORE_UNITS_PER_CARD + (room[4] - room[1]) / units
        added += after - room[2]
        room[2] = after
        touched[best] = after
    return sum(f / 2 for f in touched.values()) / len(touched), added


def _single_whole(specs: Sequence[ContainerSpec]) -> Request | None:
    """The request of a pod that is one whole-card container."""
    if len(specs) != 1 or not specs[0].request.whole_cards:
        return None
    request = specs[0].request
    if request.core_percent % CORE_UNITS_PER_CARD:
        return None  # invalid: the general path says why
    return request


def _shape(specs: Sequence[ContainerSpec]) -> tuple[Any, ...]:
    """What the answers for a pod depend on (not its name)."""
    return tuple(
        (s.container, s.init, s.order, s.request.core_percent, s.request.memory_units)
        for s in specs
    )


_PASS = ("pass", "")  # the one "fits" answer: filter tests it by identity
_NO_FIT = float("-inf")  # a node's rank in `choose` where the pod does not fit
MAX_RANKED_SHAPES = 64  # (policy, pod shape) pairs whose ranks `choose` keeps
_UNKNOWN = object()  # not in a node's memo yet (None is a memoised "does not fit")


class ClusterBook:
    """Every vgpu node's cards and what each pod holds on them."""

    def __init__(self, domain: str) -> None:
        self.domain = domain
        self.nodes: dict[str, _Node] = {}
        self.pods: dict[str, PodInfo] = {}  # uid -> active pods asking for vgpu
        self.assumed: dict[str, str] = {}  # uid -> node, bound by us, not yet seen bound
        self._assumed_specs: dict[str, tuple[ContainerSpec, ...]] = {}
        self._placed_on: dict[str, str] = {}  # uid -> node whose holds include it
        self._bound: dict[str, set[str]] = {}  # node -> uids of cached pods bound there
        # (pod shape, cards) -> the pod fits no such node even with every card free
        self._never: dict[tuple[Any, ...], bool] = {}
        # (verb, policy, pod shape) -> a small int naming it in the nodes' memos: a
        # pod shape is a nested tuple, and hashing it on every node of every
        # request cost more than the answers it looked up.
        self._memo_keys: dict[tuple[Any, ...], int] = {}
        self._last_memo_key = 0
        self._asked: dict[tuple[Any, ...], str] = {}  # (pod shape, unit) -> request text
        # (policy, pod shape) as a memo key -> {node name: the node's rank for the
        # picking filter}, shared by every node (see `choose`); each node drops
        # its entries when it changes, as it clears its memo.
        self._ranks: dict[int, dict[str, float]] = {}

    def _memo_key(self, question: tuple[Any, ...]) -> int:
        key = self._memo_keys.get(question)
        if key is None:
            if len(self._memo_keys) > 4096:
                self._memo_keys.clear()  # keys are never reused: old memo entries just miss
            self._last_memo_key += 1
            key = self._memo_keys[question] = self._last_memo_key
        return key

    # ------------------------------------------------------------ nodes

    def set_node(self, name: str, inventory: NodeInventory | None, problem: str = "") -> None:
        """A node's inventory appeared or changed (None: absent or unreadable, `problem` why)."""
        old = self.nodes.get(name)
        if old is not None and old.inventory == inventory and old.problem == problem:
            return
        fresh = _Node(name, inventory, problem)
        fresh.ranks = self._ranks
        self._forget_ranks(name)
        self.nodes[name] = fresh
        # Recount every pod bound or assumed here against the new cards; an
        # assumption keeps the cards chosen at bind.
        uids = self._bound.get(name, set()) | {u for u, n in self.assumed.items() if n == name}
        for uid in uids:
            self._placed_on.pop(uid, None)
            if uid not in self.assumed:
                self._place(uid)
            elif inventory is not None and old is not None and uid in old.cards_of:
                plan = fit.place_pod(
                    self._assumed_specs[uid],
                    fresh.usages(),
                    inventory.memory_unit_mib,
                    inventory.policy,
                    self.domain,
                    fixed=old.cards_of[uid],
                )
                fresh.add(uid, plan)
                self._placed_on[uid] = name

    def warm(self) -> None:
        """Build every node's room index now (after a listing), not in a request."""
        for node in self.nodes.values():
            if node.inventory is not None:
                node.rooms()

    def _forget_ranks(self, name: str) -> None:
        for ranks in self._ranks.values():
            ranks.pop(name, None)

    def remove_node(self, name: str) -> None:
        self._forget_ranks(name)
        node = self.nodes.pop(name, None)
        if node is not None:
            for uid in node.holds:
                self._placed_on.pop(uid, None)

    # ------------------------------------------------------------- pods

    def set_pod(self, pod: PodInfo) -> None:
        """A pod was added or changed (inactive pods and pods asking nothing are dropped)."""
        if not pod.active or not pod.specs:
            self.remove_pod(pod.uid)
            return
        old = self.pods.get(pod.uid)
        if old is not None and old.node != pod.node:
            self._bound.get(old.node, set()).discard(pod.uid)
        self.pods[pod.uid] = pod
        if pod.node:
            self._bound.setdefault(pod.node, set()).add(pod.uid)
        if pod.node and pod.uid in self.assumed:
            if self._confirm_assumption(pod):
                return
            self._drop_assumption(pod.uid)
        if pod.uid not in self.assumed:
            self._place(pod.uid)

    def remove_pod(self, uid: str) -> None:
        pod = self.pods.pop(uid, None)
        if pod is not None:
            self._bound.get(pod.node, set()).discard(uid)
        self._drop_assumption(uid)
        self._unplace(uid)

    def replace_pods(self, pods: Iterable[PodInfo]) -> None:
        """A fresh listing: pods missing from it are gone (and so are their assumptions)."""
        listed = {p.uid: p for p in pods}
        for uid in set(self.pods) | set(self.assumed):
            if uid not in listed:
                self.remove_pod(uid)
        for pod in listed.values():
            self.set_pod(pod)

    def _unplace(self, uid: str) -> None:
        name = self._placed_on.pop(uid, None)
        if name is not None and name in self.nodes:
            self.nodes[name].remove(uid)

    def _place(self, uid: str) -> None:
        """Count a cached pod on the node it is bound to."""
        self._unplace(uid)
        pod = self.pods.get(uid)
        if pod is None or not pod.node:
            return
        node = self.nodes.get(pod.node)
        if node is None or node.inventory is None:
            return
        inv = node.inventory
        known = pod.cards_known()
        try:
            plan = fit.place_pod(
                pod.specs, node.usages(), inv.memory_unit_mib, inv.policy, self.domain, fixed=known
            )
        except (NoRoom, InvalidRequest):
            # The node must have refused some container: count what is known.
            specs = tuple(s for s in pod.specs if s.container in known)
            plan = fit.place_pod(
                specs, node.usages(), inv.memory_unit_mib, inv.policy, self.domain, fixed=known
            )
        node.add(uid, plan)
        self._placed_on[uid] = pod.node

    # ------------------------------------------------------ assumptions

    def assume(
        self, uid: str, node_name: str, specs: Sequence[ContainerSpec], plan: PodPlan
    ) -> None:
        """The extender is binding this pod there: hold its room until the cache shows it."""
        self._unplace(uid)
        self.nodes[node_name].add(uid, plan)
        self._placed_on[uid] = node_name
        self.assumed[uid] = node_name
        self._assumed_specs[uid] = tuple(specs)

    def holds_cards(self, uid: str, node_name: str) -> Mapping[str, tuple[CardUuid, ...]] | None:
        """Each container's card(s) the pod holds on that node (None: it holds none)."""
        node = self.nodes.get(node_name)
        return node.cards_of.get(uid) if node is not None else None

    def forget(self, uid: str) -> None:
        """The bind failed: give the room back (the cached pod, if bound, is counted again)."""
        if uid in self.assumed:
            self._drop_assumption(uid)
            self._place(uid)

    def _confirm_assumption(self, pod: PodInfo) -> bool:
        """The cache shows our own bind: where it landed exactly as assumed (same
        node, specs and cards), the assumption's holds become the pod's placement
        as they are, without taking them off the node and placing them again
        (which would give the same holds, and clear the node's memo twice)."""
        uid = pod.uid
        node = self.nodes.get(pod.node)
        if (
            self.assumed.get(uid) != pod.node
            or self._placed_on.get(uid) != pod.node
            or node is None
            or node.inventory is None
            # What the holds depend on: the echo's specs also carry the
            # assignment's cards (`assigned`), the assumed ones do not.
            or _shape(self._assumed_specs.get(uid, ())) != _shape(pod.specs)
            or node.cards_of.get(uid) != pod.cards_known()
        ):
            return False
        del self.assumed[uid]
        del self._assumed_specs[uid]
        return True

    def _drop_assumption(self, uid: str) -> None:
        if self.assumed.pop(uid, None) is not None:
            self._assumed_specs.pop(uid, None)
            self._unplace(uid)

    # -------------------------------------------------------- decisions

    def _node(self, name: str) -> _Node:
        node = self.nodes.get(name)
        if node is None:
            raise NodeUnusable(self._missing())
        return node

    def plan(self, specs: Sequence[ContainerSpec], name: str) -> PodPlan:
        """Where the pod's containers would go on this node now (the node's policy).

        Raises NodeUnusable, NoRoom or InvalidRequest.
        """
        node = self._node(name)
        inv = node.check_usable()
        return fit.place_pod(specs, node.usages(), inv.memory_unit_mib, inv.policy, self.domain)

    def validate(self, specs: Sequence[ContainerSpec], unit_mib: int = 256) -> None:
        for spec in specs:
            fit.validate_request(spec.request, self.domain, unit_mib)

    def filter(self, specs: Sequence[ContainerSpec], names: Iterable[str]) -> FilterVerdict:
        verdict = FilterVerdict([], {}, {})
        shape = _shape(specs)
        key = self._memo_key(("filter", shape))
        kinds = _slices(specs), _single_whole(specs)
        nodes = self.nodes
        passed = verdict.passed.append
        for name in names:
            node = nodes.get(name)
            if node is None:
                answer: tuple[str, str] = ("never", f"vgpu: {self._missing()}")
            else:
                answer = node.memo.get(key) or self._judge(node, specs, key, shape, kinds)
            if answer is _PASS:  # the common case first: one identity test per node
                passed(name)
            elif answer[0] == "never":
                verdict.unresolvable[name] = answer[1]
            else:
                verdict.failed[name] = answer[1]
        return verdict

    def _judge(
        self,
        node: _Node,
        specs: Sequence[ContainerSpec],
        key: int,
        shape: tuple[Any, ...],
        kinds: tuple[list[Request] | None, Request | None],
    ) -> tuple[str, str]:
        """'pass', 'fail' (room may appear) or 'never', with the reason."""
        answer = _PASS
        slices, whole = kinds
        no_room: NoRoom | None = None
        usable = node.inventory is not None and node.healthy_cards > 0
        if usable and slices is not None:
            # The room index answers exactly what fit.place_pod would.
            assert node.inventory is not None
            if len(slices) == 1:
                core, mem = slices[0].core_percent, slices[0].memory_units
                fits = any(r[0] >= core and r[1] >= mem for r in node.rooms())
            else:
                fits = _greedy(node, slices, node.inventory.policy is Policy.BINPACK) is not None
            if fits:
                node.memo[key] = answer
                return answer
            no_room = NoRoom("no single card has that much free")
        elif usable and whole is not None:
            node.rooms()
            count = whole.whole_cards
            if len(node.empty_units) >= count and whole.memory_units <= count * min(
                node.empty_units, default=0
            ):
                node.memo[key] = answer
                return answer
            if len(node.empty_units) < count:
                no_room = NoRoom(f"only {len(node.empty_units)} card(s) are entirely free")
        try:
            if no_room is not None:
                raise no_room
            self.plan(specs, node.name)
        except (NodeUnusable, InvalidRequest) as exc:
            answer = ("never", f"vgpu: {exc.message if isinstance(exc, InvalidRequest) else exc}")
        except NoRoom as exc:
            reason, never = self._reason(specs, node.name, exc, shape)
            answer = ("never" if never else "fail", reason)
        node.memo[key] = answer
        return answer

    def _missing(self) -> str:
        return (
            f"no {node_key(self.domain)} annotation: vgpu serve is not running on this "
            f"node (or uses another resource domain than {self.domain})"
        )

    def _reason(
        self,
        specs: Sequence[ContainerSpec],
        name: str,
        exc: NoRoom,
        shape: tuple[Any, ...] | None = None,
    ) -> tuple[str, bool]:
        """One line for `kubectl describe pod`, and whether an empty node would not help."""
        node = self.nodes[name]
        inv = node.check_usable()
        unit = inv.memory_unit_mib
        # Whether the pod fits the node's cards when all are free depends on the
        # cards alone: nodes of one model share the answer.
        key = (shape or _shape(specs), node.profile())
        never = self._never.get(key)
        if never is None:
            empty = tuple(CardUsage(c, 0, 0, False, 0) for c in inv.cards)
            try:
                fit.place_pod(specs, empty, unit, inv.policy, self.domain)
                never = False
            except (NoRoom, InvalidRequest):
                never = True
            if len(self._never) > 4096:
                self._never.clear()
            self._never[key] = never
        asked = self._asked.get((key[0], unit))
        if asked is None:
            total = Request(
                sum(s.request.core_percent for s in specs if not s.init),
                sum(s.request.memory_units for s in specs if not s.init),
            )
            asked = fit.describe_request(total, self.domain, unit)
            if len(self._asked) > 4096:
                self._asked.clear()
            self._asked[(key[0], unit)] = asked
        if len(specs) == 1:
            where = fit.nearest_room(specs[0].request, node.usages(), unit)
            text = f"vgpu: no card fits {asked}: {where}"
        else:
            text = f"vgpu: the pod's containers ({asked}) do not fit the cards: {exc.why}"
        if never:
            text += " (even with every card free)"
        return text, never

    def prioritize(
        self, specs: Sequence[ContainerSpec], names: Iterable[str], policy: Policy
    ) -> list[tuple[str, int]]:
        """Score 0-10: binpack prefers the node and card left fullest, spread the emptiest."""
        key = self._memo_key(("prioritize", policy, _shape(specs)))
        kinds = _slices(specs), _single_whole(specs)
        out = []
        nodes = self.nodes
        for name in names:
            node = nodes.get(name)
            if node is None or node.inventory is None:
                out.append((name, 0))
                continue
            score = node.memo.get(key)
            if score is None:
                score = node.memo[key] = self._score(
                    self._fullness_after(node, specs, kinds=kinds), policy
                )
            out.append((name, score))
        return out

    def pick(self, specs: Sequence[ContainerSpec], names: Sequence[str], policy: Policy) -> str:
        """The one node the policy prefers among `names` (nodes the pod fits):
        binpack the fullest once the pod is placed, spread the emptiest. Ties
        go to the earliest in `names` (kube-scheduler rotates where its node
        list starts, so equal nodes take turns). Unlike prioritize's 0-10
        score, the comparison is exact: 0.51 full beats 0.49."""
        if len(names) < 2:
            return names[0] if names else ""
        key = self._memo_key(("fullness", _shape(specs)))
        kinds = _slices(specs), _single_whole(specs)
        nodes = self.nodes
        sign = 1.0 if policy is Policy.BINPACK else -1.0  # spread: the emptiest
        best, best_value = names[0], -2.0
        for name in names:
            node = nodes.get(name)
            if node is None:
                continue
            memo = node.memo
            fullness = memo.get(key, _UNKNOWN)
            if fullness is _UNKNOWN:
                if node.inventory is None:
                    continue
                fullness = memo[key] = self._fullness_after(node, specs, kinds=kinds)
            if fullness is not None and sign * fullness > best_value:
                best, best_value = name, sign * fullness
        return best

    def choose(
        self, specs: Sequence[ContainerSpec], names: Sequence[str], policy: Policy
    ) -> str | None:
        """`pick` over every node of `names`, skipping those the pod does not fit, in
        one pass: None when it fits none (then `filter` says why, node by node).

        It chooses what filter, then pick over the nodes that passed, would choose
        (the fullness is None exactly where filter fails a node), without judging
        or explaining the nodes that do not fit. Each node's rank for this pod
        shape and policy (its fullness after the pod, negated under spread; -inf
        where it does not fit or is unknown) is kept in one dict per shape, which
        a node leaves when it changes: the ranks of the nodes named are looked up
        and the best taken by C loops (map, max), and only nodes that changed
        since are worked out in Python. So the cost per node named is tens of
        nanoseconds, and a pod costs about the same at 100 nodes named as at 1,000."""
        key = self._memo_key(("rank", policy, _shape(specs)))
        ranks = self._ranks.get(key)
        if ranks is None:
            if len(self._ranks) >= MAX_RANKED_SHAPES:
                self._ranks.clear()  # the nodes' references see the same (now empty) dict
            ranks = self._ranks[key] = {}
        values = list(map(ranks.get, names))
        if None in values:
            fkey = self._memo_key(("fullness", _shape(specs)))
            kinds = _slices(specs), _single_whole(specs)
            sign = 1.0 if policy is Policy.BINPACK else -1.0  # spread: the emptiest
            nodes = self.nodes
            for i, value in enumerate(values):
                if value is not None:
                    continue
                name = names[i]
                node = nodes.get(name)
                rank = _NO_FIT
                if node is not None and node.inventory is not None:
                    memo = node.memo
                    fullness = memo.get(fkey, _UNKNOWN)
                    if fullness is _UNKNOWN:
                        fullness = memo[fkey] = self._fullness_after(node, specs, kinds=kinds)
                    if fullness is not None:
                        rank = sign * fullness
                if node is not None:
                    ranks[name] = rank  # an unknown node is not kept: set_node forgets it
                values[i] = rank
        if not values:
            return None
        rank_of = cast(Callable[[int], float], values.__getitem__)  # every one filled
        best = max(range(len(values)), key=rank_of)  # the first of equals
        return names[best] if values[best] != _NO_FIT else None

    @staticmethod
    def _score(fullness: float | None, policy: Policy) -> int:
        if fullness is None:
            return 0
        score = fullness if policy is Policy.BINPACK else 1.0 - fullness
        return max(0, min(MAX_SCORE, round(score * MAX_SCORE)))

    def _fullness_after(
        self,
        node: _Node,
        specs: Sequence[ContainerSpec],
        fast: bool = True,
        kinds: tuple[list[Request] | None, Request | None] | None = None,
    ) -> float | None:
        """Mean of the chosen card(s)' and the node's fullness once the pod is placed
        (0-1), the card(s) chosen as the node would; None where it does not fit.
        `fast` reads the node's room index for one-container pods (same answer)."""
        inv = node.inventory
        if inv is None:
            return None
        slices, whole = kinds or (_slices(specs), _single_whole(specs))
        unit = inv.memory_unit_mib
        if fast and slices is not None:
            placed = _greedy(node, slices, inv.policy is Policy.BINPACK)
            if placed is None:
                return None
            card_after, added = placed
            node_after = (node.fullness_sum + added / 2) / max(1, node.healthy_count)
            return (card_after + node_after) / 2
        if fast and whole is not None:
            # The cards fit.choose_whole would take: entirely free, so only what the
            # pod adds counts; when they are all of one size, which ones is moot.
            node.rooms()
            empty = node.empty_units
            count = whole.whole_cards
            if len(empty) < count:
                return None
            if len(set(empty)) == 1 and whole.memory_units <= count * empty[0]:
                sizes = [empty[0]] * count
            else:
                try:
                    chosen = fit.choose_whole(whole, node.usages(), unit, self.domain)
                except (NoRoom, InvalidRequest):
                    return None
                by_uuid = {u.card.uuid: u.card for u in node.usages()}
                sizes = [by_uuid[uuid].memory_units(unit) for uuid in chosen]
            left = whole.memory_units
            added = 0.0
            for units in sizes:
                mem = min(left, units)
                left -= mem
                added += (1 + mem / max(1, units)) / 2
            node_after = (node.fullness_sum + added) / max(1, node.healthy_count)
            return (added / len(sizes) + node_after) / 2
        try:
            plan = self.plan(specs, node.name)
        except (NodeUnusable, NoRoom, InvalidRequest):
            return None
        touched = plan.touched()
        healthy = [u for u in plan.usages if u.card.healthy]
        picked = [u for u in healthy if u.card.uuid in touched]
        card_after = sum(u.fullness(unit) / 2 for u in picked) / max(1, len(picked))
        node_after = sum(u.fullness(unit) / 2 for u in healthy) / max(1, len(healthy))
        return (card_after + node_after) / 2

    # ----------------------------------------------------------- views

    def node_cards(self, name: str) -> list[CardView]:
        node = self.nodes[name]
        on_card: dict[CardUuid, list[tuple[str, str, str]]] = {}
        for uid, containers in node.cards_of.items():
            pod = self.pods.get(uid)
            for container, cards in containers.items():
                for card in cards:
                    who = (pod.namespace, pod.name, container) if pod else ("", uid, container)
                    on_card.setdefault(card, []).append(who)
        return [CardView(u, tuple(sorted(on_card.get(u.card.uuid, ())))) for u in node.usages()]
