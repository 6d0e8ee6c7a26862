"""DRA mode's pure rules (vgpu.core.dra): quantities, the published capacities,
the validRange/step rules the scheduler applies, and what an allocation grants."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.core.helpers import cards
from vgpu.core.dra import (
    MIB,
    AllocatedDevice,
    CapacityRule,
    ClaimRef,
    PreparedDevice,
    card_capacities,
    cdi_device_names,
    claim_key,
    claim_view,
    device_status,
    grants,
    merge_device_status,
    parse_quantity,
    resource_slice,
    slice_devices,
)
from vgpu.core.errors import InvalidRequest, UnknownDevice

DRIVER = "vgpu.vendor.io"
NODE = "node-a"
GI = 1024 * MIB


# ------------------------------------------------------------------ quantities


@pytest.mark.parametrize(
    "text, value",
    [
        ("30", 30),
        ("100", 100),
        ("10Gi", 10 * GI),
        ("143616Mi", 143616 * MIB),
        ("256Mi", 256 * MIB),
        ("1.5Gi", 3 * GI // 2),
        ("1G", 10**9),
        ("500m", Fraction(1, 2)),
        ("1e3", 1000),
        ("2E2", 200),
        (" 7 ", 7),
        (12, 12),
    ],
    ids=lambda v: str(v),
)
def test_parse_quantity(text: Any, value: Any) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "10XB", "ten", "1.2.3", "10 Gi", None, True, "9" * 70])
def test_parse_quantity_refuses_what_is_not_a_quantity(text: Any) -> None:
    with pytest.raises(InvalidRequest):
        parse_quantity(text)


# ------------------------------------------------------ the published capacities


def test_h200_at_256_mib_publishes_143616mi() -> None:
    (card,) = cards(1, memory_mib=143771)
    caps = card_capacities(card, 256)
    assert caps["memory"].to_json() == {
        "value": "143616Mi",
        "requestPolicy": {
            "default": "143616Mi",
            "validRange": {"min": "256Mi", "max": "143616Mi", "step": "256Mi"},
        },
    }
    assert caps["cores"].to_json() == {
        "value": "100",
        "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}},
    }


@given(memory_mib=st.integers(512, 2**20), unit=st.sampled_from([64, 128, 256, 512, 1024, 4096]))
def test_published_policies_pass_the_api_servers_checks(memory_mib: int, unit: int) -> None:
    (card,) = cards(1, memory_mib=memory_mib)
    for cap in card_capacities(card, unit).values():
        rule = CapacityRule.from_json(cap.to_json())
        assert rule == cap.rule()
        assert rule.errors() == []
        assert rule.value % (unit * MIB if cap.unit else 1) == 0


def test_a_card_under_two_memory_units_is_not_published() -> None:
    small, big = cards(2, memory_mib=511)
    big = replace(big, memory_mib=512)
    assert card_capacities(small, 256) == {}
    assert [d["name"] for d in slice_devices([small, big], 256)] == ["gpu-1"]


def test_slice_lists_cards_with_their_attributes_and_taints_the_sick() -> None:
    a, b, c = cards(3, numa=[0, 1, 1])
    c = replace(c, numa_node=None)
    devices = slice_devices([replace(b, healthy=False, xid=79), c, a], 256, taint_key="d.io/x")
    assert [d["name"] for d in devices] == ["gpu-0", "gpu-1", "gpu-2"]
    assert devices[1]["taints"] == [{"key": "d.io/x", "value": "xid-79", "effect": "NoSchedule"}]
    assert "taints" not in devices[0] and "taints" not in devices[2]
    missing = replace(b, healthy=False, problem="its device node /dev/nvidia1 does not exist")
    (only,) = slice_devices([missing], 256)
    assert only["taints"][0]["value"] == "device-node-missing"
    devices = [devices[0], devices[2]]
    first = devices[0]
    assert first["allowMultipleAllocations"] is True
    assert first["attributes"] == {
        "uuid": {"string": a.uuid},
        "model": {"string": "NVIDIA H200"},
        "index": {"int": 0},
        "numaNode": {"int": 0},
    }
    assert "numaNode" not in devices[1]["attributes"]
    body = resource_slice(NODE, DRIVER, devices, 7)
    assert body["apiVersion"] == "resource.k8s.io/v1"
    assert body["spec"]["pool"] == {"name": NODE, "generation": 7, "resourceSliceCount": 1}
    assert body["spec"]["nodeName"] == NODE and body["spec"]["driver"] == DRIVER


# ------------------------------------------------------ validRange / step rules

MEMORY = CapacityRule(
    value=Fraction(143616 * MIB),
    minimum=Fraction(256 * MIB),
    maximum=Fraction(143616 * MIB),
    step=Fraction(256 * MIB),
    default=Fraction(143616 * MIB),
)
CORES = CapacityRule(Fraction(100), Fraction(1), Fraction(100), Fraction(1), Fraction(100))


@pytest.mark.parametrize(
    "rule, asked, consumed",
    [
        (CORES, None, 100),
        (CORES, 30, 30),
        (CORES, 0, 1),
        (CORES, Fraction(1, 2), 1),
        (CORES, Fraction(301, 10), 31),
        (CORES, 100, 100),
        (CORES, 101, None),
        (MEMORY, None, 143616 * MIB),
        (MEMORY, 10 * GI, 10 * GI),
        (MEMORY, 1, 256 * MIB),
        (MEMORY, 300 * MIB, 512 * MIB),
        (MEMORY, 143616 * MIB, 143616 * MIB),
        (MEMORY, 143616 * MIB + 1, None),
        (MEMORY, 200 * GI, None),
        (CapacityRule(Fraction(10)), None, 10),
        (CapacityRule(Fraction(10)), 3, 3),
        (CapacityRule(Fraction(10)), 11, None),
        (CapacityRule(Fraction(10), Fraction(2), None, Fraction(4)), 3, 6),
        (CapacityRule(Fraction(10), Fraction(2), None, Fraction(4)), 7, 10),
        (CapacityRule(Fraction(10), Fraction(2), None, Fraction(4)), 11, None),
    ],
    ids=[
        "cores-default",
        "cores-30",
        "cores-below-min",
        "cores-fraction-rounds-up",
        "cores-30.1-rounds-up",
        "cores-all",
        "cores-over-max",
        "memory-default-is-all",
        "memory-10Gi",
        "memory-1-byte-is-min",
        "memory-off-grid-rounds-up",
        "memory-all",
        "memory-over-by-a-byte",
        "memory-200Gi",
        "no-policy-default-all",
        "no-policy-as-asked",
        "no-policy-over-value",
        "grid-from-min",
        "grid-to-value",
        "grid-over-value",
    ],
)
def test_fit(rule: CapacityRule, asked: Any, consumed: Any) -> None:
    requested = None if asked is None else Fraction(asked)
    assert rule.fit(requested) == (None if consumed is None else Fraction(consumed))


@pytest.mark.parametrize(
    "rule, problem",
    [
        (MEMORY, None),
        (replace(MEMORY, default=Fraction(1000 * MIB)), "default must be min plus"),
        (replace(MEMORY, maximum=Fraction(143615 * MIB)), "max must be min plus"),
        (replace(MEMORY, maximum=MEMORY.value + 256 * MIB), "min <= max <= value"),
        (replace(MEMORY, minimum=MEMORY.value), "min + step"),
        (replace(CORES, default=Fraction(0)), "default must lie within"),
        (replace(CORES, step=Fraction(0)), "step must be positive"),
    ],
    ids=[
        "valid",
        "default-off-grid",
        "max-off-grid",
        "max-over-value",
        "min-plus-step",
        "default-below-min",
        "zero-step",
    ],
)
def test_policy_errors(rule: CapacityRule, problem: str | None) -> None:
    errors = rule.errors()
    if problem is None:
        assert errors == []
    else:
        assert any(problem in e for e in errors), errors


@given(st.integers(0, 200 * 1024))
def test_fit_lands_on_the_grid(mib: int) -> None:
    got = MEMORY.fit(Fraction(mib * MIB))
    if got is None:
        assert mib > 143616
    else:
        assert got >= mib * MIB and (got - MEMORY.minimum) % (256 * MIB) == 0
        assert got - max(mib * MIB, 256 * MIB) < 256 * MIB


# ------------------------------------------------------------------ grants

H200 = cards(2)
BY_NAME = {f"gpu-{c.index}": c for c in H200}


def result(
    device: str = "gpu-0",
    consumed: dict[str, str] | None = None,
    request: str = "gpu",
    driver: str = DRIVER,
    pool: str = NODE,
    share: str | None = "s1",
) -> AllocatedDevice:
    return AllocatedDevice(request, driver, pool, device, consumed, share)


def grant_of(*results: AllocatedDevice) -> list[tuple[str, tuple[int, ...], int, int]]:
    got = grants(results, driver=DRIVER, pool=NODE, cards=BY_NAME, memory_unit_mib=256)
    return [(g.request, tuple(c.index for c in g.cards), g.core_percent, g.memory_mib) for g in got]


@pytest.mark.parametrize(
    "results, expected",
    [
        ([result(consumed={"cores": "30", "memory": "10Gi"})], [("gpu", (0,), 30, 10240)]),
        ([result(consumed={"cores": "100", "memory": "143616Mi"})], [("gpu", (0,), 100, 0)]),
        ([result(consumed={"cores": "100", "memory": "10Gi"})], [("gpu", (0,), 100, 0)]),
        ([result(consumed={"cores": "20", "memory": "143616Mi"})], [("gpu", (0,), 20, 143616)]),
        ([result(consumed={"cores": "20"})], [("gpu", (0,), 20, 143616)]),
        ([result(consumed={"memory": "4Gi"})], [("gpu", (0,), 0, 4096)]),
        ([result(consumed={"cores": "0", "memory": "4Gi"})], [("gpu", (0,), 0, 4096)]),
        ([result(consumed={"cores": "0", "memory": "143616Mi"})], [("gpu", (0,), 100, 0)]),
        ([result(consumed=None, share=None)], [("gpu", (0,), 100, 0)]),
        ([result(consumed={"cores": "30", "memory": "10737418240"})], [("gpu", (0,), 30, 10240)]),
        (
            [
                result("gpu-0", {"cores": "30", "memory": "10Gi"}),
                result("gpu-1", {"cores": "30", "memory": "10Gi"}),
            ],
            [("gpu", (0, 1), 30, 10240)],
        ),
        (
            [
                result("gpu-1", {"cores": "100", "memory": "143616Mi"}, request="big"),
                result("gpu-0", {"cores": "5", "memory": "1Gi"}, request="small"),
            ],
            [("big", (1,), 100, 0), ("small", (0,), 5, 1024)],
        ),
        (
            [
                result("gpu-0", {"cores": "10", "memory": "1Gi"}, share="a"),
                result("gpu-0", {"cores": "10", "memory": "1Gi"}, share="b"),
            ],
            [("gpu", (0,), 20, 2048)],
        ),
        (
            [
                result(consumed={"cores": "30", "memory": "10Gi"}),
                result("gpu-9", driver="other.example.com", pool="elsewhere"),
            ],
            [("gpu", (0,), 30, 10240)],
        ),
    ],
    ids=[
        "fractional",
        "whole-card",
        "all-cores-is-whole-whatever-the-memory",
        "cores-and-all-memory",
        "cores-only-takes-the-memory-default",
        "memory-only-is-best-effort-compute-as-in-device-plugin-mode",
        "zero-cores-is-best-effort",
        "asked-nothing-is-the-whole-card",
        "exclusive-allocation-without-consumed-capacity",
        "memory-in-bytes",
        "one-request-two-cards",
        "two-requests",
        "two-shares-of-one-card",
        "other-drivers-results-skipped",
    ],
)
def test_grants(results: list[AllocatedDevice], expected: list[Any]) -> None:
    assert grant_of(*results) == expected


@pytest.mark.parametrize(
    "results, error, words",
    [
        ([result(driver="other.example.com")], InvalidRequest, "no device of driver"),
        ([], InvalidRequest, "no device of driver"),
        ([result(pool="node-b", consumed={"cores": "1"})], InvalidRequest, "another node"),
        ([result("gpu-7", {"cores": "1"})], UnknownDevice, "does not have"),
        ([result("cpu-0", {"cores": "1"})], UnknownDevice, "never published"),
        ([result(consumed={"cores": "-1"})], InvalidRequest, "cannot give"),
        ([result(consumed={"cores": "101"})], InvalidRequest, "cannot give"),
        ([result(consumed={"cores": "2.5"})], InvalidRequest, "cannot give"),
        ([result(consumed={"cores": "5", "memory": "300Mi"})], InvalidRequest, "cannot give"),
        ([result(consumed={"cores": "5", "memory": "200Gi"})], InvalidRequest, "cannot give"),
        ([result(consumed={"cores": "lots"})], InvalidRequest, "not a Kubernetes quantity"),
        (
            [result("gpu-0", {"cores": "100"}), result("gpu-1", {"cores": "5", "memory": "1Gi"})],
            InvalidRequest,
            "whole and some in part",
        ),
        (
            [
                result("gpu-0", {"cores": "5", "memory": "1Gi"}),
                result("gpu-1", {"cores": "6", "memory": "1Gi"}),
            ],
            InvalidRequest,
            "different amounts",
        ),
    ],
    ids=[
        "only-other-drivers",
        "no-results",
        "other-pool",
        "unknown-card",
        "not-a-device-name",
        "zero-cores",
        "too-many-cores",
        "fractional-cores",
        "memory-off-grid",
        "memory-over-the-card",
        "not-a-quantity",
        "whole-and-part",
        "uneven",
    ],
)
def test_grants_refuse_with_the_reason(
    results: list[AllocatedDevice], error: type[Exception], words: str
) -> None:
    with pytest.raises(error) as info:
        grant_of(*results)
    assert words in str(info.value)


# ------------------------------------------------------------------ claims


def claim(results: Any, reserved: Any = None) -> dict[str, Any]:
    status: dict[str, Any] = {"allocation": {"devices": {"results": results}}}
    if reserved is not None:
        status["reservedFor"] = reserved
    return {"metadata": {"namespace": "ns", "name": "c", "uid": "u-1"}, "status": status}


def test_claim_view_reads_results_and_pods() -> None:
    view = claim_view(
        claim(
            [
                {
                    "request": "gpu",
                    "driver": DRIVER,
                    "pool": NODE,
                    "device": "gpu-0",
                    "consumedCapacity": {"cores": "30", "memory": "10Gi"},
                    "shareID": "abc",
                }
            ],
            [{"resource": "pods", "name": "p", "uid": "pu"}, {"resource": "other", "name": "x"}],
        )
    )
    assert view.uid == "u-1" and view.pods == (("p", "pu"),)
    (r,) = view.results
    assert r.consumed == {"cores": "30", "memory": "10Gi"} and r.share_id == "abc"


@pytest.mark.parametrize(
    "obj, words",
    [
        ([], "not a JSON object"),
        ({"metadata": {"name": "c"}}, "has no allocation"),
        (claim([]), "has no allocation"),
        (claim("nope"), "has no allocation"),
        (claim([7]), "not an object"),
        (claim([{"request": "gpu", "driver": DRIVER}]), "lacks pool, device"),
        (
            claim(
                [{"request": "r", "driver": "d", "pool": "p", "device": "x", "consumedCapacity": 3}]
            ),
            "bad consumedCapacity",
        ),
    ],
    ids=[
        "not-a-dict",
        "no-status",
        "empty-results",
        "results-not-a-list",
        "result-not-a-dict",
        "missing-fields",
        "bad-consumed",
    ],
)
def test_claim_view_refuses_malformed_claims(obj: Any, words: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        claim_view(obj)
    assert words in info.value.message


@pytest.mark.parametrize(
    "ref, ok",
    [
        (ClaimRef("ns", "8f0e3c7a-0000-4000-8000-000000000000", "c"), True),
        (ClaimRef("ns", "../../etc", "c"), False),
        (ClaimRef("ns", "a" * 65, "c"), False),
        (ClaimRef("ns", "", "c"), False),
        (ClaimRef("", "u-1", "c"), False),
        (ClaimRef("ns", "u-1", "c" * 254), False),
    ],
    ids=["uuid", "path-traversal", "too-long", "empty", "no-namespace", "long-name"],
)
def test_claim_ref_check(ref: ClaimRef, ok: bool) -> None:
    if ok:
        ref.check()
    else:
        with pytest.raises(InvalidRequest):
            ref.check()


def test_cdi_names_are_unique_per_result_and_keys_per_request() -> None:
    results = [result(), result(share="b"), result("gpu-1", request="main/sub")]
    assert cdi_device_names("u", results) == ["u-gpu-gpu-0", "u-gpu-gpu-0-1", "u-main_sub-gpu-1"]
    assert claim_key("u", "gpu") == claim_key("u", "gpu") != claim_key("u", "main/sub")
    assert claim_key("u", "gpu").startswith("u-")


def test_claim_containers_follow_the_pod_spec() -> None:
    from vgpu.core.dra import claim_containers

    pod = {
        "spec": {
            "resourceClaims": [
                {"name": "direct", "resourceClaimName": "shared-claim"},
                {"name": "templ", "resourceClaimTemplateName": "t"},
            ],
            "initContainers": [{"name": "init", "resources": {"claims": [{"name": "templ"}]}}],
            "containers": [
                {"name": "a", "resources": {"claims": [{"name": "direct"}]}},
                {"name": "b", "resources": {"claims": [{"name": "templ", "request": "gpu"}]}},
                {"name": "c", "resources": {"claims": [{"name": "templ", "request": "other"}]}},
                {"name": "d"},
            ],
        },
        "status": {"resourceClaimStatuses": [{"name": "templ", "resourceClaimName": "p-templ-x"}]},
    }
    assert claim_containers(pod, "shared-claim", "gpu") == ["a"]
    assert claim_containers(pod, "p-templ-x", "gpu") == ["b", "init"]
    assert claim_containers(pod, "p-templ-x", "other") == ["c", "init"]
    assert claim_containers(pod, "unknown", "gpu") == []
    assert claim_containers(None, "shared-claim", "gpu") == []


# ------------------------------------------------------------------ burst cap from opaque config

from vgpu.core.dra import OpaqueConfig, claim_core_limit  # noqa: E402


def _slice_config(
    core_limit: object = None,
    *,
    requests: tuple[str, ...] = (),
    source: str = "FromClaim",
    **extra: object,
) -> OpaqueConfig:
    params: dict[str, object] = {"apiVersion": "vgpu.vendor.io/v1", "kind": "SliceConfig", **extra}
    if core_limit is not None:
        params["coreLimit"] = core_limit
    return OpaqueConfig(source, requests, "vgpu.vendor.io", params)


@pytest.mark.parametrize(
    ("configs", "default", "cap", "problems"),
    [
        ([], None, 30, 0),  # nothing: the guarantee
        ([], 60, 60, 0),  # the cluster default
        ([], 10, 30, 0),  # a default below the guarantee never lowers it
        ([_slice_config(80)], None, 80, 0),
        ([_slice_config("80%")], None, 80, 0),
        ([_slice_config(100)], None, 100, 0),
        ([_slice_config(30)], None, 30, 0),
        ([_slice_config(20)], None, 30, 1),  # below the guarantee: ignored
        ([_slice_config(101)], 50, 50, 1),  # out of range: the default applies
        ([_slice_config("lots")], None, 30, 1),
        ([_slice_config(True)], None, 30, 1),
        ([_slice_config(80.5)], None, 30, 1),
        ([_slice_config(80, corelimit=90)], None, 30, 1),  # a typo is not silently dropped
        ([_slice_config()], None, 30, 0),  # no coreLimit: nothing said
        ([OpaqueConfig("FromClaim", (), "vgpu.vendor.io", [1])], None, 30, 1),
        ([OpaqueConfig("FromClaim", (), "vgpu.vendor.io", {"kind": "Other"})], None, 30, 1),
        ([OpaqueConfig("FromClaim", (), "other.io", {"coreLimit": 90})], None, 30, 0),
        ([_slice_config(90, requests=("other",))], None, 30, 0),  # another request's
        ([_slice_config(90, requests=("gpu",))], None, 90, 0),
        # class first, then claim: the claim's wins; a bad claim entry leaves the class's
        ([_slice_config(50, source="FromClass"), _slice_config(70)], None, 70, 0),
        ([_slice_config(50, source="FromClass"), _slice_config(5)], None, 50, 1),
    ],
)
def test_claim_core_limit_from_opaque_parameters(
    configs: list[OpaqueConfig], default: int | None, cap: int, problems: int
) -> None:
    choice = claim_core_limit(configs, "vendor.io", "gpu", 30, default)
    assert choice.cap_percent == cap
    assert len(choice.problems) == problems
    for problem in choice.problems:
        assert "config" in problem and "ignored" in problem


def test_claim_view_reads_the_allocated_config_in_order() -> None:
    from vgpu.core.dra import claim_view

    obj = {
        "metadata": {"uid": "u1", "namespace": "default", "name": "c"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": "vgpu.vendor.io",
                            "pool": "n",
                            "device": "gpu-0",
                        }
                    ],
                    "config": [
                        {
                            "source": "FromClass",
                            "requests": ["gpu"],
                            "opaque": {"driver": "vgpu.vendor.io", "parameters": {"a": 1}},
                        },
                        {
                            "source": "FromClaim",
                            "opaque": {"driver": "vgpu.vendor.io", "parameters": {"b": 2}},
                        },
                        {"source": "FromClaim"},  # not opaque: skipped
                        "junk",
                    ],
                }
            }
        },
    }
    view = claim_view(obj)
    assert [(c.source, c.requests, c.parameters) for c in view.config] == [
        ("FromClass", ("gpu",), {"a": 1}),
        ("FromClaim", (), {"b": 2}),
    ]


# ------------------------------------------------------------- claim status


_AT = "2026-12-04T22:55:40Z"
_SLICE = PreparedDevice("gpu", NODE, "gpu-0", ("vendor.io/vgpu=x",), share_id="s-1")


@pytest.mark.parametrize(
    "core, memory, data, message",
    [
        pytest.param(
            30,
            10240,
            {"wholeCard": False, "coreLimitPercent": 30, "memoryLimitMiB": 10240},
            "request gpu: GPU-a, core 30%, memory 10240 MiB",
            id="slice",
        ),
        pytest.param(
            0,
            10240,
            {"wholeCard": False, "coreLimitPercent": None, "memoryLimitMiB": 10240},
            "request gpu: GPU-a, memory 10240 MiB",
            id="memory-only",
        ),
        pytest.param(
            100,
            0,
            {"wholeCard": True, "coreLimitPercent": None, "memoryLimitMiB": None},
            "request gpu: GPU-a, the whole card",
            id="whole-card",
        ),
    ],
)
def test_device_status_names_the_allocated_device_with_a_ready_condition(
    core: int, memory: int, data: dict[str, Any], message: str
) -> None:
    entry = device_status(DRIVER, _SLICE, "GPU-a", core, memory, _AT)
    assert entry == {
        "driver": DRIVER,
        "pool": NODE,
        "device": "gpu-0",
        "shareID": "s-1",  # the API server refuses an entry of a shared card without it
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Prepared",
                "message": message,
                "lastTransitionTime": _AT,
            }
        ],
        "data": {"request": "gpu", "uuid": "GPU-a", **data},
    }
    whole = device_status(DRIVER, replace(_SLICE, share_id=None), "GPU-a", 100, 0, _AT)
    assert "shareID" not in whole


def test_merge_device_status_keeps_other_drivers_and_unchanged_transition_times() -> None:
    other = {"driver": "net.example.com", "pool": NODE, "device": "eth0", "data": {}}
    before = device_status(DRIVER, _SLICE, "GPU-a", 30, 10240, _AT)
    later = device_status(DRIVER, _SLICE, "GPU-a", 30, 10240, "2026-12-05T00:00:00Z")
    # rewritten the same: nothing changes, the condition did not transition
    assert merge_device_status([other, before], DRIVER, [later]) == [other, before]
    # a condition that changed status gets the new time
    failed = {**later, "conditions": [{**later["conditions"][0], "status": "False"}]}
    assert merge_device_status([before, other], DRIVER, [failed]) == [other, failed]
    # another device (another shareID) is a new entry with its own time
    moved = device_status(DRIVER, replace(_SLICE, share_id="s-2"), "GPU-a", 30, 10240, "t2")
    assert merge_device_status([before], DRIVER, [moved]) == [moved]
    # unprepared: ours go, the others stay
    assert merge_device_status([before, other], DRIVER, []) == [other]
    assert merge_device_status([], DRIVER, []) == []
