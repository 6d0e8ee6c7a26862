"""Settings (vgpu.config.load) and the CLI's handling of bad configuration.

`load` is tested directly for precedence; the CLI runs as a subprocess so the
exit code, the one-line message and the absence of a traceback are real.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vgpu import config
from vgpu.config import Settings, load
from vgpu.core.errors import ConfigError
from vgpu.core.health import DEFAULT_IGNORED_XIDS
from vgpu.core.model import Policy

pytestmark = pytest.mark.timeout(30)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults() -> None:
    s = load({}, {})
    assert s == Settings()
    assert s.backend == "nvml"
    assert s.memory_unit_mib == 256
    assert s.resource_domain == "vendor.io"
    assert s.ignored_xids == tuple(sorted(DEFAULT_IGNORED_XIDS))
    assert s.device_plugin_dir == Path("/var/lib/kubelet/device-plugins")


def test_precedence_flags_over_env_over_file_over_defaults(short_tmp: Path) -> None:
    f = write(
        short_tmp / "c.yaml",
        "version: v1\nmemory_unit_mib: 128\npolicy: spread\nresource_domain: file.io\n"
        "log_level: debug\n",
    )
    env = {"VGPU_MEMORY_UNIT_MIB": "512", "VGPU_POLICY": "binpack"}
    flags = {"memory_unit_mib": "1024", "policy": None, "backend": None}
    s = load(flags, env, f)
    assert s.memory_unit_mib == 1024  # flag beats env and file
    assert s.policy is Policy.BINPACK  # env beats file (flag None = not given)
    assert s.resource_domain == "file.io"  # file beats default
    assert s.log_level == "debug"
    assert s.api_wait_s == 2.0  # default
    assert load({}, env, f).memory_unit_mib == 512
    assert load({}, {}, f).memory_unit_mib == 128


def test_config_file_from_env_and_node_name(short_tmp: Path) -> None:
    f = write(short_tmp / "c.yaml", "version: v1\nnode_name: from-file\n")
    assert load({}, {"VGPU_CONFIG_FILE": str(f)}).node_name == "from-file"
    assert load({}, {"VGPU_CONFIG_FILE": str(f), "NODE_NAME": "dn"}).node_name == "dn"
    both = {"VGPU_CONFIG_FILE": str(f), "NODE_NAME": "dn", "VGPU_NODE_NAME": "v"}
    assert load({}, both).node_name == "v"
    assert load({"node_name": "flag"}, both).node_name == "flag"


def test_env_values_are_converted() -> None:
    s = load(
        {},
        {
            "VGPU_IGNORED_XIDS": "79, 13,13",
            "VGPU_API_WAIT_S": "0.5",
            "VGPU_LOG_LEVEL": "WARNING",
            "VGPU_BACKEND": "mock",
            "VGPU_MOCK_GPUS": "preset:2xH200",
        },
    )
    assert s.ignored_xids == (13, 79)
    assert s.api_wait_s == 0.5
    assert s.log_level == "warning"
    assert s.mock_gpus == Path("preset:2xH200")


def test_unrelated_environment_is_ignored() -> None:
    assert load({}, {"VGPU_NOT_A_KEY": "x", "MEMORY_UNIT_MIB": "1"}) == Settings()


@pytest.mark.parametrize(
    "key, value, allowed",
    [
        ("memory_unit_mib", "10", "64 to 65536"),
        ("memory_unit_mib", "abc", "whole number"),
        ("memory_unit_mib", "70000", "64 to 65536"),
        ("api_wait_s", "3", "0.0 to 2.0"),
        ("reconcile_interval_s", "0", "1.0 to 3600.0"),
        ("policy", "random", "binpack or spread"),
        ("backend", "cuda", "nvml or mock"),
        ("log_format", "xml", "text or json"),
        ("resource_domain", "kubernetes.io", "outside kubernetes.io"),
        ("resource_domain", "Not A Domain", "DNS domain"),
        ("metrics_address", "9400", "HOST:PORT"),
        ("metrics_address", "0.0.0.0:70000", "HOST:PORT"),
        ("metrics_container_names", "maybe", "true or false"),
        ("ignored_xids", "13,x", "whole number"),
        ("state_dir", "", "cannot be empty"),
        ("context_overhead_mib", "-1", "0 to 65536"),
        ("hook_injection", "preload", "ld-so-preload or env"),
    ],
)
def test_bad_values_name_key_source_and_allowed(key: str, value: str, allowed: str) -> None:
    env_name = "VGPU_" + key.upper()
    with pytest.raises(ConfigError) as info:
        load({}, {env_name: value})
    msg = info.value.message
    assert f"environment {env_name}" in msg and key in msg and allowed in msg
    with pytest.raises(ConfigError, match=f"flag --{key.replace('_', '-')}"):
        load({key: value}, {})


def test_context_overhead_estimate_reaches_the_settings() -> None:
    assert Settings().context_overhead_mib == 0  # absent: nothing charged
    assert load({"context_overhead_mib": "512"}, {}).context_overhead_mib == 512


def test_hook_injection_defaults_to_ld_so_preload() -> None:
    assert Settings().hook_injection == "ld-so-preload"
    assert load({}, {"VGPU_HOOK_INJECTION": "env"}).hook_injection == "env"
    assert load({"hook_injection": "ld-so-preload"}, {}).hook_injection == "ld-so-preload"


def test_unknown_flag_key_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown setting 'colour'"):
        load({"colour": "red"}, {})


def test_mock_backend_needs_mock_gpus() -> None:
    with pytest.raises(ConfigError, match="--mock-gpus"):
        load({"backend": "mock"}, {})


BAD_FILES = [
    pytest.param("version: v1\nbogus: 1\n", "unknown key 'bogus'", id="unknown-key"),
    pytest.param("version: v1\nmemory_unit_mib: [1]\n", "memory_unit_mib", id="wrong-type"),
    pytest.param("version: v1\nmemory_unit_mib: true\n", "memory_unit_mib", id="bool-for-int"),
    pytest.param("version: v1\nmemory_unit_mib: 32\n", "memory_unit_mib=32", id="out-of-range"),
    pytest.param("version: v1\napi_wait_s: 9\n", "api_wait_s=9", id="float-out-of-range"),
    pytest.param("version: v1\nignored_xids: 5\n", "ignored_xids", id="xids-not-a-list"),
    pytest.param("version: v1\nstate_dir: 5\n", "state_dir", id="path-not-a-string"),
    pytest.param("version: v1\nbackend: [\n", "line 3", id="yaml-syntax"),
    pytest.param("version: v1\n  bad: indent\n", "line 2", id="yaml-indent"),
    pytest.param("memory_unit_mib: 512\n", "version", id="no-version"),
    pytest.param("version: v2\n", "version='v2'", id="wrong-version"),
    pytest.param("- a\n- b\n", "mapping", id="top-level-list"),
]


@pytest.mark.parametrize("text, needle", BAD_FILES)
def test_bad_config_files(short_tmp: Path, text: str, needle: str) -> None:
    f = write(short_tmp / "c.yaml", text)
    with pytest.raises(ConfigError) as info:
        load({}, {}, f)
    assert needle in info.value.message
    assert str(f) in info.value.message
    assert "\n" not in info.value.message


def test_empty_file_with_version_only_is_defaults(short_tmp: Path) -> None:
    assert load({}, {}, write(short_tmp / "c.yaml", "version: v1\n")) == Settings()


def test_missing_file(short_tmp: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load({}, {}, short_tmp / "nope.yaml")


def test_default_file_round_trips(short_tmp: Path) -> None:
    f = write(short_tmp / "d.yaml", config.default_file())
    assert load({}, {}, f) == Settings()


def test_public_is_plain_data() -> None:
    public = Settings().public()
    assert public["policy"] == "binpack"
    assert public["device_plugin_dir"] == "/var/lib/kubelet/device-plugins"
    assert isinstance(public["ignored_xids"], list)
    assert set(public) == set(config.KEYS)


# ------------------------------------------------------------------ the CLI


def vgpu(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vgpu", *args],
        capture_output=True,
        text=True,
        timeout=20,
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin"},  # no VGPU_* leaking in
    )


def serve_args(root: Path) -> list[str]:
    return [
        "serve",
        "--backend",
        "mock",
        "--mock-gpus",
        "preset:1xH200",
        "--device-plugin-dir",
        str(root / "dp"),
        "--state-dir",
        str(root / "state"),
        "--pod-resources-socket",
        str(root / "pr.sock"),
    ]


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode not in (0, None), proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("vgpu: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    "text, needles",
    [
        pytest.param("version: v1\nbogus: 1\n", ("bogus",), id="unknown-key"),
        pytest.param("version: v1\nmemory_unit_mib: abc\n", ("memory_unit_mib",), id="type"),
        pytest.param("version: v1\nmemory_unit_mib: 10\n", ("memory_unit_mib",), id="range"),
        pytest.param("version: v1\npolicy: [\n", ("line 3",), id="yaml-syntax"),
    ],
)
def test_serve_with_a_bad_config_exits_at_once(
    short_tmp: Path, text: str, needles: tuple[str, ...]
) -> None:
    f = write(short_tmp / "c.yaml", text)
    proc = vgpu(*serve_args(short_tmp), "--config", str(f))
    assert proc.returncode == 2
    assert_one_line_error(proc, *needles)
    assert not (short_tmp / "dp").exists()  # nothing was started


def test_serve_with_a_missing_config_file(short_tmp: Path) -> None:
    proc = vgpu(*serve_args(short_tmp), "--config", str(short_tmp / "nope.yaml"))
    assert proc.returncode == 2
    assert_one_line_error(proc, "nope.yaml", "does not exist")


def test_serve_mock_without_mock_gpus(short_tmp: Path) -> None:
    proc = vgpu("serve", "--backend", "mock", "--device-plugin-dir", str(short_tmp / "dp"))
    assert proc.returncode == 2
    assert_one_line_error(proc, "--mock-gpus")


def test_serve_with_a_missing_mock_file(short_tmp: Path) -> None:
    args = serve_args(short_tmp)
    args[args.index("preset:1xH200")] = str(short_tmp / "none.json")
    proc = vgpu(*args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert any(
        line.startswith("vgpu: mock GPU file") and "does not exist" in line
        for line in proc.stderr.splitlines()
    ), proc.stderr


def test_config_check_ok_and_bad(short_tmp: Path) -> None:
    good = write(short_tmp / "good.yaml", "version: v1\nmemory_unit_mib: 512\n")
    proc = vgpu("config", "check", str(good))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{good}: ok"
    bad = write(short_tmp / "bad.yaml", "version: v1\nmemory_unit_mib: 1\n")
    proc = vgpu("config", "check", str(bad))
    assert proc.returncode == 2
    assert_one_line_error(proc, "memory_unit_mib")


def test_config_default_passes_config_check(short_tmp: Path) -> None:
    proc = vgpu("config", "default")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("#")
    assert "version: v1" in proc.stdout
    for key in config.KEYS:
        assert key in proc.stdout
    f = write(short_tmp / "d.yaml", proc.stdout)
    check = vgpu("config", "check", str(f))
    assert check.returncode == 0, check.stderr


def test_status_with_an_empty_state_dir(short_tmp: Path) -> None:
    proc = vgpu("status", "--state-dir", str(short_tmp))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "node.json does not exist" in proc.stderr
    assert "--state-dir" in proc.stderr


def test_empty_ignored_xids_from_flag_or_env_ignores_nothing() -> None:
    assert config.load({"ignored_xids": ""}, {}).ignored_xids == ()
    assert config.load({}, {"VGPU_IGNORED_XIDS": ""}).ignored_xids == ()
