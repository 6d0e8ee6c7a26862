"""Held IDs arriving in Allocate: is their holder an init container of the
same pod, or dead?

The kubelet calls Allocate once per container lifetime; after its own restart
it replays its checkpoint and calls nothing. So IDs that a placement still
holds can reach Allocate for two reasons only:

* an app container reuses the IDs of an init container of its own pod (the
  kubelet hands them over without asking GetPreferredAllocation when they
  cover the request), or
* the holder's container is gone and the kubelet hands its IDs to a new
  container straight away (no GetPreferredAllocation when, e.g., a
  NUMA-aligned set holds exactly the IDs needed), before vgpu noticed.

The first must keep the holder's placement; the second must never give the
new container the old one's limits, config or files. The daemon tells them
apart by fact: the kubelet's pod-resources List (asked only in this case) and
the synced pod cache. Pure: the facts come in as values.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from vgpu.core.model import DeviceId, Placement


class Holder(enum.Enum):
    REUSED = "reused"  # an init container of the same pod: the new container shares it
    DEAD = "dead"  # its container is gone: release it and discard its directory
    UNKNOWN = "unknown"  # cannot tell: keep it; the new container gets its own placement


@dataclass(frozen=True)
class KubeletListing:
    """The kubelet's pod-resources List, reduced to what the judgement needs."""

    # (namespace, pod) -> names of its app containers (the List shows no init containers)
    pods: Mapping[tuple[str, str], frozenset[str]]
    # device ID -> (namespace, pod, container) listed as holding it
    held: Mapping[DeviceId, tuple[str, str, str]]


def judge_holder(
    placement: Placement,
    *,
    settled: bool,
    listing: KubeletListing | None,
    pod_gone: bool,
) -> tuple[Holder, str]:
    """The verdict on a placement holding IDs that arrive in Allocate, with the reason.

    `settled`: the kubelet listed the placement for a running container before
    (or an earlier run recorded it). `listing`: the kubelet's List now, None when
    it cannot be asked. `pod_gone`: the synced pod cache says the owner's pod
    (by UID) is deleted or finished.
    """
    owner = placement.owner
    if pod_gone:
        return Holder.DEAD, "the API server says its pod is gone"
    if listing is None:
        if settled:
            return (
                Holder.DEAD,
                "the kubelet listed it for a running container before and never hands a "
                "running container's IDs out again",
            )
        return Holder.UNKNOWN, "the kubelet's pod-resources API cannot be asked"
    holding = {listing.held[d] for d in placement.all_ids() if d in listing.held}
    if owner is not None:
        pod = (owner.namespace, owner.pod)
        if pod not in listing.pods:
            return Holder.DEAD, "the kubelet no longer runs its pod"
        if any(h[:2] == pod for h in holding):
            return Holder.REUSED, "a container of the same pod holds part of its IDs"
        if owner.container in listing.pods[pod]:
            return (
                Holder.DEAD,
                f"its app container {owner.container} no longer holds them (the pod was "
                "replaced by one of the same name)",
            )
        return Holder.REUSED, f"{owner.container} is an init container of a running pod"
    if holding:
        return Holder.REUSED, "a running container holds part of its IDs"
    if settled:
        return (
            Holder.DEAD,
            "the kubelet listed it for a running container before and lists it no more",
        )
    return (
        Holder.UNKNOWN,
        "it was placed without pod information and never listed by the kubelet",
    )
