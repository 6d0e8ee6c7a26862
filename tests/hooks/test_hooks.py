"""Tests of hooks/libvgpu.so against a stand-in driver (no GPU needed).

`make -C hooks test-bins` builds the library, a stand-in libcuda.so.1 and
libnvidia-ml.so.1, and the probe programs; each test runs the probe
(hooks/tests/probe.c) with the library preloaded and reads its JSON lines.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from vgpu.adapters import budget

ROOT = Path(__file__).resolve().parents[2]
HOOKS = ROOT / "hooks"
BUILD = HOOKS / "build"
LIB = BUILD / "libvgpu.so"
PROBE = BUILD / "vgpu_probe"
PROBE_DL = BUILD / "vgpu_probe_dl"  # not linked to libcuda: dlopen(RTLD_LOCAL) only
MIB = 1024 * 1024
FAKE_TOTAL = 80 * 1024 * MIB
OOM = 2
PATHS = ["direct", "dlsym", "proc", "proc2"]
KINDS = [
    "mem", "mem1", "pitch", "pitch1", "managed", "async", "async_ptsz", "pool", "pool_ptsz",
    "create", "array", "array1", "array3d", "array3d1", "mipmap",
]  # fmt: skip
# MiB the hook charges for "alloc KIND 64" (see probe.c): mipmaps have a 2nd level of 1/4.
CHARGE_64 = {kind: 80 if kind == "mipmap" else 64 for kind in KINDS}


def base_env(*, nvml: bool = False, preload: bool = True) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VGPU_", "FAKE_", "PROBE_", "LD_PRELOAD"))
    }
    libs = [BUILD / "fake", BUILD] + ([BUILD / "fake-nvml"] if nvml else [])
    env["LD_LIBRARY_PATH"] = ":".join(str(p) for p in libs)
    if preload:
        env["LD_PRELOAD"] = str(LIB)
    return env


def probe(
    *ops: object,
    env: dict[str, str] | None = None,
    timeout: float = 30,
    binary: Path = PROBE,
    **extra: object,
) -> tuple[list[dict[str, object]], str]:
    """Runs the probe; returns its JSON lines and its stderr."""
    full = base_env() if env is None else dict(env)
    full.update({k: str(v) for k, v in extra.items()})
    run = subprocess.run(
        [str(binary), *map(str, ops)], env=full, capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, f"probe failed ({run.returncode}): {run.stderr}"
    return [json.loads(line) for line in run.stdout.splitlines()], run.stderr


def start_probe(
    *ops: object, env: dict[str, str] | None = None, **extra: object
) -> tuple[subprocess.Popen[str], dict[str, object]]:
    """Starts a probe that ends its ops with `ready wait`; returns it once ready,
    with its output lines and its pid."""
    full = base_env() if env is None else dict(env)
    full.update({k: str(v) for k, v in extra.items()})
    proc = subprocess.Popen(
        [str(PROBE), *map(str, ops), "ready", "wait"],
        env=full,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines = []
    while True:
        line = proc.stdout.readline()
        assert line, f"probe exited early: {proc.stderr.read() if proc.stderr else ''}"
        lines.append(json.loads(line))
        if lines[-1]["op"] == "ready":
            return proc, {"lines": lines, "pid": lines[-1]["pid"]}


def release(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=10)


def vgpu_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("vgpu:")]


@pytest.fixture
def shared(tmp_path: Path) -> str:
    return str(tmp_path)


# ---- build and contract ----


def hooked_symbols() -> set[str]:
    text = (HOOKS / "vgpu_hooks.h").read_text()
    return set(re.findall(r"^\s*N?X\(((?:cu|nvml)\w+),", text, flags=re.M))


def test_exports_only_intercepted_symbols() -> None:
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(LIB)], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.split()[1] in "TtWi"}
    assert exported == hooked_symbols() | {"dlsym"}
    assert len(hooked_symbols()) >= 60


@pytest.mark.timeout(120)
def test_make_and_clean_from_scratch(tmp_path: Path) -> None:
    copy = tmp_path / "hooks"
    shutil.copytree(HOOKS, copy, ignore=shutil.ignore_patterns("build"))
    subprocess.run(["make", "-C", str(copy)], check=True, capture_output=True, timeout=120)
    assert (copy / "build" / "libvgpu.so").is_file()
    subprocess.run(["make", "-C", str(copy), "clean"], check=True, capture_output=True)
    assert not (copy / "build").exists()


def test_gpu_check_script_parses_and_plans_every_step() -> None:
    """The real-GPU check cannot run here; its shell and Python are checked without one."""
    import sys

    subprocess.run(["bash", "-n", str(HOOKS / "gpu-check.sh")], check=True)
    run = subprocess.run(
        [str(HOOKS / "gpu-check.sh"), "--dry-run"],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    assert plan["dry_run"] is True and len(plan["steps"]) == 11
    assert plan["steps"][-1] == "arbiter_scenarios"  # bench/arbiter.py --real, checked to load


# ---- memory: every path, every allocator ----


@pytest.mark.parametrize("path", PATHS)
def test_limit_holds_on_each_path(path: str, shared: str) -> None:
    lines, _ = probe(
        "info", "total", "alloc", "mem", 600, "alloc", "mem", 500, "info", "free", 0,
        "alloc", "mem", 500, "info",
        PROBE_PATH=path, VGPU_MEMORY_LIMIT_MIB=1024, VGPU_SHARED_DIR=shared,
    )  # fmt: skip
    info0, total, a1, a2, info1, free, a3, info2 = lines
    assert (info0["total"], info0["free"], total["bytes"]) == (1024 * MIB, 1024 * MIB, 1024 * MIB)
    assert (a1["rc"], a2["rc"]) == (0, OOM)
    assert info1["free"] == 424 * MIB
    assert free["rc"] == 0 and a3["rc"] == 0
    assert info2["free"] == 524 * MIB


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_allocator_is_charged_and_freed(kind: str, path: str, shared: str) -> None:
    # A pool keeps its memory until the next synchronisation: "sync" lets it go.
    lines, _ = probe(
        "alloc", kind, 64, "info", "alloc", kind, 64, "free", 0, "sync", "info",
        PROBE_PATH=path, VGPU_MEMORY_LIMIT_MIB=100, VGPU_SHARED_DIR=shared,
    )  # fmt: skip
    first, info, second, free, _sync, after = lines
    assert first["rc"] == 0
    assert info["free"] == (100 - CHARGE_64[kind]) * MIB
    assert second["rc"] == OOM
    assert free["rc"] == 0
    assert after["free"] == 100 * MIB


@pytest.mark.parametrize("path", PATHS[1:])
def test_program_that_only_dlopens_the_driver(path: str, shared: str) -> None:
    """Like the CUDA runtime: dlopen("libcuda.so.1", RTLD_LOCAL), then dlsym/cuGetProcAddress."""
    lines, _ = probe(
        "alloc", "mem", 60, "alloc", "create", 60, "alloc", "array", 30, "info", "free", 0,
        "info", "launchall",
        binary=PROBE_DL, PROBE_PATH=path, VGPU_MEMORY_LIMIT_MIB=100, VGPU_SHARED_DIR=shared,
    )  # fmt: skip
    mem, create, array, info, free, after, launch = lines
    assert (mem["rc"], create["rc"], array["rc"]) == (0, OOM, 0)
    assert info["free"] == 10 * MIB and free["rc"] == 0 and after["free"] == 70 * MIB
    assert launch["rc"] == 0


def test_proc_address_fallback_by_name(shared: str) -> None:
    """A driver handing out internal addresses still gets our wrapper."""
    lines, _ = probe(
        "alloc", "mem", 80, "alloc", "mem", 80,
        PROBE_PATH="proc", FAKE_CUDA_PROC_ALIAS=1, VGPU_MEMORY_LIMIT_MIB=100,
        VGPU_SHARED_DIR=shared,
    )  # fmt: skip
    assert [line["rc"] for line in lines] == [0, OOM]


def test_info_and_total_mem(shared: str) -> None:
    lines, _ = probe(
        "alloc", "mem", 100, "info", "info1", "total", "total1",
        VGPU_MEMORY_LIMIT_MIB=1024, VGPU_SHARED_DIR=shared,
    )  # fmt: skip
    _, info, info1, total, total1 = lines
    assert (info["free"], info["total"]) == (924 * MIB, 1024 * MIB)
    assert (info1["free"], info1["total"]) == (924 * MIB, 1024 * MIB)
    assert total["bytes"] == total1["bytes"] == 1024 * MIB


def test_info_never_above_the_real_card(shared: str) -> None:
    lines, _ = probe(
        "alloc", "mem", 100, "info", "total",
        VGPU_MEMORY_LIMIT_MIB=4096, VGPU_SHARED_DIR=shared, FAKE_CUDA_TOTAL_MIB=512,
    )  # fmt: skip
    _, info, total = lines
    assert (info["free"], info["total"], total["bytes"]) == (412 * MIB, 512 * MIB, 512 * MIB)


def test_info_free_clamped_to_real_free(shared: str) -> None:
    """A card with less free memory than the budget: the card's figure wins."""
    lines, _ = probe(
        "alloc", "mem", 500, "info",
        VGPU_MEMORY_LIMIT_MIB=900, VGPU_SHARED_DIR=shared, FAKE_CUDA_TOTAL_MIB=600,
    )  # fmt: skip
    assert (lines[1]["free"], lines[1]["total"]) == (100 * MIB, 600 * MIB)


def test_budget_is_per_device(shared: str) -> None:
    lines, _ = probe(
        "alloc", "mem", 80, "dev", 1, "info", "alloc", "mem", 80, "alloc", "mem", 80,
        "dev", 0, "info",
        VGPU_MEMORY_LIMIT_MIB=100, VGPU_SHARED_DIR=shared,
    )  # fmt: skip
    a0, info1, a1, a1b, info0 = lines
    assert a0["rc"] == 0 and info1["free"] == 100 * MIB
    assert (a1["rc"], a1b["rc"]) == (0, OOM)
    assert info0["free"] == 20 * MIB


def test_frees_return_budget_and_never_underflow(shared: str) -> None:
    limit = {"VGPU_MEMORY_LIMIT_MIB": 100, "VGPU_SHARED_DIR": shared}
    holder, _ = start_probe("alloc", "mem", 30, **limit)
    try:
        lines, _ = probe(
            "alloc", "mem", 50, "free", 0, "free", 0, "freeptr", "deadbeef", "info",
            "alloc", "mem", 71, "alloc", "mem", 70, **limit,
        )  # fmt: skip
        alloc, free, double, unknown, info, too_big, fits = lines
        assert alloc["rc"] == 0 and free["rc"] == 0
        assert double["rc"] != 0 and unknown["rc"] != 0
        assert info["free"] == 70 * MIB  # the holder's 30 still count
        assert (too_big["rc"], fits["rc"]) == (OOM, 0)
    finally:
        release(holder)


# ---- memory: processes and threads sharing one budget ----


def test_second_process_sees_first_at_once(shared: str) -> None:
    limit = {"VGPU_MEMORY_LIMIT_MIB": 1024, "VGPU_SHARED_DIR": shared}
    holder, _ = start_probe("alloc", "mem", 600, **limit)
    try:
        lines, _ = probe("info", "alloc", "mem", 500, "alloc", "mem", 400, **limit)
        assert lines[0]["free"] == 424 * MIB
        assert [line["rc"] for line in lines[1:]] == [OOM, 0]
    finally:
        release(holder)
    lines, _ = probe("info", "alloc", "mem", 1000, **limit)
    assert lines[0]["free"] == 1024 * MIB and lines[1]["rc"] == 0


def test_killed_holder_share_comes_back(shared: str) -> None:
    limit = {"VGPU_MEMORY_LIMIT_MIB": 1024, "VGPU_SHARED_DIR": shared}
    holder, _ = start_probe("alloc", "mem", 600, "alloc", "create", 200, **limit)
    os.kill(holder.pid, signal.SIGKILL)
    time.sleep(0.2)  # not reaped yet: the holder is a zombie, its pid still taken
    try:
        lines, _ = probe("info", "alloc", "mem", 1000, **limit)
        assert lines[0]["free"] == 1024 * MIB
        assert lines[1]["rc"] == 0
    finally:
        holder.wait(timeout=10)


def test_forked_child_gets_its_own_share(shared: str) -> None:
    lines, _ = probe(
        "alloc", "mem", 30, "forkchild", 50, "info", "forkchild", 80, "info",
        VGPU_MEMORY_LIMIT_MIB=100, VGPU_SHARED_DIR=shared,
    )  # fmt: skip
    alloc, child, info, child2, info2 = lines
    assert alloc["rc"] == 0 and child["rc"] == 0 and child2["rc"] == OOM
    assert info["free"] == info2["free"] == 70 * MIB  # the exited child's 50 came back


@pytest.mark.timeout(60)
def test_lock_of_a_killed_process_is_recovered(shared: str) -> None:
    limit = {"VGPU_MEMORY_LIMIT_MIB": 1024, "VGPU_SHARED_DIR": shared}
    probe("alloc", "mem", 100, **limit)  # creates the shared file
    env = base_env()
    env.update({k: str(v) for k, v in limit.items()})
    holder = subprocess.Popen(
        [str(BUILD / "lock_holder")], env=env, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
    holder.kill()
    holder.wait(timeout=10)
    lines, _ = probe("info", "alloc", "mem", 1000, timeout=20, **limit)
    assert lines[0]["free"] == 1024 * MIB  # totals rebuilt from the (empty) slots
    assert lines[1]["rc"] == 0


@pytest.mark.timeout(60)
def test_threads_never_exceed_the_limit(shared: str) -> None:
    for _ in range(3):
        lines, _ = probe("threads", 8, 7, VGPU_MEMORY_LIMIT_MIB=1000, VGPU_SHARED_DIR=shared)
        held = lines[0]["chunks"] * 7
        assert 1000 - 7 < held <= 1000
        assert lines[0]["driver_bytes"] == held * MIB  # what the driver really gave out


@pytest.mark.timeout(60)
def test_processes_never_exceed_the_limit(shared: str) -> None:
    env = base_env()
    env.update({"VGPU_MEMORY_LIMIT_MIB": "1000", "VGPU_SHARED_DIR": shared})
    procs = [
        subprocess.Popen(
            [str(PROBE), "fill", "mem", "7", "ready", "wait"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    held = 0
    for proc in procs:
        assert proc.stdout is not None
        fill = json.loads(proc.stdout.readline())
        held += fill["chunks"] * 7
    lines, _ = probe("info", VGPU_MEMORY_LIMIT_MIB=1000, VGPU_SHARED_DIR=shared)
    for proc in procs:
        release(proc)
    assert 1000 - 7 < held <= 1000
    assert lines[0]["free"] == (1000 - held) * MIB


def test_without_shared_dir_the_budget_is_per_process() -> None:
    holder, _ = start_probe("alloc", "mem", 600, VGPU_MEMORY_LIMIT_MIB=1024)
    try:
        lines, err = probe("alloc", "mem", 600, "info", VGPU_MEMORY_LIMIT_MIB=1024)
        assert lines[0]["rc"] == 0 and lines[1]["free"] == 424 * MIB
        assert len(vgpu_lines(err)) == 1 and "VGPU_SHARED_DIR" in err
    finally:
        release(holder)


# ---- configuration ----


def write_config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.json"
    path.write_text(text)
    return str(path)


def total_seen(shared: str, **env: object) -> tuple[int, str]:
    lines, err = probe("info", VGPU_SHARED_DIR=shared, **env)
    return int(lines[0]["total"]), err  # type: ignore[call-overload]


def test_config_file_wins_over_environment(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        '{"version": 1, "pod": {"name": "x", "memory_limit_mib": 5}, "container": "c",'
        ' "cards": [{"uuid": "GPU-1", "memory_limit_mib": 7}], "note": "\\"memory_limit_mib\\": 9",'
        ' "memory_limit_mib" : 256, "core_percent": null}',
    )
    total, err = total_seen(str(tmp_path), VGPU_CONFIG=config, VGPU_MEMORY_LIMIT_MIB=1024)
    assert total == 256 * MIB and vgpu_lines(err) == []


def test_environment_fallback_and_no_limit(shared: str) -> None:
    assert total_seen(shared, VGPU_MEMORY_LIMIT_MIB=" 2048 ")[0] == 2048 * MIB
    assert total_seen(shared) == (FAKE_TOTAL, "")


def test_null_in_config_means_no_limit(tmp_path: Path) -> None:
    config = write_config(tmp_path, '{"memory_limit_mib": null, "core_percent": null}')
    assert total_seen(str(tmp_path), VGPU_CONFIG=config) == (FAKE_TOTAL, "")


@pytest.mark.parametrize("value", ["abc", "-5", "0", "12.5", "99999999999999999999", "1e3"])
def test_bad_environment_value_is_no_limit(value: str, shared: str) -> None:
    total, err = total_seen(shared, VGPU_MEMORY_LIMIT_MIB=value)
    assert total == FAKE_TOTAL
    assert len(vgpu_lines(err)) == 1 and "VGPU_MEMORY_LIMIT_MIB" in err


@pytest.mark.parametrize(
    "text",
    [
        '{"memory_limit_mib": "2048", "core_percent": 20}',
        '{"memory_limit_mib": 2048.5}',
        '{"memory_limit_mib": 2048, "core_percent": 0}',
        "{",
        "[1, 2]",
        "",
    ],
)
def test_bad_config_file_fails_safe(tmp_path: Path, text: str) -> None:
    """A config file that cannot be used is never "no limit": with no limits in the
    environment either, the process gets no memory and no context (one line)."""
    env = {"VGPU_CONFIG": write_config(tmp_path, text), "VGPU_SHARED_DIR": str(tmp_path)}
    lines, err = probe("info", "alloc", "mem", 1, "ctx", 0, **env)
    assert int(lines[0]["total"]) == 0  # type: ignore[call-overload]
    assert lines[1]["rc"] == OOM
    assert lines[2]["rc"] == 3  # CUDA_ERROR_NOT_INITIALIZED
    (line,) = vgpu_lines(err)
    assert "is unusable" in line and "failing safe" in line


def test_bad_config_file_falls_back_to_the_environment(tmp_path: Path) -> None:
    config = write_config(tmp_path, '{"memory_limit_mib": "2048"}')
    total, err = total_seen(str(tmp_path), VGPU_CONFIG=config, VGPU_MEMORY_LIMIT_MIB=10)
    assert total == 10 * MIB
    (line,) = vgpu_lines(err)
    assert "is unusable" in line and "using the limits in the environment" in line


def test_an_environment_without_a_limit_is_no_fallback(tmp_path: Path) -> None:
    """VGPU_CORE_LIMIT=100 limits nothing: an unusable config still fails safe."""
    config = write_config(tmp_path, "{")
    total, err = total_seen(str(tmp_path), VGPU_CONFIG=config, VGPU_CORE_LIMIT=100)
    assert total == 0 and "failing safe" in err


def test_missing_config_file_uses_the_environment_limits(tmp_path: Path) -> None:
    absent = str(tmp_path / "absent.json")
    total, err = total_seen(str(tmp_path), VGPU_CONFIG=absent, VGPU_MEMORY_LIMIT_MIB=10)
    assert total == 10 * MIB and len(vgpu_lines(err)) == 1


def test_bad_core_limit_logged_once() -> None:
    lines, err = probe("launchall", "launchall", VGPU_CORE_LIMIT=150)
    assert [line["rc"] for line in lines] == [0, 0]
    assert len(vgpu_lines(err)) == 1 and "VGPU_CORE_LIMIT" in err


def _plant(shared: str, what: str) -> None:
    path = Path(shared, "vgpu.shm")
    if what == "short":
        path.write_bytes(b"not a vgpu file")  # wrong size: never mapped
    elif what == "garbage":
        path.write_bytes(os.urandom(budget.FILE_BYTES))  # the right size, another layout
    elif what == "fifo":
        os.mkfifo(path)  # opening it must not block
    elif what == "symlink":
        target = Path(shared, "elsewhere")
        target.write_bytes(b"\0" * budget.FILE_BYTES)
        path.symlink_to(target)  # never followed
    elif what == "directory":
        path.mkdir()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("what", ["short", "garbage", "fifo", "symlink", "directory"])
def test_incompatible_shared_file_falls_back(shared: str, what: str) -> None:
    _plant(shared, what)
    lines, err = probe(
        "alloc", "mem", 50, "info", VGPU_MEMORY_LIMIT_MIB=100, VGPU_SHARED_DIR=shared, timeout=10
    )
    assert lines[0]["rc"] == 0 and lines[1]["free"] == 50 * MIB
    assert len(vgpu_lines(err)) == 1 and ("unusable" in err or "cannot open" in err)
    if what == "symlink":
        assert Path(shared, "elsewhere").read_bytes() == b"\0" * budget.FILE_BYTES  # untouched


def test_precreated_zero_filled_file_is_initialised_and_shared(shared: str) -> None:
    """As the daemon creates it: zero-filled, full size, blocks allocated."""
    Path(shared, "vgpu.shm").write_bytes(b"\0" * budget.FILE_BYTES)
    limit = {"VGPU_MEMORY_LIMIT_MIB": 100, "VGPU_SHARED_DIR": shared}
    holder, _ = start_probe("alloc", "mem", 60, **limit)
    try:
        lines, err = probe("alloc", "mem", 60, **limit)
        assert lines[0]["rc"] == OOM and err == ""
    finally:
        release(holder)


# ---- dlsym forwarding ----


@pytest.mark.parametrize("preload", [True, False])
def test_dlsym_forwarding(preload: bool) -> None:
    lines, err = probe("next", "forward", env=base_env(preload=preload))
    nxt, fwd = lines
    assert nxt["value"] == 102  # RTLD_NEXT from libnext_a found libnext_b
    assert fwd == {
        "op": "forward",
        "strlen": 1,
        "malloc_next": 1,
        "driver_version": 12040,
        "missing": 0,
        "hooked_differs": 1,
    }
    assert err == ""


# ---- compute ----


def compute_env(core: int | None, *, nvml: bool = True, **extra: object) -> dict[str, str]:
    env = base_env(nvml=nvml)
    if core is not None:
        env["VGPU_CORE_LIMIT"] = str(core)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def share_of(*ops: object, env: dict[str, str]) -> tuple[float, str]:
    """The GPU share the probe's launches got in the last third of their run."""
    lines, err = probe(*ops, env=env, timeout=60)
    return float(lines[-1]["share"]), err  # type: ignore[arg-type]


# The stand-in card runs each kernel for FAKE_CUDA_LAUNCH_US on a timeline shared
# by all processes of a test (FAKE_GPU_STATE); NVML reports each process's share.
#
# What an unthrottled tenant reaches there depends on the CPU the machine leaves
# it: 0.99 alone, 0.65-1.0 beside two busy loops on two cores (issue 29). So no
# test asserts an unthrottled share as a number: each compares it with what the
# limit allows (LIMIT_BAND for 30 %), which load can only lower, never raise.
LIMIT_BAND = (0.22, 0.38)  # a 30 % tenant's share of the stand-in card
MARGIN = 0.15  # an unthrottled share this far above a throttled one is no throttle


@pytest.mark.timeout(60)
def test_launches_converge_to_the_limit(tmp_path: Path) -> None:
    state = {"FAKE_GPU_STATE": tmp_path / "gpu", "FAKE_CUDA_LAUNCH_US": 200}
    # The baseline: the same tenant without a limit, in this test, on this machine now.
    free, _ = share_of("ctx", 0, "launch", 1.5, env=compute_env(None, **state))
    limited, _ = share_of(
        "ctx", 0, "launch", 3, env=compute_env(30, VGPU_SHARED_DIR=tmp_path, **state)
    )
    print(f"GPU share: unthrottled {free:.3f}, limit 30% {limited:.3f}")
    low, high = LIMIT_BAND
    # Load only lowers a share: the band's top holds on any machine, its bottom
    # as far as the machine let the unthrottled tenant get.
    assert min(low, free / 2) <= limited <= high, (limited, free)
    # The limit is what held it: without it the same tenant got clearly more.
    assert free >= limited + MARGIN, (free, limited)


@pytest.mark.timeout(60)
def test_without_nvml_throttling_is_off_with_one_log_line(tmp_path: Path) -> None:
    # Baseline: the same tenant throttled through NVML, in this test.
    throttled, _ = share_of(
        "ctx", 0, "launch", 1.5,
        env=compute_env(30, VGPU_SHARED_DIR=tmp_path, FAKE_GPU_STATE=tmp_path / "gpu",
                        FAKE_CUDA_LAUNCH_US=200),
    )  # fmt: skip
    share, err = share_of(
        "ctx", 0, "launch", 1, env=compute_env(30, nvml=False, FAKE_CUDA_LAUNCH_US=200)
    )
    print(f"GPU share at 30%: with NVML {throttled:.3f}, without {share:.3f}")
    # Unthrottled: clearly above what the same limit gives with NVML.
    assert share >= throttled + MARGIN, (share, throttled)
    assert len(vgpu_lines(err)) == 1 and "NVML" in err and "not enforced" in err


@pytest.mark.parametrize("path", PATHS)
def test_every_launch_entry_point_passes_through(path: str) -> None:
    lines, _ = probe("launchall", env=compute_env(50), PROBE_PATH=path)
    assert lines[0]["rc"] == 0


# ---- cost ----


@pytest.mark.timeout(60)
def test_benchmark_overhead() -> None:
    run = subprocess.run(
        ["sh", str(HOOKS / "tests" / "bench.sh"), str(BUILD)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    numbers = json.loads(run.stdout)
    print(f"hook overhead: {numbers}")
    assert numbers["alloc_free_pair_ns"] < 20_000
    assert numbers["launch_ns"] < 20_000


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind not installed")
def test_valgrind_clean(shared: str) -> None:
    env = base_env()
    env.update({"VGPU_MEMORY_LIMIT_MIB": "100", "VGPU_SHARED_DIR": shared, "PROBE_PATH": "proc"})
    run = subprocess.run(
        ["valgrind", "-q", "--error-exitcode=9", str(PROBE),
         "alloc", "mem", "60", "alloc", "pitch", "60", "free", "0", "threads", "4", "7", "info"],
        env={k: str(v) for k, v in env.items()},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
