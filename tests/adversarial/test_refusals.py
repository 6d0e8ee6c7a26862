"""Issue 13, item 8: every refusal the daemon can explain has its own code
and a message with the fix, and is counted under its own outcome label."""

from __future__ import annotations

import errno
import socket
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import NodeFactory
from tests.integration.conftest_placement import (
    CORE,
    MEM,
    allocate,
    assert_admitted_ok,
    card_of,
    mock_card,
    rpc_error,
    write_mock,
)
from vgpu.adapters.kubelet.servicer import status_for
from vgpu.core.errors import (
    ApiUnavailable,
    DiskFull,
    StateIOError,
    StateReadOnly,
    TooManyOpenFiles,
    UnknownCard,
    state_error,
)
from vgpu.core.model import Resource
from vgpu.sim.harness import wait_until

CASES = [
    (errno.ENOSPC, DiskFull, grpc.StatusCode.RESOURCE_EXHAUSTED, "is full (ENOSPC)"),
    (errno.EDQUOT, DiskFull, grpc.StatusCode.RESOURCE_EXHAUSTED, "quota (EDQUOT)"),
    (errno.EMFILE, TooManyOpenFiles, grpc.StatusCode.RESOURCE_EXHAUSTED, "RLIMIT_NOFILE"),
    (errno.ENFILE, TooManyOpenFiles, grpc.StatusCode.RESOURCE_EXHAUSTED, "the node has no"),
    (errno.EROFS, StateReadOnly, grpc.StatusCode.FAILED_PRECONDITION, "remount"),
    (errno.EIO, StateIOError, grpc.StatusCode.UNAVAILABLE, "(EIO)"),
    (errno.EACCES, StateIOError, grpc.StatusCode.UNAVAILABLE, "permissions"),
]


@pytest.mark.parametrize(
    ("code", "kind", "status", "words"), CASES, ids=[errno.errorcode[c[0]] for c in CASES]
)
def test_os_errors_become_named_refusals(
    code: int, kind: type, status: grpc.StatusCode, words: str
) -> None:
    error = state_error(code, "/var/lib/vgpu/containers/p1", "write the config of p1")
    assert type(error) is kind
    assert status_for(error) == status
    assert words in error.message and "/var/lib/vgpu/containers/p1" in error.message
    assert "resume by themselves" in error.message
    assert error.errno_name == errno.errorcode[code]


def test_unknown_card_and_api_unavailable_codes() -> None:
    assert status_for(UnknownCard("gone", "GPU-1")) == grpc.StatusCode.FAILED_PRECONDITION
    assert status_for(ApiUnavailable("no kubelet")) == grpc.StatusCode.UNAVAILABLE


def outcomes(url: str) -> dict[str, float]:
    body = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    return {
        s.labels["outcome"]: s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name == "vgpu_calls_total" and s.labels["method"] == "GetPreferredAllocation"
    }


@pytest.mark.timeout(60)
def test_capacity_refusal_without_the_kubelets_record_is_unavailable(
    make_node: NodeFactory,
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = make_node(daemon_args=("--metrics-address", f"127.0.0.1:{port}"))
    for name in ("a", "b"):
        assert_admitted_ok(node.submit(node.pod(name, {CORE: 60, MEM: 10})))
    node.podres_socket.unlink()  # the kubelet's pod-resources API is gone
    refused = node.submit(node.pod("c", {CORE: 50, MEM: 10}))
    assert refused.code == grpc.StatusCode.UNAVAILABLE, refused.error
    assert "pod-resources socket" in (refused.error or "") and "40 core free" in (
        refused.error or ""
    )
    assert outcomes(f"http://127.0.0.1:{port}").get("ApiUnavailable") == 1


@pytest.mark.timeout(60)
def test_ids_of_a_card_that_vanished(make_node: NodeFactory, short_tmp: Path) -> None:
    gpus = write_mock(short_tmp / "gpus.json", [mock_card(0), mock_card(1)])
    node = make_node(gpus)
    gone = mock_card(1)["uuid"]
    write_mock(gpus, [mock_card(0)])
    before = [d for d in node.kubelet.devices(CORE) if card_of(d) == gone]
    assert before
    assert wait_until(lambda: not any(card_of(d) == gone for d in node.kubelet.devices(CORE)), 10)
    # Its short ID, and its legacy ID (a checkpoint from before issue 19), alike.
    for device_id in (before[0], f"{gone}-c0"):
        err = rpc_error(lambda d=device_id: allocate(node, Resource.CORE, [d]))  # type: ignore[misc]
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
        assert f"card {gone}" in (err.details() or "") and "no longer on this node" in (
            err.details() or ""
        )
