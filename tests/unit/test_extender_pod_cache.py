"""The extender decodes a pod once per (uid, resourceVersion): kube-scheduler
sends the same pod to filter, then to prioritize. A changed pod (new
resourceVersion), a pod without one, or a different pod is decoded afresh."""

from __future__ import annotations

from typing import Any

import pytest

from vgpu.adapters.extender_http import BadRequest, _pod, _PodCache

CORE, MEM = "vendor.io/vcuda-core", "vendor.io/vcuda-memory"


def _args(uid: str, version: str | None, core: int, name: str = "p") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "default", "uid": uid}
    if version is not None:
        meta["resourceVersion"] = version
    limits = {CORE: str(core), MEM: "4"}
    spec = {"containers": [{"name": "main", "resources": {"limits": limits}}]}
    return {"Pod": {"metadata": meta, "spec": spec}}


def _core(args: dict[str, Any], cache: _PodCache) -> int:
    return _pod(args, "vendor.io", cache).specs[0].request.core_percent


def test_same_uid_and_version_is_decoded_once() -> None:
    cache = _PodCache()
    first = _pod(_args("u1", "7", 30), "vendor.io", cache)
    assert _pod(_args("u1", "7", 30), "vendor.io", cache) is first


@pytest.mark.parametrize(
    ("second", "core"),
    [
        pytest.param(_args("u1", "8", 60), 60, id="new-resource-version"),
        pytest.param(_args("u2", "7", 60), 60, id="other-uid"),
        pytest.param(_args("u1", None, 60), 60, id="no-resource-version"),
        pytest.param(_args("u1", "7", 60, name="q"), 60, id="other-name-same-key"),
    ],
)
def test_a_different_pod_is_decoded_afresh(second: dict[str, Any], core: int) -> None:
    cache = _PodCache()
    assert _core(_args("u1", "7", 30), cache) == 30
    assert _core(second, cache) == core


def test_the_cache_is_bounded_and_bad_input_is_still_refused() -> None:
    cache = _PodCache(size=4)
    for i in range(10):
        _pod(_args(f"u{i}", "1", 10), "vendor.io", cache)
    assert len(cache._pods) <= 4
    with pytest.raises(BadRequest, match="metadata.uid"):
        _pod(_args("", "1", 10), "vendor.io", cache)
