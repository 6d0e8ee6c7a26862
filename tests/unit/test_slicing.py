"""The device-ID format: one format/parse pair, at most 16 characters, naming
the card by index and UUID digest; legacy (pre-issue-19) IDs still parse."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpu.core.errors import ConfigError, UnknownDevice
from vgpu.core.model import Card, CardUuid, Resource
from vgpu.core.slicing import (
    MAX_CARD_INDEX,
    MAX_DEVICE_ID_LEN,
    MAX_SLICE_INDEX,
    MAX_UUID_LEN,
    card_device_ids,
    card_digest,
    card_of,
    check_card_uuid,
    format_device_id,
    format_legacy_device_id,
    id_names_card,
    ids_by_card,
    parse_device_id,
    units_per_card,
)

pytestmark = pytest.mark.timeout(30)

H200 = "GPU-8f0e3c7a-1b2d-4e5f-8a9b-0c1d2e3f4a5b"
OTHER = "GPU-1c2d3e4f-0000-4000-8000-000000000001"
uuids = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9-]{0,51}\Z")


def card(uuid: str = H200, index: int = 0) -> Card:
    return Card(uuid=CardUuid(uuid), index=index, name="H200", memory_mib=143771, minor=index)


@pytest.mark.parametrize(
    "index, resource, slice_index, want",
    [
        (0, Resource.CORE, 0, f"0c0.{card_digest(H200)}"),
        (3, Resource.MEMORY, 561, f"3m561.{card_digest(H200)}"),
        (15, Resource.MEMORY, 2245, f"15m2245.{card_digest(H200)}"),
    ],
    ids=["core-0", "memory-561", "card-15-64MiB-units"],
)
def test_format_and_parse(index: int, resource: Resource, slice_index: int, want: str) -> None:
    c = card(index=index)
    device_id = format_device_id(c, resource, slice_index)
    assert device_id == want
    ref = parse_device_id(device_id)
    assert (ref.resource, ref.index, ref.card_index, ref.legacy) == (
        resource,
        slice_index,
        index,
        False,
    )
    assert ref.names(c)


def test_digest_is_stable_and_short() -> None:
    # Stable across runs and versions: a reboot must give the same IDs.
    assert card_digest(H200) == card_digest(str(H200))
    assert len(card_digest(H200)) == 4 and card_digest(H200) != card_digest(OTHER)
    assert (
        card_digest("GPU-00000h200-0000-4000-8000-000000000000") == "a2p8"
    )  # pinned: it must never change


@given(
    uuid=uuids,
    index=st.integers(0, MAX_CARD_INDEX),
    resource=st.sampled_from(list(Resource)),
    slice_index=st.integers(0, MAX_SLICE_INDEX),
)
def test_round_trip_and_length_property(
    uuid: str, index: int, resource: Resource, slice_index: int
) -> None:
    c = card(check_card_uuid(uuid), index)
    device_id = format_device_id(c, resource, slice_index)
    assert len(device_id) <= MAX_DEVICE_ID_LEN
    ref = parse_device_id(device_id)
    assert (ref.resource, ref.index, ref.card_index) == (resource, slice_index, index)
    assert ref.names(c) and id_names_card(device_id, uuid, index)


def test_a_swapped_or_reordered_card_never_matches() -> None:
    old = card(H200, 2)
    device_id = format_device_id(old, Resource.MEMORY, 7)
    assert not parse_device_id(device_id).names(card(OTHER, 2))  # swapped: same index
    assert not parse_device_id(device_id).names(card(H200, 3))  # re-ordered
    assert card_of(device_id, [card(OTHER, 2), card(H200, 3)]) is None
    assert card_of(device_id, [card(OTHER, 0), old]) == old


def test_too_large_indexes_are_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="memory_unit_mib"):
        format_device_id(card(), Resource.MEMORY, MAX_SLICE_INDEX + 1)
    with pytest.raises(ConfigError):
        format_device_id(card(index=MAX_CARD_INDEX + 1), Resource.CORE, 0)


@pytest.mark.parametrize(
    "uuid, resource, index",
    [
        (H200, Resource.CORE, 0),
        (H200, Resource.MEMORY, 561),
        ("a", Resource.CORE, 99),
        ("GPU-x-c1", Resource.MEMORY, 3),  # a uuid that itself looks like an ID
    ],
    ids=["core-0", "memory-561", "one-char-uuid", "uuid-with-suffix-shape"],
)
def test_legacy_ids_still_parse(uuid: str, resource: Resource, index: int) -> None:
    legacy = format_legacy_device_id(CardUuid(uuid), resource, index)
    assert legacy == f"{uuid}-{'c' if resource is Resource.CORE else 'm'}{index}"
    ref = parse_device_id(legacy)
    assert (ref.card_uuid, ref.resource, ref.index, ref.legacy) == (uuid, resource, index, True)
    assert ref.names(card(uuid, 5)) and not ref.names(card(OTHER, 5))


@given(uuid=uuids, resource=st.sampled_from(list(Resource)), index=st.integers(0, 10**6))
def test_legacy_round_trip_property(uuid: str, resource: Resource, index: int) -> None:
    ref = parse_device_id(format_legacy_device_id(check_card_uuid(uuid), resource, index))
    assert (ref.card_uuid, ref.resource, ref.index) == (uuid, resource, index)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "-c1",
        "GPU-abc",
        "GPU-abc-",
        "GPU-abc-c",
        "GPU-abc-x1",
        "GPU-abc-c01",  # no leading zeros: one ID per slice
        "GPU-abc-c-1",
        "GPU-abc-c1a",
        "GPU-abc-c+1",
        "GPU-abc-c 1",
        "GPU-abc-m\u0661",  # ARABIC-INDIC DIGIT ONE
        "c1",
        "0c1.abc",  # digest too short
        "0c1.abcde",  # digest too long
        "0c1.ABCD",  # upper case
        "0c01.abcd",  # leading zero
        "1000c1.abcd",  # card index over 999
        "0c10000000.abcd",  # slice index over 7 digits
        "0x1.abcd",
        "0c1abcd",
        "x" * 500 + "-c1x",
        "GPU-abc-c\u00b2",  # superscript two: isdigit() but not int()
    ],
    ids=[
        "empty",
        "no-card",
        "no-kind",
        "trailing-dash",
        "kind-without-index",
        "unknown-kind",
        "leading-zero",
        "negative",
        "junk-after-index",
        "plus-sign",
        "space",
        "arabic-digit",
        "no-separator",
        "short-digest",
        "long-digest",
        "upper-digest",
        "short-leading-zero",
        "short-big-card",
        "short-big-slice",
        "short-unknown-kind",
        "short-no-dot",
        "long-junk",
        "superscript-digit",
    ],
)
def test_malformed_ids_raise_unknown_device(bad: str) -> None:
    with pytest.raises(UnknownDevice) as info:
        parse_device_id(bad)
    assert info.value.device_ids == (bad,)
    assert len(info.value.message) < 300  # a huge ID is not echoed in full


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "G" * (MAX_UUID_LEN + 1),
        "GPU 1",
        "-GPU",
        "GPU_1",
        "GPU/1",
        "GPU-é",
        "GPU-1\n",  # '$' would match before a trailing newline
    ],
    ids=[
        "empty",
        "too-long",
        "space",
        "leading-dash",
        "underscore",
        "slash",
        "non-ascii",
        "trailing-newline",
    ],
)
def test_bad_uuids_raise_config_error(bad: str) -> None:
    with pytest.raises(ConfigError, match="card uuid"):
        check_card_uuid(bad)


def test_card_device_ids_and_units() -> None:
    c = card()
    core = card_device_ids(c, Resource.CORE, 256)
    memory = card_device_ids(c, Resource.MEMORY, 256)
    assert len(core) == units_per_card(c, Resource.CORE, 256) == 100
    assert len(memory) == units_per_card(c, Resource.MEMORY, 256) == 561
    assert len(card_device_ids(c, Resource.MEMORY, 512)) == 280
    digest = card_digest(H200)
    assert core[0] == f"0c0.{digest}" and memory[-1] == f"0m560.{digest}"
    assert len(set(core) | set(memory)) == 661
    assert max(len(d) for d in card_device_ids(card(index=15), Resource.MEMORY, 1)) <= 16
    grouped = ids_by_card([*core[:2], memory[0]], [card(OTHER, 1), c])
    assert list(grouped) == [H200]
    assert [(r, i) for r, i, _ in grouped[CardUuid(H200)]] == [
        (Resource.CORE, 0),
        (Resource.CORE, 1),
        (Resource.MEMORY, 0),
    ]


def test_ids_by_card_rejects_foreign_ids() -> None:
    with pytest.raises(UnknownDevice):
        ids_by_card([f"{H200}-c0", "nvidia0"], [card()])
    with pytest.raises(UnknownDevice, match="names no card"):
        ids_by_card([format_device_id(card(OTHER), Resource.CORE, 0)], [card()])
