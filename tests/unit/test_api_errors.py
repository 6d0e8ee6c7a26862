"""API error wording (address, status or OS error, what to check), the
readiness clock, and the api_unready_after_s key."""

from __future__ import annotations

from pathlib import Path

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from vgpu import config
from vgpu.adapters.kube_errors import api_error_text
from vgpu.core.errors import ConfigError
from vgpu.core.readiness import ApiHealth

ADDR = "https://10.96.0.1:443"


@pytest.mark.parametrize(
    ("status", "check"),
    [
        (401, "token"),
        (403, "ClusterRole"),
        (429, "throttling"),
        (503, "check its health"),
        (500, "check its health"),
    ],
)
def test_http_errors_name_address_status_and_check(status: int, check: str) -> None:
    text = api_error_text(ApiException(status=status, reason="Reason"), ADDR)
    assert text.startswith(f"API server {ADDR}: HTTP {status} Reason;"), text
    assert check in text


def test_os_errors_are_named_from_the_urllib3_chain() -> None:
    pool = urllib3.PoolManager(retries=False)
    with pytest.raises(Exception) as info:
        pool.request("GET", "http://127.0.0.1:1/")  # nothing listens on port 1
    text = api_error_text(info.value, "http://127.0.0.1:1")
    assert text.startswith("API server http://127.0.0.1:1 unreachable: ECONNREFUSED"), text
    assert "check that the API server is up" in text


def test_an_error_without_errno_is_named_by_type() -> None:
    text = api_error_text(ValueError("bad kubeconfig"), ADDR)
    assert "ValueError: bad kubeconfig" in text


def test_api_health_turns_unready_after_the_limit() -> None:
    health = ApiHealth()
    assert health.not_ready(100.0, 60) == ""
    health.failed(100.0, "API server x unreachable: ECONNREFUSED")
    health.failed(130.0, "API server x unreachable: ETIMEDOUT")
    assert health.not_ready(160.0, 60) == ""  # 60 s exactly: still ready
    reason = health.not_ready(161.0, 60)
    assert "unreachable for 61s" in reason and "ETIMEDOUT" in reason and "2 failed" in reason
    health.ok()
    assert health.not_ready(500.0, 60) == ""


def test_api_unready_after_s_default_and_range(tmp_path: Path) -> None:
    assert config.load({}, {}).api_unready_after_s == 60.0
    assert config.load({}, {"VGPU_API_UNREADY_AFTER_S": "5"}).api_unready_after_s == 5.0
    for bad in ("0", "4.9", "86401", "soon"):
        with pytest.raises(ConfigError, match="api_unready_after_s"):
            config.load({}, {"VGPU_API_UNREADY_AFTER_S": bad})
    path = tmp_path / "c.yaml"
    path.write_text("version: v1\napi_unready_after_s: 120\n")
    assert config.load({}, {}, path).api_unready_after_s == 120.0
