"""DRA mode's pure rules: what is published, how capacity is consumed, and what
a claim's allocation grants a container.

Kubernetes' Dynamic Resource Allocation (resource.k8s.io/v1) with consumable
capacity: each healthy card is one device `gpu-<index>` that several claims may
share (`allowMultipleAllocations`), with two capacities:

    cores   value 100, validRange min 1, max 100, step 1, default 100
    memory  the card's memory rounded down to the memory unit, validRange
            min = step = one unit, max = default = that value

kube-scheduler fits each claim on one card by these rules (`fit`), writes
what it consumed into the claim's allocation, and the driver turns that into
the device plugin's own limit contract (`grants`): the scheduler's numbers are
the container's limits.

What a claim gets:

- it consumes all 100 cores -> the card whole: no core or memory limit, no
  hook (also when the allocation carries no consumed capacity, which is how an
  exclusive allocation looks without the consumable-capacity feature);
- otherwise -> VGPU_CORE_LIMIT = the cores consumed and VGPU_MEMORY_LIMIT_MIB =
  the memory consumed. A claim that asks cores only consumes the memory
  default, i.e. the whole card's memory: it gets that as its limit and, as every
  claim consumes at least one memory unit, keeps the card to itself. A claim
  that asks memory only consumes the cores default, 0: best-effort compute with
  its memory limit, blocking no one's cores, as a memory-only request does in
  device-plugin mode. A claim that asks nothing consumes 0 cores and the whole
  memory: the card whole, as before.

Pure: quantities come in as the API's strings, cards as core Cards.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from vgpu.core.arbiter import CapChoice, check_cap, default_core_cap
from vgpu.core.errors import InvalidRequest, UnknownDevice
from vgpu.core.model import CORE_UNITS_PER_CARD, Card

API_VERSION = "resource.k8s.io/v1"
CORES = "cores"
MEMORY = "memory"
MIB = 1024 * 1024
MAX_DEVICES_PER_SLICE = 128
_DEVICE_RE = re.compile(r"^gpu-(0|[1-9][0-9]{0,5})$")


def driver_name(domain: str) -> str:
    """The DRA driver name, e.g. vgpu.vendor.io (also the DeviceClass name)."""
    return f"vgpu.{domain}"


def cdi_kind(domain: str) -> str:
    """The CDI kind of vgpu's devices, e.g. vendor.io/vgpu."""
    return f"{domain}/vgpu"


def device_name(card: Card) -> str:
    return f"gpu-{card.index}"


def card_index(name: str) -> int:
    """The card index of a device name `gpu-<index>`; UnknownDevice otherwise."""
    match = _DEVICE_RE.match(name)
    if match is None:
        raise UnknownDevice(
            f"device {name[:80]!r} is not a vgpu device name (gpu-<index>); the allocation "
            "names a device this driver never published",
            (name,),
        )
    return int(match.group(1))


# ------------------------------------------------------------------ quantities

_QUANTITY_RE = re.compile(r"^([+-]?[0-9]+(?:\.[0-9]*)?|[+-]?\.[0-9]+)([A-Za-z]*|[eE][+-]?[0-9]+)$")
_SUFFIX: dict[str, Fraction] = {
    "": Fraction(1),
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
}


def parse_quantity(text: object) -> Fraction:
    """A Kubernetes quantity ("30", "10Gi", "1.5G", "500m", "1e3") as an exact number."""
    raw = str(text).strip() if isinstance(text, str | int) and not isinstance(text, bool) else ""
    match = _QUANTITY_RE.match(raw) if len(raw) <= 64 else None
    if match is None:
        raise InvalidRequest(f"{str(text)[:40]!r} is not a Kubernetes quantity (e.g. 30, 10Gi)")
    number, suffix = match.groups()
    if suffix[:1] in ("e", "E") and suffix[1:].lstrip("+-").isdigit():
        return Fraction(number) * Fraction(10) ** int(suffix[1:])
    if suffix not in _SUFFIX:
        raise InvalidRequest(f"{raw!r} has an unknown quantity suffix {suffix!r}")
    return Fraction(number) * _SUFFIX[suffix]


def mib_quantity(mib: int) -> str:
    return f"{mib}Mi"


# ------------------------------------------------------------ capacity policy


@dataclass(frozen=True)
class CapacityRule:
    """A capacity and its requestPolicy as the API states them, in base units
    (bytes for memory): what the API server checks and the scheduler applies."""

    value: Fraction
    minimum: Fraction | None = None  # None: no validRange (a request takes what it asks)
    maximum: Fraction | None = None
    step: Fraction | None = None
    default: Fraction | None = None  # None: the whole value

    def fit(self, requested: Fraction | None) -> Fraction | None:
        """What a request consumes, None when the device cannot give it.

        Not asked: the default (the whole value without a policy). Below min:
        min. Off the grid: rounded up to min + n * step. Above max (also after
        rounding) or above the value: not allocatable.
        """
        if requested is None:
            return self.value if self.default is None else self.default
        amount = requested
        if self.minimum is not None:
            amount = max(amount, self.minimum)
            if self.step:
                steps = -((self.minimum - amount) // self.step)  # ceil((amount - min) / step)
                amount = self.minimum + steps * self.step
        limit = self.value if self.maximum is None else min(self.maximum, self.value)
        return amount if 0 <= amount <= limit else None

    def errors(self) -> list[str]:
        """The API server's checks of the policy (empty when valid)."""
        out = []
        low = self.minimum if self.minimum is not None else Fraction(0)
        high = self.maximum if self.maximum is not None else self.value
        if not 0 <= low <= high <= self.value:
            out.append("need 0 <= min <= max <= value")
        if self.default is not None and not low <= self.default <= high:
            out.append("default must lie within [min, max]")
        if self.step is not None:
            if self.step <= 0 or low + self.step > self.value:
                out.append("step must be positive and min + step must not exceed the value")
            else:
                if self.maximum is not None and (self.maximum - low) % self.step:
                    out.append("max must be min plus a multiple of step")
                if self.default is not None and (self.default - low) % self.step:
                    out.append("default must be min plus a multiple of step")
        return out

    @classmethod
    def from_json(cls, raw: Any) -> CapacityRule:
        """A published DeviceCapacity ({value, requestPolicy}); InvalidRequest if malformed."""
        if not isinstance(raw, dict) or "value" not in raw:
            raise InvalidRequest("a capacity needs a value")
        policy = raw.get("requestPolicy") or {}
        valid = policy.get("validRange") if isinstance(policy, dict) else None
        if policy and not isinstance(valid, dict):
            raise InvalidRequest("a requestPolicy needs a validRange (validValues unsupported)")

        def get(source: Any, key: str) -> Fraction | None:
            return parse_quantity(source[key]) if source and key in source else None

        return cls(
            value=parse_quantity(raw["value"]),
            minimum=get(valid, "min"),
            maximum=get(valid, "max"),
            step=get(valid, "step"),
            default=get(policy, "default"),
        )


@dataclass(frozen=True)
class Capacity:
    """One of vgpu's two capacities of a card, in whole units (cores, MiB)."""

    name: str
    value: int
    minimum: int
    step: int
    default: int
    unit: str = ""  # quantity suffix: "" (cores) or "Mi"

    def quantity(self, amount: int) -> str:
        return f"{amount}{self.unit}"

    @property
    def scale(self) -> int:
        return MIB if self.unit == "Mi" else 1

    def rule(self) -> CapacityRule:
        s = self.scale
        return CapacityRule(
            Fraction(self.value * s),
            Fraction(self.minimum * s),
            Fraction(self.value * s),
            Fraction(self.step * s),
            Fraction(self.default * s),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "value": self.quantity(self.value),
            "requestPolicy": {
                "default": self.quantity(self.default),
                "validRange": {
                    "min": self.quantity(self.minimum),
                    "max": self.quantity(self.value),
                    "step": self.quantity(self.step),
                },
            },
        }


def card_capacities(card: Card, memory_unit_mib: int) -> dict[str, Capacity]:
    """The two capacities of one card; {} when it has under two memory units
    (min + step must fit in the value)."""
    memory_mib = card.memory_units(memory_unit_mib) * memory_unit_mib
    if memory_mib < 2 * memory_unit_mib:
        return {}
    return {
        # Not asked: 0 cores, best-effort compute, as a memory-only request in
        # device-plugin mode (one meaning per request in both modes).
        CORES: Capacity(CORES, CORE_UNITS_PER_CARD, 0, 1, 0),
        MEMORY: Capacity(MEMORY, memory_mib, memory_unit_mib, memory_unit_mib, memory_mib, "Mi"),
    }


# ------------------------------------------------------------ ResourceSlice


def health_taint_value(card: Card) -> str:
    """Why a card is tainted, as a label value: xid-<n>, device-node-missing or unhealthy."""
    if card.xid is not None:
        return f"xid-{card.xid}"
    if card.problem and "device node" in card.problem:
        return "device-node-missing"
    return "unhealthy"


def slice_devices(
    cards: Sequence[Card], memory_unit_mib: int, taint_key: str = "vgpu/unhealthy"
) -> list[dict[str, Any]]:
    """The ResourceSlice devices: one per card with room for two memory units.

    A sick card stays published with a NoSchedule device taint (`taint_key`,
    the reason as its value; DRADeviceTaints): nothing new is allocated on it,
    and the claims already on it stay visible against a device that exists.
    """
    devices = []
    for card in sorted(cards, key=lambda c: c.index):
        capacities = card_capacities(card, memory_unit_mib)
        if not capacities:
            continue
        attributes: dict[str, Any] = {
            "uuid": {"string": card.uuid},
            "model": {"string": card.name[:64]},
            "index": {"int": card.index},
        }
        if card.numa_node is not None:
            attributes["numaNode"] = {"int": card.numa_node}
        device: dict[str, Any] = {
            "name": device_name(card),
            "allowMultipleAllocations": True,
            "attributes": attributes,
            "capacity": {name: cap.to_json() for name, cap in capacities.items()},
        }
        if not card.healthy:
            device["taints"] = [
                {"key": taint_key, "value": health_taint_value(card), "effect": "NoSchedule"}
            ]
        devices.append(device)
    return devices[:MAX_DEVICES_PER_SLICE]


@dataclass(frozen=True)
class DeviceHealthReport:
    """One device's health as the kubelet's DRA health stream carries it."""

    pool: str
    device: str
    healthy: bool
    updated_s: int  # unix seconds of the last change
    message: str = ""


def health_reports(
    cards: Sequence[Card], pool: str, since_s: Mapping[str, int]
) -> list[DeviceHealthReport]:
    """Every card's health (the full list the stream sends), by device name;
    `since_s` maps card UUIDs to the time their health last changed."""
    out = []
    for card in sorted(cards, key=lambda c: c.index):
        why = ""
        if not card.healthy:
            why = f"XID {card.xid}" if card.xid is not None else card.problem or "unhealthy"
        out.append(
            DeviceHealthReport(
                pool, device_name(card), card.healthy, since_s.get(card.uuid, 0), why
            )
        )
    return out


def slice_name(node: str, driver: str) -> str:
    """The one slice's name: <node>-<driver>, a DNS subdomain of at most 253 characters."""
    return f"{node}-{driver}"[:253].rstrip("-.")


def resource_slice(
    node: str, driver: str, devices: list[dict[str, Any]], generation: int
) -> dict[str, Any]:
    """The node's one ResourceSlice: pool = node, resourceSliceCount 1."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node, driver)},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


# ------------------------------------------------------------ claims


@dataclass(frozen=True)
class AllocatedDevice:
    """One result of a claim's allocation, as the API reports it."""

    request: str
    driver: str
    pool: str
    device: str
    consumed: Mapping[str, str] | None = field(default=None, hash=False)
    share_id: str | None = None


@dataclass(frozen=True)
class Grant:
    """What one request of a claim gets on this node: one limit config."""

    request: str
    cards: tuple[Card, ...]
    core_percent: int  # per card; 100 = whole cards
    memory_mib: int  # per card; 0 = no limit
    devices: tuple[AllocatedDevice, ...]

    @property
    def whole(self) -> bool:
        return self.core_percent >= CORE_UNITS_PER_CARD


def _consumption(
    result: AllocatedDevice, card: Card, memory_unit_mib: int
) -> tuple[int, int] | None:
    """(cores, memory MiB) a result consumed; None for an exclusive (whole) allocation."""
    if not result.consumed:
        return None
    caps = card_capacities(card, memory_unit_mib)
    out = []
    for name in (CORES, MEMORY):
        cap = caps[name]
        raw = result.consumed.get(name)
        try:
            amount = cap.rule().default if raw is None else parse_quantity(raw)
        except InvalidRequest as exc:
            raise InvalidRequest(f"request {result.request!r}: {name}: {exc.message}") from None
        if amount is None or cap.rule().fit(amount) != amount:
            raise InvalidRequest(
                f"request {result.request!r} consumed {name}={raw} of {result.device}, which "
                f"it cannot give (valid: {cap.quantity(cap.minimum)} to "
                f"{cap.quantity(cap.value)} in steps of {cap.quantity(cap.step)}); the "
                "allocation does not follow the published ResourceSlice"
            )
        out.append(int(amount / cap.scale))
    return out[0], out[1]


def _whole_memory(card: Card, memory_unit_mib: int) -> int:
    return card.memory_units(memory_unit_mib) * memory_unit_mib


def grants(
    results: Sequence[AllocatedDevice],
    *,
    driver: str,
    pool: str,
    cards: Mapping[str, Card],
    memory_unit_mib: int,
) -> list[Grant]:
    """The limit configs a claim's allocation asks for, one per request.

    `results` are all the claim's results; other drivers' are skipped (they
    prepare their own). `cards` maps device names (gpu-<index>) to the cards
    present now. Raises InvalidRequest / UnknownDevice naming the problem.
    """
    mine = [r for r in results if r.driver == driver]
    if not mine:
        drivers = sorted({r.driver for r in results}) or ["none"]
        raise InvalidRequest(
            f"the claim has no device of driver {driver} allocated (drivers: "
            f"{', '.join(drivers)}); only claims allocated by the scheduler with devices of "
            f"DeviceClass {driver} can be prepared here"
        )
    by_request: dict[str, list[AllocatedDevice]] = {}
    for result in mine:
        if result.pool != pool:
            raise InvalidRequest(
                f"request {result.request!r} got {result.device} of pool {result.pool!r}, not "
                f"this node's pool {pool!r}; the claim was allocated for another node"
            )
        card_index(result.device)
        if result.device not in cards:
            raise UnknownDevice(
                f"request {result.request!r} got {result.device}, which this node does not "
                f"have (cards: {', '.join(sorted(cards)) or 'none'}); the card is gone or the "
                "allocation is stale: delete the pod so that its claim is allocated again",
                (result.device,),
            )
        by_request.setdefault(result.request, []).append(result)
    out = []
    for request, items in by_request.items():
        per_card: dict[str, tuple[Card, int, int]] = {}
        for item in items:
            card = cards[item.device]
            used = _consumption(item, card, memory_unit_mib)
            cores, memory = used if used is not None else (CORE_UNITS_PER_CARD, 0)
            prior = per_card.get(item.device)
            if prior is not None:  # the same card twice (two shares of it)
                cores, memory = prior[1] + cores, prior[2] + memory
            if used is not None and cores == 0 and memory == _whole_memory(card, memory_unit_mib):
                cores = CORE_UNITS_PER_CARD  # asked nothing: the card whole
            per_card[item.device] = (card, min(cores, CORE_UNITS_PER_CARD), memory)
        if any(cores >= CORE_UNITS_PER_CARD for _, cores, _ in per_card.values()):
            if any(cores < CORE_UNITS_PER_CARD for _, cores, _ in per_card.values()):
                raise InvalidRequest(
                    f"request {request!r} holds some cards whole and some in part; vgpu gives "
                    "one limit per request: ask whole cards and slices in separate requests"
                )
            core, memory = CORE_UNITS_PER_CARD, 0
        else:
            limits = {(c, m) for _, c, m in per_card.values()}
            if len(limits) > 1:
                raise InvalidRequest(
                    f"request {request!r} consumed different amounts on its cards "
                    f"({sorted(limits)}); vgpu gives one limit per request"
                )
            core, memory = limits.pop()
        ordered = sorted(per_card.values(), key=lambda v: v[0].index)
        out.append(
            Grant(
                request=request,
                cards=tuple(c for c, _, _ in ordered),
                core_percent=core,
                memory_mib=memory,
                devices=tuple(items),
            )
        )
    return out


# ------------------------------------------------------------ the kubelet's view

_UID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$")


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it in NodePrepare/NodeUnprepareResources."""

    namespace: str
    uid: str
    name: str

    def check(self) -> None:
        """InvalidRequest unless the UID can name files (it is part of paths)."""
        if not _UID_RE.match(self.uid):
            raise InvalidRequest(
                f"claim UID {self.uid[:80]!r} is not a Kubernetes UID (letters, digits and '-', "
                "at most 64)"
            )
        if not 0 < len(self.namespace) <= 63 or not 0 < len(self.name) <= 253:
            raise InvalidRequest(
                f"claim {self.uid} needs a namespace (at most 63 characters) and a name (at "
                "most 253)"
            )

    @property
    def shown(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class PreparedDevice:
    """One allocated (request, device) of a prepared claim, as the kubelet gets it."""

    request: str
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True)
class OpaqueConfig:
    """One entry of status.allocation.devices.config: an opaque configuration
    the scheduler copied from the DeviceClass (FromClass) or the claim
    (FromClaim), for the requests it names (all when empty)."""

    source: str
    requests: tuple[str, ...]
    driver: str
    parameters: Any = field(default=None, hash=False, compare=False)


CONFIG_KIND = "SliceConfig"
CORE_LIMIT = "coreLimit"


def config_api_version(domain: str) -> str:
    """The apiVersion of vgpu's opaque parameters, e.g. vgpu.vendor.io/v1."""
    return f"{driver_name(domain)}/v1"


def claim_core_limit(
    configs: Sequence[OpaqueConfig],
    domain: str,
    request: str,
    guarantee_percent: int,
    default_percent: int | None,
) -> CapChoice:
    """The burst cap of one request of a claim, from the allocation's opaque
    configs of this driver that apply to it (FromClass entries come first, then
    FromClaim: the last valid `coreLimit` wins). A malformed or out-of-range
    entry is ignored with a problem naming it and the next source applies;
    without one the cluster default, else the guarantee. Like the annotation, a
    cap only raises the request's own ceiling, never below its guarantee."""
    driver = driver_name(domain)
    version = config_api_version(domain)
    chosen: int | None = None
    problems: list[str] = []
    for i, entry in enumerate(configs):
        if entry.driver != driver or (entry.requests and request not in entry.requests):
            continue
        where = f"config {i} ({entry.source or 'unknown source'})"
        params = entry.parameters
        if not isinstance(params, dict):
            problems.append(f"{where}: parameters are not an object; ignored")
            continue
        if params.get("apiVersion") != version or params.get("kind") != CONFIG_KIND:
            problems.append(
                f"{where}: parameters are not apiVersion {version}, kind {CONFIG_KIND}; ignored"
            )
            continue
        unknown = sorted(str(k)[:32] for k in params if k not in ("apiVersion", "kind", CORE_LIMIT))
        if unknown:
            problems.append(
                f"{where}: unknown field(s) {', '.join(unknown)} (known: {CORE_LIMIT}); ignored"
            )
            continue
        if CORE_LIMIT not in params:
            continue
        checked = check_cap(
            f"{where}: {CORE_LIMIT}", params[CORE_LIMIT], guarantee_percent, "request"
        )
        if isinstance(checked, str):
            problems.append(checked)
            continue
        chosen = checked
    if chosen is not None:
        return CapChoice(chosen, tuple(problems))
    return CapChoice(default_core_cap(guarantee_percent, default_percent), tuple(problems))


def _configs(devices: Any) -> tuple[OpaqueConfig, ...]:
    """The allocation's opaque configs; entries that are not opaque objects are skipped
    (the API server validates their shape; parameters are free-form)."""
    raw = devices.get("config") if isinstance(devices, dict) else None
    out = []
    for entry in raw if isinstance(raw, list) else []:
        opaque = entry.get("opaque") if isinstance(entry, dict) else None
        if not isinstance(opaque, dict) or not opaque.get("driver"):
            continue
        requests = entry.get("requests") or []
        out.append(
            OpaqueConfig(
                source=str(entry.get("source") or ""),
                requests=tuple(str(r) for r in requests) if isinstance(requests, list) else (),
                driver=str(opaque["driver"]),
                parameters=opaque.get("parameters"),
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class ClaimView:
    """What the driver reads of a ResourceClaim: its allocation and its users."""

    uid: str
    namespace: str
    name: str
    results: tuple[AllocatedDevice, ...]
    pods: tuple[tuple[str, str], ...]  # (name, uid) of the pods it is reserved for
    config: tuple[OpaqueConfig, ...] = ()  # the allocation's opaque configs, in order


def claim_view(obj: Any) -> ClaimView:
    """Parse a ResourceClaim (API JSON); InvalidRequest when it has no allocation
    or the allocation is malformed."""
    if not isinstance(obj, dict):
        raise InvalidRequest("the ResourceClaim is not a JSON object")
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    ident = f"{meta.get('namespace', '?')}/{meta.get('name', '?')}"
    allocation = status.get("allocation") if isinstance(status, dict) else None
    devices = allocation.get("devices") if isinstance(allocation, dict) else None
    raw_results = devices.get("results") if isinstance(devices, dict) else None
    if not isinstance(raw_results, list) or not raw_results:
        raise InvalidRequest(
            f"ResourceClaim {ident} has no allocation (status.allocation.devices.results is "
            "empty); the scheduler allocates a claim before the kubelet prepares it"
        )
    results = []
    for i, raw in enumerate(raw_results):
        if not isinstance(raw, dict):
            raise InvalidRequest(f"ResourceClaim {ident}: result {i} is not an object")
        missing = [k for k in ("request", "driver", "pool", "device") if not raw.get(k)]
        if missing:
            raise InvalidRequest(f"ResourceClaim {ident}: result {i} lacks {', '.join(missing)}")
        consumed = raw.get("consumedCapacity")
        if consumed is not None and not (
            isinstance(consumed, dict) and all(isinstance(v, str | int) for v in consumed.values())
        ):
            raise InvalidRequest(f"ResourceClaim {ident}: result {i} has a bad consumedCapacity")
        share = raw.get("shareID")
        results.append(
            AllocatedDevice(
                request=str(raw["request"]),
                driver=str(raw["driver"]),
                pool=str(raw["pool"]),
                device=str(raw["device"]),
                consumed={str(k): str(v) for k, v in consumed.items()} if consumed else None,
                share_id=str(share) if share else None,
            )
        )
    pods = tuple(
        (str(r.get("name", "")), str(r.get("uid", "")))
        for r in (status.get("reservedFor") or [])
        if isinstance(r, dict) and r.get("resource") == "pods"
    )
    return ClaimView(
        uid=str(meta.get("uid", "")),
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        results=tuple(results),
        pods=pods,
        config=_configs(devices),
    )


def allocation_signature(results: Sequence[AllocatedDevice]) -> str:
    """A stable text of an allocation: a prepared claim whose allocation still reads
    the same needs nothing rewritten."""
    parts = sorted(
        "|".join(
            [
                r.request,
                r.driver,
                r.pool,
                r.device,
                r.share_id or "",
                ",".join(f"{k}={v}" for k, v in sorted((r.consumed or {}).items())),
            ]
        )
        for r in results
    )
    return "\n".join(parts)


def claim_key(uid: str, request: str) -> str:
    """A request's limit-config directory name: the claim UID and a digest of the request."""
    return f"{uid}-{hashlib.sha256(request.encode()).hexdigest()[:8]}"


def cdi_device_names(claim_uid: str, results: Sequence[AllocatedDevice]) -> list[str]:
    """One CDI device name per result: <claim uid>-<request>-<device>[-<n>]."""
    names: list[str] = []
    for r in results:
        base = f"{claim_uid}-{r.request.replace('/', '_')}-{r.device}"
        name, n = base, 1
        while name in names:
            name, n = f"{base}-{n}", n + 1
        names.append(name)
    return names


# ------------------------------------------------------------ claim users, claim status


def claim_containers(pod: Any, claim_name: str, request: str) -> list[str]:
    """The containers of `pod` (API JSON) that use request `request` of the
    ResourceClaim named `claim_name`: through the pod's resourceClaims entry
    that names it (resourceClaimName, or a template's generated claim as
    status.resourceClaimStatuses records it), and each container's
    resources.claims (the whole claim, or that request). Sorted; [] when the
    pod says nothing about it."""
    if not isinstance(pod, dict):
        return []
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    local = {
        str(e.get("name"))
        for e in spec.get("resourceClaims") or []
        if isinstance(e, dict) and e.get("resourceClaimName") == claim_name
    }
    local |= {
        str(e.get("name"))
        for e in status.get("resourceClaimStatuses") or []
        if isinstance(e, dict) and e.get("resourceClaimName") == claim_name
    }
    out = set()
    for kind in ("initContainers", "containers"):
        for container in spec.get(kind) or []:
            if not isinstance(container, dict):
                continue
            for use in (container.get("resources") or {}).get("claims") or []:
                if (
                    isinstance(use, dict)
                    and use.get("name") in local
                    and use.get("request") in (None, "", request)
                ):
                    out.add(str(container.get("name", "")))
    return sorted(out)


READY_CONDITION = "Ready"
PREPARED_REASON = "Prepared"


def device_status(
    driver: str,
    device: PreparedDevice,
    card_uuid: str,
    core_percent: int,
    memory_mib: int,
    prepared_at: str,
) -> dict[str, Any]:
    """One entry of the claim's status.devices (AllocatedDeviceStatus, KEP-4817):
    the allocated device (driver, pool, device and, for a shared card, the
    allocation's shareID: the API server refuses an entry that names no
    allocated device), a Ready condition since `prepared_at` (RFC 3339; the API
    server requires type, status, reason and lastTransitionTime), and in `data`
    (a JSON object) the card and the limits the container got."""
    whole = core_percent >= CORE_UNITS_PER_CARD
    core = None if whole or core_percent == 0 else core_percent
    memory = None if whole or memory_mib == 0 else memory_mib
    if whole:
        granted = "the whole card"
    else:
        parts = [f"core {core}%" if core else "", f"memory {memory} MiB" if memory else ""]
        granted = ", ".join(p for p in parts if p) or "no limit"
    entry: dict[str, Any] = {
        "driver": driver,
        "pool": device.pool,
        "device": device.device,
        "conditions": [
            {
                "type": READY_CONDITION,
                "status": "True",
                "reason": PREPARED_REASON,
                "message": f"request {device.request}: {card_uuid or 'card'}, {granted}",
                "lastTransitionTime": prepared_at,
            }
        ],
        "data": {
            "request": device.request,
            "uuid": card_uuid,
            "wholeCard": whole,
            "coreLimitPercent": core,
            "memoryLimitMiB": memory,
        },
    }
    if device.share_id is not None:
        entry["shareID"] = device.share_id
    return entry


def _device_key(entry: Mapping[str, Any]) -> tuple[str, str, str, str]:
    return (
        str(entry.get("driver", "")),
        str(entry.get("pool", "")),
        str(entry.get("device", "")),
        str(entry.get("shareID") or ""),
    )


def merge_device_status(
    current: Sequence[Mapping[str, Any]], driver: str, ours: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The claim's status.devices with `driver`'s entries made `ours`: other
    drivers' entries kept as they are, in their order. A condition whose type
    and status an entry of the same device already had keeps that entry's
    lastTransitionTime (it did not transition), so rewriting an unchanged
    preparation changes nothing."""
    before = {_device_key(e): e for e in current if e.get("driver") == driver}
    out = [dict(e) for e in current if e.get("driver") != driver]
    for entry in ours:
        merged = dict(entry)
        old = before.get(_device_key(entry))
        if old is not None and entry.get("conditions"):
            had = {
                (c.get("type"), c.get("status")): c.get("lastTransitionTime")
                for c in old.get("conditions") or []
                if isinstance(c, Mapping)
            }
            conditions = []
            for cond in entry["conditions"]:
                since = had.get((cond.get("type"), cond.get("status")))
                conditions.append({**cond, "lastTransitionTime": since} if since else dict(cond))
            merged["conditions"] = conditions
        out.append(merged)
    return out
