"""The webhook's pure decisions: mutation patch, request rules, review parsing,
and the matchConditions CEL evaluated by a real CEL engine (cel-python)."""

from __future__ import annotations

import base64
import json
from typing import Any

import celpy
import pytest

from vgpu.core import admission
from vgpu.core.errors import InvalidRequest
from vgpu.core.fit import check_container
from vgpu.core.model import ContainerSpec, Request

D = "vendor.io"
CORE = f"{D}/vcuda-core"
MEM = f"{D}/vcuda-memory"


def pod(
    *limits: dict[str, Any],
    init: tuple[dict[str, Any], ...] = (),
    scheduler: str | None = None,
    claims: bool = False,
    requests_only: bool = False,
) -> dict[str, Any]:
    def box(i: int, lim: dict[str, Any], prefix: str) -> dict[str, Any]:
        key = "requests" if requests_only else "limits"
        return {"name": f"{prefix}{i}", "image": "x", "resources": {key: lim} if lim else {}}

    spec: dict[str, Any] = {"containers": [box(i, lim, "c") for i, lim in enumerate(limits)]}
    if init:
        spec["initContainers"] = [box(i, lim, "i") for i, lim in enumerate(init)]
    if scheduler is not None:
        spec["schedulerName"] = scheduler
    if claims:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "t"}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec}


def cel_matches(obj: dict[str, Any], domain: str = D) -> bool:
    env = celpy.Environment()
    program = env.program(env.compile(admission.match_condition_expression(domain)))
    result = program.evaluate({"object": celpy.json_to_cel(obj)})  # type: ignore[attr-defined]
    return bool(result)


CASES = [
    ("core-and-memory", pod({CORE: "30", MEM: "16"}), True),
    ("memory-only", pod({MEM: "4"}), True),
    ("second-container", pod({"cpu": "1"}, {CORE: "100"}), True),
    ("init-container-only", pod({"cpu": "1"}, init=({CORE: "50", MEM: "1"},)), True),
    ("requests-only", pod({CORE: "100"}, requests_only=True), True),
    ("no-resources", pod({}), False),
    ("cpu-only", pod({"cpu": "1", "memory": "1Gi"}), False),
    ("nvidia-gpu", pod({"nvidia.com/gpu": "1"}), False),
    ("other-domain", pod({"other.io/vcuda-core": "30"}), False),
    ("init-without-resources", pod({}, init=({},)), False),
]


@pytest.mark.parametrize(("obj", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_match_condition_and_asks_agree(obj: dict[str, Any], expected: bool) -> None:
    assert admission.asks_vgpu(obj, D) is expected
    assert cel_matches(obj) is expected


def test_match_condition_refuses_a_hostile_domain() -> None:
    with pytest.raises(ValueError, match="DNS subdomain"):
        admission.match_condition_expression("x') || true || ('")


def test_match_condition_names_the_domain() -> None:
    assert cel_matches(pod({"acme.io/vcuda-core": "100"}), "acme.io")
    assert not cel_matches(pod({CORE: "100"}), "acme.io")


PATCH_CASES = [
    ("defaulted", pod({CORE: "100"}, scheduler="default-scheduler"), "replace"),
    ("absent", pod({CORE: "100"}), "add"),
    ("empty", pod({CORE: "100"}, scheduler=""), "replace"),
    ("init-only", pod({}, init=({MEM: "2"},), scheduler="default-scheduler"), "replace"),
    ("chosen-scheduler", pod({CORE: "100"}, scheduler="my-scheduler"), None),
    ("already-vgpu", pod({CORE: "100"}, scheduler="vgpu-scheduler"), None),
    ("dra-pod", pod({CORE: "100"}, scheduler="default-scheduler", claims=True), None),
    ("no-vgpu", pod({"cpu": "1"}, scheduler="default-scheduler"), None),
]


@pytest.mark.parametrize(
    ("obj", "op"), [c[1:] for c in PATCH_CASES], ids=[c[0] for c in PATCH_CASES]
)
def test_scheduler_patch(obj: dict[str, Any], op: str | None) -> None:
    patch = admission.scheduler_patch(obj, D, "vgpu-scheduler")
    if op is None:
        assert patch == []
    else:
        assert patch == [{"op": op, "path": "/spec/schedulerName", "value": "vgpu-scheduler"}]


def test_empty_scheduler_name_means_no_mutation() -> None:
    assert admission.scheduler_patch(pod({CORE: "100"}), D, "") == []


def test_mutate_response_carries_a_base64_json_patch() -> None:
    review = admission.Review("u1", "", "Pod", "CREATE", "ns", pod({CORE: "100"}))
    out = admission.mutate(review, D, "vgpu-scheduler")
    assert out["response"]["uid"] == "u1" and out["response"]["allowed"] is True
    assert out["response"]["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(out["response"]["patch"]))
    assert ops[0]["value"] == "vgpu-scheduler"


def spec(core: int, mem: int, name: str = "main", init: bool = False) -> ContainerSpec:
    return ContainerSpec("uid", "ns", "p", name, Request(core, mem), 0.0, init=init)


RULES = [
    ("fraction-without-memory", spec(30, 0), "must come with vendor.io/vcuda-memory"),
    ("core-150", spec(150, 4), "neither a fraction of one card"),
    ("core-250-init", spec(250, 0, "setup", True), "request 200 or 300"),
]


@pytest.mark.parametrize(("s", "fragment"), [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_refusals_use_the_node_rules_and_name_the_container(
    s: ContainerSpec, fragment: str
) -> None:
    with pytest.raises(InvalidRequest) as node:
        check_container(s, D, 256)  # what the node raises at admission
    (message,) = admission.refusals([s], D, 256)
    assert fragment in message and node.value.message in message
    assert f"ns/p/{s.container}" in message
    assert message.startswith("init container" if s.init else "container")


def test_fine_requests_pass() -> None:
    assert admission.refusals([spec(30, 16), spec(0, 4), spec(200, 0), spec(100, 8)], D, 256) == []


BAD = [
    ("not-json", b"{nope"),
    ("not-object", b"[1]"),
    ("wrong-version", json.dumps({"apiVersion": "admission.k8s.io/v1beta1"}).encode()),
    ("no-request", b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}'),
    (
        "no-uid",
        b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{}}',
    ),
    (
        "object-not-a-map",
        b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview",'
        b'"request":{"uid":"u","kind":{"kind":"Pod"},"object":5}}',
    ),
    ("too-large", b" " * (admission.MAX_REVIEW_BYTES + 1)),
]


@pytest.mark.parametrize("body", [b[1] for b in BAD], ids=[b[0] for b in BAD])
def test_parse_review_refuses_bad_bodies(body: bytes) -> None:
    with pytest.raises(admission.BadReview):
        admission.parse_review(body)


def test_unknown_kind_is_allowed_with_a_warning() -> None:
    review = admission.Review("u", "apps", "Deployment", "CREATE", "ns", {})
    for out in (admission.mutate(review, D, "s"), admission.validate(review, [], D, 256)):
        assert out["response"]["allowed"] is True
        assert "Pods only" in out["response"]["warnings"][0]
