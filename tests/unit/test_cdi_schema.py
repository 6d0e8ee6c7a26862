"""The tests' strict CDI validator refuses what a spec's declared version does
not allow (so the checks that use it can fail), and accepts vgpu's specs."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.cdi_schema import CdiSpecError, validate_spec
from vgpu.adapters.dra.cdi import CDI_VERSION, spec_document
from vgpu.core.contract import ContainerEdits, DeviceNode, MountSpec

EDITS = ContainerEdits(
    envs={"VGPU_CORE_LIMIT": "30"},
    mounts=(MountSpec("/etc/vgpu", "/var/lib/vgpu/containers/pk", True),),
    devices=(DeviceNode("/dev/nvidia0", "/dev/nvidia0"),),
)


def _spec() -> dict[str, Any]:
    return spec_document("vendor.io/vgpu", {"pk": EDITS, "0123-gpu-0": EDITS})


def test_vgpu_specs_are_valid_for_their_version() -> None:
    spec = _spec()
    assert spec["cdiVersion"] == CDI_VERSION == "0.5.0"
    validate_spec(spec)


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        pytest.param(
            lambda s: s.update(annotations={"a": "b"}), "annotations need", id="0.6-annotations"
        ),
        pytest.param(
            lambda s: s["devices"][0].update(annotations={"a": "b"}),
            "not allowed",
            id="0.6-device-annotations",
        ),
        pytest.param(lambda s: s.update(kind="vendor.io/v.gpu"), "dot in the class", id="0.6-dot"),
        pytest.param(
            lambda s: s["devices"][0]["containerEdits"].update(additionalGIDs=[5]),
            "not allowed",
            id="0.7-gids",
        ),
        pytest.param(lambda s: s.update(cdiVersion="0.4.0"), "hostPath", id="0.4-hostpath"),
        pytest.param(lambda s: s.update(cdiVersion="0.9.9"), "not a released", id="bad-version"),
        pytest.param(lambda s: s.update(devices=[]), "at least one", id="no-devices"),
        pytest.param(
            lambda s: s["devices"][0].update(name="-x"), "not a valid device name", id="bad-name"
        ),
        pytest.param(
            lambda s: s["devices"][0]["containerEdits"]["env"].append("no-equals"),
            "NAME=VALUE",
            id="bad-env",
        ),
        pytest.param(
            lambda s: s["devices"][0]["containerEdits"]["mounts"][0].update(containerPath="rel"),
            "absolute",
            id="relative-mount",
        ),
        pytest.param(lambda s: s.update(extra=1), "not allowed", id="unknown-field"),
    ],
)
def test_what_the_declared_version_does_not_allow_is_refused(mutate: Any, words: str) -> None:
    spec = copy.deepcopy(_spec())
    mutate(spec)
    with pytest.raises(CdiSpecError, match=words):
        validate_spec(spec)


def test_a_leading_digit_needs_0_5() -> None:
    spec = _spec()
    for device in spec["devices"]:
        for node in device["containerEdits"]["deviceNodes"]:
            del node["hostPath"]
    spec["cdiVersion"] = "0.4.0"
    with pytest.raises(CdiSpecError, match="leading digit"):
        validate_spec(spec)
