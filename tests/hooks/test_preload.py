"""No way around the hook (issue 17, item 3): /etc/ld.so.preload loads it into
every process of a sliced container, and it finds its limits without any env.

Each test builds a "container" in a private mount namespace (`unshare -m`,
root): /etc, /run and /usr get a throw-away overlay, the limit contract's own
mounts (vgpu.core.contract: the config dir at /etc/vgpu, the budget file at
/var/run/vgpu/vgpu.shm, the hook under /usr/local/vgpu and, last, the
read-only /etc/ld.so.preload) are bind-mounted as a runtime would, and the
stand-in driver is installed into that namespace's ld.so.cache, as a real
driver is. Nothing is mounted on the machine itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.hooks.test_hooks import BUILD, LIB, MIB, OOM, PROBE
from vgpu.adapters.fs import ContainerStore, install_hook
from vgpu.core.contract import (
    PRELOAD_FILE,
    ContainerEdits,
    container_edits,
    with_hook_injection,
)
from vgpu.core.model import CardUuid, Placement

NOT_INITIALIZED = 3
LIMIT_MIB = 1024
NOBODY = 65534

# The namespace: overlays, the driver in ld.so.cache, the contract's mounts
# ("ro"/"rw" host target, one per line in $MOUNTS), then the command.
SCRIPT = r"""
set -e
W="$1"; shift
mount -t tmpfs -o mode=0755 tmpfs "$W"
for d in etc run usr; do
    mkdir -p "$W/$d.u" "$W/$d.w"
    mount -t overlay overlay -o "lowerdir=/$d,upperdir=$W/$d.u,workdir=$W/$d.w" "/$d"
done
mount -t tmpfs tmpfs /dev/shm
printf '%s\n' $DRIVER_DIRS > /etc/ld.so.conf.d/zz-vgpu-stand-in.conf
ldconfig -X
mkdir -p /usr/local/vgpu-test
mount -t tmpfs -o mode=0755 tmpfs /usr/local/vgpu-test
cp "$PROBE_BIN" /usr/local/vgpu-test/probe
cp /usr/local/vgpu-test/probe /usr/local/vgpu-test/probe-suid
chmod 4755 /usr/local/vgpu-test/probe-suid
printf '%s\n' "$MOUNTS" | while read -r mode host target; do
    [ -n "$target" ] || continue
    if [ -d "$host" ]; then
        mkdir -p "$target"
    else
        mkdir -p "$(dirname "$target")"; : > "$target"
    fi
    mount --bind "$host" "$target"
    if [ "$mode" = ro ]; then mount -o remount,bind,ro "$target"; fi
done
set +e
cd "$CWD"
"$@"
rc=$?
if [ -n "$LIST" ]; then
    (cd "$W" && find etc.u run.u usr.u -mindepth 1; ls -A /dev/shm) > "$LIST" 2>&1
fi
exit $rc
"""


@dataclass
class Container:
    root: Path
    edits: ContainerEdits
    config_file: Path
    budget_file: Path

    def env(self) -> dict[str, str]:
        """What the runtime gives the container's first process."""
        path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        return {"PATH": path, **self.edits.envs}

    def run(
        self,
        command: str,
        *,
        preload: bool = True,
        list_files: Path | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """`command` (sh) as the container's first process would run it; without
        `preload`, a container with no hook at all (no mount, no LD_PRELOAD)."""
        mounts = [m for m in self.edits.mounts if preload or m.container_path != PRELOAD_FILE]
        env = self.env() if preload else {k: v for k, v in self.env().items() if k != "LD_PRELOAD"}
        cwd = self.root / "cwd"
        cwd.mkdir(exist_ok=True)
        setup = {
            "PATH": self.env()["PATH"],
            "MOUNTS": "\n".join(
                f"{'ro' if m.read_only else 'rw'} {m.host_path} {m.container_path}" for m in mounts
            ),
            "DRIVER_DIRS": " ".join(str(BUILD / d) for d in ("fake", "fake-nvml", ".")),
            "PROBE_BIN": str(PROBE),
            "CWD": str(cwd),
            "LIST": str(list_files or ""),
        }
        work = self.root / "ns"
        work.mkdir(exist_ok=True)
        container = ["env", "-i", *(f"{k}={v}" for k, v in env.items()), "sh", "-c", command]
        return subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", SCRIPT, "ns", str(work),
             *container],
            env=setup, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip


def make_container(root: Path, *, core: int = 30, memory_mib: int = LIMIT_MIB) -> Container:
    """A sliced container as the daemon makes it: the hook installed (with its
    preload file), the config and budget file written, the edits of the contract."""
    placement = Placement(
        key="c1",
        cards=(CardUuid("GPU-00000000-0000-0000-0000-000000000000"),),
        ids={},
        core_percent=core,
        memory_mib=memory_mib,
    )
    hook = install_hook(LIB, root / "hooks", "0.0.0-test")
    paths = ContainerStore(root / "state", 256).write(placement)
    edits = container_edits(
        placement,
        [None],
        config_dir=str(paths.config_dir),
        shared_dir=str(paths.shared_dir),
        hook_path=str(hook),
    )
    edits = with_hook_injection(edits, str(hook), "ld-so-preload")
    return Container(root, edits, paths.config_file, paths.budget_file)


@pytest.fixture
def container(tmp_path: Path) -> Container:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail(
            "these tests need root and unshare(1) (util-linux) for a private mount namespace"
        )
    return make_container(tmp_path)


def json_lines(run: subprocess.CompletedProcess[str]) -> list[dict[str, object]]:
    assert run.returncode == 0, f"rc {run.returncode}: {run.stderr}"
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def vgpu_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("vgpu")]


P = "/usr/local/vgpu-test/probe"


# ---- a clean environment is still limited ----


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "launcher",
    [
        pytest.param("env -i", id="env-i"),
        pytest.param("env -u LD_PRELOAD -u VGPU_CONFIG -u VGPU_SHARED_DIR", id="env-u"),
        # a tenant's own variables cannot widen the mounted limits
        pytest.param(
            "env -i VGPU_MEMORY_LIMIT_MIB=999999 VGPU_CONFIG=/dev/null VGPU_SHARED_DIR=/tmp",
            id="env-i-tenant-vars",
        ),
    ],
)
def test_a_clean_environment_is_still_limited(container: Container, launcher: str) -> None:
    run = container.run(f"{launcher} {P} alloc mem 1000 alloc mem 100 info")
    alloc, over, info = json_lines(run)
    assert alloc["rc"] == 0 and over["rc"] == OOM
    assert info["total"] == LIMIT_MIB * MIB
    assert vgpu_lines(run.stderr) == []


@pytest.mark.timeout(60)
def test_without_the_preload_mount_a_clean_environment_escapes(container: Container) -> None:
    """The control: what `hook_injection: env` leaves open."""
    run = container.run(f"env -i {P} alloc mem 1000 alloc mem 100 info", preload=False)
    _, over, info = json_lines(run)
    assert over["rc"] == 0 and info["total"] == 80 * 1024 * MIB


@pytest.mark.timeout(60)
def test_the_preload_file_cannot_be_changed_from_inside(container: Container) -> None:
    """Read-only and a mount point: no write, no removal, no rename over it."""
    run = container.run(
        "echo /dev/null > /etc/ld.so.preload || echo no-write; "
        "rm -f /etc/ld.so.preload || echo no-rm; "
        "echo x > p.$$ && { mv p.$$ /etc/ld.so.preload || echo no-mv; }; "
        "rm -f p.$$; cat /etc/ld.so.preload"
    )
    hook = container.edits.envs["LD_PRELOAD"]
    assert run.stdout.split() == ["no-write", "no-rm", "no-mv", hook], run.stderr


@pytest.mark.timeout(60)
def test_clean_environment_processes_share_the_container_budget(container: Container) -> None:
    """The budget file is found at its fixed mount: two env -i processes share one limit."""
    run = container.run(
        f"env -i {P} alloc mem 800 ready sleep 20000 > a.out & "
        "n=0; until grep -q ready a.out; do "
        "sleep 0.05; n=$((n+1)); [ $n -lt 400 ] || exit 9; done; "
        f"env -i {P} alloc mem 400 alloc mem 200; kill $!; wait"
    )
    second, third = json_lines(run)
    assert second["rc"] == OOM and third["rc"] == 0


@pytest.mark.timeout(60)
def test_a_setuid_program_run_by_another_user_is_limited(container: Container) -> None:
    """As sudo starts programs: secure execution (AT_SECURE) ignores LD_PRELOAD,
    never /etc/ld.so.preload."""
    run = container.run(
        f"setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups "
        "env -i LD_PRELOAD= /usr/local/vgpu-test/probe-suid alloc mem 1000 alloc mem 100 info"
    )
    alloc, over, info = json_lines(run)
    assert alloc["rc"] == 0 and over["rc"] == OOM and info["total"] == LIMIT_MIB * MIB


@pytest.mark.timeout(90)
def test_the_core_limit_applies_to_a_clean_environment(container: Container) -> None:
    # Only the stand-in card's own knobs (its kernel time and shared timeline): the
    # real driver needs none. No VGPU_*, no LD_PRELOAD, no LD_LIBRARY_PATH.
    card = f"FAKE_GPU_STATE={container.root / 'gpu'} FAKE_CUDA_LAUNCH_US=200"
    run = container.run(f"env -i {card} {P} ctx 0 launch 3")
    lines = json_lines(run)
    assert lines[0]["rc"] == 0
    share = float(lines[-1]["share"])  # type: ignore[arg-type]
    print(f"GPU share under env -i at a 30% limit: {share:.3f}")
    assert 0.2 <= share <= 0.4


# ---- harmless everywhere else ----

EVERYDAY = (
    "echo out; echo err >&2; ls -a /etc/vgpu; sh -c 'exit 0'; cat /dev/null; "
    "python3 -c 'import ctypes, json; print(json.dumps([1]))'; "
    "env -i /bin/ls -d /; head -c 1 /etc/passwd >/dev/null; ./static; echo rc=$?"
)


@pytest.mark.timeout(90)
def test_everyday_programs_run_unchanged_with_no_output_and_no_files(
    container: Container, tmp_path: Path
) -> None:
    static = tmp_path / "cwd" / "static"
    static.parent.mkdir(exist_ok=True)
    source = tmp_path / "static.c"
    source.write_text('#include <stdio.h>\nint main(void) { puts("static ok"); return 0; }\n')
    subprocess.run(["gcc", "-static", "-O2", "-o", str(static), str(source)], check=True)
    budget_before = container.budget_file.read_bytes()
    with_hook = container.run(EVERYDAY, list_files=tmp_path / "with.txt")
    without = container.run(EVERYDAY, preload=False, list_files=tmp_path / "without.txt")
    assert with_hook.returncode == without.returncode == 0, with_hook.stderr
    assert with_hook.stdout == without.stdout and "static ok\nrc=0" in with_hook.stdout
    assert with_hook.stderr == without.stderr == "err\n"
    # No file anywhere the programs could write: the overlays over /etc, /run and
    # /usr hold only the contract's mount points, /dev/shm is empty, the working
    # directory holds only the program, and the budget file was not touched.
    created = set((tmp_path / "with.txt").read_text().split())
    assert created == set((tmp_path / "without.txt").read_text().split()) | {"etc.u/ld.so.preload"}
    assert not any(
        name.startswith("run.u/vgpu/") and name != "run.u/vgpu/vgpu.shm" for name in created
    )
    assert sorted(p.name for p in static.parent.iterdir()) == ["static"]
    assert container.budget_file.read_bytes() == budget_before
    # ... and the hook really was in those processes.
    # (Named by both LD_PRELOAD and /etc/ld.so.preload, it is loaded once.)
    maps = container.run("grep -c libvgpu /proc/self/maps; env -i grep -c libvgpu /proc/self/maps")
    both, preload_only = maps.stdout.split()
    assert int(both) > 0 and both == preload_only, maps.stderr


# ---- a config that cannot be used: logged once, fail-safe ----


def break_config(config: Path, how: str) -> None:
    text = config.read_text()
    config.unlink()
    if how == "missing":
        return
    if how == "corrupt":
        config.write_text(text[: len(text) // 2])
    elif how == "oversized":  # a valid object, padded past 64 KiB
        config.write_text(text.replace("{", '{"pad": "' + "x" * 70000 + '",', 1))
    elif how == "symlink":
        target = config.parent / "elsewhere.json"
        target.write_text(text)
        config.symlink_to(target)
    elif how == "fifo":
        os.mkfifo(config)
    elif how == "directory":
        config.mkdir()
    elif how == "unreadable":
        config.write_text(text)
        config.chmod(0)
    elif how == "wrong-type":
        config.write_text(text.replace('"memory_limit_mib": 1024', '"memory_limit_mib": "1024"'))
    else:  # pragma: no cover
        raise AssertionError(how)


BROKEN = [
    "missing",
    "corrupt",
    "oversized",
    "symlink",
    "fifo",
    "directory",
    "unreadable",
    "wrong-type",
]


def as_user(how: str) -> str:
    """Root reads a mode-000 file: the unreadable case runs as another user."""
    return (
        f"setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups " if how == "unreadable" else ""
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", BROKEN)
def test_an_unusable_config_without_env_limits_fails_safe(container: Container, how: str) -> None:
    break_config(container.config_file, how)
    run = container.run(f"{as_user(how)}env -i {P} info alloc mem 1 ctx 0 nvml; echo shell-ok")
    info, alloc, ctx, nvml = json_lines(run)
    assert info["total"] == 0 and alloc["rc"] == OOM and ctx["rc"] == NOT_INITIALIZED
    assert nvml["total"] == 0  # NVML shows no memory either
    assert run.stdout.endswith("shell-ok\n")
    (line,) = vgpu_lines(run.stderr)
    assert "/etc/vgpu/config.json is unusable" in line and "failing safe" in line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["corrupt", "fifo"])
def test_an_unusable_config_falls_back_to_the_env_limits(container: Container, how: str) -> None:
    break_config(container.config_file, how)
    run = container.run(f"{P} info alloc mem 1000 alloc mem 100 ctx 0")  # the runtime's env
    info, alloc, over, ctx = json_lines(run)
    assert info["total"] == LIMIT_MIB * MIB and alloc["rc"] == 0 and over["rc"] == OOM
    assert ctx["rc"] == 0
    (line,) = [line for line in vgpu_lines(run.stderr) if "config.json" in line]
    assert "is unusable" in line and "using the limits in the environment" in line


@pytest.mark.timeout(60)
def test_an_unusable_config_leaves_programs_without_cuda_alone(container: Container) -> None:
    break_config(container.config_file, "corrupt")
    run = container.run("env -i sh -c 'echo hello; ls /etc/vgpu >/dev/null'")
    assert (run.returncode, run.stdout, run.stderr) == (0, "hello\n", "")


def test_the_hooks_fixed_paths_are_the_contracts() -> None:
    from vgpu.core import contract

    header = (LIB.parent.parent / "vgpu.h").read_text()
    assert f'#define VGPU_MOUNT_DIR "{contract.CONFIG_MOUNT}"' in header
    assert contract.CONFIG_FILE == contract.CONFIG_MOUNT + "/config.json"
    assert '#define VGPU_MOUNT_CONFIG VGPU_MOUNT_DIR "/config.json"' in header
    assert f'#define VGPU_MOUNT_SHARED_DIR "{contract.SHARED_MOUNT}"' in header
    assert contract.PRELOAD_FILE == "/etc/ld.so.preload"
