"""The fake API server, exercised only through the official ``kubernetes`` client."""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config, watch
from urllib3.exceptions import ProtocolError

from vgpu.sim.apiserver import THREAD_PREFIX, FakeApiServer, make_node, make_pod

CORE = "vendor.io/vcuda-core"
_END = object()


def _server_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def _wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met before the deadline"
        time.sleep(0.01)


class _Watcher:
    """Consumes ``Watch().stream(...)`` in a thread; events land in a queue."""

    def __init__(self, func: Callable[..., Any], **kwargs: Any) -> None:
        self.watch = watch.Watch()
        self.events: queue.Queue[Any] = queue.Queue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(func,), kwargs=kwargs, daemon=True)
        self._thread.start()

    def _run(self, func: Callable[..., Any], **kwargs: Any) -> None:
        try:
            for event in self.watch.stream(func, **kwargs):
                self.events.put(event)
        except BaseException as err:
            self.error = err
        finally:
            self.events.put(_END)

    def next(self, timeout: float = 5.0) -> Any:
        event = self.events.get(timeout=timeout)
        assert event is not _END, f"watch ended early (error: {self.error!r})"
        return event

    def take(self, n: int, timeout: float = 5.0) -> list[tuple[str, str]]:
        return [(e["type"], e["raw_object"]["metadata"]["name"]) for e in self._n(n, timeout)]

    def _n(self, n: int, timeout: float) -> list[Any]:
        return [self.next(timeout) for _ in range(n)]

    def wait_end(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "watch did not end in time"
            if self.events.get(timeout=remaining) is _END:
                break
        self._thread.join(timeout=max(0.1, deadline - time.monotonic()))
        assert not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    srv = FakeApiServer()
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        assert _server_threads() == []


@pytest.fixture
def v1(server: FakeApiServer) -> Iterator[client.CoreV1Api]:
    api_client = client.ApiClient(client.Configuration(host=server.url))
    try:
        yield client.CoreV1Api(api_client)
    finally:
        api_client.close()


def _gpu_pod(name: str, node: str, **kw: Any) -> dict[str, Any]:
    containers = [{"name": "main", "resources": {"limits": {CORE: "30"}}}]
    return make_pod(name, node=node, containers=containers, **kw)


@pytest.mark.timeout(20)
def test_kubeconfig_list_with_field_selector(server: FakeApiServer, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    server.write_kubeconfig(kubeconfig)
    api_client = config.new_client_from_config(config_file=str(kubeconfig))
    v1 = client.CoreV1Api(api_client)
    server.add_pod(_gpu_pod("a", "node-1"))
    server.add_pod(_gpu_pod("b", "node-2"))
    server.add_pod(_gpu_pod("c", "node-1", namespace="team", phase="Running"))

    pods = v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=node-1")
    assert isinstance(pods, client.V1PodList)
    assert [(p.metadata.namespace, p.metadata.name) for p in pods.items] == [
        ("default", "a"),
        ("team", "c"),
    ]
    assert int(pods.metadata.resource_version) == server.resource_version
    pod = pods.items[0]
    assert pod.spec.containers[0].resources.limits == {CORE: "30"}
    assert pod.status.phase == "Pending" and pods.items[1].status.phase == "Running"
    assert pod.metadata.uid and pod.metadata.creation_timestamp is not None

    both = v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=node-1,metadata.name=c")
    assert [p.metadata.name for p in both.items] == ["c"]
    assert [p.metadata.name for p in v1.list_namespaced_pod("team").items] == ["c"]
    not_running = v1.list_pod_for_all_namespaces(field_selector="status.phase!=Running")
    assert [p.metadata.name for p in not_running.items] == ["a", "b"]
    with pytest.raises(client.ApiException) as err:
        v1.list_pod_for_all_namespaces(field_selector="spec.bogus=1")
    assert err.value.status == 400
    api_client.close()


@pytest.mark.timeout(20)
def test_label_selector(server: FakeApiServer, v1: client.CoreV1Api) -> None:
    for name, labels in (("a", {"app": "x", "tier": "gpu"}), ("b", {"app": "y"}), ("c", {})):
        pod = make_pod(name, node="n")
        pod["metadata"]["labels"] = labels
        server.add_pod(pod)

    def names(selector: str) -> list[str]:
        return [
            p.metadata.name
            for p in v1.list_namespaced_pod("default", label_selector=selector).items
        ]

    assert names("app=x") == ["a"]
    assert names("app!=x") == ["b", "c"]
    assert names("app in (x,y)") == ["a", "b"]
    assert names("tier") == ["a"]
    assert names("!tier,app") == ["b"]


@pytest.mark.timeout(20)
def test_get_pod_node_and_404(server: FakeApiServer, v1: client.CoreV1Api) -> None:
    stored = server.add_pod(_gpu_pod("a", "node-1", annotations={"k": "v"}))
    server.add_node({"metadata": {"name": "node-1", "labels": {"gpu": "yes"}}})
    pod = v1.read_namespaced_pod("a", "default")
    assert isinstance(pod, client.V1Pod)
    assert pod.metadata.uid == stored["metadata"]["uid"]
    assert pod.metadata.annotations == {"k": "v"}
    assert pod.spec.node_name == "node-1"
    assert v1.read_node("node-1").metadata.labels == {"gpu": "yes"}
    assert [n.metadata.name for n in v1.list_node().items] == ["node-1"]

    calls: list[Callable[[], Any]] = [
        lambda: v1.read_namespaced_pod("missing", "default"),
        lambda: v1.read_namespaced_pod("a", "other-namespace"),
        lambda: v1.read_node("missing"),
        lambda: v1.read_namespace("default"),  # an endpoint the fake does not serve
    ]
    for call in calls:
        with pytest.raises(client.ApiException) as err:
            call()
        assert err.value.status == 404
        assert '"kind":"Status"' in err.value.body and '"reason":"NotFound"' in err.value.body


@pytest.mark.timeout(20)
def test_patch_annotations(server: FakeApiServer, v1: client.CoreV1Api) -> None:
    stored = server.add_pod(_gpu_pod("a", "node-1", annotations={"keep": "1", "drop": "2"}))
    rv0 = int(stored["metadata"]["resourceVersion"])

    # the client's default content type for a dict body is strategic merge patch
    patched = v1.patch_namespaced_pod("a", "default", {"metadata": {"annotations": {"x/y": "1"}}})
    assert patched.metadata.annotations == {"keep": "1", "drop": "2", "x/y": "1"}
    assert int(patched.metadata.resource_version) > rv0

    merged = v1.patch_namespaced_pod(
        "a",
        "default",
        {"metadata": {"annotations": {"drop": None, "x/y": "2"}}},
        _content_type="application/merge-patch+json",
    )
    assert merged.metadata.annotations == {"keep": "1", "x/y": "2"}
    assert int(merged.metadata.resource_version) > int(patched.metadata.resource_version)

    ops = [{"op": "add", "path": "/metadata/annotations/vendor.io~1idx", "value": "0,1"}]
    jsonpatched = v1.patch_namespaced_pod("a", "default", ops)
    assert jsonpatched.metadata.annotations["vendor.io/idx"] == "0,1"

    current = server.get_pod("default", "a")
    assert current is not None
    assert current["metadata"]["annotations"] == {"keep": "1", "x/y": "2", "vendor.io/idx": "0,1"}
    assert current["metadata"]["uid"] == patched.metadata.uid

    # optimistic concurrency: a stale resourceVersion in the patch is a 409
    stale = {"metadata": {"resourceVersion": str(rv0), "annotations": {"z": "1"}}}
    with pytest.raises(client.ApiException) as err:
        v1.patch_namespaced_pod("a", "default", stale)
    assert err.value.status == 409
    with pytest.raises(client.ApiException) as err:
        v1.patch_namespaced_pod("missing", "default", {"metadata": {"annotations": {"z": "1"}}})
    assert err.value.status == 404

    node = server.add_node({"metadata": {"name": "node-1"}})
    patched_node = v1.patch_node("node-1", {"metadata": {"annotations": {"a": "b"}}})
    assert patched_node.metadata.annotations == {"a": "b"}
    assert patched_node.metadata.uid == node["metadata"]["uid"]


@pytest.mark.timeout(20)
def test_watch_added_modified_deleted_in_order(server: FakeApiServer, v1: client.CoreV1Api) -> None:
    server.add_pod(_gpu_pod("old", "node-1"))
    # no resourceVersion: the current state comes first as synthetic ADDED events
    w = _Watcher(
        v1.list_pod_for_all_namespaces, field_selector="spec.nodeName=node-1", timeout_seconds=10
    )
    first = w.next()
    assert first["type"] == "ADDED" and isinstance(first["object"], client.V1Pod)
    assert first["object"].metadata.name == "old"

    server.add_pod(_gpu_pod("elsewhere", "node-2"))  # filtered out by the field selector
    server.add_pod(_gpu_pod("a", "node-1"))
    server.set_pod_phase("default", "a", "Running")
    server.update_pod(
        "default", "a", lambda p: p["metadata"].setdefault("labels", {}).update(x="1")
    )
    server.delete_pod("default", "a")
    server.update_pod("default", "old", lambda p: p["spec"].update(nodeName="node-3"))
    events = [w.next() for _ in range(5)]
    assert [(e["type"], e["object"].metadata.name) for e in events] == [
        ("ADDED", "a"),
        ("MODIFIED", "a"),
        ("MODIFIED", "a"),
        ("DELETED", "a"),
        ("DELETED", "old"),  # moved out of the selector
    ]
    assert events[1]["object"].status.phase == "Running"
    rvs = [int(e["object"].metadata.resource_version) for e in events]
    assert rvs == sorted(rvs) and len(set(rvs)) == len(rvs)
    w.watch.stop()  # shuts the client socket down, which ends the blocked read
    w.wait_end()
    assert w.error is None or isinstance(w.error, ProtocolError), repr(w.error)


@pytest.mark.timeout(20)
def test_concurrent_watches(server: FakeApiServer, v1: client.CoreV1Api) -> None:
    rv = v1.list_pod_for_all_namespaces().metadata.resource_version
    watchers = {
        node: _Watcher(
            v1.list_pod_for_all_namespaces,
            field_selector=f"spec.nodeName={node}",
            resource_version=rv,
            timeout_seconds=10,
        )
        for node in ("n1", "n2", "n3")
    }
    everything = _Watcher(
        v1.list_namespaced_pod, namespace="default", resource_version=rv, timeout_seconds=10
    )
    for i in range(3):
        for node in watchers:
            server.add_pod(make_pod(f"{node}-{i}", node=node))
    for node, w in watchers.items():
        assert w.take(3) == [("ADDED", f"{node}-{i}") for i in range(3)]
    assert len(everything.take(9)) == 9
    for w in [*watchers.values(), everything]:
        # kubernetes' Watch.stop() shuts the client socket down: the blocked read may
        # end in a ProtocolError instead of a quiet end of the stream
        w.watch.stop()
    for w in [*watchers.values(), everything]:
        w.wait_end()
        assert w.error is None or isinstance(w.error, ProtocolError), repr(w.error)


@pytest.mark.timeout(20)
def test_watch_resumes_from_resource_version(server: FakeApiServer, v1: client.CoreV1Api) -> None:
    server.add_pod(_gpu_pod("a", "node-1"))
    listed = v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=node-1")
    rv = listed.metadata.resource_version
    # changes made while nobody watches are replayed from the history
    server.add_pod(_gpu_pod("b", "node-1"))
    server.set_pod_phase("default", "a", "Running")
    server.delete_pod("default", "b")
    w = _Watcher(
        v1.list_pod_for_all_namespaces,
        field_selector="spec.nodeName=node-1",
        resource_version=rv,
        timeout_seconds=1,
    )
    assert w.take(3) == [("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")]
    w.wait_end()  # timeoutSeconds ends the stream
    assert w.error is None


@pytest.mark.timeout(20)
def test_watch_too_old_resource_version_is_410() -> None:
    with FakeApiServer(history_size=3) as server:
        api_client = client.ApiClient(client.Configuration(host=server.url))
        v1 = client.CoreV1Api(api_client)
        rv = v1.list_pod_for_all_namespaces().metadata.resource_version
        for i in range(5):
            server.add_pod(make_pod(f"p{i}", node="n"))
        with pytest.raises(client.ApiException) as err:
            for _ in watch.Watch().stream(
                v1.list_pod_for_all_namespaces, resource_version=rv, timeout_seconds=5
            ):
                pytest.fail("no event expected before the 410")
        assert err.value.status == 410
        assert "Expired" in str(err.value.reason)

        # a recent version still works; compact() expires it like an etcd compaction
        recent = v1.list_pod_for_all_namespaces().metadata.resource_version
        server.add_pod(make_pod("fresh", node="n"))
        w = _Watcher(v1.list_pod_for_all_namespaces, resource_version=recent, timeout_seconds=1)
        assert w.take(1) == [("ADDED", "fresh")]
        w.wait_end()
        server.compact()
        with pytest.raises(client.ApiException) as err:
            list(watch.Watch().stream(v1.list_pod_for_all_namespaces, resource_version=recent))
        assert err.value.status == 410
        api_client.close()
    assert _server_threads() == []


@pytest.mark.timeout(20)
def test_bookmarks() -> None:
    with FakeApiServer(bookmark_interval_s=0.05) as server:
        api_client = client.ApiClient(client.Configuration(host=server.url))
        v1 = client.CoreV1Api(api_client)
        server.add_pod(make_pod("a", node="n"))
        w = _Watcher(
            v1.list_pod_for_all_namespaces,
            resource_version=str(server.resource_version),
            allow_watch_bookmarks=True,
            timeout_seconds=1,
        )
        event = w.next()
        assert event["type"] == "BOOKMARK"
        assert event["raw_object"]["metadata"]["resourceVersion"] == str(server.resource_version)
        w.wait_end()
        api_client.close()


@pytest.mark.timeout(20)
def test_set_down_fails_calls_and_ends_watches(server: FakeApiServer, v1: client.CoreV1Api) -> None:
    server.add_pod(_gpu_pod("a", "node-1"))
    rv = v1.list_pod_for_all_namespaces().metadata.resource_version
    watchers = [
        _Watcher(v1.list_pod_for_all_namespaces, resource_version=rv),  # no timeout: would retry
        _Watcher(v1.list_pod_for_all_namespaces, resource_version=rv, timeout_seconds=15),
    ]
    server.add_pod(_gpu_pod("b", "node-1"))
    for w in watchers:
        assert w.take(1) == [("ADDED", "b")]  # both streams are established

    server.set_down(True)
    for w in watchers:
        w.wait_end(timeout=3)
        # cut mid-stream (like a crashed server), or a retry got the 503
        assert isinstance(w.error, ProtocolError | client.ApiException), repr(w.error)
    with pytest.raises(client.ApiException) as err:
        v1.read_namespaced_pod("a", "default")
    assert err.value.status == 503
    with pytest.raises(client.ApiException) as err:
        v1.patch_namespaced_pod("a", "default", {"metadata": {"annotations": {"k": "v"}}})
    assert err.value.status == 503
    assert server.get_pod("default", "a")["metadata"].get("annotations") is None  # type: ignore[index]

    server.set_down(False)
    assert v1.read_namespaced_pod("a", "default").metadata.name == "a"


@pytest.mark.timeout(20)
def test_set_delay_slows_calls(server: FakeApiServer, v1: client.CoreV1Api) -> None:
    server.add_pod(make_pod("a", node="n"))
    v1.read_namespaced_pod("a", "default")  # warm the connection
    server.set_delay(0.3)
    start = time.monotonic()
    v1.read_namespaced_pod("a", "default")
    assert time.monotonic() - start >= 0.3
    server.set_delay(0)
    start = time.monotonic()
    v1.read_namespaced_pod("a", "default")
    assert time.monotonic() - start < 0.3


@pytest.mark.timeout(20)
def test_request_log(server: FakeApiServer, v1: client.CoreV1Api) -> None:
    assert server.request_count == 0 and server.requests() == []
    server.add_pod(make_pod("a", node="n"))
    server.update_pod("default", "a", lambda p: None)  # in-process calls are not requests
    assert server.request_count == 0
    v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=n")
    v1.patch_namespaced_pod("a", "default", {"metadata": {"annotations": {"k": "v"}}})
    assert server.request_count == 2
    assert server.requests() == [
        ("GET", "/api/v1/pods?fieldSelector=spec.nodeName%3Dn"),
        ("PATCH", "/api/v1/namespaces/default/pods/a"),
    ]


@pytest.mark.timeout(20)
def test_stop_is_prompt_with_open_watches() -> None:
    server = FakeApiServer()
    server.start()
    api_client = client.ApiClient(client.Configuration(host=server.url))
    v1 = client.CoreV1Api(api_client)
    server.add_pod(make_pod("a", node="n"))
    watchers = [
        _Watcher(
            v1.list_pod_for_all_namespaces, field_selector="spec.nodeName=n", timeout_seconds=15
        )
        for _ in range(3)
    ]
    for w in watchers:
        assert w.take(1) == [("ADDED", "a")]
    v1.read_namespaced_pod("a", "default")  # an idle keep-alive connection, too
    _wait_for(lambda: len(_server_threads()) >= 4)

    start = time.monotonic()
    server.stop()
    assert time.monotonic() - start < 1.0
    assert _server_threads() == []
    for w in watchers:
        w.wait_end(timeout=3)
    with pytest.raises(Exception):  # noqa: B017 - urllib3 gives up: connection refused
        v1.read_namespaced_pod("a", "default", _request_timeout=2)
    api_client.close()


@pytest.mark.timeout(20)
def test_store_helpers() -> None:
    server = FakeApiServer()  # the store works without serving
    pod = server.add_pod(
        make_pod(
            "a",
            node="n",
            namespace="",
            init_containers=[{"resources": {"limits": {CORE: "10"}}}],
            creation_timestamp="2024-01-02T03:04:05Z",
        )
    )
    assert pod["metadata"]["namespace"] == "default"
    assert pod["metadata"]["creationTimestamp"] == "2024-01-02T03:04:05Z"
    assert pod["spec"]["initContainers"][0]["name"] == "init0"
    assert pod["status"]["phase"] == "Pending"
    with pytest.raises(ValueError):
        server.add_pod(make_pod("a", node="n"))
    rv = server.resource_version
    same = server.update_pod("default", "a", lambda p: None)
    assert same["metadata"]["resourceVersion"] == str(rv)  # a no-op bumps nothing
    assert server.set_pod_phase("default", "a", "Running")["status"]["phase"] == "Running"
    assert [p["metadata"]["name"] for p in server.pods()] == ["a"]
    server.delete_pod("default", "a")
    assert server.get_pod("default", "a") is None and server.pods() == []
    with pytest.raises(KeyError):
        server.delete_pod("default", "a")
    assert server.url.startswith("http://127.0.0.1:")
    server.stop()  # never started: a no-op


def test_pods_view_shares_stored_pods_that_writes_never_change() -> None:
    """The scheduler stand-in reads pods_view() without copies, as kube-scheduler
    reads its informer cache: that holds only while every write, through the
    API or the helpers, stores a new object instead of changing the old one."""
    with FakeApiServer() as server:
        server.add_pod(make_pod("a", node=None))
        before = server.pods_view()
        snapshot = [dict(p["metadata"]) for p in before]
        v1 = client.CoreV1Api(client.ApiClient(client.Configuration(host=server.url)))
        v1.create_namespaced_pod_binding(
            "a",
            "default",
            client.V1Binding(
                metadata=client.V1ObjectMeta(name="a", annotations={"x": "1"}),
                target=client.V1ObjectReference(kind="Node", name="n"),
            ),
            _preload_content=False,
        )
        v1.patch_namespaced_pod("a", "default", {"metadata": {"labels": {"l": "v"}}})
        server.set_pod_phase("default", "a", "Running")
        assert [dict(p["metadata"]) for p in before] == snapshot
        assert "nodeName" not in before[0]["spec"]
        after = server.pods_view()[0]
        assert after is not before[0]
        assert after["spec"]["nodeName"] == "n" and after["metadata"]["annotations"] == {"x": "1"}
        assert after["metadata"]["labels"] == {"l": "v"} and after["status"]["phase"] == "Running"


def test_nodes_view_shares_stored_nodes_that_writes_never_change() -> None:
    """The stand-in reads nodes_view() without copies too: a node write, through
    the API or the helper, stores a new object and leaves the old one as it was."""
    with FakeApiServer() as server:
        server.add_node(make_node("n1"))
        before = server.nodes_view()
        snapshot = copy.deepcopy(before)
        v1 = client.CoreV1Api(client.ApiClient(client.Configuration(host=server.url)))
        v1.patch_node("n1", {"spec": {"unschedulable": True}})
        server.update_node("n1", lambda n: n["metadata"].setdefault("labels", {}).update(a="b"))
        assert before == snapshot
        after = server.nodes_view()[0]
        assert after is not before[0]
        assert after["spec"]["unschedulable"] is True and after["metadata"]["labels"]["a"] == "b"
