"""A stand-in for kube-scheduler's DRA allocation, for tests, the demo and the
benchmarks: it fits ResourceClaims to the devices of the published
ResourceSlices and writes ``status.allocation`` (and ``reservedFor``) the way
the scheduler does, through the fake API server's store.

What it follows (resource.k8s.io/v1, consumable capacity):

* only complete pools count, at their highest generation (every slice of the
  generation present, ``resourceSliceCount`` of them);
* a request (``exactly``: ``deviceClassName``, ``selectors``, ``count``,
  ``capacity.requests``) takes devices that satisfy the DeviceClass's and its
  own CEL selectors (evaluated by cel-python: ``device.driver``,
  ``device.attributes["<driver>"].<name>``; capacity is offered as plain
  numbers, without the Kubernetes ``quantity`` functions);
* a device with ``allowMultipleAllocations`` is shared: each capacity is
  consumed by ``CapacityRule.fit`` (not asked: the default; below min: min; off
  the step grid: rounded up; over max: the device does not fit) and the
  consumption of all claims together never exceeds its value; the result
  records ``consumedCapacity`` (every capacity) and a fresh ``shareID``;
* any other device is exclusive: used by at most one claim, no consumedCapacity;
* all of a claim's devices come from one node; candidates are tried in node
  and device-name order (first fit).

* a device with a ``NoSchedule`` or ``NoExecute`` taint is not allocated
  (DRADeviceTaints; tolerations are not modelled).

Not modelled: ``firstAvailable``, ``allocationMode: All``, admin access,
constraints, tolerations, counters, binding conditions.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from vgpu.core.dra import CapacityRule, parse_quantity
from vgpu.core.errors import InvalidRequest
from vgpu.sim.apiserver import FakeApiServer

__all__ = ["Allocator", "Unschedulable", "claim_body", "device_class_body", "format_quantity"]

JSON = dict[str, Any]
_BINARY = (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))


class Unschedulable(Exception):
    """No device fits the claim (the scheduler would leave the pod pending)."""


def format_quantity(amount: Fraction, binary: bool) -> str:
    """A quantity in the API's canonical style: the largest exact binary suffix, or plain."""
    if amount.denominator != 1:
        return f"{int(amount * 1000)}m"
    value = int(amount)
    if binary and value:
        for suffix, size in _BINARY:
            if value % size == 0:
                return f"{value // size}{suffix}"
    return str(value)


@dataclass
class _Device:
    driver: str
    pool: str
    node: str
    data: JSON

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.driver, self.pool, str(self.data.get("name")))

    @property
    def shared(self) -> bool:
        return bool(self.data.get("allowMultipleAllocations"))

    def rules(self) -> dict[str, CapacityRule]:
        return {
            name: CapacityRule.from_json(raw)
            for name, raw in (self.data.get("capacity") or {}).items()
        }

    def cel(self) -> JSON:
        attributes: JSON = {}
        for name, value in (self.data.get("attributes") or {}).items():
            domain, _, short = name.rpartition("/")
            attributes.setdefault(domain or self.driver, {})[short] = next(iter(value.values()))
        capacity: JSON = {
            self.driver: {name: int(rule.value) for name, rule in self.rules().items()}
        }
        return {"driver": self.driver, "attributes": attributes, "capacity": capacity}


class _Selectors:
    """CEL expressions compiled once (cel-python)."""

    def __init__(self) -> None:
        try:
            import celpy
        except ImportError as exc:  # pragma: no cover - an install problem, said plainly
            raise RuntimeError(
                "the DRA scheduler stand-in needs cel-python: pip install 'vgpu[sim]'"
            ) from exc
        self._to_cel = celpy.json_to_cel  # type: ignore[attr-defined]
        self._env = celpy.Environment()
        self._programs: dict[str, Any] = {}

    def matches(self, expression: str, device: _Device) -> bool:
        program = self._programs.get(expression)
        if program is None:
            try:
                program = self._env.program(self._env.compile(expression))
            except Exception as exc:
                raise Unschedulable(
                    f"CEL selector {expression!r} does not compile: {exc}"
                ) from None
            self._programs[expression] = program
        try:
            result = program.evaluate({"device": self._to_cel(device.cel())})
        except Exception:
            return False  # e.g. an attribute the device lacks: no match
        return isinstance(result, int) and bool(result)  # celpy's BoolType is an int


class Allocator:
    def __init__(self, api: FakeApiServer) -> None:
        self.api = api
        self.selectors = _Selectors()

    # ----------------------------------------------------------- inventory

    def devices(self) -> list[_Device]:
        """Devices of complete pools at their highest generation, by node and name."""
        pools: dict[tuple[str, str], list[JSON]] = {}
        for obj in self.api.objects("resourceslices"):
            spec = obj.get("spec") or {}
            pools.setdefault((str(spec.get("driver")), str(spec["pool"]["name"])), []).append(spec)
        out: list[_Device] = []
        for (driver, pool), specs in pools.items():
            top = max(s["pool"]["generation"] for s in specs)
            current = [s for s in specs if s["pool"]["generation"] == top]
            if len(current) != current[0]["pool"]["resourceSliceCount"]:
                continue  # an incomplete pool is not used
            for spec in current:
                for device in spec.get("devices") or []:
                    out.append(_Device(driver, pool, str(spec.get("nodeName", "")), device))
        return sorted(out, key=lambda d: (d.node, str(d.data.get("name"))))

    def usage(self, skip: tuple[str, str] | None = None) -> dict[tuple[str, str, str], Any]:
        """Per device: consumed capacity (shared) or "exclusive", over all allocated claims."""
        used: dict[tuple[str, str, str], Any] = {}
        for claim in self.api.objects("resourceclaims"):
            meta = claim["metadata"]
            if skip == (meta.get("namespace"), meta.get("name")):
                continue
            allocation = (claim.get("status") or {}).get("allocation") or {}
            for r in (allocation.get("devices") or {}).get("results") or []:
                self._add_use(
                    used, (r["driver"], r["pool"], r["device"]), r.get("consumedCapacity")
                )
        return used

    @staticmethod
    def _add_use(
        used: dict[tuple[str, str, str], Any], key: tuple[str, str, str], consumed: Any
    ) -> None:
        if consumed is None:
            used[key] = "exclusive"
            return
        slot = used.setdefault(key, {})
        if slot == "exclusive":
            return
        for name, quantity in consumed.items():
            slot[name] = slot.get(name, Fraction(0)) + parse_quantity(quantity)

    # ---------------------------------------------------------- allocation

    def allocate(
        self,
        namespace: str,
        name: str,
        *,
        pod: tuple[str, str] | None = None,
        node: str | None = None,
    ) -> JSON:
        """Allocate the claim (if not yet) and reserve it for ``pod`` (name, uid);
        returns its status. Unschedulable when no device fits."""
        claim = self.api.get_object("resourceclaims", name, namespace)
        if claim is None:
            raise Unschedulable(f"ResourceClaim {namespace}/{name} does not exist")
        status = claim.get("status") or {}
        allocation = status.get("allocation")
        if allocation is None:
            allocation = self._fit(claim, node)
        reserved = list(status.get("reservedFor") or [])
        if pod is not None and not any(r.get("uid") == pod[1] for r in reserved):
            reserved.append({"resource": "pods", "name": pod[0], "uid": pod[1]})

        def write(obj: JSON) -> None:
            obj["status"] = {"allocation": allocation, "reservedFor": reserved}
            if not reserved:
                del obj["status"]["reservedFor"]

        stored = self.api.update_object("resourceclaims", name, write, namespace)
        return dict(stored["status"])

    def deallocate(self, namespace: str, name: str) -> None:
        """What the resourceclaim controller does once no pod uses the claim."""

        def clear(obj: JSON) -> None:
            obj.pop("status", None)

        self.api.update_object("resourceclaims", name, clear, namespace)

    def _fit(self, claim: JSON, node: str | None) -> JSON:
        ident = f"{claim['metadata'].get('namespace')}/{claim['metadata']['name']}"
        requests = ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []
        if not requests:
            raise Unschedulable(f"claim {ident} has no device request")
        used = self.usage(skip=(claim["metadata"].get("namespace"), claim["metadata"]["name"]))
        devices = self.devices()
        nodes = [node] if node is not None else sorted({d.node for d in devices})
        reasons: list[str] = []
        for candidate in nodes:
            try:
                results = self._fit_on(
                    ident,
                    requests,
                    [d for d in devices if d.node == candidate],
                    copy.deepcopy(used),
                )
            except Unschedulable as exc:
                reasons.append(f"{candidate}: {exc}")
                continue
            devices_out: JSON = {"results": results}
            config = self._config(claim, requests)
            if config:
                devices_out["config"] = config
            return {
                "devices": devices_out,
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [candidate]}
                            ]
                        }
                    ]
                },
            }
        raise Unschedulable(f"no node fits claim {ident}: {'; '.join(reasons) or 'no devices'}")

    def _config(self, claim: JSON, requests: list[JSON]) -> list[JSON]:
        """status.allocation.devices.config as the scheduler copies it: each used
        DeviceClass's config (source FromClass, for the requests of that class),
        then the claim's own (source FromClaim, its `requests` as written)."""
        out: list[JSON] = []
        by_class: dict[str, list[str]] = {}
        for request in requests:
            name = (request.get("exactly") or {}).get("deviceClassName")
            if name:
                by_class.setdefault(str(name), []).append(str(request["name"]))
        for name, names in by_class.items():
            device_class = self.api.get_object("deviceclasses", name) or {}
            for entry in (device_class.get("spec") or {}).get("config") or []:
                if "opaque" in entry:
                    out.append(
                        {"source": "FromClass", "requests": names, "opaque": entry["opaque"]}
                    )
        for entry in ((claim.get("spec") or {}).get("devices") or {}).get("config") or []:
            if "opaque" in entry:
                item: JSON = {"source": "FromClaim", "opaque": copy.deepcopy(entry["opaque"])}
                if entry.get("requests"):
                    item["requests"] = list(entry["requests"])
                out.append(item)
        return out

    def _fit_on(
        self,
        ident: str,
        requests: Iterable[JSON],
        devices: list[_Device],
        used: dict[tuple[str, str, str], Any],
    ) -> list[JSON]:
        results: list[JSON] = []
        for request in requests:
            exactly = request.get("exactly")
            if not isinstance(exactly, dict):
                raise Unschedulable(f"request {request.get('name')!r}: only 'exactly' is modelled")
            if exactly.get("allocationMode", "ExactCount") != "ExactCount":
                raise Unschedulable("only allocationMode ExactCount is modelled")
            expressions = self._expressions(exactly)
            wanted = {
                k: parse_quantity(v)
                for k, v in ((exactly.get("capacity") or {}).get("requests") or {}).items()
            }
            count = int(exactly.get("count", 1))
            taken = 0
            for device in devices:
                if taken == count:
                    break
                if any(
                    t.get("effect") in ("NoSchedule", "NoExecute")
                    for t in device.data.get("taints") or []
                ):
                    continue
                if not all(self.selectors.matches(e, device) for e in expressions):
                    continue
                consumed = self._consume(device, wanted, used.get(device.key))
                if consumed is False:
                    continue
                result: JSON = {
                    "request": request["name"],
                    "driver": device.driver,
                    "pool": device.pool,
                    "device": device.data["name"],
                }
                if isinstance(consumed, dict):
                    binary = {
                        name: str((device.data["capacity"][name]).get("value", "")).endswith("i")
                        for name in consumed
                    }
                    result["consumedCapacity"] = {
                        name: format_quantity(amount, binary[name])
                        for name, amount in consumed.items()
                    }
                    result["shareID"] = str(uuid.uuid4())
                    self._add_use(used, device.key, result["consumedCapacity"])
                else:
                    self._add_use(used, device.key, None)
                results.append(result)
                taken += 1
            if taken < count:
                raise Unschedulable(
                    f"request {request['name']!r} of {ident}: {taken} of {count} device(s) fit"
                )
        return results

    def _expressions(self, exactly: JSON) -> list[str]:
        name = exactly.get("deviceClassName")
        device_class = self.api.get_object("deviceclasses", str(name)) if name else None
        if device_class is None:
            raise Unschedulable(f"DeviceClass {name!r} does not exist")
        selectors = list((device_class.get("spec") or {}).get("selectors") or [])
        selectors += list(exactly.get("selectors") or [])
        return [str(s["cel"]["expression"]) for s in selectors if "cel" in s]

    def _consume(self, device: _Device, wanted: dict[str, Fraction], prior: Any) -> Any:
        """The consumption on `device` (dict), True for an exclusive fit, False if none."""
        try:
            rules = device.rules()
        except InvalidRequest:
            return False
        if not set(wanted) <= set(rules):
            return False  # capacity asked that the device does not have
        if not device.shared:
            if prior is not None:
                return False
            return all(rules[k].value >= v for k, v in wanted.items())
        if prior == "exclusive":
            return False
        consumed: dict[str, Fraction] = {}
        for name, rule in rules.items():
            amount = rule.fit(wanted.get(name))
            if amount is None or (prior or {}).get(name, 0) + amount > rule.value:
                return False
            consumed[name] = amount
        return consumed


def claim_body(
    name: str,
    *,
    namespace: str = "default",
    device_class: str = "vgpu.vendor.io",
    capacity: dict[str, str] | None = None,
    count: int = 1,
    selectors: Iterable[str] = (),
    request: str = "gpu",
) -> JSON:
    """A ResourceClaim asking one request ``exactly`` of a DeviceClass."""
    exactly: JSON = {"deviceClassName": device_class}
    if count != 1:
        exactly["count"] = count
    if capacity:
        exactly["capacity"] = {"requests": dict(capacity)}
    expressions = list(selectors)
    if expressions:
        exactly["selectors"] = [{"cel": {"expression": e}} for e in expressions]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"devices": {"requests": [{"name": request, "exactly": exactly}]}},
    }


def device_class_body(driver: str) -> JSON:
    """The DeviceClass deploy/dra/ ships: every device of the driver."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": driver},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]},
    }
