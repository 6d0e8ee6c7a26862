"""`vgpu extender`'s settings: same precedence and validation as `vgpu serve`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vgpu.config import EXTENDER_KEYS, ExtenderSettings, load_extender
from vgpu.core.errors import ConfigError
from vgpu.core.model import Policy

pytestmark = pytest.mark.timeout(30)


def test_defaults() -> None:
    s = load_extender({}, {})
    assert s == ExtenderSettings()
    assert s.listen == "127.0.0.1:8888" and s.kubeconfig is None and s.policy is Policy.BINPACK
    assert list(s.public()) == list(EXTENDER_KEYS)


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path: Path) -> None:
    f = tmp_path / "extender.yaml"
    f.write_text(
        "version: v1\nlisten: 0.0.0.0:9000\npolicy: spread\nbind_timeout_s: 2\n"
        "resource_domain: file.io\n"
    )
    env = {"VGPU_POLICY": "binpack", "VGPU_LISTEN": "127.0.0.1:9100"}
    s = load_extender({"listen": "127.0.0.1:9200"}, env, f)
    assert s.listen == "127.0.0.1:9200"  # flag
    assert s.policy is Policy.BINPACK  # env over file
    assert s.bind_timeout_s == 2.0 and s.resource_domain == "file.io"  # file
    assert s.node_choice == "extender"  # the default
    assert load_extender({}, {"VGPU_NODE_CHOICE": "scheduler"}).node_choice == "scheduler"


@pytest.mark.parametrize(
    ("flags", "text", "message"),
    [
        ({"listen": "nowhere"}, None, "listen='nowhere' is invalid; allowed: HOST:PORT"),
        ({"bind_timeout_s": "99"}, None, "bind_timeout_s='99' is invalid"),
        ({"policy": "random"}, None, "binpack or spread"),
        ({"node_choice": "kube"}, None, "node_choice='kube' is invalid; allowed: extender or"),
        ({}, "version: v1\nnode_name: x\n", "unknown key 'node_name'"),
        ({}, "version: v2\n", "version='v2' is not supported"),
    ],
    ids=["listen", "timeout", "policy", "node-choice", "serve-only-key", "version"],
)
def test_invalid_settings_name_the_key(
    tmp_path: Path, flags: dict[str, str], text: str | None, message: str
) -> None:
    path = None
    if text is not None:
        path = tmp_path / "bad.yaml"
        path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_extender(flags, {}, path)
    assert message in err.value.message


def test_cli_exits_2_with_one_line_without_an_api_server(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vgpu", "extender", "--listen", "127.0.0.1:18888"],
        capture_output=True,
        text=True,
        timeout=20,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "vgpu extender: no API server configured: pass --kubeconfig FILE, or run in a cluster "
        "(the in-cluster service account is used there)"
    ]


def test_docs_document_the_extender_only_keys() -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "scheduling.md").read_text()
    defaults = ExtenderSettings().public()
    for key in ("listen", "bind_timeout_s", "node_choice"):
        row = f"| `{key}` | `{defaults[key]}` | {EXTENDER_KEYS[key]} |"
        assert row in readme.splitlines(), row
