"""Card <-> device ID mapping: the one owner of the device-ID format.

A device ID is ``<card index><c|m><slice index>.<card digest>``, e.g.
``3m2245.k3f9``: slice 2245 of memory on the card at inventory index 3, whose
UUID hashes to ``k3f9`` (4 base-32 characters of its SHA-256, 20 bits). It is
at most 16 characters, so the kubelet's checkpoint and ListAndWatch stay
small (thousands of IDs per node), yet it still names its card: a card
swapped or re-ordered after a reboot is at the same index with another
digest, so its IDs never match the old card's.

Before issue 19 IDs were ``<card uuid>-c<index>`` and
``<card uuid>-m<index>`` (up to 63 characters). Those *legacy* IDs are still
parsed: running containers, the kubelet's checkpoint and our state records
hold them across the upgrade (see docs/performance.md). A '.' never occurs in
a card UUID, so the two forms can never be mistaken for one another.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from vgpu.core.errors import ConfigError, UnknownDevice
from vgpu.core.model import CORE_UNITS_PER_CARD, Card, CardUuid, DeviceId, Resource

MAX_DEVICE_ID_LEN = 16
MAX_LEGACY_DEVICE_ID_LEN = 63
MAX_UUID_LEN = 52
MAX_CARD_INDEX = 999  # 3 digits
MAX_SLICE_INDEX = 9_999_999  # 7 digits: 1 MiB units of a 9 TiB card
DIGEST_CHARS = 4
_DIGEST_ALPHABET = "0123456789abcdefghijklmnopqrstuv"  # base 32, lower case
_UUID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")
_INDEX_RE = re.compile(r"0|[1-9][0-9]*")
_SHORT_RE = re.compile(r"(0|[1-9][0-9]{0,2})([cm])(0|[1-9][0-9]{0,6})\.([0-9a-v]{4})")
_KIND = {Resource.CORE: "c", Resource.MEMORY: "m"}
_RESOURCE_BY_KIND = {v: k for k, v in _KIND.items()}


@dataclass(frozen=True)
class SliceRef:
    """What a device ID says: a slice of one resource on one card.

    A short ID names its card by inventory index and UUID digest; a legacy ID
    by its full UUID (then `card_index` is None and `card_digest` is derived).
    """

    resource: Resource
    index: int
    card_digest: str
    card_index: int | None = None
    card_uuid: CardUuid | None = None

    @property
    def legacy(self) -> bool:
        return self.card_uuid is not None

    def names(self, card: Card) -> bool:
        """Is this slice on `card`? (Index and digest, or the UUID itself.)"""
        return id_names_card_ref(self, card.uuid, card.index)


def id_names_card_ref(ref: SliceRef, uuid: str, card_index: int | None) -> bool:
    if ref.card_uuid is not None:
        return ref.card_uuid == uuid
    return ref.card_index == card_index and ref.card_digest == card_digest(uuid)


def check_card_uuid(uuid: str) -> CardUuid:
    """Validate that a card UUID can be named by device IDs."""
    if not uuid or len(uuid) > MAX_UUID_LEN or not _UUID_RE.fullmatch(uuid):
        raise ConfigError(
            f"card uuid {uuid!r} is not usable: it must be 1-{MAX_UUID_LEN} characters of "
            "letters, digits and '-', starting with a letter or digit (e.g. GPU-8f0e3c7a-...)"
        )
    return CardUuid(uuid)


@lru_cache(maxsize=4096)
def card_digest(uuid: str) -> str:
    """The card's stable short digest: 20 bits of SHA-256 of its UUID, base 32."""
    value = int.from_bytes(hashlib.sha256(uuid.encode()).digest()[:3], "big") >> 4
    out = []
    for _ in range(DIGEST_CHARS):
        out.append(_DIGEST_ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(out))


def format_device_id(card: Card, resource: Resource, index: int) -> DeviceId:
    """The short ID of slice `index` of `resource` on `card`."""
    if not 0 <= card.index <= MAX_CARD_INDEX or not 0 <= index <= MAX_SLICE_INDEX:
        raise ConfigError(
            f"card index {card.index} / slice {index} cannot be named in a "
            f"{MAX_DEVICE_ID_LEN}-character device ID (at most {MAX_CARD_INDEX} cards and "
            f"{MAX_SLICE_INDEX + 1} slices per card); raise memory_unit_mib"
        )
    return DeviceId(f"{card.index}{_KIND[resource]}{index}.{card_digest(card.uuid)}")


def format_legacy_device_id(card: CardUuid, resource: Resource, index: int) -> DeviceId:
    """The ID format before issue 19; still understood, advertised only for
    slices that running containers hold under it (see docs/performance.md)."""
    return DeviceId(f"{card}-{_KIND[resource]}{index}")


def parse_device_id(device_id: str) -> SliceRef:
    """What a short or legacy device ID names; UnknownDevice if it is neither."""
    short = _SHORT_RE.fullmatch(device_id)
    if short is not None:
        card_index, kind, index, digest = short.groups()
        return SliceRef(_RESOURCE_BY_KIND[kind], int(index), digest, card_index=int(card_index))
    card, sep, tail = device_id.rpartition("-")
    if (
        sep
        and card
        and len(device_id) <= MAX_LEGACY_DEVICE_ID_LEN
        and _UUID_RE.fullmatch(card)
        and tail[:1] in _RESOURCE_BY_KIND
        and _INDEX_RE.fullmatch(tail[1:])
    ):
        uuid = CardUuid(card)
        return SliceRef(
            _RESOURCE_BY_KIND[tail[0]], int(tail[1:]), card_digest(uuid), card_uuid=uuid
        )
    raise UnknownDevice(
        f"device ID {device_id[:80]!r} is not a vgpu slice ID (expected <card index><c|m><n>."
        "<digest>, e.g. 3m12.k3f9); only pass IDs this plugin advertised",
        (device_id,),
    )


def card_of(device_id: str, cards: Iterable[Card]) -> Card | None:
    """The card among `cards` that a device ID names (None: none of them, or malformed)."""
    try:
        ref = parse_device_id(device_id)
    except UnknownDevice:
        return None
    return next((c for c in cards if ref.names(c)), None)


def id_names_card(device_id: str, uuid: str, card_index: int | None) -> bool:
    """Does a device ID name the card with this UUID (at this inventory index)?
    False for a malformed ID."""
    try:
        ref = parse_device_id(device_id)
    except UnknownDevice:
        return False
    return id_names_card_ref(ref, uuid, card_index)


def units_per_card(card: Card, resource: Resource, memory_unit_mib: int) -> int:
    if resource is Resource.CORE:
        return CORE_UNITS_PER_CARD
    return card.memory_units(memory_unit_mib)


def card_device_ids(card: Card, resource: Resource, memory_unit_mib: int) -> list[DeviceId]:
    """All device IDs of one card for one resource, in index order."""
    return [
        format_device_id(card, resource, i)
        for i in range(units_per_card(card, resource, memory_unit_mib))
    ]


def ids_by_card(
    ids: Iterable[str], cards: Iterable[Card]
) -> dict[CardUuid, list[tuple[Resource, int, DeviceId]]]:
    """Group device IDs by the card they name; UnknownDevice for any other ID."""
    known = list(cards)
    out: dict[CardUuid, list[tuple[Resource, int, DeviceId]]] = {}
    for raw in ids:
        ref = parse_device_id(raw)
        card = next((c for c in known if ref.names(c)), None)
        if card is None:
            raise UnknownDevice(f"device ID {raw[:80]!r} names no card of this node", (raw,))
        out.setdefault(card.uuid, []).append((ref.resource, ref.index, DeviceId(raw)))
    return out
