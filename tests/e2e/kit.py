"""The kit of ../shared/realk8s driven from Python: start and stop its control
plane and node with its own scripts (by PID, also on failure), restart a node
component exactly as it ran, and the process helpers around that.

Shared by the runners here (`python -m tests.e2e.kit_restarts`,
`python -m tests.e2e.local`); not a pytest module. See README.md.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
KIT = Path(os.environ.get("REALK8S_KIT", str(REPO.parent / "shared" / "realk8s"))).resolve()
DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived: unwind through every `finally` and tear down."""


class SetupError(Exception):
    """The kit or the daemon did not come up: the run proves nothing."""


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    raise Interrupted(signal.Signals(signum).name)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Teardown must finish: a second Ctrl-C while it runs is ignored (each
    step it runs is bounded by the kit's own timeouts)."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def now_s() -> float:
    return time.time()


def read_env_file(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def proc_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_exit(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc_alive(pid):
            return True
        time.sleep(0.02)
    return not proc_alive(pid)


def proc_argv(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [a.decode() for a in raw.split(b"\0") if a]


def proc_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            k, v = item.decode(errors="replace").split("=", 1)
            env[k] = v
    return env


def spawn_detached(argv: Sequence[str], env: dict[str, str], cwd: str, log_file: Path) -> int:
    """Start `argv` as the kit's scripts do (`cmd >> log 2>&1 < /dev/null &` in a
    shell that then exits): not our child, so nothing of ours holds it as a
    zombie when stop-node.sh waits for it to go. Returns its pid."""
    script = 'log="$1"; shift; "$@" >> "$log" 2>&1 < /dev/null & echo $!'
    done = subprocess.run(
        ["/bin/sh", "-c", script, "sh", str(log_file), *argv],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
        start_new_session=True,
        timeout=10,
    )
    return int(done.stdout.strip())


def run_script(
    argv: Sequence[str], env: dict[str, str], stderr_file: Path, timeout_s: float
) -> str:
    """Run a kit script in its own session (Ctrl-C in our terminal never reaches
    what it starts); its stderr is appended to `stderr_file`; returns stdout."""
    with stderr_file.open("a") as err:
        proc = subprocess.Popen(
            list(argv),
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except BaseException:
            # interrupted or hung mid-start: stop the script itself (its group);
            # what it already started is stopped by pid from its pid files
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if proc.returncode != 0:
        raise SetupError(f"{argv[0]} exited {proc.returncode} (see {stderr_file})")
    return out.strip()


# ---------------------------------------------------------------- the kit


@dataclass
class Kit:
    """The control plane and the node, each from the kit's own scripts."""

    work: Path
    keep: bool
    home: str = ""
    cp_dir: Path | None = None
    node_dir: Path | None = None
    cp: dict[str, str] = field(default_factory=dict)
    node: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # Extra environment for controlplane/start.sh and node/start-node.sh (each
    # script's header lists its options), and whether start-controllers.sh runs.
    cp_env: dict[str, str] = field(default_factory=dict)
    node_env: dict[str, str] = field(default_factory=lambda: {"FAKE_NVIDIA_DEVICES": "2"})
    controllers: bool = False

    @property
    def script_log(self) -> Path:
        return self.work / "kit-scripts.log"

    def base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["REALK8S_HOME"] = self.home
        for k in ("KUBECONFIG", "NODE_DIR", "CP_DIR", "KEEP", "KEEP_CP_DIR", "SCHEDULER"):
            env.pop(k, None)
        return env

    def start(self) -> None:
        t0 = now_s()
        self.home = run_script([str(KIT / "unpack.sh")], dict(os.environ), self.script_log, 600)
        self.cp_dir = Path(tempfile.mkdtemp(prefix="k8scp.", dir="/tmp"))
        env = self.base_env() | self.cp_env
        env["CP_DIR"] = str(self.cp_dir)
        run_script([str(KIT / "controlplane" / "start.sh")], env, self.script_log, 180)
        self.cp = read_env_file(self.cp_dir / "env")
        if self.controllers:
            run_script(
                [str(KIT / "controlplane" / "start-controllers.sh"), str(self.cp_dir)],
                self.base_env(),
                self.script_log,
                60,
            )
        t1 = now_s()
        self.node_dir = Path(tempfile.mkdtemp(prefix="k8snode.", dir="/tmp"))
        env = self.base_env() | self.node_env
        env["NODE_DIR"] = str(self.node_dir)
        run_script(
            [str(KIT / "node" / "start-node.sh"), str(self.cp_dir)], env, self.script_log, 180
        )
        self.node = read_env_file(self.node_dir / "env")
        self.timings = {"controlplane_s": t1 - t0, "node_s": now_s() - t1}

    def stop(self) -> list[str]:
        """Node, then control plane, each by its own stop script (by PID)."""
        errors: list[str] = []
        env = self.base_env()
        if self.keep:
            env["KEEP"] = "1"
            env["KEEP_CP_DIR"] = "1"
        if self.node_dir is not None and self.node_dir.exists():
            try:
                run_script(
                    [str(KIT / "node" / "stop-node.sh"), str(self.node_dir)],
                    env,
                    self.script_log,
                    180,
                )
            except (SetupError, subprocess.TimeoutExpired) as exc:
                errors.append(f"stop-node.sh: {exc}")
        if self.cp_dir is not None and self.cp_dir.exists():
            try:
                run_script(
                    [str(KIT / "controlplane" / "stop.sh"), str(self.cp_dir)],
                    env,
                    self.script_log,
                    120,
                )
            except (SetupError, subprocess.TimeoutExpired) as exc:
                errors.append(f"stop.sh: {exc}")
        return errors

    @property
    def kubeconfig(self) -> str:
        return self.cp["KUBECONFIG"]

    @property
    def node_name(self) -> str:
        return self.node.get("NODE_NAME", "127.0.0.1")

    def kubectl(
        self, *args: str, stdin: str | None = None, timeout_s: float = 30, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        kubectl = self.node.get("KUBECTL") or str(Path(self.cp["K8S_BIN"]) / "kubectl")
        return run_kubectl(kubectl, self.kubeconfig, args, stdin, timeout_s, check)

    def restart_component(self, name: str) -> dict[str, Any]:
        """SIGTERM the node's kubelet or containerd, wait for it to exit, start it
        again exactly as before: same argv (the kubelet's from kubelet.cmd), same
        environment and working directory (read from /proc before the signal), same
        log appended to; its pid file updated so that stop-node.sh stops the new one."""
        assert self.node_dir is not None
        pid_file = self.node_dir / f"{name}.pid"
        pid = int(pid_file.read_text().strip())
        argv = proc_argv(pid)
        cmd_file = self.node_dir / f"{name}.cmd"
        info: dict[str, Any] = {"component": name, "old_pid": pid}
        if cmd_file.exists():
            from_cmd = shlex.split(cmd_file.read_text().strip())
            info["cmd_file_matches_proc"] = from_cmd == argv
            argv = from_cmd
        info["argv"] = argv
        env = proc_environ(pid)
        cwd = os.readlink(f"/proc/{pid}/cwd")
        t_signal = now_s()
        os.kill(pid, signal.SIGTERM)
        if not wait_exit(pid, 30):
            info["needed_sigkill"] = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            wait_exit(pid, 10)
        t_exited = now_s()
        new_pid = spawn_detached(argv, env, cwd, self.node_dir / f"{name}.log")
        pid_file.write_text(f"{new_pid}\n")
        info.update(
            new_pid=new_pid,
            t_signal=t_signal,
            exit_s=t_exited - t_signal,
            down_s=now_s() - t_signal,
        )
        return info


def run_kubectl(
    kubectl: str,
    kubeconfig: str,
    args: Sequence[str],
    stdin: str | None = None,
    timeout_s: float = 30,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """kubectl with this kubeconfig; RuntimeError naming the command on failure (`check`)."""
    done = subprocess.run(
        [kubectl, "--kubeconfig", kubeconfig, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
    return done


def wait_for(what: str, cond: Callable[[], bool], timeout_s: float, step_s: float = 0.25) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise SetupError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(step_s)
    return time.monotonic() - t0


def our_processes(markers: Sequence[str], exclude: set[int]) -> list[str]:
    """Processes whose command line names one of this run's dirs."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in exclude:
            continue
        try:
            cmd = " ".join(proc_argv(int(d.name)))
        except OSError:
            continue
        if any(m in cmd for m in markers) and proc_alive(int(d.name)):
            found.append(f"{d.name} {cmd[:200]}")
    return found


def device_plugin_socket_live() -> bool:
    """True when a kubelet serves the host's one device-plugin dir: only one
    node per host can, so no kit node may start then."""
    sock = DEVICE_PLUGIN_DIR / "kubelet.sock"
    if not sock.exists():
        return False
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(1)
    try:
        s.connect(str(sock))
    except OSError:
        return False
    finally:
        s.close()
    return True


def exec_sections(stdout: str) -> dict[str, list[str]]:
    """The output of an exec script that prints `@@name` before each part, by part."""
    sections: dict[str, list[str]] = {}
    current = ""
    for line in stdout.splitlines():
        if line.startswith("@@"):
            current = line[2:]
            sections[current] = []
        elif current:
            sections[current].append(line)
    return sections
