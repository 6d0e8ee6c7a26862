"""Soak: ``python -m bench soak [--minutes 30] [--seed N] [--out FILE]``.

Churn against the real daemon on a simulated node (kubelet simulator, fake
API server, mock cards) for a given time, mixing every bad day the daemon must
survive: admissions (some with init containers) and deletions, kill -9 of the
daemon, kubelet restarts, API server outages, card faults, a tenant planting
links, FIFOs and deep trees in what it can write, a tenant hammering the
metrics port with half-open connections, and a full disk for a while (a real
tmpfs; skipped, and said so, where mounting is not allowed).

After every step it checks, from the state on disk and the kubelet's record:
no card is overcommitted (device IDs, and the memory limits handed out); no
live container's record is lost; no record is orphaned for long; no trash is
left for long; the daemon is alive, `vgpu status` answers, /healthz answers
in time; host files planted links point to are untouched. RSS and descriptor
counts are sampled after every step and must stay flat. Exit status 1 on any
violation. A 2-minute run is part of the test suite
(tests/adversarial/test_soak_ci.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil  # type: ignore[import-untyped, unused-ignore]

from bench.common import Json
from vgpu.core.slicing import parse_device_id
from vgpu.sim.faults import FaultUnavailable, SmallDisk
from vgpu.sim.harness import SimNode
from vgpu.sim.kubelet import Admission, SimPod

MIB = 2**20
CARDS = 4
CARD_MIB = 143771
UNIT_MIB = 256
MAX_LIVE = 24
ORPHAN_GRACE_S = 45.0  # the daemon keeps a never-listed placement 30 s
TRASH_GRACE_S = 60.0
HEALTHZ_LIMIT_S = 3.0
RSS_GROWTH_LIMIT_MIB = 30.0
FD_GROWTH_LIMIT = 20
ALLOWED_REFUSALS = {
    None,  # the kubelet itself: no room, or the plugin is re-registering
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
}
WEIGHTS = {
    "admit": 40,
    "delete": 22,
    "finish_pod": 5,
    "kill9": 3,
    "kubelet_restart": 3,
    "api_outage": 3,
    "card_fault": 3,
    "tenant_attack": 6,
    "status": 4,
}
SIZES = [
    {"core": 10, "mem": 20},
    {"core": 25, "mem": 60},
    {"core": 5, "mem": 4},
    {"core": 50, "mem": 200},
    {"mem": 40},
    {"core": 100},
]


def card(i: int, **extra: Any) -> dict[str, Any]:
    return {
        "uuid": f"GPU-soak{i:04d}-0000-4000-8000-{i:012d}",
        "name": "NVIDIA H200",
        "memory_mib": CARD_MIB,
        "numa_node": i % 2,
        **extra,
    }


def write_cards(path: Path, faulty: int | None = None) -> None:
    cards = [card(i, **({"xid": 79} if i == faulty else {})) for i in range(CARDS)]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"gpus": cards}))
    os.replace(tmp, path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Hammer:
    """A tenant hammering the metrics port: half-open connections, and real
    scrapes, while /healthz is timed."""

    port: int
    alive: Any  # () -> bool: the daemon is up and not just restarted
    stop: threading.Event = field(default_factory=threading.Event)
    connections: int = 0
    healthz: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def run(self) -> None:
        while not self.stop.is_set():
            with contextlib.ExitStack() as stack:
                for _ in range(200):
                    try:
                        conn = stack.enter_context(
                            socket.create_connection(("127.0.0.1", self.port), 0.5)
                        )
                        conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                        self.connections += 1
                    except OSError:
                        pass
                self._probe()
                self.stop.wait(0.5)
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5).read()
            self.stop.wait(0.5)

    def _probe(self) -> None:
        up = self.alive()
        t0 = time.monotonic()
        try:
            urllib.request.urlopen(
                f"http://127.0.0.1:{self.port}/healthz", timeout=HEALTHZ_LIMIT_S
            ).read()
            self.healthz.append(time.monotonic() - t0)
        except OSError as exc:
            if up and self.alive():
                self.failures.append(f"/healthz failed while the daemon was up: {exc}")


class Soak:
    def __init__(self, minutes: float, seed: int) -> None:
        self.minutes = minutes
        self.rng = random.Random(seed)
        self.seed = seed
        self.root = Path(tempfile.mkdtemp(prefix="vsoak", dir="/tmp"))
        self.gpus = self.root / "gpus.json"
        write_cards(self.gpus)
        self.port = free_port()
        self.node = SimNode(
            self.root / "node",
            gpus=self.gpus,
            node="soak-node",
            seed=seed,
            daemon_args=[
                "--metrics-address",
                f"127.0.0.1:{self.port}",
                "--reconcile-interval-s",
                "2",
            ],
        )
        (self.root / "node").mkdir()
        self.host = self.root / "host"  # what planted links point to
        self.host.mkdir()
        (self.host / "secret").write_text("host secret\n")
        self.disk: SmallDisk | None = SmallDisk(self.node.state_dir, size_mib=64)
        self.disk_note = ""
        self.live: list[SimPod] = []
        self.counter = 0
        self.steps: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.violations: list[str] = []
        self.samples: list[tuple[float, float, int]] = []  # (t, rss MiB, fds)
        self.orphans: dict[str, float] = {}
        self.splits: dict[str, str] = {}  # container -> its records, when not one
        self.timed: list[tuple[float, str]] = []  # (end, fault) being undone later
        self.disk_full_until = 0.0
        self.restarted_at = 0.0
        self.hammer = Hammer(self.port, self._up)
        self.trace: list[str] = []  # the last steps, for the report on a violation
        self.daemon_log = ""

    # -------------------------------------------------------------- lifecycle

    def _up(self) -> bool:
        proc = self.node.proc
        return proc is not None and proc.poll() is None and time.monotonic() - self.restarted_at > 5

    def run(self) -> Json:
        started = time.monotonic()
        try:
            try:
                self.disk.mount()  # type: ignore[union-attr]
            except FaultUnavailable as exc:
                self.disk, self.disk_note = None, f"skipped: {exc}"
            self.node.start(timeout_s=30)
            self.restarted_at = time.monotonic()
            hammer = threading.Thread(target=self.hammer.run, name="hammer", daemon=True)
            hammer.start()
            self._loop(started + self.minutes * 60)
            self.hammer.stop.set()
            hammer.join(10)
            self._wind_down()
        finally:
            self.hammer.stop.set()
            self.node.close()
            if self.disk is not None:
                with contextlib.suppress(FaultUnavailable):
                    self.disk.unmount()
            shutil.rmtree(self.root, ignore_errors=True)
        return self._report(time.monotonic() - started)

    def _loop(self, deadline: float) -> None:
        total_s = self.minutes * 60
        disk_at = time.monotonic() + total_s / 2
        disk_for = min(60.0, total_s / 10)
        kinds = list(WEIGHTS)
        weights = [WEIGHTS[k] for k in kinds]
        while time.monotonic() < deadline:
            now = time.monotonic()
            self._undo_faults(now)
            if self.disk is not None and disk_at and now >= disk_at:
                disk_at = 0.0
                self._full_disk(disk_for)
                continue
            kind = self.rng.choices(kinds, weights)[0]
            if kind == "admit" and len(self.live) >= MAX_LIVE:
                kind = "delete"
            getattr(self, f"_{kind}")()
            self.steps[kind] += 1
            self.trace = [*self.trace[-199:], f"{time.time():.3f} {kind} s{self.counter}"]
            self._check(kind)
        for _end, fault in list(self.timed):
            self._undo(fault)
        self.timed.clear()

    # ------------------------------------------------------------------ steps

    def _admit(self) -> None:
        self.counter += 1
        size = self.rng.choice(SIZES)
        requests = {self.node.core if k == "core" else self.node.memory: v for k, v in size.items()}
        init = None
        if self.rng.random() < 0.15 and "core" in size and size["core"] < 100:
            init = {"setup": dict(requests)}
        pod = self.node.pod(f"s{self.counter}", {"main": requests}, init=init)
        result = self.node.submit(pod)
        self._count(result)
        if result.ok:
            self.live.append(pod)

    def _count(self, result: Admission) -> None:
        if result.ok:
            self.outcomes["ok"] += 1
            return
        code = result.code
        self.outcomes[code.name if code else "kubelet"] += 1
        if code not in ALLOWED_REFUSALS:
            self.violations.append(f"refusal with {code}: {result.error}")

    def _delete(self) -> None:
        if self.live:
            self.node.delete(self.live.pop(self.rng.randrange(len(self.live))))

    def _finish_pod(self) -> None:
        if self.live:
            self.node.finish(self.live.pop(self.rng.randrange(len(self.live))))

    def _kill9(self) -> None:
        self.restarted_at = time.monotonic() + 3600  # not "up" until it is back
        self.node.kill_daemon()
        try:
            self.node.start_daemon(timeout_s=30)
        except RuntimeError as exc:
            self.violations.append(f"the daemon did not come back after kill -9: {exc}")
        self.restarted_at = time.monotonic()

    def _kubelet_restart(self) -> None:
        before = self.node.registrations()
        self.node.kubelet.restart()
        if not self.node.kubelet.wait_for(lambda: self.node.registrations() > before, 10):
            self.violations.append("no re-registration within 10 s of a kubelet restart")

    def _api_outage(self) -> None:
        assert self.node.api is not None
        self.node.api.set_down(True)
        self.timed.append((time.monotonic() + self.rng.uniform(2, 8), "api"))

    def _card_fault(self) -> None:
        if any(f.startswith("card") for _, f in self.timed):
            return
        faulty = self.rng.randrange(CARDS)
        write_cards(self.gpus, faulty)
        self.timed.append((time.monotonic() + self.rng.uniform(2, 6), f"card{faulty}"))

    def _undo_faults(self, now: float) -> None:
        for item in [t for t in self.timed if t[0] <= now]:
            self.timed.remove(item)
            self._undo(item[1])

    def _undo(self, fault: str) -> None:
        if fault == "api":
            assert self.node.api is not None
            self.node.api.set_down(False)
        elif fault.startswith("card"):
            write_cards(self.gpus)

    def _tenant_attack(self) -> None:
        """A tenant plants links, a FIFO and a deep tree in what it can write.

        Like a container, it writes through what it opened (its mount), never
        through host paths, which the daemon may have moved away meanwhile.
        """
        if not self.live:
            return
        pod = self.rng.choice(self.live)
        for path in self._writable(pod):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue  # gone meanwhile: fine
            try:
                if os.path.isdir(f"/proc/self/fd/{fd}"):
                    self._plant(fd)
                else:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                        os.pwrite(fd, b"\xff" * 64, 0)
            finally:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _plant(self, dir_fd: int) -> None:
        with contextlib.suppress(OSError):
            for name, target in (("vgpu.shm", self.host / "secret"), ("up", self.host)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f".{name}.lnk", dir_fd=dir_fd)
                os.symlink(target, f".{name}.lnk", dir_fd=dir_fd)
                os.replace(f".{name}.lnk", name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        with contextlib.suppress(OSError):
            os.mkfifo("pipe", dir_fd=dir_fd)
        fd = os.dup(dir_fd)
        try:
            for name in ["deep"] + ["d"] * 300:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, dir_fd=fd)
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = child
        except OSError:
            pass
        finally:
            os.close(fd)

    def _writable(self, pod: SimPod) -> list[Path]:
        """What the pod's containers can write: their records' shared directory
        (or budget file), once the daemon knows the owner."""
        out: list[Path] = []
        for record in self._records().values():
            if (record.get("pod") or {}).get("name") == pod.name:
                config_dir = self.node.state_dir / "containers" / record["key"]
                out += [p for p in (config_dir / "shared", config_dir / "vgpu.shm") if p.exists()]
        return out

    def _status(self) -> None:
        try:
            result = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "vgpu",
                    "status",
                    "-o",
                    "json",
                    "--state-dir",
                    str(self.node.state_dir),
                ],
                capture_output=True,
                text=True,
                timeout=15,
            )
        except subprocess.TimeoutExpired:
            self.violations.append("vgpu status did not answer within 15 s")
            return
        if result.returncode != 0 or "Traceback" in result.stderr:
            self.violations.append(f"vgpu status failed: {result.stderr[-300:]}")

    def _full_disk(self, seconds: float) -> None:
        assert self.disk is not None
        self.disk.fill()
        self.disk_full_until = time.monotonic() + seconds
        self.steps["full_disk"] += 1
        while time.monotonic() < self.disk_full_until:
            kind = self.rng.choice(["admit", "admit", "delete", "status"])
            getattr(self, f"_{kind}")()
            self.steps[f"{kind} (disk full)"] += 1
            self._check(kind)
        self.disk.free()
        self.disk_full_until = time.monotonic() + 10  # the daemon writes what waited

    # ----------------------------------------------------------------- checks

    def _records(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        root = self.node.state_dir / "containers"
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(root):
                if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                    continue
                try:
                    fd = os.open(
                        Path(entry.path) / "config.json",
                        os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK,
                    )
                    try:
                        data = json.loads(os.read(fd, 1 << 20))
                    finally:
                        os.close(fd)
                    out[entry.name] = data
                except (OSError, ValueError):
                    out[entry.name] = {}
        return out

    def _check(self, step: str) -> None:
        now = time.monotonic()
        disk_trouble = now < self.disk_full_until
        proc = self.node.proc
        if proc is None or proc.poll() is not None:
            self.violations.append(f"the daemon is not running after {step}")
            return
        records = self._records()
        held: dict[str, dict[str, set[str]]] = {}
        for data in records.values():
            for resource, ids in (data.get("device_ids") or {}).items():
                for d in ids:
                    held.setdefault(_card_part(d), {}).setdefault(resource, set()).add(d)
        for uuid, per in held.items():
            if len(per.get("vcuda-core", ())) > 100:
                self.violations.append(f"{step}: card {uuid} core overcommitted")
            if len(per.get("vcuda-memory", ())) > CARD_MIB // UNIT_MIB:
                self.violations.append(f"{step}: card {uuid} memory overcommitted")
        by_ids = {
            frozenset((r, frozenset(v)) for r, v in (d.get("device_ids") or {}).items() if v): k
            for k, d in records.items()
        }
        live_keys: set[str] = set()
        live_sets: list[dict[str, frozenset[str]]] = []
        limits: Counter[str] = Counter()
        pods = {p.uid: p for p in self.node.kubelet.active_pods()}
        for uid, containers in self.node.kubelet.allocated().items():
            pod = pods.get(uid)
            if pod is None:
                continue
            for c in pod.containers:
                ids = {
                    r.split("/")[1]: frozenset(v) for r, v in (containers.get(c.name) or {}).items()
                }
                ids = {r: v for r, v in ids.items() if v}
                if not ids:
                    continue
                live_sets.append(ids)
                key = by_ids.get(frozenset(ids.items()))
                if key is None:
                    self._unmatched(step, f"{pod.name}/{c.name}", ids, records, disk_trouble)
                    live_keys |= {
                        k
                        for k, d in records.items()
                        if _ids_of(d)
                        and all(v <= ids.get(r, frozenset()) for r, v in _ids_of(d).items())
                    }
                    continue
                live_keys.add(key)
                record = records[key]
                for uuid in record.get("cards", []):
                    limits[uuid] += record.get("memory_limit_mib") or 0
                cards = {_card_part(d) for v in ids.values() for d in v}
                if len(ids.get("vcuda-core", ())) < 100 and len(cards) > 1:
                    self.violations.append(f"{step}: {pod.name}/{c.name} spans cards {cards}")
        for uuid, mib in limits.items():
            if mib > CARD_MIB:
                self.violations.append(f"{step}: memory limits on {uuid} sum to {mib} MiB")
        # A key seen orphaned once and gone since starts afresh if it comes back
        # (the same device IDs give the same key).
        self.orphans = {k: t for k, t in self.orphans.items() if k in records}
        for key, data in records.items():
            mine = {r: frozenset(v) for r, v in (data.get("device_ids") or {}).items() if v}
            shared = any(
                all(v <= s.get(r, frozenset()) for r, v in mine.items()) for s in live_sets
            )
            if key in live_keys or (mine and shared):
                self.orphans.pop(key, None)
                continue
            first = self.orphans.setdefault(key, now)
            if now - first > ORPHAN_GRACE_S and not disk_trouble:
                self.violations.append(f"{step}: record {key} orphaned for {now - first:.0f} s")
                self.orphans[key] = now
        self._check_trash(now)
        self._check_host(step)
        self._sample(proc.pid)

    def _unmatched(
        self,
        step: str,
        name: str,
        ids: dict[str, frozenset[str]],
        records: dict[str, dict[str, Any]],
        disk_trouble: bool,
    ) -> None:
        """No one record holds exactly a live container's IDs. Lost if some ID is
        in no record at all; split (a documented fallback: its resources were
        placed without being paired) if records within its IDs cover them."""
        inside = [
            _ids_of(d)
            for d in records.values()
            if _ids_of(d) and all(v <= ids.get(r, frozenset()) for r, v in _ids_of(d).items())
        ]
        covered = {r: frozenset().union(*(x.get(r, frozenset()) for x in inside)) for r in ids}
        if covered == ids:
            if name not in self.splits:
                self.splits[name] = f"{step}: {[{r: len(v) for r, v in x.items()} for x in inside]}"
            return
        if not disk_trouble:
            missing = {r: len(ids[r] - covered.get(r, frozenset())) for r in ids}
            self.violations.append(f"{step}: record of {name} lost (IDs in no record: {missing})")

    def _check_trash(self, now: float) -> None:
        root = self.node.state_dir / "containers"
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(root):
                if entry.name.startswith(".trash-"):
                    age = time.time() - entry.stat(follow_symlinks=False).st_ctime
                    if age > TRASH_GRACE_S:
                        self.violations.append(f"{entry.name} still there after {age:.0f} s")

    def _check_host(self, step: str) -> None:
        if (self.host / "secret").read_text() != "host secret\n" or not self.host.is_dir():
            self.violations.append(f"{step}: a host file a link pointed to was changed")

    def _sample(self, pid: int) -> None:
        try:
            proc = psutil.Process(pid)
            self.samples.append((time.monotonic(), proc.memory_info().rss / MIB, proc.num_fds()))
        except psutil.Error:
            pass

    def _wind_down(self) -> None:
        for pod in list(self.live):
            self.node.delete(pod)
        self.live.clear()
        self.disk_full_until = 0.0
        deadline = time.monotonic() + ORPHAN_GRACE_S
        while time.monotonic() < deadline:
            if not self._records() and not list((self.node.state_dir / "containers").glob(".t*")):
                break
            time.sleep(0.5)
        else:
            self.violations.append(f"records left after every pod ended: {list(self._records())}")
        log = self.node.log()
        if self.violations:
            self.daemon_log = log
        if "Traceback" in log:
            at = log.index("Traceback")
            self.violations.append(f"traceback in the daemon log: {log[at : at + 1500]}")
        self.violations += self.hammer.failures

    # ----------------------------------------------------------------- report

    def _report(self, seconds: float) -> Json:
        third = max(1, len(self.samples) // 3)
        first, last = self.samples[:third], self.samples[-third:]
        rss_growth = fd_growth = 0.0
        if first and last:
            rss_growth = statistics.median(s[1] for s in last) - statistics.median(
                s[1] for s in first
            )
            fd_growth = statistics.median(s[2] for s in last) - statistics.median(
                s[2] for s in first
            )
        if rss_growth > RSS_GROWTH_LIMIT_MIB:
            self.violations.append(f"RSS grew {rss_growth:.1f} MiB (median, first vs last third)")
        if fd_growth > FD_GROWTH_LIMIT:
            self.violations.append(f"descriptors grew by {fd_growth:.0f} (median)")
        health = self.hammer.healthz
        return {
            "minutes": self.minutes,
            "seed": self.seed,
            "seconds": round(seconds, 1),
            "steps": dict(sorted(self.steps.items())),
            "admissions": dict(sorted(self.outcomes.items())),
            "disk_faults": self.disk_note or "ran",
            "rss_mib": {
                "first_third_median": round(statistics.median(s[1] for s in first), 1)
                if first
                else None,
                "last_third_median": round(statistics.median(s[1] for s in last), 1)
                if last
                else None,
                "max": round(max((s[1] for s in self.samples), default=0.0), 1),
                "growth": round(rss_growth, 2),
            },
            "fds": {
                "max": max((s[2] for s in self.samples), default=0),
                "growth": fd_growth,
            },
            "metrics_hammer": {
                "half_open_connections": self.hammer.connections,
                "healthz_checks": len(health),
                "healthz_max_ms": round(max(health, default=0.0) * 1e3, 1),
                "healthz_p50_ms": round(statistics.median(health) * 1e3, 1) if health else None,
            },
            "split_containers": len(self.splits),
            "split_examples": dict(list(self.splits.items())[:5]),
            "trace": self.trace if self.violations else [],
            "violations": self.violations[:50],
            "violation_count": len(self.violations),
            "passed": not self.violations,
        }


def _ids_of(record: dict[str, Any]) -> dict[str, frozenset[str]]:
    return {r: frozenset(v) for r, v in (record.get("device_ids") or {}).items() if v}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = parser.parse_args(argv)
    soak = Soak(args.minutes, args.seed)
    report = soak.run()
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        if soak.daemon_log:  # what the daemon said, next to the report
            args.out.with_suffix(".daemon.log").write_text(soak.daemon_log)
    return 0 if report["passed"] else 1


def _card_part(device_id: str) -> str:
    """The part of a device ID that names its card (index and digest, or a legacy UUID)."""
    ref = parse_device_id(device_id)
    return ref.card_uuid or f"{ref.card_index}.{ref.card_digest}"
