"""The DRA claim record keeps each request's burst cap; a record written before
caps were kept (or with a damaged cap) still loads, its requests then falling
back to the cluster default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vgpu.adapters.dra.state import ClaimRecord, ClaimStore
from vgpu.core.arbiter import default_core_cap
from vgpu.core.dra import ClaimRef, PreparedDevice, claim_key
from vgpu.core.model import CardUuid, Placement

UID = "0b7f4c2e-1111-4222-8333-444455556666"


def _record(caps: tuple[tuple[str, int], ...]) -> ClaimRecord:
    placement = Placement(
        key=claim_key(UID, "gpu"),
        cards=(CardUuid("GPU-1"),),
        ids={},
        core_percent=30,
        memory_mib=10240,
    )
    device = PreparedDevice("gpu", "node-1", "gpu-0", ("vendor.io/vgpu=x",), None)
    return ClaimRecord(
        claim=ClaimRef("default", UID, "nb"),
        pods=(("notebook", "pod-uid"),),
        signature="sig",
        placements=(placement,),
        devices=(device,),
        cdi_file="vgpu-x.json",
        cdi_spec={"kind": "vendor.io/vgpu"},
        created_s=1.0,
        core_caps=caps,
    )


def test_caps_survive_the_round_trip(tmp_path: Path) -> None:
    store = ClaimStore(tmp_path, 256)
    store.write(_record((("gpu", 80),)))
    (loaded,), bad = store.load_all()
    assert bad == []
    assert loaded.core_caps == (("gpu", 80),) and loaded.core_cap("gpu") == 80
    assert loaded.core_cap("other") is None
    assert json.loads(store.path(UID).read_text())["core_caps"] == {"gpu": 80}


@pytest.mark.parametrize(
    "caps",
    [
        pytest.param(None, id="absent-older-record"),
        pytest.param({"gpu": "80"}, id="not-a-number"),
        pytest.param({"gpu": 0}, id="zero"),
        pytest.param({"gpu": 101}, id="above-the-card"),
        pytest.param({"gpu": True}, id="a-bool"),
        pytest.param(["gpu", 80], id="not-a-map"),
    ],
)
def test_a_record_without_a_usable_cap_still_loads(tmp_path: Path, caps: object) -> None:
    store = ClaimStore(tmp_path, 256)
    store.write(_record((("gpu", 80),)))
    data = json.loads(store.path(UID).read_text())
    if caps is None:
        del data["core_caps"]
    else:
        data["core_caps"] = caps
    store.path(UID).write_text(json.dumps(data))
    (loaded,), bad = store.load_all()
    assert bad == [] and loaded.core_cap("gpu") is None
    assert loaded.placements[0].core_percent == 30


@pytest.mark.parametrize(
    ("guarantee", "default", "cap"),
    [
        pytest.param(30, None, 30, id="no-default-the-guarantee"),
        pytest.param(30, 80, 80, id="the-default"),
        pytest.param(30, 10, 30, id="a-default-below-the-guarantee-counts-as-it"),
        pytest.param(30, 100, 100, id="the-whole-card"),
    ],
)
def test_default_core_cap(guarantee: int, default: int | None, cap: int) -> None:
    assert default_core_cap(guarantee, default) == cap
