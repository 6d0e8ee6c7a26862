"""`vgpu serve --mode dra`: its settings, its start-up refusals, and `vgpu demo --dra`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vgpu import config
from vgpu.core.errors import ConfigError


def test_device_plugin_is_the_default_mode() -> None:
    settings = config.load({}, {})
    assert settings.mode == "device-plugin"
    assert settings.kubelet_registry_dir == Path("/var/lib/kubelet/plugins_registry")
    assert settings.cdi_dir == Path("/var/run/cdi")
    assert settings.dra_plugin_dir() == Path("/var/lib/kubelet/plugins/vgpu.vendor.io")


def test_plugin_dir_follows_the_domain_unless_set() -> None:
    assert config.load({"resource_domain": "example.com"}, {}).dra_plugin_dir() == Path(
        "/var/lib/kubelet/plugins/vgpu.example.com"
    )
    chosen = config.load({"kubelet_plugin_dir": "/x/y"}, {"VGPU_MODE": "dra"})
    assert chosen.dra_plugin_dir() == Path("/x/y") and chosen.mode == "dra"


def test_mode_from_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("version: v1\nmode: dra\ncdi_dir: /etc/cdi\n")
    settings = config.load({}, {}, path)
    assert (settings.mode, settings.cdi_dir) == ("dra", Path("/etc/cdi"))


def test_an_unknown_mode_names_the_key_and_the_choices() -> None:
    with pytest.raises(ConfigError) as info:
        config.load({}, {"VGPU_MODE": "extender"})
    assert "VGPU_MODE" in info.value.message and "device-plugin or dra" in info.value.message


def _serve(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "vgpu",
            "serve",
            "--mode",
            "dra",
            "--backend",
            "mock",
            "--mock-gpus",
            "preset:1xH200",
            "--state-dir",
            str(root / "state"),
            "--kubelet-registry-dir",
            str(root / "reg"),
            "--kubelet-plugin-dir",
            str(root / "plug"),
            "--cdi-dir",
            str(root / "cdi"),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin"},
    )


@pytest.mark.parametrize(
    "extra, needle",
    [
        ((), "node_name is not set"),
        (("--node-name", "n1"), "DRA mode needs the API server"),
    ],
    ids=["no-node-name", "no-api-server"],
)
def test_dra_mode_refuses_to_start_without_what_it_needs(
    short_tmp: Path, extra: tuple[str, ...], needle: str
) -> None:
    proc = _serve(short_tmp, *extra)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert any(line.startswith("vgpu: ") and needle in line for line in proc.stderr.splitlines())
    assert not (short_tmp / "reg").exists() and not (short_tmp / "plug").exists()


@pytest.mark.timeout(60)
def test_demo_dra_runs_on_mock_cards() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vgpu", "demo", "--dra"],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "prepared notebook    (cores=30, memory=10Gi) -> gpu-0  [core 30%, memory 10 GiB]" in out
    assert "trainer     (cores=100) -> gpu-1  [whole card, no limits]" in out
    assert "default/notebook claim notebook-gpu" in out
    assert "PENDING  too-big" in out
    assert "env VGPU_MEMORY_LIMIT_MIB=10240" in out
    assert "driver stopped with exit code 0" in out
