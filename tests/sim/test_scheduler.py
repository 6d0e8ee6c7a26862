"""The scheduler stand-in searches nodes as kube-scheduler does: it stops once
numFeasibleNodesToFind nodes passed its own filters, starts each cycle where
the last one stopped, and sends the extender only those feasible nodes."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from vgpu.sim.apiserver import FakeApiServer, make_node, make_pod
from vgpu.sim.harness import wait_until
from vgpu.sim.scheduler import SchedulerStandIn, num_feasible_nodes_to_find

pytestmark = pytest.mark.timeout(60)

RES = "example.com/thing"


@pytest.mark.parametrize(
    ("nodes", "percentage", "expected"),
    [
        pytest.param(0, 0, 0, id="no-nodes"),
        pytest.param(50, 0, 50, id="under-100-all"),
        pytest.param(99, 10, 99, id="under-100-all-whatever-the-percentage"),
        pytest.param(100, 0, 100, id="100-adaptive-50pct-floored-at-100"),
        pytest.param(200, 0, 100, id="200-adaptive-49pct-is-98-floored-at-100"),
        pytest.param(250, 0, 120, id="250-adaptive-48pct"),
        pytest.param(1000, 0, 420, id="1000-adaptive-42pct"),
        pytest.param(5000, 0, 500, id="5000-adaptive-10pct"),
        pytest.param(6000, 0, 300, id="6000-adaptive-floor-5pct"),
        pytest.param(1000, 30, 300, id="set-30pct"),
        pytest.param(200, 100, 200, id="set-100pct-all"),
        pytest.param(200, 10, 100, id="set-10pct-floored-at-100"),
    ],
)
def test_num_feasible_nodes_to_find_follows_kube_scheduler(
    nodes: int, percentage: int, expected: int
) -> None:
    assert num_feasible_nodes_to_find(nodes, percentage) == expected


def test_an_out_of_range_percentage_is_refused() -> None:
    with pytest.raises(ValueError, match="0 \\(adaptive\\) to 100"):
        SchedulerStandIn(FakeApiServer(), "http://127.0.0.1:1", percentage_of_nodes_to_score=101)


class _Recorder(BaseHTTPRequestHandler):
    """An extender that passes every node it is sent (or the first `keep`) and
    records the names and the verbs."""

    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[list[str]]] = []
    verbs: ClassVar[list[str]] = []
    keep: ClassVar[int | None] = None

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        args = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        verb = self.path.rsplit("/", 1)[1]
        type(self).verbs.append(verb)
        if verb == "filter":
            type(self).seen.append(list(args["NodeNames"]))
            kept = args["NodeNames"][: type(self).keep]
            answer: Any = {"NodeNames": kept, "FailedNodes": {}, "Error": ""}
        else:
            answer = [{"Host": n, "Score": 0} for n in args["NodeNames"]]
        body = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def recorder() -> Iterator[str]:
    _Recorder.seen, _Recorder.verbs, _Recorder.keep = [], [], None
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _cluster(nodes: int, full: int) -> FakeApiServer:
    """`nodes` nodes named in order; the first `full` have none of RES left."""
    api = FakeApiServer(bookmark_interval_s=60.0)
    for i in range(nodes):
        api.add_node(make_node(f"node-{i:04d}", allocatable={RES: "0" if i < full else "4"}))
    return api


def _add_pod(api: FakeApiServer, name: str, scheduler_name: str = "vgpu-scheduler") -> None:
    """A pending pod asking one RES."""
    api.add_pod(
        make_pod(
            name,
            node=None,
            containers=[{"resources": {"limits": {RES: "1"}}}],
            scheduler_name=scheduler_name,
        )
    )


def _schedule(api: FakeApiServer, url: str, pods: int) -> SchedulerStandIn:
    """Schedule `pods` pods one after another (each asking one RES); binds itself."""
    scheduler = SchedulerStandIn(api, url, managed_resources=(RES,), binder=False)
    api.start()
    scheduler.start()
    try:
        for i in range(pods):
            _add_pod(api, f"p{i}")
            assert wait_until(lambda i=i: scheduler.stats.bound == i + 1, 20)
    finally:
        scheduler.stop()
        api.stop()
    return scheduler


def test_the_extender_sees_only_the_first_feasible_nodes_from_a_rotating_start(
    recorder: str,
) -> None:
    # 250 nodes: kube-scheduler looks for 48% of them, 120 feasible nodes. The
    # first ten have no room: they count as processed but are not sent.
    _schedule(_cluster(250, 10), recorder, 3)
    names = [f"node-{i:04d}" for i in range(250)]
    first, second, third = _Recorder.seen
    assert first == names[10:130]  # 10 failed + 120 feasible processed: next start 130
    assert second == names[130:250]  # 120 processed: next start 250 % 250 = 0
    assert third == names[10:130]  # from node 0 again: its first ten fail


def test_under_100_nodes_every_feasible_node_is_sent(recorder: str) -> None:
    _schedule(_cluster(60, 5), recorder, 2)
    names = [f"node-{i:04d}" for i in range(60)]
    assert _Recorder.seen == [names[5:], names[5:]]


def test_one_node_left_by_the_extender_skips_prioritize(recorder: str) -> None:
    # kube-scheduler: a single feasible node after the extenders is taken as it
    # is, without scoring (vgpu extender's node_choice "extender" relies on it).
    _Recorder.keep = 1
    one = _schedule(_cluster(5, 0), recorder, 2)
    assert _Recorder.verbs == ["filter", "filter"]
    assert (one.stats.filter_calls, one.stats.prioritize_calls) == (2, 0)
    _Recorder.verbs, _Recorder.keep = [], 2
    two = _schedule(_cluster(5, 0), recorder, 1)
    assert _Recorder.verbs == ["filter", "prioritize"]
    assert (two.stats.filter_calls, two.stats.prioritize_calls) == (1, 1)


def test_a_default_profile_checks_the_fit_resources_without_calling_an_extender(
    recorder: str,
) -> None:
    # The bench's baseline: pods ask RES, no extender manages it, and
    # NodeResourcesFit still checks it (kube-scheduler checks every extended
    # resource unless an extender sets ignoredByScheduler). Two nodes hold 4 each.
    api = _cluster(3, 1)
    scheduler = SchedulerStandIn(
        api,
        recorder,
        scheduler_name="default-scheduler",
        managed_resources=("unused.io/none",),
        fit_resources=(RES,),
        binder=False,
    )
    api.start()
    scheduler.start()
    try:
        for i in range(9):
            _add_pod(api, f"p{i}", "default-scheduler")
        assert wait_until(lambda: scheduler.stats.bound == 8 and scheduler.stats.unschedulable, 20)
        on = [(p["spec"] or {}).get("nodeName") for p in api.pods()]
    finally:
        scheduler.stop()
        api.stop()
    assert sorted(n for n in on if n) == ["node-0001"] * 4 + ["node-0002"] * 4
    assert _Recorder.verbs == []  # no extender call
    pending = [p for p in api.pods() if not (p["spec"] or {}).get("nodeName")]
    (condition,) = pending[0]["status"]["conditions"]
    assert "0/3 nodes are available: 3 Insufficient example.com/thing." in condition["message"]
