"""Issue 28's restart scenarios on the REAL components of ../shared/realk8s.

    python -m tests.e2e.kit_restarts --scenario kubelet|containerd|daemon-kill \\
        --runs 3 [--keep] [--out DIR]

One run: start the kit's control plane and node (kubelet 1.36 + containerd 2.3),
start `vgpu serve` (mock 2 x H200) as a host process from this repo's venv, create
a burst of 12 slice pods at once, 0.5 s later restart one component (the kubelet,
containerd, or the daemon by kill -9), wait until every pod is Running or
terminal, check issue 28's invariants, delete the pods, check their records go,
tear everything down by PID (also on failure and on Ctrl-C) and write a JSON
result. The command prints a table and exits 1 when any invariant failed.

Not a pytest test (no `test_` prefix; tests/e2e/conftest.py ignores the folder):
it needs root, the kit, and about a minute per run. See tests/e2e/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
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
    exec_sections,
    now_s,
    our_processes,
    signals_deferred,
    wait_for,
)

VENV_VGPU = REPO / ".venv" / "bin" / "vgpu"
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
SCENARIOS = ("kubelet", "containerd", "daemon-kill")
DOMAIN = "vendor.io"
CORE = f"{DOMAIN}/vcuda-core"
MEMORY = f"{DOMAIN}/vcuda-memory"
MEMORY_UNIT_MIB = 256
RECONCILE_INTERVAL_S = 10.0  # the daemon's default, passed explicitly
NAMESPACE = "default"
LABEL = "e2e=kit-restarts"
IMAGE = "docker.io/local/busybox:1.35"
RESTART_DELAY_S = 0.5  # after the burst's create returned
SETTLE_TIMEOUT_S = 90.0
GONE_TIMEOUT_S = 60.0  # deleted pods leave the API server
RECORDS_SLACK_S = 1.0  # on top of one reconcile period
RECORDS_WATCH_S = 45.0  # how long to keep watching records after the verdict's deadline
LOG_PATTERNS = (
    "released",
    "adopted",
    "replaced a directory",
    "fallback rule",
    "kubelet restart noticed",
)

# The burst: (vcuda-core, vcuda-memory units) per pod. Cores are distinct, so a
# pod given a neighbour's core limit is always caught; memory takes 9 values in
# 8-16. Chosen by hand so that the cores sum to 192 of the node's 200 and pack
# onto the two cards in creation order with binpack (87+11 on one card, 94 on
# the other): without a restart every pod fits, so a refusal is news.
BURST: tuple[tuple[int, int], ...] = (
    (22, 12),
    (10, 9),
    (17, 14),
    (13, 8),
    (25, 16),
    (11, 11),
    (15, 10),
    (18, 13),
    (12, 15),
    (14, 9),
    (16, 12),
    (19, 11),
)


def log(msg: str) -> None:
    print(f"[kit_restarts {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the daemon


@dataclass
class Daemon:
    """`vgpu serve` as a host process from this repo's venv, logging JSON lines to a file."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    log_file: Path
    proc: subprocess.Popen[bytes] | None = None
    exits: list[int] = field(default_factory=list)

    def start(self) -> None:
        with self.log_file.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )

    def kill9(self) -> int:
        assert self.proc is not None
        pid = self.proc.pid
        self.proc.kill()
        self.exits.append(self.proc.wait())
        return pid

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 15 s; the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            code = self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.exits.append(code)
        return code

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid


@dataclass(frozen=True)
class VgpuSource:
    """Which vgpu the daemon and `vgpu status` run: the working tree (the venv's
    editable install) or a git revision exported with `git archive` into the run's
    work dir and put first on PYTHONPATH (so edits in progress never change
    the daemon under a run)."""

    rev: str  # "worktree" or a git revision
    commit: str | None = None  # the revision, resolved
    tree: Path | None = None  # the exported tree

    @classmethod
    def resolve(cls, rev: str) -> VgpuSource:
        if rev == "worktree":
            return cls(rev)
        done = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode != 0:
            raise SetupError(f"--vgpu-src {rev}: not a revision of {REPO}")
        return cls(rev, done.stdout.strip())

    def export(self, work: Path) -> VgpuSource:
        if self.commit is None:
            return self
        tree = work / "src"
        tree.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", self.commit, "vgpu"],
            capture_output=True,
            check=True,
            timeout=60,
        )
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        return VgpuSource(self.rev, self.commit, tree)

    def argv(self, *args: str) -> list[str]:
        if self.tree is None:
            return [str(VENV_VGPU), *args]
        return [str(VENV_PYTHON), "-m", "vgpu", *args]

    @property
    def cwd(self) -> str:
        """`python -m` puts the working directory first on sys.path, before
        PYTHONPATH: run from the exported tree, never from the repo."""
        return str(self.tree if self.tree is not None else REPO)

    def module_file(self) -> str:
        """Where the daemon's `vgpu` package comes from (checked before a run)."""
        done = subprocess.run(
            [str(VENV_PYTHON), "-c", "import vgpu; print(vgpu.__file__)"],
            env=self.env(),
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=60,
        )
        path = done.stdout.strip()
        expected = self.tree if self.tree is not None else REPO
        if done.returncode != 0 or not path.startswith(f"{expected}/"):
            raise SetupError(f"vgpu would be imported from {path!r}, not from {expected}")
        return path

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        if self.tree is not None:
            env["PYTHONPATH"] = str(self.tree)
        return env

    def describe(self, argv: Sequence[str]) -> str:
        """The command line to rerun it by hand."""
        if self.tree is None:
            return shlex.join(argv)
        return (
            f"mkdir -p SRC && git -C {REPO} archive {self.commit} vgpu | tar -x -C SRC && "
            f"cd SRC && PYTHONPATH=SRC {shlex.join(argv)}    # SRC was {self.tree}"
        )


def daemon_argv(src: VgpuSource, kit: Kit, work: Path) -> list[str]:
    return src.argv(
        "serve",
        "--backend",
        "mock",
        "--mock-gpus",
        "preset:2xH200",
        "--device-plugin-dir",
        str(DEVICE_PLUGIN_DIR),
        "--pod-resources-socket",
        kit.node["POD_RESOURCES_SOCKET"],
        "--state-dir",
        str(work / "state"),
        "--hook-dir",
        str(work / "hook"),
        "--cdi-dir",
        str(work / "cdi"),
        "--kubeconfig",
        kit.kubeconfig,
        "--node-name",
        kit.node_name,
        "--reconcile-interval-s",
        f"{RECONCILE_INTERVAL_S:g}",
        "--log-format",
        "json",
    )


def vgpu_status(src: VgpuSource, state_dir: Path) -> dict[str, Any]:
    done = subprocess.run(
        src.argv("status", "-o", "json", "--state-dir", str(state_dir)),
        env=src.env(),
        cwd=src.cwd,
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        raise RuntimeError(f"vgpu status: {done.stderr.strip() or done.stdout.strip()}")
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


# ---------------------------------------------------------------- pods


def pod_names() -> list[str]:
    return [f"slice-{i:02d}" for i in range(len(BURST))]


def asked(name: str) -> tuple[int, int]:
    return BURST[int(name.rsplit("-", 1)[1])]


def burst_manifest(kit: Kit) -> str:
    docs = []
    for name, (core, mem) in zip(pod_names(), BURST, strict=True):
        limits = {CORE: str(core), MEMORY: str(mem)}
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": NAMESPACE,
                    "labels": dict([LABEL.split("=", 1)]),
                },
                "spec": {
                    "hostNetwork": True,
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {
                            "name": "main",
                            "image": IMAGE,
                            "imagePullPolicy": "Never",
                            "command": ["sleep", "3600"],
                            "env": [
                                {"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                                {
                                    "name": "KUBERNETES_SERVICE_PORT",
                                    "value": kit.cp["APISERVER_PORT"],
                                },
                            ],
                            "resources": {"limits": limits},
                        }
                    ],
                },
            }
        )
    return "\n---\n".join(json.dumps(d) for d in docs) + "\n"


def list_pods(kit: Kit) -> dict[str, dict[str, Any]]:
    done = kit.kubectl("get", "pods", "-n", NAMESPACE, "-l", LABEL, "-o", "json")
    items: list[dict[str, Any]] = json.loads(done.stdout)["items"]
    return {p["metadata"]["name"]: p for p in items}


def unschedulable(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
        for c in pod.get("status", {}).get("conditions", [])
    )


def settled(pod: dict[str, Any]) -> bool:
    phase = pod.get("status", {}).get("phase")
    return phase in ("Running", "Succeeded", "Failed") or unschedulable(pod)


def why_not_running(pod: dict[str, Any]) -> dict[str, Any]:
    """Everything the API server says about a pod that is not Running."""
    st = pod.get("status", {})
    out: dict[str, Any] = {"reason": st.get("reason"), "message": st.get("message")}
    out["conditions"] = [
        {k: c.get(k) for k in ("type", "status", "reason", "message")}
        for c in st.get("conditions", [])
        if c.get("status") != "True"
    ]
    states = []
    for cs in st.get("containerStatuses", []) or []:
        for kind, body in (cs.get("state") or {}).items():
            if kind == "running":
                continue
            states.append(
                {
                    "container": cs.get("name"),
                    "state": kind,
                    "reason": body.get("reason"),
                    "message": body.get("message"),
                    "exit_code": body.get("exitCode"),
                }
            )
    out["container_states"] = states
    texts = [out["reason"], out["message"]]
    texts += [c.get("reason") for c in out["conditions"]]
    texts += [s.get("message") or s.get("reason") for s in states]
    # ContainerCreating / PodInitializing are no reason: they say "not yet"
    meaningful = [t for t in texts if t and t not in ("ContainerCreating", "PodInitializing")]
    out["explained"] = bool(meaningful)
    out["summary"] = "; ".join(str(t) for t in meaningful)[:500]
    return out


EXEC_SCRIPT = (
    "echo @@env; env; "
    "echo @@config; cat /etc/vgpu/config.json 2>&1; echo; "
    "echo @@etc; ls -la /etc/vgpu 2>&1; "
    "echo @@shm; p=/var/run/vgpu/vgpu.shm; "
    "if test -f $p; then echo file; elif test -d $p; then echo directory; "
    "elif test -e $p; then echo other; else echo missing; fi"
)


def exec_pod(kit: Kit, name: str) -> dict[str, Any]:
    """What the running container got: env, /etc/vgpu/config.json, the budget file."""
    done = kit.kubectl(
        "exec", "-n", NAMESPACE, name, "-c", "main", "--", "sh", "-c", EXEC_SCRIPT, check=False
    )
    if done.returncode != 0:
        return {"exec_error": (done.stderr or done.stdout).strip()[:500]}
    sections = exec_sections(done.stdout)
    env = dict(ln.split("=", 1) for ln in sections.get("env", []) if "=" in ln)
    got: dict[str, Any] = {
        "env": {k: v for k, v in env.items() if k.startswith(("VGPU_", "NVIDIA_", "LD_PRELOAD"))},
        "shm": (sections.get("shm") or ["?"])[0],
        "etc_vgpu": sections.get("etc", []),
    }
    text = "\n".join(sections.get("config", [])).strip()
    try:
        got["config"] = json.loads(text)
    except ValueError:
        got["config"] = None
        got["config_error"] = text[:300]
    return got


def check_running_pod(name: str, got: dict[str, Any]) -> list[str]:
    """Every way a Running pod's limits differ from its own request."""
    core, mem = asked(name)
    mem_mib = mem * MEMORY_UNIT_MIB
    if "exec_error" in got:
        return [f"exec failed: {got['exec_error']}"]
    problems = []
    env = got["env"]
    if env.get("VGPU_CORE_LIMIT") != str(core):
        problems.append(f"env VGPU_CORE_LIMIT={env.get('VGPU_CORE_LIMIT')} but asked {core}")
    if env.get("VGPU_MEMORY_LIMIT_MIB") != str(mem_mib):
        problems.append(
            f"env VGPU_MEMORY_LIMIT_MIB={env.get('VGPU_MEMORY_LIMIT_MIB')} but asked {mem_mib}"
        )
    if got["shm"] != "file":
        problems.append(f"/var/run/vgpu/vgpu.shm is {got['shm']}, not a file")
    cfg = got.get("config")
    if not isinstance(cfg, dict):
        problems.append(f"/etc/vgpu/config.json unreadable: {got.get('config_error', '')[:120]}")
    else:
        if cfg.get("core_units") != core:
            problems.append(f"config core_units={cfg.get('core_units')} but asked {core}")
        if cfg.get("memory_limit_mib") != mem_mib:
            problems.append(
                f"config memory_limit_mib={cfg.get('memory_limit_mib')} but asked {mem_mib}"
            )
        owner = cfg.get("pod")
        if isinstance(owner, dict) and owner.get("name") != name:
            problems.append(f"config names pod {owner.get('name')}, not {name}")
    return problems


# ---------------------------------------------------------------- the state


def status_checks(
    doc: dict[str, Any], running: Sequence[str], pods: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """no_overcommit and status_consistent from one `vgpu status -o json`."""
    cards = {c["uuid"]: c for c in doc["cards"]}
    containers = [c for c in doc["containers"] if "claim" not in c]
    sums: dict[str, dict[str, int]] = {u: {"core": 0, "memory_mib": 0, "n": 0} for u in cards}
    for c in containers:
        for uuid in c["cards"]:
            s = sums.setdefault(uuid, {"core": 0, "memory_mib": 0, "n": 0})
            s["core"] += 100 if c["whole_cards"] else c["core"]
            s["memory_mib"] += c["memory_mib"]
            s["n"] += 1
    overcommit: list[str] = []
    inconsistent: list[str] = []
    per_card = []
    for uuid, card in cards.items():
        s = sums[uuid]
        row = {
            "index": card["index"],
            "uuid": uuid,
            "core_allocated": card["core_allocated"],
            "containers_core_sum": s["core"],
            "memory_allocated_mib": card["memory_allocated_mib"],
            "containers_memory_sum_mib": s["memory_mib"],
            "memory_mib": card["memory_mib"],
            "containers": s["n"],
        }
        per_card.append(row)
        g = f"GPU {card['index']}"
        if card["core_allocated"] > 100 or s["core"] > 100:
            overcommit.append(f"{g}: core {card['core_allocated']} / containers {s['core']} > 100")
        if max(card["memory_allocated_mib"], s["memory_mib"]) > card["memory_mib"]:
            overcommit.append(
                f"{g}: memory {card['memory_allocated_mib']} / containers {s['memory_mib']}"
                f" MiB > {card['memory_mib']}"
            )
        if s["core"] != card["core_allocated"]:
            inconsistent.append(
                f"{g}: containers' core sum {s['core']} != core_allocated {card['core_allocated']}"
            )
        if s["memory_mib"] != card["memory_allocated_mib"]:
            inconsistent.append(
                f"{g}: containers' memory sum {s['memory_mib']} MiB != memory_allocated_mib "
                f"{card['memory_allocated_mib']}"
            )
    by_owner: dict[tuple[Any, Any, Any], list[dict[str, Any]]] = {}
    for c in containers:
        by_owner.setdefault((c["namespace"], c["pod"], c["container"]), []).append(c)
    for name in running:
        entries = by_owner.get((NAMESPACE, name, "main"), [])
        if len(entries) != 1:
            keys = [e["key"] for e in entries]
            inconsistent.append(f"{name}/main listed {len(entries)} times {keys}")
            continue
        e = entries[0]
        core, mem = asked(name)
        if e["core"] != core or e["memory_mib"] != mem * MEMORY_UNIT_MIB:
            inconsistent.append(
                f"{name}/main placement core {e['core']} mem {e['memory_mib']} MiB, "
                f"asked {core} / {mem * MEMORY_UNIT_MIB}"
            )
        uid = pods.get(name, {}).get("metadata", {}).get("uid")
        if e.get("pod_uid") and uid and e["pod_uid"] != uid:
            inconsistent.append(f"{name}/main placement names uid {e['pod_uid']}, pod has {uid}")
    for owner, entries in by_owner.items():
        if owner[1] is not None and len(entries) > 1 and owner[1] not in running:
            inconsistent.append(f"{owner[0]}/{owner[1]}/{owner[2]} listed {len(entries)} times")
    unowned = [
        {"key": c["key"], "cards": c["cards"], "core": c["core"], "memory_mib": c["memory_mib"]}
        for c in containers
        if c["pod"] is None
    ]
    stale = [
        {"pod": c["pod"], "key": c["key"]}
        for c in containers
        if c["pod"] is not None and c["pod"] not in running
    ]
    return {
        "per_card": per_card,
        "containers": [
            {
                k: c.get(k)
                for k in ("namespace", "pod", "container", "pod_uid", "key", "cards", "core")
            }
            | {"memory_mib": c["memory_mib"]}
            for c in containers
        ],
        "unowned": unowned,
        "not_running_owners": stale,
        "overcommit": overcommit,
        "inconsistent": inconsistent,
    }


# ---------------------------------------------------------------- the log


def parse_log(path: Path, t_restart: float) -> dict[str, Any]:
    """Counts and times (s after the restart) of the lines each pattern matches."""
    hits: dict[str, list[dict[str, Any]]] = {p: [] for p in LOG_PATTERNS}
    errors: list[str] = []
    placed_before: set[str] = set()
    placed_after: set[str] = set()
    placed: list[dict[str, Any]] = []
    if not path.exists():
        return {"counts": dict.fromkeys(LOG_PATTERNS, 0), "lines": hits, "errors": errors}
    for raw in path.read_text(errors="replace").splitlines():
        msg = raw
        t: float | None = None
        try:
            rec = json.loads(raw)
            msg = str(rec.get("msg", raw))
            stamp = dt.datetime.strptime(rec["ts"], "%Y-%m-%dT%H:%M:%S.%fZ")
            t = stamp.replace(tzinfo=dt.UTC).timestamp() - t_restart
            if rec.get("level") in ("error", "critical"):
                errors.append(f"{t:+.3f}s {msg}"[:300])
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
        if msg.startswith("placed ") and t is not None:
            (placed_before if t < 0 else placed_after).add(msg.split()[1])
            placed.append({"t_s": round(t, 3), "key": msg.split()[1]})
        for p in LOG_PATTERNS:
            if p in msg:
                hits[p].append({"t_s": None if t is None else round(t, 3), "msg": msg[:400]})
    return {
        "counts": {p: len(v) for p, v in hits.items()},
        "lines": hits,
        "placed": placed[:200],
        "placed_keys_before_restart": len(placed_before),
        "placed_keys_after_restart": len(placed_after - placed_before),
        "errors": errors[:50],
    }


def live_releases(result: dict[str, Any], t_restart: float) -> list[str]:
    """Releases, before the pods were deleted, of a placement a Running pod
    holds at the end (its config's key, or its record's in `vgpu status`) that
    no Allocate placed again afterwards: issue 28's first promise, a restart
    never releases a live slice. (A half-admitted pod whose IDs the restarted
    kubelet itself offers again and allocates anew is not one: its key is
    logged `placed` after the release.)"""
    owner: dict[str, str] = {}
    for name, entry in result.get("pods", {}).items():
        cfg = entry.get("got", {}).get("config")
        if entry.get("phase") == "Running" and isinstance(cfg, dict) and cfg.get("key"):
            owner[str(cfg["key"])] = name
    running = {n for n, e in result.get("pods", {}).items() if e.get("phase") == "Running"}
    for c in result.get("status_first", {}).get("containers", []):
        if c.get("pod") in running:
            owner.setdefault(str(c["key"]), str(c["pod"]))
    t_delete = float(result.get("deletion", {}).get("t_delete", now_s())) - t_restart
    placed = result.get("log", {}).get("placed", [])
    out = []
    for line in result.get("log", {}).get("lines", {}).get("released", []):
        words = str(line["msg"]).split()
        if len(words) < 2 or words[0] != "released" or line["t_s"] is None:
            continue
        key = words[1].rstrip(":")
        again = any(p["key"] == key and p["t_s"] >= line["t_s"] for p in placed)
        if key in owner and line["t_s"] < t_delete and not again:
            out.append(f"{line['t_s']:+.3f} s: {owner[key]} ({key}): {line['msg'][:160]}")
    return out


# ---------------------------------------------------------------- one run


def sample_overcommit(
    src: VgpuSource,
    state_dir: Path,
    peaks: dict[str, dict[str, int]],
    seen: list[str],
    t_restart: float,
) -> None:
    """One look at the cards while the pods settle: the peak per card, and any
    moment a card was over 100 % core or over its memory."""
    try:
        doc = vgpu_status(src, state_dir)
    except (RuntimeError, ValueError, subprocess.TimeoutExpired):
        return
    for msg in status_checks(doc, [], {})["overcommit"]:
        if not any(m.startswith(msg) for m in seen):
            seen.append(f"{msg} (while settling, first seen {now_s() - t_restart:+.1f} s)")
    for card in doc["cards"]:
        peak = peaks.setdefault(f"GPU {card['index']}", {"core": 0, "memory_mib": 0})
        peak["core"] = max(peak["core"], card["core_allocated"])
        peak["memory_mib"] = max(peak["memory_mib"], card["memory_allocated_mib"])


def allocatable_core(kit: Kit) -> str | None:
    done = kit.kubectl("get", "node", kit.node_name, "-o", "json", check=False)
    if done.returncode != 0:
        return None
    value: str | None = json.loads(done.stdout)["status"].get("allocatable", {}).get(CORE)
    return value


def one_run(scenario: str, index: int, out: Path, keep: bool, source: VgpuSource) -> dict[str, Any]:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_id = f"{scenario}-{index}-{stamp}"
    work = Path(tempfile.mkdtemp(prefix=f"vgpu-e2e.{scenario}.", dir="/tmp"))
    t_start = now_s()
    result: dict[str, Any] = {
        "run": run_id,
        "scenario": scenario,
        "index": index,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "work_dir": str(work),
        "git": git_state(),
        "vgpu_src": {"rev": source.rev, "commit": source.commit},
        "burst": {
            n: {"core": c, "memory_units": m} for n, (c, m) in zip(pod_names(), BURST, strict=True)
        },
    }
    kit = Kit(work=work, keep=keep)
    daemon: Daemon | None = None
    verdicts: dict[str, dict[str, Any]] = {}
    result["verdicts"] = verdicts
    try:
        log(f"{run_id}: starting the kit")
        kit.start()
        result["kit"] = {
            "cp_dir": str(kit.cp_dir),
            "node_dir": str(kit.node_dir),
            "node_name": kit.node_name,
            "containerd": kit.node.get("CONTAINERD_VERSION"),
            "timings": kit.timings,
        }
        src = source.export(work)
        result["vgpu_src"]["module"] = src.module_file()
        daemon = Daemon(daemon_argv(src, kit, work), src.env(), src.cwd, work / "daemon.log")
        result["daemon_argv"] = daemon.argv
        result["daemon_command"] = src.describe(daemon.argv)
        daemon.start()
        waited = wait_for(
            f"Node {kit.node_name} allocatable {CORE}=200",
            lambda: allocatable_core(kit) == "200",
            60,
        )
        result["daemon_registered_s"] = round(waited, 2)
        log(f"{run_id}: daemon registered ({waited:.1f} s); creating the burst")

        t_create = now_s()
        kit.kubectl("create", "-f", "-", stdin=burst_manifest(kit))
        t_created = now_s()
        result["create_s"] = round(t_created - t_create, 3)
        time.sleep(max(0.0, t_created + RESTART_DELAY_S - now_s()))

        t_restart = now_s()
        if scenario == "daemon-kill":
            old = daemon.kill9()
            daemon.start()
            restart: dict[str, Any] = {
                "component": "vgpu serve",
                "old_pid": old,
                "new_pid": daemon.pid,
                "t_signal": t_restart,
                "down_s": now_s() - t_restart,
            }
        else:
            restart = kit.restart_component(scenario)
            t_restart = float(restart["t_signal"])
        restart["after_create_s"] = round(t_restart - t_created, 3)
        result["restart"] = restart
        log(f"{run_id}: restarted {restart['component']} ({restart['after_create_s']} s after)")

        pods: dict[str, dict[str, Any]] = {}
        first_running: dict[str, float] = {}
        peaks: dict[str, dict[str, int]] = {}
        seen_overcommit: list[str] = []

        def all_settled() -> bool:
            nonlocal pods
            pods = list_pods(kit)
            sample_overcommit(src, work / "state", peaks, seen_overcommit, t_restart)
            for n, p in pods.items():
                if p.get("status", {}).get("phase") == "Running" and n not in first_running:
                    first_running[n] = now_s() - t_create
            return len(pods) == len(BURST) and all(settled(p) for p in pods.values())

        try:
            result["settle_s"] = round(wait_for("pods settled", all_settled, SETTLE_TIMEOUT_S), 2)
        except SetupError:
            result["settle_s"] = None  # recorded per pod below
        log(f"{run_id}: pods settled ({result['settle_s']} s); checking them")

        running = sorted(
            n for n, p in pods.items() if p.get("status", {}).get("phase") == "Running"
        )
        per_pod: dict[str, Any] = {}
        for name in pod_names():
            core, mem = asked(name)
            pod = pods.get(name, {})
            st = pod.get("status", {})
            entry: dict[str, Any] = {
                "asked": {"core": core, "memory_units": mem, "memory_mib": mem * MEMORY_UNIT_MIB},
                "phase": st.get("phase"),
                "uid": pod.get("metadata", {}).get("uid"),
                "running_after_s": round(first_running[name], 2) if name in first_running else None,
            }
            if name in running:
                got = exec_pod(kit, name)
                entry["got"] = got
                entry["problems"] = check_running_pod(name, got)
            else:
                entry["why"] = why_not_running(pod) if pod else {"explained": False}
            per_pod[name] = entry
        result["pods"] = per_pod

        wrong = {n: e["problems"] for n, e in per_pod.items() if e.get("problems")}
        verdicts["own_limits"] = {"ok": not wrong, "failures": wrong}
        unexplained = [
            n for n, e in per_pod.items() if "why" in e and not e["why"].get("explained")
        ]
        verdicts["not_running_explained"] = {"ok": not unexplained, "failures": unexplained}

        result["settle_peaks"] = peaks
        doc = vgpu_status(src, work / "state")
        first = status_checks(doc, running, pods)
        result["status_first"] = first
        final = first
        if first["inconsistent"] or first["overcommit"]:
            # one reconcile period later: is it lasting, or was it an owner still being learned?
            time.sleep(RECONCILE_INTERVAL_S + 1)
            final = status_checks(vgpu_status(src, work / "state"), running, list_pods(kit))
            result["status_after_reconcile"] = final
        overcommit = set(first["overcommit"]) | set(final["overcommit"]) | set(seen_overcommit)
        verdicts["no_overcommit"] = {"ok": not overcommit, "failures": sorted(overcommit)}
        verdicts["status_consistent"] = {
            "ok": not final["inconsistent"],
            "failures": final["inconsistent"],
            "at_first_look": first["inconsistent"],
        }

        result["deletion"] = delete_and_watch(src, kit, work)
        verdicts["records_gone_after_delete"] = {
            "ok": bool(result["deletion"]["ok"]),
            "failures": result["deletion"]["failures"],
        }
        result["log"] = parse_log(daemon.log_file, t_restart)
        live = live_releases(result, t_restart)
        verdicts["no_live_release"] = {"ok": not live, "failures": live}
    except Interrupted as exc:
        result["error"] = f"interrupted by {exc}"
        raise
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        log(f"{run_id}: {result['error']}")
    finally:
        with signals_deferred():
            result["teardown"] = teardown(kit, daemon, work, out, run_id, keep)
            if "log" not in result and daemon is not None:
                result["log"] = parse_log(
                    daemon.log_file, float(result.get("restart", {}).get("t_signal", now_s()))
                )
            result["ok"] = (
                "error" not in result
                and bool(verdicts)
                and all(v["ok"] for v in verdicts.values())
                and not result["teardown"]["leftover_processes"]
            )
            result["wall_s"] = round(now_s() - t_start, 1)
            path = out / f"{run_id}.json"
            path.write_text(json.dumps(result, indent=2, default=str) + "\n")
            result["result_file"] = str(path)
            if not keep:
                shutil.rmtree(work, ignore_errors=True)
    return result


def delete_and_watch(src: VgpuSource, kit: Kit, work: Path) -> dict[str, Any]:
    """Delete the burst; the daemon's records of it must be gone within one
    reconcile period of the pods leaving the API server."""
    t_delete = now_s()
    kit.kubectl("delete", "pods", "-n", NAMESPACE, "-l", LABEL, "--wait=false")
    info: dict[str, Any] = {"failures": [], "t_delete": t_delete}
    try:
        wait_for("deleted pods gone", lambda: not list_pods(kit), GONE_TIMEOUT_S)
    except SetupError as exc:
        info["failures"].append(str(exc))
    t_gone = now_s()
    info["pods_gone_s"] = round(t_gone - t_delete, 2)
    deadline = t_gone + RECONCILE_INTERVAL_S + RECORDS_SLACK_S
    remaining: list[dict[str, Any]] = []
    at_deadline: list[dict[str, Any]] | None = None
    t_clear: float | None = None
    while now_s() < deadline + RECORDS_WATCH_S:
        doc = vgpu_status(src, work / "state")
        remaining = [
            {"pod": c["pod"], "key": c["key"], "core": c["core"], "memory_mib": c["memory_mib"]}
            for c in doc["containers"]
        ]
        if not remaining:
            t_clear = now_s()
            break
        if at_deadline is None and now_s() > deadline:
            at_deadline = remaining
        time.sleep(0.25)
    info["records_gone_after_pods_s"] = None if t_clear is None else round(t_clear - t_gone, 2)
    info["records_at_deadline"] = at_deadline or []
    info["records_left"] = remaining if t_clear is None else []
    info["trash_left"] = sorted(p.name for p in (work / "state" / "containers").glob(".trash-*"))[
        :20
    ]
    if t_clear is None or t_clear > deadline:
        info["failures"].append(
            f"{len(at_deadline or remaining)} records still there "
            f"{RECONCILE_INTERVAL_S + RECORDS_SLACK_S:g} s after the pods were gone "
            f"(gone after {info['records_gone_after_pods_s']} s): "
            + ", ".join(f"{r['key']}({r['pod']})" for r in (at_deadline or remaining))
        )
    info["ok"] = not info["failures"]
    return info


def teardown(
    kit: Kit, daemon: Daemon | None, work: Path, out: Path, run_id: str, keep: bool
) -> dict[str, Any]:
    """Daemon, node, control plane, by PID; the logs saved next to the result."""
    info: dict[str, Any] = {}
    if daemon is not None:
        info["daemon_exit"] = daemon.stop()
        info["daemon_exits"] = daemon.exits
    logs = out / f"{run_id}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    for src in (
        work / "daemon.log",
        kit.script_log,
        *((kit.node_dir / n for n in ("kubelet.log", "containerd.log")) if kit.node_dir else ()),
    ):
        if src.exists():
            with contextlib.suppress(OSError):
                shutil.copy2(src, logs / src.name)
    info["stop_errors"] = kit.stop()
    markers = [str(p) for p in (kit.cp_dir, kit.node_dir, work) if p is not None]
    mine = {os.getpid()}
    leftovers = our_processes(markers, mine)
    if leftovers:  # never leave anything behind: by pid, and say so
        for line in leftovers:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
    info["leftover_processes"] = leftovers
    info["kept"] = keep
    if keep:
        info["kept_dirs"] = markers
    return info


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30
        )
        return done.stdout.strip()

    untracked = git("ls-files", "--others", "--exclude-standard", "--", "vgpu").splitlines()
    digest = hashlib.sha256(git("diff", "HEAD", "--", "vgpu").encode())
    for name in sorted(untracked):
        with contextlib.suppress(OSError):
            digest.update(name.encode() + b"\0" + (REPO / name).read_bytes())
    return {
        "vgpu_uncommitted_sha256": digest.hexdigest()[:16],
        "head": git("log", "-1", "--format=%H %s"),
        "dirty": [ln for ln in git("status", "--short").splitlines() if ln][:50],
    }


# ---------------------------------------------------------------- the command


def preflight() -> None:
    if os.geteuid() != 0:
        raise SetupError("the kit needs root (mknod, cgroups, mounts)")
    if not VENV_VGPU.exists():
        raise SetupError(
            f"{VENV_VGPU} missing: python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]'"
        )
    if device_plugin_socket_live():
        raise SetupError(
            f"another kubelet serves {DEVICE_PLUGIN_DIR / 'kubelet.sock'}: stop that node first"
        )


def table(results: Sequence[dict[str, Any]]) -> str:
    names = (
        "own_limits",
        "not_running_explained",
        "no_overcommit",
        "status_consistent",
        "records_gone_after_delete",
        "no_live_release",
    )
    short = ("own", "why", "overc", "status", "gone", "live")
    head = f"{'run':<34} {'run/all':>7} " + " ".join(f"{s:>6}" for s in short)
    head += "  " + " ".join(f"{p.split()[0][:8]:>8}" for p in LOG_PATTERNS) + "  placed pre/post"
    lines = [head]
    for r in results:
        pods = r.get("pods", {})
        running = sum(1 for e in pods.values() if e.get("phase") == "Running")
        cells = []
        for n in names:
            v = r.get("verdicts", {}).get(n)
            cells.append(f"{'-' if v is None else ('ok' if v['ok'] else 'FAIL'):>6}")
        counts = r.get("log", {}).get("counts", {})
        lines.append(
            f"{r['run']:<34} {running:>3}/{len(BURST):<3} "
            + " ".join(cells)
            + "  "
            + " ".join(f"{counts.get(p, '-'):>8}" for p in LOG_PATTERNS)
            + f"  {r.get('log', {}).get('placed_keys_before_restart', '-'):>6}"
            + f"/{r.get('log', {}).get('placed_keys_after_restart', '-')}"
        )
        vsrc = r.get("vgpu_src", {})
        lines.append(
            f"    vgpu {vsrc.get('rev')} {vsrc.get('commit') or ''}"
            f"  settle {r.get('settle_s')} s  run {r.get('wall_s')} s"
        )
        if r.get("error"):
            lines.append(f"    error: {r['error']}")
        for n in names:
            v = r.get("verdicts", {}).get(n)
            if v and not v["ok"]:
                fails = v["failures"]
                items = fails.items() if isinstance(fails, dict) else enumerate(fails)
                for k, f in list(items)[:8]:
                    lines.append(f"    {n}: {k}: {f}" if isinstance(k, str) else f"    {n}: {f}")
        if r.get("teardown", {}).get("leftover_processes"):
            lines.append(f"    leftover processes killed: {r['teardown']['leftover_processes']}")
        lines.append(f"    result: {r.get('result_file')}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.e2e.kit_restarts",
        description="Issue 28's restart scenarios on the real kubelet/containerd of realk8s.",
    )
    ap.add_argument("--scenario", choices=SCENARIOS, required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the node, cp and work dirs")
    ap.add_argument("--out", type=Path, default=Path("/tmp/kit-restarts"))
    ap.add_argument(
        "--vgpu-src",
        default="worktree",
        metavar="worktree|REV",
        help="the vgpu the daemon runs: the working tree (default, the venv's editable "
        "install) or a git revision exported per run (e.g. HEAD: edits in progress excluded)",
    )
    args = ap.parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _on_signal)
    results: list[dict[str, Any]] = []
    try:
        preflight()
        source = VgpuSource.resolve(args.vgpu_src)
        for i in range(1, args.runs + 1):
            r = one_run(args.scenario, i, out, args.keep, source)
            results.append(r)
            log(f"{r['run']}: {'ok' if r['ok'] else 'FAILED'} in {r['wall_s']} s")
    except Interrupted as exc:
        log(f"interrupted ({exc}); torn down")
        print(table(results))
        return 130
    except SetupError as exc:
        log(str(exc))
        return 2
    print(table(results))
    return 0 if results and all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
