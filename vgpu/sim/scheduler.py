"""A kube-scheduler stand-in that calls a scheduler extender over HTTP exactly as
kube-scheduler (1.36) does, for tests, the cluster demo and benchmarks.

Wire facts it follows (kube-scheduler's pkg/scheduler/extender.go):

* ``POST <urlPrefix>/<verb>`` with ``Content-Type: application/json``; the
  JSON uses the Go field names (no JSON tags): ExtenderArgs ``{Pod, Nodes,
  NodeNames}``, ExtenderFilterResult ``{Nodes, NodeNames, FailedNodes,
  FailedAndUnresolvableNodes, Error}``, HostPriorityList ``[{Host, Score}]``,
  ExtenderBindingArgs ``{PodName, PodNamespace, PodUID, Node}``,
  ExtenderBindingResult ``{Error}``. A non-200 answer is an error.
* nodeCacheCapable: the full Pod and ``NodeNames`` are sent, ``Nodes`` is
  null; otherwise ``Nodes`` is a NodeList and ``NodeNames`` null. A result
  naming a node that was not sent is an error.
* With managedResources, only pods asking for one of them (in requests or
  limits, of app or init containers) reach the extender, for every verb.
* A filter ``Error`` (or an HTTP failure) fails the scheduling attempt (the
  extender is not ignorable). Failed nodes' reasons appear in the pod's
  PodScheduled condition: ``0/N nodes are available: <count> <reason>, ...``.
* prioritize is called only when more than one node passes filter; each
  score (0-10) is multiplied by the weight and by 10 (MaxNodeScore /
  MaxExtenderPriority); the highest total wins, ties broken at random.
* The scheduling cycle is serial; binding cycles run in parallel. With a
  bindVerb the extender binds (creates the Binding); a bind error sends the
  pod back to the queue with backoff. Other pods are bound by the scheduler
  itself through pods/binding.

The built-in filter is reduced to what matters here: NodeResourcesFit (node
allocatable minus what bound and assumed pods ask) on ``fit_resources``, by
default the managed resources. kube-scheduler checks every extended resource
a pod asks unless an extender sets ``ignoredByScheduler: true`` for it, which
vgpu's profile does not: a default profile scheduling the same pods checks
the same resources (``fit_resources`` without an extender).
As kube-scheduler's findNodesThatPassFilters, it stops once it has found
``num_feasible_nodes_to_find`` feasible nodes, starting each cycle where the
last one stopped, and the extender sees only those nodes.
"""

from __future__ import annotations

import functools
import json
import random
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from vgpu.adapters.httpwire import read_response, request_bytes
from vgpu.sim.apiserver import FakeApiServer

__all__ = ["SchedulerStandIn"]

MAX_NODE_SCORE = 100
MAX_EXTENDER_PRIORITY = 10
MIN_FEASIBLE_NODES_TO_FIND = 100
MIN_FEASIBLE_NODES_PERCENTAGE_TO_FIND = 5


def num_feasible_nodes_to_find(all_nodes: int, percentage_of_nodes_to_score: int = 0) -> int:
    """How many feasible nodes a scheduling cycle looks for before it stops
    filtering: kube-scheduler's numFeasibleNodesToFind (pkg/scheduler/
    schedule_one.go). Below 100 nodes, all of them. Otherwise
    percentageOfNodesToScore percent of the nodes, where 0 (unset, the default)
    means the adaptive max(5, 50 - nodes/125) percent (integer division, as in
    Go), and never fewer than 100 nodes."""
    if all_nodes < MIN_FEASIBLE_NODES_TO_FIND:
        return all_nodes
    percentage = percentage_of_nodes_to_score
    if percentage == 0:
        percentage = max(MIN_FEASIBLE_NODES_PERCENTAGE_TO_FIND, 50 - all_nodes // 125)
    return max(MIN_FEASIBLE_NODES_TO_FIND, all_nodes * percentage // 100)


MAX_KNOWN_PODS = 50_000  # pods whose requests are kept worked out
MAX_ANSWER_BYTES = 64 * 2**20  # an extender's or the API server's answer
_HEADERS = {
    "Content-Type": "application/json",
    "Accept": "application/json",
    "User-Agent": "vgpu-sim-scheduler",
}


class ExtenderError(Exception):
    pass


class _Conn:
    """One kept-alive HTTP/1.1 client connection (TCP_NODELAY, as Go sets it)."""

    def __init__(self, target: tuple[str, int], timeout_s: float) -> None:
        self.sock = socket.create_connection(target, timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = self.sock.makefile("rb")

    def close(self) -> None:
        self.reader.close()
        self.sock.close()

    def exchange(self, request: bytes) -> tuple[int, bytes, bool]:
        """Send one request; (status, body, whether the server closes).
        ValueError on a malformed answer, OSError on a broken connection."""
        self.sock.sendall(request)
        status, _, data, close = read_response(self.reader, MAX_ANSWER_BYTES)
        return status, data, close


@dataclass
class _PodState:
    attempts: int = 0
    next_try: float = 0.0
    backoff_s: float = 0.0
    last_error: str = ""
    binding: bool = False


@dataclass
class Stats:
    filter_calls: int = 0
    prioritize_calls: int = 0
    bind_calls: int = 0
    bind_errors: list[str] = field(default_factory=list)
    unschedulable: int = 0
    bound: int = 0


@functools.lru_cache(maxsize=4096)
def _parse_quantity(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0


def _quantity(value: Any) -> int:
    """A plain integer quantity (0 if it is not one), parsed once per distinct
    string, as kube-scheduler keeps parsed quantities in its NodeInfo cache."""
    return _parse_quantity(str(value))


class SchedulerStandIn:
    def __init__(
        self,
        api: FakeApiServer,
        extender_url: str,
        *,
        scheduler_name: str = "vgpu-scheduler",
        managed_resources: Sequence[str] = (),
        fit_resources: Sequence[str] | None = None,
        node_cache_capable: bool = True,
        weight: int = 1,
        http_timeout_s: float = 5.0,
        binder: bool = True,
        bind_workers: int = 8,
        initial_backoff_s: float = 0.1,
        max_backoff_s: float = 1.0,
        seed: int = 0,
        percentage_of_nodes_to_score: int = 0,
    ) -> None:
        self.api = api
        self.extender_url = extender_url.rstrip("/")
        self.scheduler_name = scheduler_name
        self.managed = frozenset(managed_resources)
        # What NodeResourcesFit checks against node allocatable.
        self.fit = self.managed if fit_resources is None else frozenset(fit_resources)
        self.node_cache_capable = node_cache_capable
        self.weight = weight
        self.http_timeout_s = http_timeout_s
        self.binder = binder
        self.initial_backoff_s = initial_backoff_s
        self.max_backoff_s = max_backoff_s
        self.rng = random.Random(seed)
        if not 0 <= percentage_of_nodes_to_score <= 100:
            raise ValueError("percentage_of_nodes_to_score must be 0 (adaptive) to 100")
        self.percentage_of_nodes_to_score = percentage_of_nodes_to_score
        self._next_start_node_index = 0  # kube-scheduler's nextStartNodeIndex
        self.stats = Stats()
        self._pods: dict[str, _PodState] = {}
        self._assumed: dict[str, tuple[str, dict[str, int]]] = {}  # uid -> (node, requests)
        self._assumed_used: dict[str, dict[str, int]] = {}  # node -> what assumed pods ask
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(bind_workers, thread_name_prefix="sim-sched-bind")
        self._conns = threading.local()  # kept-alive HTTP connections, per thread
        self._requests_of: dict[str, dict[str, int]] = {}  # pod uid -> effective requests

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="sim-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self._pool.shutdown(wait=True)

    def __enter__(self) -> SchedulerStandIn:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- queue

    def _loop(self) -> None:
        seen = 0
        while not self._stop.is_set():
            seen = self.api.wait_for_change(seen, 0.05)
            now = time.monotonic()
            queue = []
            # One snapshot per pass, as kube-scheduler schedules from its cache:
            # the node list and what bound pods use (assumed pods are added per pod).
            # The pods are shared, read-only views, as an informer's cache gives:
            # deep copies of every pod on each pass made this loop's pace swing
            # with the machine's load.
            pods = self.api.pods_view()
            nodes = self._schedulable_nodes()
            used = self._bound_usage(pods)
            for pod in pods:
                spec, meta = pod.get("spec") or {}, pod["metadata"]
                if spec.get("schedulerName") != self.scheduler_name or spec.get("nodeName"):
                    continue
                if (pod.get("status") or {}).get("phase", "Pending") != "Pending":
                    continue
                with self._lock:
                    state = self._pods.setdefault(meta["uid"], _PodState())
                    if state.binding or state.next_try > now:
                        continue
                queue.append(pod)
            queue.sort(key=lambda p: (p["metadata"]["creationTimestamp"], p["metadata"]["name"]))
            for pod in queue:
                if self._stop.is_set():
                    return
                self._schedule_one(pod, nodes, used)

    def _schedulable_nodes(self) -> list[dict[str, Any]]:
        """The nodes not cordoned (shared views, as kube-scheduler's cache gives)."""
        return [n for n in self.api.nodes_view() if not (n.get("spec") or {}).get("unschedulable")]

    def _backoff(self, uid: str, error: str) -> None:
        with self._lock:
            state = self._pods.setdefault(uid, _PodState())
            state.backoff_s = min(
                self.max_backoff_s,
                state.backoff_s * 2 if state.backoff_s else self.initial_backoff_s,
            )
            state.next_try = time.monotonic() + state.backoff_s
            state.last_error = error
            state.binding = False

    # ------------------------------------------------------ scheduling cycle

    def interested(self, pod: dict[str, Any]) -> bool:
        if not self.managed:
            return True
        spec = pod.get("spec") or {}
        for container in (spec.get("containers") or []) + (spec.get("initContainers") or []):
            resources = container.get("resources") or {}
            names = set(resources.get("requests") or {}) | set(resources.get("limits") or {})
            if names & self.managed:
                return True
        return False

    def _requests(self, pod: dict[str, Any]) -> dict[str, int]:
        """Effective request per resource NodeResourcesFit checks: max(largest init, sum of apps),
        worked out once per pod (a pod's resources never change; its UID names
        it for its life), as kube-scheduler keeps it in its cache."""
        uid = pod["metadata"].get("uid", "")
        if not uid:
            return self._work_out_requests(pod)
        known = self._requests_of.get(uid)
        if known is None:
            if len(self._requests_of) > MAX_KNOWN_PODS:
                self._requests_of.clear()
            known = self._requests_of[uid] = self._work_out_requests(pod)
        return known

    def _work_out_requests(self, pod: dict[str, Any]) -> dict[str, int]:
        spec = pod.get("spec") or {}

        def asked(c: dict[str, Any]) -> dict[str, int]:
            resources = c.get("resources") or {}
            merged = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
            return {r: _quantity(merged[r]) for r in self.fit if r in merged}

        out: dict[str, int] = {}
        for c in spec.get("containers") or []:
            for r, n in asked(c).items():
                out[r] = out.get(r, 0) + n
        for c in spec.get("initContainers") or []:
            for r, n in asked(c).items():
                out[r] = max(out.get(r, 0), n)
        return out

    def _bound_usage(self, pods: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
        """node -> resource -> what its bound, active pods ask; and forget the
        assumptions of pods this snapshot shows bound (or gone)."""
        used: dict[str, dict[str, int]] = {}
        bound: set[str] = set()
        present: set[str] = set()
        for other in pods:
            present.add(other["metadata"]["uid"])
            node = (other.get("spec") or {}).get("nodeName")
            if node and (other.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                bound.add(other["metadata"]["uid"])
                for r, n in self._requests(other).items():
                    used.setdefault(node, {})[r] = used.setdefault(node, {}).get(r, 0) + n
        with self._lock:
            for uid in list(self._assumed):
                done = uid in bound or uid not in present
                if done and not self._pods.get(uid, _PodState()).binding:
                    self._unassume(uid)
        return used

    def _find_feasible(
        self,
        pod: dict[str, Any],
        nodes: list[dict[str, Any]],
        bound_used: dict[str, dict[str, int]] | None = None,
    ) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """NodeResourcesFit on the managed resources, as kube-scheduler's
        findNodesThatPassFilters runs its filters: from nextStartNodeIndex
        round the node list, stopping once num_feasible_nodes_to_find nodes
        passed; the next cycle starts after the nodes this one processed.
        Returns the feasible nodes and the reasons of those that failed."""
        wanted = sorted((r, n) for r, n in self._requests(pod).items() if n)
        if bound_used is None:
            bound_used = self._bound_usage(self.api.pods_view())
        total = len(nodes)
        to_find = num_feasible_nodes_to_find(total, self.percentage_of_nodes_to_score)
        start = self._next_start_node_index % total if total else 0
        feasible: list[dict[str, Any]] = []
        failed: dict[str, str] = {}
        nothing: dict[str, int] = {}
        with self._lock:
            own_host, own = self._assumed.get(pod["metadata"]["uid"], ("", nothing))
            for i in range(total):
                if len(feasible) >= to_find:
                    break
                node = nodes[(start + i) % total]
                name = node["metadata"]["name"]
                allocatable = (node.get("status") or {}).get("allocatable") or {}
                bound = bound_used.get(name, nothing)
                assumed = self._assumed_used.get(name, nothing)
                for r, n in wanted:
                    used = bound.get(r, 0) + assumed.get(r, 0)
                    if name == own_host:
                        used -= own.get(r, 0)
                    if _quantity(allocatable.get(r, 0)) - used < n:
                        failed[name] = f"Insufficient {r}"
                        break
                else:
                    feasible.append(node)
        if total:
            self._next_start_node_index = (start + len(feasible) + len(failed)) % total
        return feasible, failed

    def _schedule_one(
        self,
        pod: dict[str, Any],
        nodes: list[dict[str, Any]] | None = None,
        used: dict[str, dict[str, int]] | None = None,
    ) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        with self._lock:
            self._pods.setdefault(uid, _PodState()).attempts += 1
        if nodes is None:
            nodes = self._schedulable_nodes()
        feasible, reasons = self._find_feasible(pod, nodes, used)
        interested = self.interested(pod)
        try:
            if interested and feasible:
                feasible, failed = self._filter(pod, feasible)
                reasons.update(failed)
        except ExtenderError as exc:
            self._unschedulable(pod, f"extender filter failed: {exc}", len(nodes))
            return
        if not feasible:
            counts: dict[str, int] = {}
            for reason in reasons.values():
                counts[reason] = counts.get(reason, 0) + 1
            detail = ", ".join(f"{n} {r}" for r, n in sorted(counts.items()))
            self._unschedulable(pod, f"0/{len(nodes)} nodes are available: {detail}.", len(nodes))
            return
        host = feasible[0]["metadata"]["name"]
        if len(feasible) > 1:
            host = self._select(pod, feasible, interested)
        with self._lock:
            self._assume(uid, host, self._requests(pod))
            self._pods[uid].binding = True
        self._pool.submit(self._binding_cycle, pod, host, interested)

    def _assume(self, uid: str, host: str, requests: dict[str, int]) -> None:
        """Count the pod on `host` until a snapshot shows it bound (under _lock)."""
        self._unassume(uid)
        self._assumed[uid] = (host, requests)
        on_host = self._assumed_used.setdefault(host, {})
        for r, n in requests.items():
            on_host[r] = on_host.get(r, 0) + n

    def _unassume(self, uid: str) -> None:
        """Drop the pod's assumption, if any (under _lock)."""
        host, requests = self._assumed.pop(uid, ("", {}))
        on_host = self._assumed_used.get(host)
        if on_host is None:
            return
        for r, n in requests.items():
            on_host[r] = on_host.get(r, 0) - n
        if not any(on_host.values()):
            del self._assumed_used[host]

    def _unschedulable(self, pod: dict[str, Any], message: str, nodes: int) -> None:
        meta = pod["metadata"]
        self.stats.unschedulable += 1

        def mutate(obj: dict[str, Any]) -> None:
            status = obj.setdefault("status", {})
            conditions = [
                c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"
            ]
            conditions.append(
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": message,
                }
            )
            status["conditions"] = conditions

        try:
            self.api.update_pod(meta["namespace"], meta["name"], mutate)
        except KeyError:
            pass
        self._backoff(meta["uid"], message)

    def _nodes_arg(self, nodes: list[dict[str, Any]]) -> dict[str, Any]:
        if self.node_cache_capable:
            return {"Nodes": None, "NodeNames": [n["metadata"]["name"] for n in nodes]}
        return {"Nodes": {"metadata": {}, "items": nodes}, "NodeNames": None}

    def _filter(
        self, pod: dict[str, Any], nodes: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], dict[str, str]]:
        self.stats.filter_calls += 1
        result = self._post("filter", {"Pod": pod, **self._nodes_arg(nodes)})
        if not isinstance(result, dict):
            raise ExtenderError("filter answer is not an object")
        if result.get("Error"):
            raise ExtenderError(str(result["Error"]))
        by_name = {n["metadata"]["name"]: n for n in nodes}
        if self.node_cache_capable and result.get("NodeNames") is not None:
            names = list(result["NodeNames"])
        elif result.get("Nodes") is not None:
            names = [n["metadata"]["name"] for n in result["Nodes"].get("items") or []]
        else:
            names = []
        for name in names:
            if name not in by_name:
                raise ExtenderError(f"extender claims a filtered node {name!r} not in the input")
        failed = dict(result.get("FailedNodes") or {})
        failed.update(result.get("FailedAndUnresolvableNodes") or {})
        return [by_name[n] for n in names], failed

    def _select(self, pod: dict[str, Any], nodes: list[dict[str, Any]], interested: bool) -> str:
        scores: dict[str, int] = {n["metadata"]["name"]: 0 for n in nodes}
        if interested:
            self.stats.prioritize_calls += 1
            try:
                result = self._post("prioritize", {"Pod": pod, **self._nodes_arg(nodes)})
                for entry in result or []:
                    if entry["Host"] in scores:
                        scores[entry["Host"]] += (
                            int(entry["Score"])
                            * self.weight
                            * (MAX_NODE_SCORE // MAX_EXTENDER_PRIORITY)
                        )
            except (ExtenderError, KeyError, TypeError, ValueError):
                pass  # kube-scheduler ignores a failed prioritize
        best = max(scores.values())
        return self.rng.choice(sorted(n for n, s in scores.items() if s == best))

    # ---------------------------------------------------------- binding cycle

    def _binding_cycle(self, pod: dict[str, Any], host: str, interested: bool) -> None:
        meta = pod["metadata"]
        try:
            if self.binder and interested:
                self.stats.bind_calls += 1
                args = {
                    "PodName": meta["name"],
                    "PodNamespace": meta["namespace"],
                    "PodUID": meta["uid"],
                    "Node": host,
                }
                result = self._post("bind", args)
                if not isinstance(result, dict):
                    raise ExtenderError("bind answer is not an object")
                if result.get("Error"):
                    raise ExtenderError(str(result["Error"]))
            else:
                self._bind_self(meta, host)
        except ExtenderError as exc:
            self.stats.bind_errors.append(str(exc))
            with self._lock:
                self._unassume(meta["uid"])
            self._backoff(meta["uid"], f"binding rejected: {exc}")
            return
        with self._lock:
            # The assumption stays until a snapshot shows the pod bound (_bound_usage).
            state = self._pods.setdefault(meta["uid"], _PodState())
            state.binding = False
            state.next_try = float("inf")  # bound: never again
        self.stats.bound += 1

    def _bind_self(self, meta: dict[str, Any], host: str) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": host},
        }
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding"
        status, data = self._request(self.api.url, path, body)
        if status != 201:
            raise ExtenderError(f"binding failed with HTTP {status}: {data[:200]!r}")

    # ------------------------------------------------------------------ HTTP

    def _request(self, base: str, path: str, body: Any) -> tuple[int, bytes]:
        """POST over a kept-alive connection per thread and server, as Go's HTTP
        client does for kube-scheduler; a broken one is replaced once.

        The HTTP/1.1 exchange is written out here rather than through
        http.client, whose email-based header parser and line-by-line request
        cost more per call than the extender's whole answer; Go's client costs
        kube-scheduler microseconds. The stand-in's own binds (the baseline)
        go through here too."""
        url = urlsplit(base)
        target = (url.hostname or "127.0.0.1", url.port or 80)
        request = request_bytes(
            "POST",
            path,
            f"{target[0]}:{target[1]}",
            _HEADERS,
            json.dumps(body).encode(),
        )
        conns: dict[tuple[str, int], _Conn] = self._conns.__dict__.setdefault("by_target", {})
        for attempt in (1, 2):
            conn = conns.get(target)
            try:
                if conn is None:
                    conn = conns[target] = _Conn(target, self.http_timeout_s)
                status, data, close = conn.exchange(request)
                if close:
                    conn.close()
                    conns.pop(target, None)
                return status, data
            except (OSError, ValueError) as exc:
                if conn is not None:
                    conn.close()
                conns.pop(target, None)
                if attempt == 2 or isinstance(exc, TimeoutError):
                    raise ExtenderError(f"{type(exc).__name__}: {exc}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _post(self, verb: str, args: Any) -> Any:
        url = urlsplit(self.extender_url)
        status, data = self._request(self.extender_url, f"{url.path}/{verb}", args)
        if status != 200:
            raise ExtenderError(
                f"failed {verb} with extender at URL {self.extender_url}/{verb}, code {status}"
            )
        try:
            return json.loads(data)
        except ValueError as exc:
            raise ExtenderError(f"{verb} answer is not JSON: {exc}") from None

    def state(self, uid: str) -> _PodState:
        with self._lock:
            return self._pods.get(uid, _PodState())
