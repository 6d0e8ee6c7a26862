"""The e2e suite (test_cluster.py) on the one-node cluster of ../shared/realk8s.

    python -m tests.e2e.local --images DIR [--out DIR] [--keep] [-- PYTEST_ARGS...]

tools/e2e-local.sh builds the images and calls this. One run: start the kit's
control plane with what a Helm install needs (ServiceAccount tokens on:
DISABLE_ADMISSION=TaintNodesByCondition), its controllers
(start-controllers.sh) and a node importing every tarball in --images; run
the suite with profiles/realk8s.yaml and the kit's addresses and dirs in the
environment; tear everything down by PID, also on failure and on Ctrl-C; exit
with pytest's status (2 when the kit did not come up, 130 on Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.e2e.kit import (
    DEVICE_PLUGIN_DIR,
    REPO,
    Interrupted,
    Kit,
    SetupError,
    _on_signal,
    device_plugin_socket_live,
    now_s,
    our_processes,
    signals_deferred,
)

PROFILE = REPO / "tests" / "e2e" / "profiles" / "realk8s.yaml"
IMAGE = "ghcr.io/vgpu-project/vgpu:0.1.0"
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
# Host paths the chart's DaemonSet writes (hostPath, not movable by a value):
# removed after the run when the run made them.
HOST_DIRS = (Path("/var/lib/vgpu"), Path("/usr/local/vgpu"))


def log(msg: str) -> None:
    print(f"[e2e-local {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def suite_env(kit: Kit, image: str, out: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VGPU_E2E_KUBECONFIG=kit.kubeconfig,
        VGPU_E2E_KUBECTL=kit.node["KUBECTL"],
        VGPU_E2E_IMAGE=image,
        VGPU_E2E_PROFILE=str(PROFILE),
        VGPU_E2E_NODE=kit.node_name,
        VGPU_E2E_OUT=str(out),
        VGPU_E2E_APISERVER_PORT=kit.cp["APISERVER_PORT"],
        VGPU_E2E_KUBELET_ROOT_DIR=kit.node["KUBELET_ROOT"],
        VGPU_E2E_CDI_DIR=kit.node["CDI_DIR"],
    )
    return env


def run_suite(env: dict[str, str], out: Path, extra: Sequence[str]) -> int:
    argv = [
        str(VENV_PYTHON),
        "-m",
        "pytest",
        "-n0",
        "-v",
        "-rA",
        f"--junitxml={out / 'junit.xml'}",
        "tests/e2e/test_cluster.py",
        *extra,
    ]
    log(f"running {' '.join(argv[1:])}")
    proc = subprocess.Popen(argv, env=env, cwd=REPO, start_new_session=True)
    try:
        return proc.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise


def save_logs(kit: Kit, out: Path) -> None:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for d in (kit.cp_dir, kit.node_dir):
        if d is None:
            continue
        for f in d.glob("*.log"):
            with contextlib.suppress(OSError):
                shutil.copy2(f, logs / f.name)
    if kit.node_dir is not None and (kit.node_dir / "pod-logs").is_dir():
        with contextlib.suppress(OSError):
            shutil.copytree(kit.node_dir / "pod-logs", logs / "pod-logs", dirs_exist_ok=True)
    with contextlib.suppress(OSError):
        shutil.copy2(kit.script_log, logs / kit.script_log.name)


def teardown(kit: Kit, work: Path, out: Path, made: list[Path]) -> dict[str, Any]:
    info: dict[str, Any] = {}
    save_logs(kit, out)
    info["stop_errors"] = kit.stop()
    markers = [str(p) for p in (kit.cp_dir, kit.node_dir, work) if p is not None]
    leftovers = our_processes(markers, {os.getpid()})
    for line in leftovers:  # never leave anything behind: by pid, and say so
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(line.split()[0]), signal.SIGKILL)
    info["leftover_processes"] = leftovers
    for d in made:
        shutil.rmtree(d, ignore_errors=True)
    info["removed_host_dirs"] = [str(d) for d in made]
    if not kit.keep:
        shutil.rmtree(work, ignore_errors=True)
    return info


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.e2e.local", description=__doc__)
    ap.add_argument("--images", type=Path, required=True, help="dir of image tarballs")
    ap.add_argument("--image", default=IMAGE, help="the vgpu image in --images")
    ap.add_argument("--out", type=Path, default=Path("/tmp/vgpu-e2e-local"))
    ap.add_argument("--keep", action="store_true", help="keep the kit's dirs (still stopped)")
    ap.add_argument(
        "--restarts",
        type=int,
        default=0,
        metavar="RUNS",
        help="then RUNS runs each of kit_restarts' kubelet and containerd scenarios "
        "(their own kit, after this one is down)",
    )
    ap.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = ap.parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _on_signal)
    if os.geteuid() != 0:
        log("the kit needs root")
        return 2
    if device_plugin_socket_live():
        log(f"another kubelet serves {DEVICE_PLUGIN_DIR / 'kubelet.sock'}: stop that node first")
        return 2
    made = [d for d in HOST_DIRS if not d.exists()]
    work = Path(tempfile.mkdtemp(prefix="vgpu-e2e-local.", dir="/tmp"))
    kit = Kit(
        work=work,
        keep=args.keep,
        cp_env={"DISABLE_ADMISSION": "TaintNodesByCondition"},
        node_env={"IMAGES": str(args.images.resolve())},
        controllers=True,
    )
    result: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "out": str(out)}
    t0 = now_s()
    code = 2
    try:
        log("starting the kit (control plane, controllers, node)")
        kit.start()
        result["kit_s"] = round(now_s() - t0, 1)
        result["kit"] = {"cp_dir": str(kit.cp_dir), "node_dir": str(kit.node_dir)}
        log(f"kit up in {result['kit_s']} s")
        t1 = now_s()
        code = run_suite(suite_env(kit, args.image, out), out, args.pytest_args)
        result["suite_s"] = round(now_s() - t1, 1)
    except Interrupted as exc:
        result["error"] = f"interrupted by {exc}"
        code = 130
    except (SetupError, subprocess.SubprocessError, OSError, KeyError) as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        log(result["error"])
        code = 2
    finally:
        with signals_deferred():
            result["teardown"] = teardown(kit, work, out, made)
            result["wall_s"] = round(now_s() - t0, 1)
            result["exit"] = code
            (out / "run.json").write_text(json.dumps(result, indent=2) + "\n")
    if result["teardown"]["leftover_processes"]:
        log(f"leftover processes killed: {result['teardown']['leftover_processes']}")
        code = code or 1
    log(f"exit {code}; kit {result.get('kit_s')} s, suite {result.get('suite_s')} s; {out}")
    if args.restarts and code != 130:
        code = max(code, restarts(args.restarts, out))
    return code


def restarts(runs: int, out: Path) -> int:
    """Issue 28's kubelet and containerd restarts during a burst of slice pods
    (tests/e2e/kit_restarts.py, its own kit and daemon): the suite's check (i)."""
    worst = 0
    for scenario in ("kubelet", "containerd"):
        argv = [str(VENV_PYTHON), "-m", "tests.e2e.kit_restarts", "--scenario", scenario]
        argv += ["--runs", str(runs), "--out", str(out / "kit-restarts")]
        log(f"running {' '.join(argv[1:])}")
        t0 = now_s()
        proc = subprocess.Popen(argv, cwd=REPO)
        try:
            rc = proc.wait()
        except BaseException:
            proc.send_signal(signal.SIGINT)  # it tears its kit down on SIGINT
            proc.wait()
            raise
        log(f"kit_restarts --scenario {scenario}: exit {rc} in {now_s() - t0:.0f} s")
        worst = max(worst, rc)
        if rc == 130:
            break
    return worst


if __name__ == "__main__":
    sys.exit(main())
