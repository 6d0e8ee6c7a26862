"""Issue 30, item 2: the extender at the pace of the REAL kube-scheduler.

``python -m bench extender --real [--nodes 200] [--pods 1000] [--rounds 3]``
runs on ../shared/realk8s (its own control plane, no kubelet node): etcd,
kube-apiserver and kube-scheduler v1.36.2, with N Nodes created as API objects
(8 H200 each: the vgpu-node inventory annotation and the vcuda allocatable the
node daemon would publish) and the real ``vgpu extender`` subprocess.

Each round, for each client setting (``1000``: both profiles' clients at 1000
QPS / burst 1000; ``stock``: the client defaults, 50 QPS / burst 100), two
streams, the default profile's and vgpu's, each the same 1,000 sliced pods:

1. the scheduler is stopped (by its PID) and the pods are created, so all of
   them wait when it starts ("created at once");
2. for vgpu, the extender's pod gauge shows it has seen every one;
3. kube-scheduler starts (start-scheduler.sh) with the default profile, or
   with the chart's rendered vgpu-scheduler configuration (deploy/scheduler,
   the extender's URL and the client settings filled in);
4. a watch records when each pod is bound; pods/s is (bound - 1) over the
   time from the first bind to the last;
5. vgpu's assignments are checked (no card overcommitted, every card on the
   pod's node and fitting, Pending only when no card fits), then every pod is
   deleted (grace 0) before the next stream.

CPU (user + system) of the extender, kube-scheduler, kube-apiserver and etcd
is measured over each stream, per pod bound; the extender's RSS is sampled.
The load average is recorded beside each stream (other work shares the box).
The targets read each round's ratio (vgpu / default) and take the median.

``python -m bench extender --stand-in`` is the same scenario on the in-repo
stand-ins (bench/fastpath.py: the scheduler stand-in and the fake API server);
its numbers say nothing about the real components' ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import psutil
import yaml

from bench.common import Json, Target, machine
from tests.e2e.kit import read_env_file, run_script
from vgpu.adapters.gpus import preset_cards
from vgpu.core.annotations import format_inventory
from vgpu.core.model import CardUuid, Policy
from vgpu.sim.cluster import free_port

REPO = Path(__file__).resolve().parents[1]
KIT = Path(os.environ.get("REALK8S_KIT", str(REPO.parent / "shared" / "realk8s"))).resolve()
RENDERED = REPO / "deploy" / "scheduler" / "02-configmap.yaml"
DOMAIN = "vendor.io"
CORE, MEM = f"{DOMAIN}/vcuda-core", f"{DOMAIN}/vcuda-memory"
UNIT = 256
CARD_UNITS = 143771 // UNIT
CARDS_PER_NODE = 8
NAMESPACE = "default"
LABEL = "vgpu-bench"
# The shapes of bench.fastpath's stream (core %, memory units of 256 MiB).
SHAPES = [(10, 16), (20, 24), (30, 40), (40, 64), (25, 32)]
RATIO_LIMIT = 0.9  # vgpu pods/s at least 0.9x the default profile's (1000 QPS)
STOCK_RATIO_LIMIT = 1.0  # never slower than the default profile (stock clients)
RSS_LIMIT_MIB = 256.0
CLIENTS = {"1000": (1000, 1000), "stock": None}  # qps, burst (None: the client's defaults)


# ------------------------------------------------------------------ the API


class Api:
    """A small HTTPS client for the kit's API server: a kept-alive connection per
    thread, the admin token, JSON in and out."""

    def __init__(self, server: str, token: str, ca: str) -> None:
        url = urlsplit(server)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 443
        self.token = token
        self.context = ssl.create_default_context(cafile=ca)
        self._local = threading.local()

    def _conn(self) -> http.client.HTTPSConnection:
        conn: http.client.HTTPSConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPSConnection(
                self.host, self.port, context=self.context, timeout=60
            )
            self._local.conn = conn
        return conn

    def call(self, method: str, path: str, body: Any = None, ok: Sequence[int] = (200, 201)) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        for attempt in (1, 2):
            conn = self._conn()
            try:
                conn.request(method, path, data, headers)
                reply = conn.getresponse()
                text = reply.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise
                continue
            if reply.status not in ok:
                raise RuntimeError(f"{method} {path}: HTTP {reply.status}: {text[:300]!r}")
            return json.loads(text) if text else None
        raise AssertionError("unreachable")  # pragma: no cover

    def watch(self, path: str) -> tuple[http.client.HTTPSConnection, Iterator[Json]]:
        """A watch on its own connection: the connection (shut its socket down to
        end the watch from another thread) and its events, read blocking (a read
        timed out in the middle of a chunk would lose the stream's place)."""
        conn = http.client.HTTPSConnection(self.host, self.port, context=self.context)
        conn.request("GET", path, headers={"Authorization": f"Bearer {self.token}"})
        reply = conn.getresponse()
        if reply.status != 200:
            conn.close()
            raise RuntimeError(f"watch {path}: HTTP {reply.status}")

        def events() -> Iterator[Json]:
            buffer = b""
            try:
                while True:
                    chunk = reply.read1(65536)
                    if not chunk:
                        return
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        if line.strip():
                            yield json.loads(line)
            finally:
                conn.close()

        return conn, events()


# ------------------------------------------------------------------ the kit


def _pid_of(pid_file: Path, marker: str) -> int | None:
    """The pid in `pid_file` if that process runs and its command line names `marker`."""
    try:
        pid = int(pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, ValueError):
        return None
    return pid if marker in cmdline else None


@dataclass
class ControlPlane:
    """etcd + kube-apiserver from controlplane/start.sh (SCHEDULER=0), the
    scheduler started and stopped per stream, everything stopped by PID."""

    work: Path
    home: str = ""
    cp_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def log(self) -> Path:
        return self.work / "kit-scripts.log"

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "CP_DIR")}
        env["REALK8S_HOME"] = self.home
        return env

    def start(self) -> None:
        self.home = run_script([str(KIT / "unpack.sh")], dict(os.environ), self.log, 600)
        self.cp_dir = Path(tempfile.mkdtemp(prefix="k8scp.", dir="/tmp"))
        env = self._base_env() | {"CP_DIR": str(self.cp_dir), "SCHEDULER": "0"}
        run_script([str(KIT / "controlplane" / "start.sh")], env, self.log, 180)
        self.env = read_env_file(self.cp_dir / "env")

    def api(self) -> Api:
        return Api(self.env["APISERVER"], self.env["TOKEN"], self.env["CA"])

    @property
    def kubeconfig(self) -> str:
        return self.env["KUBECONFIG"]

    def pid(self, name: str) -> int | None:
        assert self.cp_dir is not None
        return _pid_of(self.cp_dir / f"{name}.pid", name)

    def start_scheduler(self, config: Path) -> None:
        assert self.cp_dir is not None
        argv = [str(KIT / "controlplane" / "start-scheduler.sh"), str(self.cp_dir), str(config)]
        run_script(argv, self._base_env(), self.log, 120)

    def stop_scheduler(self) -> None:
        """As start-scheduler.sh stops one: SIGTERM by its PID, SIGKILL after 10 s."""
        assert self.cp_dir is not None
        pid = self.pid("kube-scheduler")
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while psutil.pid_exists(pid) and time.monotonic() < deadline:
                with contextlib.suppress(psutil.Error):
                    if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                        break
                time.sleep(0.05)
            with contextlib.suppress(ProcessLookupError):
                if psutil.pid_exists(pid) and self.pid("kube-scheduler") == pid:
                    os.kill(pid, signal.SIGKILL)
        (self.cp_dir / "kube-scheduler.pid").unlink(missing_ok=True)

    def stop(self) -> None:
        if self.cp_dir is not None and self.cp_dir.exists():
            env = self._base_env()
            run_script(
                [str(KIT / "controlplane" / "stop.sh"), str(self.cp_dir)], env, self.log, 120
            )


# ------------------------------------------------------------------ objects


def node_objects(count: int) -> list[Json]:
    """Node objects as the API holds them for a node running `vgpu serve` with 8 H200:
    the inventory annotation and the vcuda allocatable it publishes."""
    out = []
    alloc = {
        "cpu": "128",
        "memory": "2Ti",
        "pods": "250",
        CORE: str(100 * CARDS_PER_NODE),
        MEM: str(CARDS_PER_NODE * CARD_UNITS),
    }
    for n in range(count):
        name = f"node-{n:04d}"
        cards = [
            replace(c, uuid=CardUuid(f"GPU-n{n:04d}-{c.index}"))
            for c in preset_cards(f"preset:{CARDS_PER_NODE}xH200")
        ]
        out.append(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "labels": {"kubernetes.io/hostname": name, LABEL: "node"},
                    "annotations": {
                        f"{DOMAIN}/vgpu-node": format_inventory(cards, UNIT, Policy.BINPACK)
                    },
                },
                "spec": {},
                "status": {
                    "capacity": dict(alloc),
                    "allocatable": dict(alloc),
                    "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
                },
            }
        )
    return out


def pod_object(name: str, scheduler: str, core: int, mem: int, stream: str) -> Json:
    limits = {CORE: str(core), MEM: str(mem)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {LABEL: stream}},
        "spec": {
            "schedulerName": scheduler,
            "containers": [
                {
                    "name": "main",
                    "image": "docker.io/local/busybox:1.35",
                    "resources": {"limits": limits, "requests": limits},
                }
            ],
        },
    }


def _parallel(fn: Any, items: Sequence[Any], workers: int = 8) -> None:
    with ThreadPoolExecutor(workers) as pool:
        for _ in pool.map(fn, items):
            pass


# ------------------------------------------------------------------ configs


def _client(qps: tuple[int, int] | None) -> Json:
    out: Json = {"kubeconfig": "@KUBECONFIG@"}
    if qps is not None:
        out["qps"], out["burst"] = qps
    return out


def default_config(qps: tuple[int, int] | None) -> Json:
    return {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": _client(qps),
        "leaderElection": {"leaderElect": False},
    }


def rendered() -> tuple[Json, Json]:
    """The chart's kube-scheduler and extender configurations, as deploy/ renders them."""
    data = yaml.safe_load(RENDERED.read_text())["data"]
    return yaml.safe_load(data["scheduler-config.yaml"]), yaml.safe_load(data["extender.yaml"])


def vgpu_config(qps: tuple[int, int] | None, port: int) -> Json:
    """The chart's configuration with what a kit run changes: the kubeconfig and
    client rate, no leader election, the extender's local port."""
    config, _ = rendered()
    config["clientConnection"] = _client(qps)
    config["leaderElection"] = {"leaderElect": False}
    for ext in config["extenders"]:
        ext["urlPrefix"] = f"http://127.0.0.1:{port}"
    return config


# ------------------------------------------------------------------ the extender


class ExtenderProcess:
    """`vgpu extender` with the chart's settings on local ports."""

    def __init__(
        self,
        kubeconfig: str,
        work: Path,
        node_choice: str | None = None,
        tree: Path | None = None,
    ) -> None:
        """`tree`: run the vgpu package found there (another commit's, for a
        before-and-after in one run) instead of this checkout's."""
        _, settings = rendered()
        self.port, self.metrics = free_port(), free_port()
        config = work / "extender.yaml"
        settings.update(
            listen=f"127.0.0.1:{self.port}",
            metrics_address=f"127.0.0.1:{self.metrics}",
            kubeconfig=kubeconfig,
        )
        if node_choice:
            settings["node_choice"] = node_choice
        config.write_text(yaml.safe_dump(settings))
        self.log_path = work / "extender.log"
        self._log = self.log_path.open("ab")
        env = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_")}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        if tree is not None:
            env["PYTHONPATH"] = str(tree)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vgpu", "extender", "--config", str(config)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            # `-m` puts the working directory first on sys.path: the tree's own
            # vgpu must win over this checkout's.
            cwd=str(tree or REPO),
        )
        self.ps = psutil.Process(self.proc.pid)
        self.peak_rss_mib = 0.0

    def _get(self, port: int, path: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request("GET", path)
            reply = conn.getresponse()
            return reply.status, reply.read().decode()
        except OSError:
            return 0, ""
        finally:
            conn.close()

    def ready(self) -> bool:
        return self._get(self.port, "/readyz")[0] == 200

    def gauge(self, name: str) -> float:
        for line in self._get(self.metrics, "/metrics")[1].splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return -1.0

    def requests(self) -> dict[str, list[float]]:
        """verb -> [requests, seconds answering them] from its metrics (counts since start)."""
        out: dict[str, list[float]] = {}
        for line in self._get(self.metrics, "/metrics")[1].splitlines():
            for suffix, i in (("_count", 0), ("_sum", 1)):
                head = f'vgpu_extender_request_duration_seconds{suffix}{{verb="'
                if line.startswith(head):
                    verb = line[len(head) :].split('"', 1)[0]
                    out.setdefault(verb, [0.0, 0.0])[i] = float(line.split()[-1])
        return out

    def rss_mib(self) -> float:
        rss = self.ps.memory_info().rss / 2**20
        self.peak_rss_mib = max(self.peak_rss_mib, rss)
        return rss

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


# ------------------------------------------------------------------ one stream


def _cpu_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return float(t.user + t.system)


class BindWatch:
    """When each pod of a stream is first seen bound: a watch from before the
    scheduler starts, resumed from the last resourceVersion seen when the API
    server ends it (it closes a watcher that falls behind, as this one can on a
    loaded box), or after a list when that version is gone."""

    def __init__(self, api: Api, stream: str, version: str, expected: int) -> None:
        self.api = api
        self.bound_at: dict[str, float] = {}
        self.expected = expected
        self.version = version
        self.restarts = 0
        self.done = threading.Event()
        self.closing = False
        self.selector = quote(f"{LABEL}={stream}")
        self.error = ""
        self._conn: http.client.HTTPSConnection | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _seen(self, obj: Json) -> None:
        meta = obj.get("metadata") or {}
        self.version = meta.get("resourceVersion") or self.version
        name = meta.get("name", "")
        if (obj.get("spec") or {}).get("nodeName") and name not in self.bound_at:
            self.bound_at[name] = time.monotonic()
            if len(self.bound_at) >= self.expected:
                self.done.set()

    def _run(self) -> None:
        path = f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={self.selector}"
        try:
            relist = False
            while not self.closing and not self.done.is_set():
                if relist:  # the version is gone (410): list, then watch on from there
                    listed = self.api.call("GET", path)
                    for item in listed["items"]:
                        self._seen(item)
                    self.version = listed["metadata"]["resourceVersion"]
                    relist = False
                try:
                    self._conn, events = self.api.watch(
                        f"{path}&watch=1&resourceVersion={self.version}&timeoutSeconds=1800"
                    )
                except RuntimeError:
                    relist = True
                    self.restarts += 1
                    continue
                for event in events:
                    if event.get("type") == "ERROR":
                        relist = True
                        break
                    self._seen(event.get("object") or {})
                if not self.closing:
                    self.restarts += 1
        except Exception as exc:  # reported with the stream
            if not self.closing:
                self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.done.set()

    def close(self) -> None:
        self.closing = True
        conn = self._conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(5)


@dataclass
class Cluster:
    cp: ControlPlane
    api: Api
    nodes: list[Json]
    work: Path
    extender: ExtenderProcess | None = None
    profile_dir: Path | None = None  # py-spy profiles of the extender, one per vgpu stream

    def _profiler(self, stream: str) -> subprocess.Popen[bytes] | None:
        spy = shutil.which("py-spy")
        if self.profile_dir is None or spy is None or self.extender is None:
            return None
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        out = self.profile_dir / f"{stream}.txt"
        pid = str(self.extender.proc.pid)
        argv = [spy, "record", "-p", pid, "-r", "100", "--gil", "--format", "raw"]
        return subprocess.Popen(
            [*argv, "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def pods(self, stream: str | None = None) -> list[Json]:
        selector = quote(f"{LABEL}={stream}" if stream else LABEL)
        path = f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={selector}"
        items: list[Json] = self.api.call("GET", path)["items"]
        return items

    def delete_pods(self) -> None:
        path = (
            f"/api/v1/namespaces/{NAMESPACE}/pods?labelSelector={quote(LABEL)}&gracePeriodSeconds=0"
        )
        self.api.call("DELETE", path, {"kind": "DeleteOptions", "gracePeriodSeconds": 0})
        deadline = time.monotonic() + 120
        while self.pods() and time.monotonic() < deadline:
            time.sleep(0.2)
        if self.extender is not None:
            while self.extender.gauge("vgpu_extender_pods") != 0 and time.monotonic() < deadline:
                time.sleep(0.1)

    def stream(
        self, profile: str, client: str, shapes: Sequence[tuple[int, int]], tag: str, limit_s: float
    ) -> Json:
        qps = CLIENTS[client]
        vgpu = profile == "vgpu"
        scheduler = "vgpu-scheduler" if vgpu else "default-scheduler"
        stream = f"{profile}-{client}-{tag}"
        self.cp.stop_scheduler()
        config = self.work / f"scheduler-{profile}-{client}.yaml"
        if vgpu:
            assert self.extender is not None
            config.write_text(yaml.safe_dump(vgpu_config(qps, self.extender.port)))
        else:
            config.write_text(yaml.safe_dump(default_config(qps)))
        pods = [
            pod_object(f"{stream}-{i:05d}", scheduler, core, mem, stream)
            for i, (core, mem) in enumerate(shapes)
        ]
        _parallel(lambda p: self.api.call("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", p), pods)
        if self.extender is not None:
            deadline = time.monotonic() + 60
            while (
                self.extender.gauge("vgpu_extender_pods") < len(pods)
                and time.monotonic() < deadline
            ):
                time.sleep(0.1)
        listed = self.api.call("GET", f"/api/v1/namespaces/{NAMESPACE}/pods?limit=1")
        watch = BindWatch(self.api, stream, listed["metadata"]["resourceVersion"], len(pods))
        load = os.getloadavg()
        pids = {
            "kube-apiserver": self.cp.pid("kube-apiserver"),
            "etcd": self.cp.pid("etcd"),
            "extender": self.extender.proc.pid if self.extender is not None else None,
        }
        cpu0 = {k: _cpu_s(p) for k, p in pids.items()}
        asked0 = self.extender.requests() if vgpu and self.extender is not None else {}
        profiler = self._profiler(stream) if vgpu else None
        t_start = time.monotonic()
        self.cp.start_scheduler(config)
        pids["kube-scheduler"] = self.cp.pid("kube-scheduler")
        cpu0["kube-scheduler"] = 0.0  # a new process: all its CPU is this stream's
        t_ready = time.monotonic()
        rss: list[float] = []
        deadline = t_start + limit_s
        last_count, last_change = 0, time.monotonic()
        while not watch.done.wait(0.5) and time.monotonic() < deadline:
            if self.extender is not None:
                rss.append(self.extender.rss_mib())
            if len(watch.bound_at) != last_count:
                last_count, last_change = len(watch.bound_at), time.monotonic()
            elif time.monotonic() - last_change > 15:
                break  # no bind for 15 s: the rest stay Pending
        cpu = {k: _cpu_s(p) - cpu0[k] for k, p in pids.items()}
        watch.close()
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)
            profiler.wait(60)
        if self.extender is not None:
            rss.append(self.extender.rss_mib())
        self.cp.stop_scheduler()
        times = sorted(watch.bound_at.values())
        bound = len(times)
        listed_pods = self.pods(stream)
        bound_listed = sum(1 for p in listed_pods if p["spec"].get("nodeName"))
        span = times[-1] - times[0] if bound > 1 else 0.0
        result: Json = {
            "profile": profile,
            "client": client,
            "pods": len(pods),
            "bound": bound,
            "bound_listed_after": bound_listed,
            "seconds_first_to_last_bind": round(span, 2),
            "pods_per_s": round((bound - 1) / span, 1) if span > 0 else 0.0,
            "scheduler_start_s": round(t_ready - t_start, 2),
            "first_bind_after_start_s": round(times[0] - t_start, 2) if times else None,
            "load_avg": [round(x, 2) for x in load],
            "cpu_ms_per_pod": {
                k: round(1000 * v / max(bound, 1), 2) for k, v in sorted(cpu.items()) if pids[k]
            },
            "watch_error": watch.error,
            "watch_restarts": watch.restarts,
        }
        if vgpu:
            assert self.extender is not None
            result["extender_rss_mib"] = round(max(rss), 1) if rss else 0.0
            asked = self.extender.requests()
            result["extender_requests"] = {
                verb: {
                    "count": int(n - asked0.get(verb, [0.0, 0.0])[0]),
                    "mean_ms": round(
                        1000
                        * (t - asked0.get(verb, [0.0, 0.0])[1])
                        / max(1.0, n - asked0.get(verb, [0.0, 0.0])[0]),
                        3,
                    ),
                }
                for verb, (n, t) in asked.items()
            }
            result["checks"] = check_assignments(listed_pods, self.nodes)
        return result


# ------------------------------------------------------------------ checks


def check_assignments(pods: Sequence[Json], nodes: Sequence[Json]) -> Json:
    """Every bound pod's assignment: its card on its node, no card over its core or
    memory; every Pending pod: no card has its room (Pending only when nothing fits)."""
    cards_of: dict[str, set[str]] = {}
    for node in nodes:
        text = node["metadata"]["annotations"][f"{DOMAIN}/vgpu-node"]
        cards_of[node["metadata"]["name"]] = {c["uuid"] for c in json.loads(text)["cards"]}
    used: dict[str, list[int]] = {c: [0, 0] for cards in cards_of.values() for c in cards}
    wrong_node = unassigned = 0
    pending: list[tuple[int, int]] = []
    for pod in pods:
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        core, mem = int(limits[CORE]), int(limits[MEM])
        node = pod["spec"].get("nodeName")
        if not node:
            pending.append((core, mem))
            continue
        text = (pod["metadata"].get("annotations") or {}).get(f"{DOMAIN}/vgpu-assignment")
        if not text:
            unassigned += 1
            continue
        assignment = json.loads(text)
        for card in assignment["containers"]["main"]:
            if assignment["node"] != node or card not in cards_of.get(node, set()):
                wrong_node += 1
                continue
            used[card][0] += core
            used[card][1] += mem
    over = sum(1 for c, m in used.values() if c > 100 or m > CARD_UNITS)
    pending_with_room = sum(
        1
        for core, mem in pending
        if any(c + core <= 100 and m + mem <= CARD_UNITS for c, m in used.values())
    )
    return {
        "overcommitted_cards": over,
        "cards_not_on_the_pods_node": wrong_node,
        "bound_without_assignment": unassigned,
        "pending": len(pending),
        "pending_though_a_card_fits": pending_with_room,
    }


# ------------------------------------------------------------------ the run


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def run(
    nodes: int = 200,
    pods: int = 1000,
    rounds: int = 3,
    clients: Sequence[str] = ("1000", "stock"),
    limit_s: float = 300.0,
    node_choice: str | None = None,
    profile_dir: Path | None = None,
    tree: Path | None = None,
) -> Json:
    """Every round: for each client setting, the default profile's stream and
    vgpu's (their order alternating by round), each into an empty cluster."""
    rng = random.Random(5)
    shapes = [rng.choice(SHAPES) for _ in range(pods)]
    work = Path(tempfile.mkdtemp(prefix="vgpu-bk-", dir="/tmp"))
    cp = ControlPlane(work)
    extender: ExtenderProcess | None = None
    streams: list[Json] = []
    started = time.monotonic()
    try:
        cp.start()
        api = cp.api()
        node_json = node_objects(nodes)
        _parallel(lambda n: api.call("POST", "/api/v1/nodes", n), node_json)
        extender = ExtenderProcess(cp.kubeconfig, work, node_choice, tree)
        deadline = time.monotonic() + 120
        while not extender.ready():
            if extender.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(extender.log_path.read_text()[-2000:])
            time.sleep(0.1)
        cluster = Cluster(cp, api, node_json, work, extender, profile_dir)
        extender.rss_mib()
        idle_rss = extender.peak_rss_mib
        for r in range(rounds):
            for client in clients:
                order = ("default", "vgpu") if r % 2 == 0 else ("vgpu", "default")
                for profile in order:
                    print(
                        f"round {r + 1}/{rounds}: {profile}, {client} client ...",
                        file=sys.stderr,
                        flush=True,
                    )
                    result = cluster.stream(profile, client, shapes, f"r{r}", limit_s)
                    result["round"] = r + 1
                    result["uptime"] = _uptime()
                    streams.append(result)
                    print(f"  {json.dumps(result)}", file=sys.stderr, flush=True)
                    cluster.delete_pods()
        peak_rss = extender.peak_rss_mib
    finally:
        if extender is not None:
            extender.stop()
        cp.stop()
        shutil.rmtree(work, ignore_errors=True)
    result = summarize(nodes, pods, rounds, clients, streams, idle_rss, peak_rss, started)
    result["extender_tree"] = str(tree) if tree is not None else "this checkout"
    return result


def summarize(
    nodes: int,
    pods: int,
    rounds: int,
    clients: Sequence[str],
    streams: Sequence[Json],
    idle_rss: float,
    peak_rss: float,
    started: float,
) -> Json:
    by: dict[str, Json] = {}
    targets: list[Target] = []
    for client in clients:
        ratios = []
        for r in range(1, rounds + 1):
            pair = {s["profile"]: s for s in streams if s["client"] == client and s["round"] == r}
            base, ours = pair["default"]["pods_per_s"], pair["vgpu"]["pods_per_s"]
            ratios.append(round(ours / base, 2) if base else 0.0)
        ratio = _median(ratios)
        mine = [s for s in streams if s["client"] == client]
        by[client] = {
            "ratios": ratios,
            "median_ratio": ratio,
            "default_pods_per_s": [s["pods_per_s"] for s in mine if s["profile"] == "default"],
            "vgpu_pods_per_s": [s["pods_per_s"] for s in mine if s["profile"] == "vgpu"],
        }
        limit = RATIO_LIMIT if client == "1000" else STOCK_RATIO_LIMIT
        # "at least" as a limit on the inverse
        targets.append(
            Target(
                f"default profile / vgpu pods/s, {client} clients, median round",
                round(1 / max(ratio, 1e-3), 2),
                round(1 / limit, 2),
                "x",
            )
        )
    checks = [s["checks"] for s in streams if "checks" in s]
    bad = {k: sum(c[k] for c in checks) for k in checks[0]} if checks else {}
    targets += [
        Target("cards overcommitted", bad.get("overcommitted_cards", 0), 0, "cards"),
        Target(
            "pods on a card not of their node, or bound without an assignment",
            bad.get("cards_not_on_the_pods_node", 0) + bad.get("bound_without_assignment", 0),
            0,
            "pods",
        ),
        Target(
            "pods Pending though a card fits", bad.get("pending_though_a_card_fits", 0), 0, "pods"
        ),
        Target("extender RSS, peak", round(peak_rss, 1), RSS_LIMIT_MIB, "MiB"),
    ]
    ext_cpu = [s["cpu_ms_per_pod"].get("extender", 0.0) for s in streams if s["profile"] == "vgpu"]
    return {
        "kind": "real components (../shared/realk8s: kube-apiserver, kube-scheduler v1.36.2)",
        "machine": machine(),
        "nodes": nodes,
        "cards": nodes * CARDS_PER_NODE,
        "pods": pods,
        "rounds": rounds,
        "by_client": by,
        "extender_rss_mib": {"synced_idle": round(idle_rss, 1), "peak": round(peak_rss, 1)},
        "extender_cpu_ms_per_pod": {"min": min(ext_cpu, default=0), "max": max(ext_cpu, default=0)},
        "checks": bad,
        "streams": list(streams),
        "seconds": round(time.monotonic() - started, 1),
        "targets": [t.to_json() for t in targets],
    }


# ------------------------------------------------------------------ printing


def render(result: Json) -> str:
    out = [
        f"{result['kind']}: {result['nodes']} nodes x {CARDS_PER_NODE} cards, "
        f"{result['pods']} pods, {result['rounds']} round(s)"
    ]
    out.append(
        "  round  client  profile  pods/s  bound  load(1m)  "
        "CPU ms/pod: extender sched apiserver etcd"
    )
    for s in result["streams"]:
        cpu = s["cpu_ms_per_pod"]
        out.append(
            f"  {s['round']:<5}  {s['client']:<6}  {s['profile']:<7}  {s['pods_per_s']:>6}  "
            f"{s['bound']:>5}  {s['load_avg'][0]:>8}  "
            f"{cpu.get('extender', '-')!s:>8} {cpu.get('kube-scheduler', '-')!s:>5} "
            f"{cpu.get('kube-apiserver', '-')!s:>9} {cpu.get('etcd', '-')!s:>4}"
        )
    for client, row in result["by_client"].items():
        out.append(
            f"  {client} clients: ratio per round {row['ratios']}, median {row['median_ratio']}"
        )
    rss = result["extender_rss_mib"]
    out.append(f"  extender RSS: {rss['synced_idle']} MiB synced, {rss['peak']} MiB peak")
    for t in result["targets"]:
        verdict = "PASS" if t["passed"] else "MISS"
        out.append(f"  [{verdict}] {t['name']}: {t['value']} {t['unit']} (target <= {t['limit']})")
    return "\n".join(out)


def stand_in(nodes: int, pods: int, rounds: int, node_choice: str | None) -> Json:
    """The same scenario on the in-repo stand-ins (bench/fastpath.py's extender stream)."""
    from bench import fastpath

    out = fastpath.extender(nodes, pods, node_choice=node_choice or "extender", rounds=rounds)
    return {"kind": "stand-ins (vgpu.sim scheduler stand-in and fake API server)", **out}


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench extender", description=__doc__.split("\n\n")[0]
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--real", action="store_true", help="on ../shared/realk8s")
    where.add_argument("--stand-in", action="store_true", help="on the in-repo stand-ins")
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--clients",
        nargs="+",
        choices=list(CLIENTS),
        default=list(CLIENTS),
        help="client settings for both profiles (real only): 1000 QPS, or the defaults",
    )
    parser.add_argument("--node-choice", choices=("extender", "scheduler"), default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    parser.add_argument(
        "--py-spy", type=Path, default=None, metavar="DIR", help="profile the extender (py-spy)"
    )
    parser.add_argument(
        "--extender-tree",
        type=Path,
        default=None,
        metavar="DIR",
        help="run the extender from the vgpu package under DIR (e.g. `git archive` of a "
        "commit): a before-and-after, one run each",
    )
    args = parser.parse_args(list(argv))
    if args.real:
        result = run(
            args.nodes,
            args.pods,
            args.rounds,
            args.clients,
            node_choice=args.node_choice,
            profile_dir=args.py_spy,
            tree=args.extender_tree,
        )
        print(render(result))
    else:
        result = stand_in(args.nodes, args.pods, args.rounds, args.node_choice)
        print(json.dumps({k: v for k, v in result.items() if k != "targets"}, indent=1))
        for t in result["targets"]:
            verdict = "PASS" if t["passed"] else "MISS"
            print(f"[{verdict}] {t['name']}: {t['value']} {t['unit']} (target <= {t['limit']})")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0
