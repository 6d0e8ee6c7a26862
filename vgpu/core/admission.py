"""Admission decisions for `vgpu webhook`: pure, no I/O.

Two answers to an AdmissionReview v1 about a Pod:

- **mutate**: a pod that asks for `<domain>/vcuda-core` or `<domain>/vcuda-memory`
  in any container (init containers included), whose schedulerName is empty or
  `default-scheduler`, and that is not a DRA-mode pod, gets a JSONPatch setting
  `spec.schedulerName` to the vgpu scheduler's name;
- **validate**: at CREATE, every container that asks for vgpu resources passes
  the node's own request rules (`fit.check_container`, the code the node runs
  at admission), or the pod is refused with the node's message, naming the
  container and the fix.

A DRA-mode pod is one with `spec.resourceClaims`: its GPUs come through claims
and the default scheduler's DRA plugin places them, so the scheduler name is
never changed for it (even if it also asks for extended resources).

`match_condition_expression` is the one definition of the webhook
configurations' matchConditions CEL: only pods that ask for vgpu resources are
sent to the webhook at all, so `failurePolicy: Fail` blocks nothing else.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vgpu.core.errors import InvalidRequest
from vgpu.core.fit import check_container
from vgpu.core.model import ContainerSpec, Resource

# The API server refuses request bodies over 3 MiB; an AdmissionReview carries
# one object (plus oldObject on UPDATE), so twice that is a generous bound.
MAX_REVIEW_BYTES = 6 * 1024 * 1024
DEFAULT_SCHEDULERS = frozenset({"", "default-scheduler"})
MATCH_CONDITION_NAME = "asks-for-vgpu-resources"
REVIEW_API_VERSION = "admission.k8s.io/v1"
_DOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


class BadReview(Exception):
    """The body is not an AdmissionReview v1 request: answered with HTTP 400."""


def _containers_cel(field_name: str, domain: str) -> str:
    names = [r.full_name(domain) for r in Resource]

    def asks(where: str) -> str:
        inner = " || ".join(f"'{n}' in c.resources.{where}" for n in names)
        return f"(has(c.resources.{where}) && ({inner}))"

    return (
        f"object.spec.{field_name}.exists(c, has(c.resources) && "
        f"({asks('limits')} || {asks('requests')}))"
    )


def match_condition_expression(domain: str) -> str:
    """The matchConditions CEL both webhook configurations use: true for a pod
    that asks for `<domain>/vcuda-core` or `<domain>/vcuda-memory` in any
    container or init container (requests or limits)."""
    if not _DOMAIN.match(domain):
        raise ValueError(f"resource domain {domain!r} is not a DNS subdomain")
    return (
        f"{_containers_cel('containers', domain)} || "
        f"(has(object.spec.initContainers) && {_containers_cel('initContainers', domain)})"
    )


@dataclass(frozen=True)
class Review:
    """The parts of an AdmissionReview v1 request the webhook reads."""

    uid: str
    group: str
    kind: str
    operation: str
    namespace: str
    obj: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_pod(self) -> bool:
        return self.group == "" and self.kind == "Pod"


def parse_review(body: bytes) -> Review:
    """An AdmissionReview v1 request, or BadReview naming what is wrong."""
    if len(body) > MAX_REVIEW_BYTES:
        raise BadReview(f"body of {len(body)} bytes is over the {MAX_REVIEW_BYTES}-byte limit")
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadReview(f"body is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise BadReview("body is not a JSON object")
    if doc.get("apiVersion") != REVIEW_API_VERSION or doc.get("kind") != "AdmissionReview":
        raise BadReview(
            f"expected apiVersion {REVIEW_API_VERSION} kind AdmissionReview, got "
            f"{doc.get('apiVersion')!r} {doc.get('kind')!r}: set admissionReviewVersions: [v1]"
        )
    request = doc.get("request")
    if not isinstance(request, dict):
        raise BadReview("AdmissionReview has no request")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise BadReview("AdmissionReview request has no uid")
    kind = request.get("kind")
    if not isinstance(kind, dict):
        raise BadReview("AdmissionReview request has no kind")
    obj = request.get("object")
    if obj is not None and not isinstance(obj, dict):
        raise BadReview("AdmissionReview request.object is not an object")
    return Review(
        uid=uid,
        group=str(kind.get("group") or ""),
        kind=str(kind.get("kind") or ""),
        operation=str(request.get("operation") or ""),
        namespace=str(request.get("namespace") or ""),
        obj=obj or {},
    )


def _containers(pod: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return
    for key in ("initContainers", "containers"):
        items = spec.get(key)
        if isinstance(items, list):
            yield from (c for c in items if isinstance(c, dict))


def asks_vgpu(pod: Mapping[str, Any], domain: str) -> bool:
    """True when any container or init container names a vgpu resource."""
    names = {r.full_name(domain) for r in Resource}
    for container in _containers(pod):
        resources = container.get("resources")
        if not isinstance(resources, dict):
            continue
        for part in ("limits", "requests"):
            values = resources.get(part)
            if isinstance(values, dict) and names & values.keys():
                return True
    return False


def is_dra_pod(pod: Mapping[str, Any]) -> bool:
    """A pod that gets its devices through DRA claims."""
    spec = pod.get("spec")
    return isinstance(spec, dict) and bool(spec.get("resourceClaims"))


def scheduler_patch(
    pod: Mapping[str, Any], domain: str, scheduler_name: str
) -> list[dict[str, Any]]:
    """The JSONPatch that hands the pod to the vgpu scheduler; [] when none is due."""
    if not scheduler_name or is_dra_pod(pod) or not asks_vgpu(pod, domain):
        return []
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return []
    current = spec.get("schedulerName")
    if current is not None and not isinstance(current, str):
        return []
    if (current or "") not in DEFAULT_SCHEDULERS:
        return []  # the pod chose a scheduler: respect it
    op = "replace" if "schedulerName" in spec else "add"
    return [{"op": op, "path": "/spec/schedulerName", "value": scheduler_name}]


def named_pod(review: Review) -> dict[str, Any]:
    """The review's pod with a namespace and a name for messages (a pod made
    from generateName has no name yet at CREATE)."""
    pod = dict(review.obj)
    meta = dict(pod.get("metadata") or {})
    meta["namespace"] = meta.get("namespace") or review.namespace or "default"
    if not meta.get("name"):
        meta["name"] = f"{meta.get('generateName') or ''}<generated>"
    pod["metadata"] = meta
    return pod


def refusals(specs: Sequence[ContainerSpec], domain: str, unit_mib: int) -> list[str]:
    """The node's request rules over a pod's containers: one message per broken container."""
    out = []
    for spec in specs:
        try:
            check_container(spec, domain, unit_mib)
        except InvalidRequest as exc:
            kind = "init container" if spec.init else "container"
            text = exc.message
            if spec.problem:
                out.append(text)  # already names namespace/pod/container
            else:
                out.append(f"{kind} {spec.namespace}/{spec.pod}/{spec.container}: {text}")
    return out


def response(
    review_uid: str,
    allowed: bool,
    message: str = "",
    patch: Sequence[Mapping[str, Any]] = (),
    warnings: Sequence[str] = (),
) -> dict[str, Any]:
    """An AdmissionReview v1 response."""
    answer: dict[str, Any] = {"uid": review_uid, "allowed": allowed}
    if not allowed:
        answer["status"] = {"code": 422, "reason": "Invalid", "message": message}
    if patch:
        answer["patchType"] = "JSONPatch"
        answer["patch"] = base64.b64encode(json.dumps(list(patch)).encode()).decode()
    if warnings:
        answer["warnings"] = list(warnings)
    return {"apiVersion": REVIEW_API_VERSION, "kind": "AdmissionReview", "response": answer}


def not_a_pod(review: Review) -> dict[str, Any]:
    """Allowed with a warning: the webhook judges pods only (a configuration slip)."""
    what = f"{review.group or 'core'}/{review.kind or '?'}"
    return response(
        review.uid,
        True,
        warnings=[
            f"vgpu webhook judges Pods only and let this {what} through: check the "
            "webhook configuration's rules (resources: [pods])"
        ],
    )


def mutate(review: Review, domain: str, scheduler_name: str) -> dict[str, Any]:
    if not review.is_pod:
        return not_a_pod(review)
    if review.operation != "CREATE":
        return response(review.uid, True)
    return response(review.uid, True, patch=scheduler_patch(review.obj, domain, scheduler_name))


def validate(
    review: Review, specs: Sequence[ContainerSpec], domain: str, unit_mib: int
) -> dict[str, Any]:
    """`specs`: the pod's containers as the node parses them (adapters.kube.container_specs)."""
    if not review.is_pod:
        return not_a_pod(review)
    if review.operation != "CREATE":
        return response(review.uid, True)
    problems = refusals(specs, domain, unit_mib)
    if problems:
        return response(review.uid, False, "vgpu: " + "; ".join(problems))
    return response(review.uid, True)
