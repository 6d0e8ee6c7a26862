"""The device-ID format: one format/parse pair, bounded length, validated UUIDs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vgpu.core.errors import ConfigError, UnknownDevice
from vgpu.core.model import Card, CardUuid, Resource
from vgpu.core.slicing import (
    MAX_DEVICE_ID_LEN,
    MAX_UUID_LEN,
    card_device_ids,
    check_card_uuid,
    format_device_id,
    ids_by_card,
    parse_device_id,
    units_per_card,
)

pytestmark = pytest.mark.timeout(30)

H200 = "GPU-8f0e3c7a-1b2d-4e5f-8a9b-0c1d2e3f4a5b"
uuids = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9-]{0,51}\Z")


@pytest.mark.parametrize(
    "uuid, resource, index, want",
    [
        (H200, Resource.CORE, 0, f"{H200}-c0"),
        (H200, Resource.MEMORY, 561, f"{H200}-m561"),
        ("a", Resource.CORE, 99, "a-c99"),
        ("GPU-x-c1", Resource.MEMORY, 3, "GPU-x-c1-m3"),  # a uuid that itself looks like an ID
    ],
    ids=["core-0", "memory-561", "one-char-uuid", "uuid-with-suffix-shape"],
)
def test_format_and_parse(uuid: str, resource: Resource, index: int, want: str) -> None:
    device_id = format_device_id(CardUuid(uuid), resource, index)
    assert device_id == want
    assert parse_device_id(device_id) == (uuid, resource, index)


@given(uuid=uuids, resource=st.sampled_from(list(Resource)), index=st.integers(0, 10**6))
def test_round_trip_property(uuid: str, resource: Resource, index: int) -> None:
    card = check_card_uuid(uuid)
    assert parse_device_id(format_device_id(card, resource, index)) == (uuid, resource, index)


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


def test_longest_uuid_and_a_large_index_fit_in_63_chars() -> None:
    longest = check_card_uuid("G" * MAX_UUID_LEN)
    # 52 + len("-m") + 9 digits = 63: any index below 10**9 fits. The largest
    # real one is far smaller: a 16 TiB card in 64 MiB units has 262144.
    assert len(format_device_id(longest, Resource.MEMORY, 999_999_999)) == MAX_DEVICE_ID_LEN
    assert len(format_device_id(longest, Resource.CORE, 99)) < MAX_DEVICE_ID_LEN
    assert MAX_DEVICE_ID_LEN == 63


def test_nvidia_style_uuid_ids_are_short() -> None:
    assert len(format_device_id(CardUuid(H200), Resource.MEMORY, 2**20)) <= MAX_DEVICE_ID_LEN


def test_card_device_ids_and_units() -> None:
    card = Card(uuid=CardUuid(H200), index=0, name="H200", memory_mib=143771, minor=0)
    core = card_device_ids(card, Resource.CORE, 256)
    memory = card_device_ids(card, Resource.MEMORY, 256)
    assert len(core) == units_per_card(card, Resource.CORE, 256) == 100
    assert len(memory) == units_per_card(card, Resource.MEMORY, 256) == 561
    assert len(card_device_ids(card, Resource.MEMORY, 512)) == 280
    assert core[0] == f"{H200}-c0" and memory[-1] == f"{H200}-m560"
    assert len(set(core) | set(memory)) == 661
    grouped = ids_by_card([*core[:2], memory[0]])
    assert list(grouped) == [H200]
    assert [(r, i) for r, i, _ in grouped[CardUuid(H200)]] == [
        (Resource.CORE, 0),
        (Resource.CORE, 1),
        (Resource.MEMORY, 0),
    ]


def test_ids_by_card_rejects_foreign_ids() -> None:
    with pytest.raises(UnknownDevice):
        ids_by_card([f"{H200}-c0", "nvidia0"])
