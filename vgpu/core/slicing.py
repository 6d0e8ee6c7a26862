"""Card <-> device ID mapping: the one owner of the device-ID format.

A device ID is ``<card uuid>-c<index>`` for a core slice and
``<card uuid>-m<index>`` for a memory slice. It encodes its card, is stable
across restarts and reboots (UUID and index only), unique, and at most 63
characters (a card UUID may be at most 52 characters).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from vgpu.core.errors import ConfigError, UnknownDevice
from vgpu.core.model import CORE_UNITS_PER_CARD, Card, CardUuid, DeviceId, Resource

MAX_DEVICE_ID_LEN = 63
MAX_UUID_LEN = 52
_UUID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")
_INDEX_RE = re.compile(r"0|[1-9][0-9]*")
_KIND = {Resource.CORE: "c", Resource.MEMORY: "m"}
_RESOURCE_BY_KIND = {v: k for k, v in _KIND.items()}


def check_card_uuid(uuid: str) -> CardUuid:
    """Validate that a card UUID can be embedded in device IDs."""
    if not uuid or len(uuid) > MAX_UUID_LEN or not _UUID_RE.fullmatch(uuid):
        raise ConfigError(
            f"card uuid {uuid!r} is not usable: it must be 1-{MAX_UUID_LEN} characters of "
            "letters, digits and '-', starting with a letter or digit (e.g. GPU-8f0e3c7a-...)"
        )
    return CardUuid(uuid)


def format_device_id(card: CardUuid, resource: Resource, index: int) -> DeviceId:
    return DeviceId(f"{card}-{_KIND[resource]}{index}")


def parse_device_id(device_id: str) -> tuple[CardUuid, Resource, int]:
    """Split a device ID into (card, resource, index); UnknownDevice if malformed."""
    card, sep, tail = device_id.rpartition("-")
    if sep and card and tail[:1] in _RESOURCE_BY_KIND and _INDEX_RE.fullmatch(tail[1:]):
        return CardUuid(card), _RESOURCE_BY_KIND[tail[0]], int(tail[1:])
    raise UnknownDevice(
        f"device ID {device_id[:80]!r} is not a vgpu slice ID (expected <card uuid>-c<n> or "
        "<card uuid>-m<n>); only pass IDs this plugin advertised",
        (device_id,),
    )


def units_per_card(card: Card, resource: Resource, memory_unit_mib: int) -> int:
    if resource is Resource.CORE:
        return CORE_UNITS_PER_CARD
    return card.memory_units(memory_unit_mib)


def card_device_ids(card: Card, resource: Resource, memory_unit_mib: int) -> list[DeviceId]:
    """All device IDs of one card for one resource, in index order."""
    return [
        format_device_id(card.uuid, resource, i)
        for i in range(units_per_card(card, resource, memory_unit_mib))
    ]


def ids_by_card(ids: Iterable[str]) -> dict[CardUuid, list[tuple[Resource, int, DeviceId]]]:
    out: dict[CardUuid, list[tuple[Resource, int, DeviceId]]] = {}
    for raw in ids:
        card, resource, index = parse_device_id(raw)
        out.setdefault(card, []).append((resource, index, DeviceId(raw)))
    return out
