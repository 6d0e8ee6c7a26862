"""Held IDs arriving in Allocate: the holder's verdict from the kubelet's facts."""

from __future__ import annotations

import pytest

from vgpu.core.model import CardUuid, DeviceId, Owner, Placement, Resource
from vgpu.core.reuse import Holder, KubeletListing, judge_holder

CARD = CardUuid("GPU-0")
IDS = frozenset(DeviceId(f"GPU-0-c{i}") for i in range(10))
INIT = Owner("ns", "web", "setup", "uid-1")
APP = Owner("ns", "web", "main", "uid-1")


def placement(owner: Owner | None) -> Placement:
    return Placement("p1", (CARD,), {Resource.CORE: IDS}, 10, 1024, owner)


def listing(pods: dict[tuple[str, str], set[str]], held: dict[str, str] | None = None) -> object:
    return KubeletListing(
        {k: frozenset(v) for k, v in pods.items()},
        {DeviceId(d): ("ns", "web", c) for d, c in (held or {}).items()},
    )


WEB = {("ns", "web"): {"main"}}
CASES = [
    # id, owner, settled, listing, pod_gone, verdict
    ("api-says-gone", APP, False, listing(WEB), True, Holder.DEAD),
    ("no-listing-settled", APP, True, None, False, Holder.DEAD),
    ("no-listing-unsettled", INIT, False, None, False, Holder.UNKNOWN),
    ("pod-no-longer-runs", APP, True, listing({}), False, Holder.DEAD),
    ("init-of-running-pod", INIT, False, listing(WEB), False, Holder.REUSED),
    ("app-of-namesake-pod", APP, True, listing(WEB), False, Holder.DEAD),
    (
        "same-pod-holds-part",
        APP,
        True,
        listing(WEB, {"GPU-0-c0": "main"}),
        False,
        Holder.REUSED,
    ),
    ("ownerless-held-part", None, False, listing(WEB, {"GPU-0-c3": "main"}), False, Holder.REUSED),
    ("ownerless-settled", None, True, listing(WEB), False, Holder.DEAD),
    ("ownerless-unsettled", None, False, listing(WEB), False, Holder.UNKNOWN),
]


@pytest.mark.parametrize(
    ("owner", "settled", "facts", "pod_gone", "verdict"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_judge_holder(
    owner: Owner | None, settled: bool, facts: object, pod_gone: bool, verdict: Holder
) -> None:
    assert isinstance(facts, KubeletListing | None)
    got, why = judge_holder(placement(owner), settled=settled, listing=facts, pod_gone=pod_gone)
    assert got is verdict, why
    assert why
