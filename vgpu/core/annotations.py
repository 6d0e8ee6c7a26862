"""The three annotations that tie the node daemons and the scheduler extender.

- ``<domain>/vgpu-node`` on a Node: the node daemon's inventory (versioned
  JSON: memory unit, the node's card policy, and per card UUID, index,
  model, memory, memory units, NUMA node and health). Written by
  `vgpu serve` at start and whenever a card changes.
- ``<domain>/vgpu-assignment`` on a Pod: the card(s) the extender chose for
  each container at bind, ``{"node": N, "containers": {name: [uuid, ...]}}``.
- ``<domain>/vgpu-placements`` on a Pod: what the node daemon actually
  placed after admission, ``{name: {"cards": [...], "core": .., ...}}``.

Parsing is strict and bounded: these are written by other programs (and a
pod's own annotations by its owner), so anything malformed is rejected with
ValueError naming what is wrong, never trusted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vgpu.core.model import Card, CardUuid, Policy

INVENTORY_VERSION = 1
MAX_ANNOTATION_CHARS = 64 * 1024  # far above 16 cards; far below the API's 256 KiB cap
MAX_CARDS = 64


def node_key(domain: str) -> str:
    return f"{domain}/vgpu-node"


def assignment_key(domain: str) -> str:
    return f"{domain}/vgpu-assignment"


def placements_key(domain: str) -> str:
    return f"{domain}/vgpu-placements"


@dataclass(frozen=True)
class NodeInventory:
    """A node's cards as its daemon published them."""

    memory_unit_mib: int
    policy: Policy
    cards: tuple[Card, ...]  # by index; `minor` is not published (-1)


@dataclass(frozen=True)
class Assignment:
    """The extender's choice for a pod: its node and each container's card(s)."""

    node: str
    containers: Mapping[str, tuple[CardUuid, ...]]


def _load(text: str, what: str) -> Any:
    if len(text) > MAX_ANNOTATION_CHARS:
        raise ValueError(f"{what} is {len(text)} characters, over {MAX_ANNOTATION_CHARS}")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{what} is not JSON: {exc}") from None


def _int(obj: Mapping[str, Any], key: str, low: int, high: int, what: str) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what}: {key} must be a whole number from {low} to {high}")
    return value


def _str(obj: Mapping[str, Any], key: str, what: str, limit: int = 253) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value or len(value) > limit:
        raise ValueError(f"{what}: {key} must be a non-empty string of at most {limit} characters")
    return value


# ----------------------------------------------------------------- inventory


def format_inventory(cards: Sequence[Card], memory_unit_mib: int, policy: Policy) -> str:
    body = {
        "version": INVENTORY_VERSION,
        "memory_unit_mib": memory_unit_mib,
        "policy": policy.value,
        "cards": [
            {
                "uuid": c.uuid,
                "index": c.index,
                "model": c.name,
                "memory_mib": c.memory_mib,
                "memory_units": c.memory_units(memory_unit_mib),
                "numa_node": c.numa_node,
                "healthy": c.healthy,
            }
            for c in sorted(cards, key=lambda c: c.index)
        ],
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def parse_inventory(text: str) -> NodeInventory:
    what = "the vgpu-node annotation"
    data = _load(text, what)
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a JSON object")
    version = data.get("version")
    if version != INVENTORY_VERSION:
        raise ValueError(
            f"{what} has version {version!r}; this extender reads version {INVENTORY_VERSION} "
            "(run the same vgpu version on the nodes and in the scheduler)"
        )
    unit = _int(data, "memory_unit_mib", 64, 65536, what)
    try:
        policy = Policy(data.get("policy"))
    except ValueError:
        raise ValueError(f"{what}: policy must be binpack or spread") from None
    raw_cards = data.get("cards")
    if not isinstance(raw_cards, list) or len(raw_cards) > MAX_CARDS:
        raise ValueError(f"{what}: cards must be a list of at most {MAX_CARDS} cards")
    cards = []
    for i, raw in enumerate(raw_cards):
        where = f"{what}, card {i}"
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be an object")
        numa = raw.get("numa_node")
        if numa is not None and (isinstance(numa, bool) or not isinstance(numa, int)):
            raise ValueError(f"{where}: numa_node must be a number or null")
        healthy = raw.get("healthy")
        if not isinstance(healthy, bool):
            raise ValueError(f"{where}: healthy must be true or false")
        card = Card(
            uuid=CardUuid(_str(raw, "uuid", where, 52)),
            index=_int(raw, "index", 0, 1023, where),
            name=_str(raw, "model", where),
            memory_mib=_int(raw, "memory_mib", 1, 1 << 40, where),
            minor=-1,
            numa_node=numa,
            healthy=healthy,
        )
        if raw.get("memory_units") != card.memory_units(unit):
            raise ValueError(f"{where}: memory_units does not match memory_mib / memory_unit_mib")
        cards.append(card)
    if len({c.uuid for c in cards}) != len(cards):
        raise ValueError(f"{what} lists a card twice")
    return NodeInventory(unit, policy, tuple(sorted(cards, key=lambda c: c.index)))


# ---------------------------------------------------------------- assignment


def format_assignment(node: str, containers: Mapping[str, Sequence[CardUuid]]) -> str:
    body = {"node": node, "containers": {k: list(v) for k, v in sorted(containers.items())}}
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def parse_assignment(text: str) -> Assignment:
    what = "the vgpu-assignment annotation"
    data = _load(text, what)
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a JSON object")
    node = _str(data, "node", what)
    raw = data.get("containers")
    if not isinstance(raw, dict):
        raise ValueError(f"{what}: containers must map container names to card lists")
    containers: dict[str, tuple[CardUuid, ...]] = {}
    for name, cards in raw.items():
        if (
            not isinstance(cards, list)
            or not cards
            or len(cards) > MAX_CARDS
            or not all(isinstance(c, str) and 0 < len(c) <= 52 for c in cards)
        ):
            raise ValueError(f"{what}: container {name[:63]!r} needs a list of card UUIDs")
        containers[name] = tuple(CardUuid(c) for c in cards)
    return Assignment(node, containers)


# ---------------------------------------------------------------- placements


def parse_placements(text: str) -> dict[str, tuple[CardUuid, ...]]:
    """Container name -> card(s), from the node daemon's placements annotation."""
    what = "the vgpu-placements annotation"
    data = _load(text, what)
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a JSON object")
    out: dict[str, tuple[CardUuid, ...]] = {}
    for name, entry in data.items():
        cards = entry.get("cards") if isinstance(entry, dict) else None
        if (
            not isinstance(cards, list)
            or not cards
            or not all(isinstance(c, str) and 0 < len(c) <= 52 for c in cards)
        ):
            raise ValueError(f"{what}: container {name[:63]!r} has no card list")
        out[name] = tuple(CardUuid(c) for c in cards)
    return out
