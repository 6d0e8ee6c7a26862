"""Node admission under the REAL kubelet device manager (issue 30, item 1).

`dmharness` from ``../shared/realk8s`` runs the unmodified device manager,
topology manager and admit handler of Kubernetes 1.32.10 against the plugins
registering in a directory of our own (it never touches the kit's node). Per
round, three plugins take turns, each with a fresh directory, a fresh
harness and the same scenario: ``pods`` one-container pods asking
``vcuda-core: 5`` and ``vcuda-memory: 4``, admitted one after the other.

* ``vgpu``: ``vgpu serve`` on mock GPUs (a subprocess, metrics on, as the
  chart runs it), its pod cache on the fake API server, where the same pods
  are bound to the node before the harness starts (as the kubelet learns of
  a pod from the API server). The harness serves no pod-resources API: the
  daemon's reconcile after an Allocate fails at once here.
* ``null``: the project's do-nothing Python plugin (`vgpu.sim.nullplugin`,
  a subprocess, one server per resource), advertising the very IDs vgpu
  advertises, so every request and answer has the same size.
* ``go``: the kit's do-nothing Go plugin (``sampleplugin --preferred``), the
  floor; its IDs are of the same count, but longer.

Each figure is the harness's own: ``admit_ms`` per pod (the kubelet's whole
admit-handler loop: GetPreferredAllocation and Allocate per resource, and the
checkpoint write), and each RPC's time from its pass-through in the device
manager. The first admission after the plugin started is in the sample. The
ratios are taken within one round (plugins seconds apart, so the machine's
load hits all three); the targets read the median round.

    export REALK8S_HOME=$(../shared/realk8s/unpack.sh)   # once per machine
    python -m bench.realnode [--pods 40] [--rounds 3]     # or: python -m bench --only realnode
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import Json, Target, percentile
from vgpu.adapters.gpus import preset_cards
from vgpu.core.model import Resource
from vgpu.core.slicing import card_device_ids
from vgpu.sim.apiserver import FakeApiServer, make_node, make_pod
from vgpu.sim.cluster import free_port
from vgpu.sim.harness import wait_until

GPUS = "preset:2xH200"
UNIT_MIB = 256
DOMAIN = "vendor.io"
CORE, MEM = f"{DOMAIN}/vcuda-core", f"{DOMAIN}/vcuda-memory"
NODE = "realnode-bench"
POD_CORE, POD_MEM = 5, 4
PLUGINS = ("vgpu", "null", "go")
PHASES = ("Allocate", "GetPreferredAllocation")
P50_LIMIT, P99_LIMIT, CALL_LIMIT = 1.3, 1.5, 1.5
HARNESS_TIMEOUT_S = 180.0


def kit_home() -> Path:
    return Path(os.environ.get("REALK8S_HOME", "/var/tmp/realk8s"))


def kit_missing() -> str | None:
    """Why the kit's binaries cannot be used, or None."""
    for name in ("dmharness", "sampleplugin"):
        binary = kit_home() / "bin" / name
        if not os.access(binary, os.X_OK):
            return (
                f"{binary} not found: run `export REALK8S_HOME=$(../shared/realk8s/unpack.sh)` "
                "first (the real kubelet harness is not in CI)"
            )
    return None


def advertised_ids(gpus: str = GPUS) -> dict[str, list[str]]:
    """The IDs vgpu advertises for these mock cards (short IDs, card order)."""
    cards = sorted(preset_cards(gpus), key=lambda c: c.index)
    return {
        name: [d for c in cards for d in card_device_ids(c, resource, UNIT_MIB)]
        for name, resource in ((CORE, Resource.CORE), (MEM, Resource.MEMORY))
    }


# ------------------------------------------------------------------------ plugins


class _Plugin:
    """One plugin (one or two processes) in its socket directory."""

    def __init__(self, kind: str, root: Path) -> None:
        self.kind = kind
        self.root = root
        self.sockets = root / "dp"
        self.sockets.mkdir()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Any] = []
        self.api: FakeApiServer | None = None
        self.uids: list[str] = []
        self.metrics_port = free_port()

    def server_side_ms(self) -> Json:
        """vgpu's own time per call (its vgpu_call_duration_seconds histogram),
        mean ms by method: what the harness's figure spends inside the daemon."""
        if self.kind != "vgpu":
            return {}
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5
            ) as reply:
                text = reply.read().decode()
        except OSError:
            return {}
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}
        for line in text.splitlines():
            for suffix, into in (("_sum{", sums), ("_count{", counts)):
                head = f"vgpu_call_duration_seconds{suffix}"
                if line.startswith(head) and 'method="' in line:
                    method = line.split('method="', 1)[1].split('"', 1)[0]
                    into[method] = into.get(method, 0.0) + float(line.rsplit(" ", 1)[1])
        return {
            m: round(1000 * sums[m] / counts[m], 3) for m in sums if counts.get(m) and m in PHASES
        }

    def _spawn(self, argv: Sequence[str], name: str) -> None:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        env = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_")}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self.logs.append(log)
        self.procs.append(
            subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=env)
        )

    def start(self, pods: int, gpus: str) -> None:
        if self.kind == "vgpu":
            self._start_vgpu(pods, gpus)
        elif self.kind == "null":
            self._spawn(
                [sys.executable, "-m", "bench.realnode", "null", str(self.sockets), gpus], "null"
            )
        else:
            ids = advertised_ids(gpus)
            for name in (CORE, MEM):
                self._spawn(
                    [
                        str(kit_home() / "bin" / "sampleplugin"),
                        "--socket-dir",
                        str(self.sockets),
                        "--resource",
                        name,
                        "--count",
                        str(len(ids[name])),
                        "--preferred",
                        "--quiet",
                    ],
                    f"go-{name.rsplit('/', 1)[1]}",
                )
        # Serving before the harness starts, as a daemon that runs before its
        # kubelet (sampleplugin only serves once it sees kubelet.sock).
        want = {"vgpu": 2, "null": 2, "go": 0}[self.kind]
        if not wait_until(lambda: self._serving() >= want, 60.0, 0.05):
            raise RuntimeError(f"{self.kind} did not start serving; log:\n{self.log()[-3000:]}")

    def _serving(self) -> int:
        if any(p.poll() is not None for p in self.procs):
            raise RuntimeError(f"{self.kind} exited; log:\n{self.log()[-3000:]}")
        return sum(1 for p in self.sockets.iterdir() if p.is_socket())

    def _start_vgpu(self, pods: int, gpus: str) -> None:
        api = FakeApiServer(bookmark_interval_s=60.0)
        self.api = api
        api.start()
        api.add_node(make_node(NODE, labels={f"{DOMAIN}/vgpu": "true"}))
        limits = {CORE: str(POD_CORE), MEM: str(POD_MEM)}
        for i in range(pods):
            api.add_pod(
                make_pod(
                    f"p{i:03d}",
                    node=NODE,
                    containers=[{"name": "main", "resources": {"limits": limits}}],
                )
            )
            created = api.get_pod("default", f"p{i:03d}")
            assert created is not None
            self.uids.append(created["metadata"]["uid"])
        kubeconfig = self.root / "kubeconfig"
        api.write_kubeconfig(kubeconfig)
        # Serving requires the pod cache to have synced: both sockets appear together.
        self._spawn(
            [
                sys.executable,
                "-m",
                "vgpu",
                "serve",
                "--backend",
                "mock",
                "--mock-gpus",
                gpus,
                "--device-plugin-dir",
                str(self.sockets),
                "--pod-resources-socket",
                str(self.root / "no-pod-resources.sock"),
                "--state-dir",
                str(self.root / "state"),
                "--node-name",
                NODE,
                "--resource-domain",
                DOMAIN,
                "--kubeconfig",
                str(kubeconfig),
                "--metrics-address",
                f"127.0.0.1:{self.metrics_port}",
            ],
            "vgpu",
        )

    def log(self) -> str:
        return "".join(
            p.read_text(errors="replace") for p in sorted(self.root.glob("*.log")) if p.is_file()
        )

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()
        if self.api is not None:
            self.api.stop()


def _scenario(pods: int, uids: Sequence[str]) -> Json:
    limits = {CORE: POD_CORE, MEM: POD_MEM}
    steps: list[Json] = []
    for i in range(pods):
        pod: Json = {"name": f"p{i:03d}", "containers": [{"name": "main", "limits": limits}]}
        if uids:
            pod["uid"] = uids[i]
        steps.append({"op": "admit", "pod": pod, "expect": "admitted"})
    return {
        "resources": [CORE, MEM],
        "register_timeout": 30,
        "admit_timeout": 30,
        "node": {"name": NODE},
        "steps": steps,
    }


def _harness(plugin: _Plugin, pods: int) -> Json:
    scenario = plugin.root / "scenario.json"
    scenario.write_text(json.dumps(_scenario(pods, plugin.uids)))
    out = plugin.root / "harness.json"
    proc = subprocess.run(
        [
            str(kit_home() / "bin" / "dmharness"),
            "--socket-dir",
            str(plugin.sockets),
            "--scenario",
            str(scenario),
            "--out",
            str(out),
            "--quiet",
            "--no-events",
            "--v",
            "-1",
        ],
        capture_output=True,
        timeout=HARNESS_TIMEOUT_S,
        check=False,
    )
    if not out.exists():
        raise RuntimeError(
            f"dmharness wrote nothing (rc {proc.returncode}): {proc.stderr[-2000:]!r}"
        )
    document: Json = json.loads(out.read_text())
    return document


def _summary(document: Json) -> Json:
    """Per-pod admit times and per-RPC times (ms, in admission order)."""
    admit: list[float] = []
    kubelet: list[float] = []
    calls: dict[str, list[float]] = {"Allocate": [], "GetPreferredAllocation": []}
    failed: list[str] = []
    for step in document.get("steps", []):
        a = step.get("admit")
        if not a:
            continue
        if not a.get("admitted"):
            failed.append(f"{a.get('pod')}: {a.get('reason')} {a.get('message')}"[:300])
            continue
        admit.append(float(a["admit_ms"]))
        rpcs = [r for r in a.get("rpcs", []) if r.get("phase") == "admit"]
        for rpc in rpcs:
            if rpc.get("rpc") in calls:
                calls[rpc["rpc"]].append(float(rpc["ms"]))
        # The device manager's own time for the containers beside the RPCs
        # (mostly its checkpoint: rewritten, fsync'ed, after every allocation).
        allocate_ms = sum(float(c.get("allocate_ms", 0.0)) for c in a.get("containers", []))
        kubelet.append(allocate_ms - sum(float(r["ms"]) for r in rpcs))
    return {"admit_ms": admit, "kubelet_ms": kubelet, "calls_ms": calls, "failures": failed}


def _stats(values: Sequence[float]) -> Json:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "first_ms": round(values[0], 3),
        "p50_ms": round(percentile(values, 50), 3),
        "p99_ms": round(percentile(values, 99), 3),
        "max_ms": round(max(values), 3),
    }


def one(kind: str, pods: int = 40, gpus: str = GPUS) -> Json:
    """One plugin under one fresh harness: its summary, the harness's verdict."""
    root = Path(tempfile.mkdtemp(prefix=f"vgpu-rn-{kind}-", dir="/tmp"))
    plugin = _Plugin(kind, root)
    load = os.getloadavg()[0]
    try:
        plugin.start(pods, gpus)
        document = _harness(plugin, pods)
        server = plugin.server_side_ms()
    finally:
        plugin.stop()
    summary = _summary(document)
    out: Json = {
        "ok": bool(document.get("ok")),
        "harness_failures": [str(f)[:300] for f in document.get("failures", [])][:3],
        "admitted": len(summary["admit_ms"]),
        "failures": summary["failures"][:3],
        "load_1m": round(load, 2),
        "pod": _stats(summary["admit_ms"]),
        "kubelet_own": _stats(summary["kubelet_ms"]),
        "Allocate": _stats(summary["calls_ms"]["Allocate"]),
        "GetPreferredAllocation": _stats(summary["calls_ms"]["GetPreferredAllocation"]),
        "server_side_mean_ms": server,
        "registration_ms": {
            r: v.get("ms") for r, v in (document.get("registration") or {}).items()
        },
        "samples": summary,
    }
    if out["ok"] and out["admitted"] == pods:
        subprocess.run(["rm", "-rf", str(root)], check=False)
    else:
        out["kept"] = str(root)
    return out


def _ratio(a: Json, b: Json, key: str) -> float:
    if not a.get("n") or not b.get("n") or not b[key]:
        return float("inf")
    return round(float(a[key]) / float(b[key]), 2)


def round_ratios(results: Json) -> Json:
    v, n = results["vgpu"], results["null"]
    return {
        "pod_p50": _ratio(v["pod"], n["pod"], "p50_ms"),
        "pod_p99": _ratio(v["pod"], n["pod"], "p99_ms"),
        "pod_first": _ratio(v["pod"], n["pod"], "first_ms"),
        "allocate_p50": _ratio(v["Allocate"], n["Allocate"], "p50_ms"),
        "allocate_p99": _ratio(v["Allocate"], n["Allocate"], "p99_ms"),
        "preferred_p50": _ratio(v["GetPreferredAllocation"], n["GetPreferredAllocation"], "p50_ms"),
        "preferred_p99": _ratio(v["GetPreferredAllocation"], n["GetPreferredAllocation"], "p99_ms"),
    }


def run(pods: int = 40, rounds: int = 3, gpus: str = GPUS, keep_samples: bool = False) -> Json:
    missing = kit_missing()
    if missing is not None:
        return {"available": False, "reason": missing}
    per_round: list[Json] = []
    for r in range(rounds):
        order = PLUGINS[r % len(PLUGINS) :] + PLUGINS[: r % len(PLUGINS)]
        results = {kind: one(kind, pods, gpus) for kind in order}
        if not keep_samples:
            for result in results.values():
                result.pop("samples", None)
        per_round.append({"order": list(order), **results, "ratios": round_ratios(results)})
    keys = list(per_round[0]["ratios"])
    ranges = {
        k: [min(r["ratios"][k] for r in per_round), max(r["ratios"][k] for r in per_round)]
        for k in keys
    }
    middle = sorted(range(rounds), key=lambda i: per_round[i]["ratios"]["pod_p50"])[rounds // 2]
    median = per_round[middle]["ratios"]
    failures = sum(
        1 for r in per_round for k in PLUGINS if not r[k]["ok"] or r[k]["admitted"] != pods
    )
    targets = [
        Target("real kubelet: pod admission p50 vs null plugin", median["pod_p50"], P50_LIMIT, "x"),
        Target("real kubelet: pod admission p99 vs null plugin", median["pod_p99"], P99_LIMIT, "x"),
        Target(
            "real kubelet: Allocate p50 vs null plugin", median["allocate_p50"], CALL_LIMIT, "x"
        ),
        Target(
            "real kubelet: GetPreferredAllocation p50 vs null plugin",
            median["preferred_p50"],
            CALL_LIMIT,
            "x",
        ),
        Target("real kubelet: runs with a failed admission", failures, 0, "runs"),
    ]
    return {
        "available": True,
        "harness": "dmharness (kubelet device manager 1.32.10)",
        "gpus": gpus,
        "pods": pods,
        "pod_limits": {CORE: POD_CORE, MEM: POD_MEM},
        "rounds": per_round,
        "median_round": middle,
        "ratio_ranges": ranges,
        "targets": [t.to_json() for t in targets],
    }


# ---------------------------------------------------------- the null plugin process


def serve_null(sockets: Path, gpus: str) -> None:
    """Both resources from the do-nothing Python plugin, with vgpu's very IDs,
    until SIGTERM (a subprocess of the bench, as vgpu is)."""
    from vgpu.sim.nullplugin import NullDevicePlugin

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    plugins = []
    for name, ids in advertised_ids(gpus).items():
        plugin = NullDevicePlugin(
            sockets,
            name,
            0,
            f"null-{name.rsplit('-', 1)[1]}.sock",
            watch=True,
            workers=8,  # as vgpu's servers
        )
        plugin.set_devices(dict.fromkeys(ids, "Healthy"))
        plugin.start()
        plugins.append(plugin)
    stop.wait()
    for plugin in plugins:
        plugin.stop()


def _print(result: Json) -> None:
    if not result.get("available"):
        print(f"not available: {result.get('reason')}")
        return
    for i, r in enumerate(result["rounds"]):
        print(f"round {i + 1} (order {', '.join(r['order'])}):")
        print(f"  {'':28}{'vgpu':>16}{'null':>16}{'go':>16}{'vgpu/null':>11}")
        for label, part, key in (
            ("pod admission first (ms)", "pod", "first_ms"),
            ("pod admission p50 (ms)", "pod", "p50_ms"),
            ("pod admission p99 (ms)", "pod", "p99_ms"),
            ("Allocate p50 (ms)", "Allocate", "p50_ms"),
            ("Allocate p99 (ms)", "Allocate", "p99_ms"),
            ("GetPreferred p50 (ms)", "GetPreferredAllocation", "p50_ms"),
            ("GetPreferred p99 (ms)", "GetPreferredAllocation", "p99_ms"),
            ("kubelet's own p50 (ms)", "kubelet_own", "p50_ms"),
        ):
            cells = [f"{r[k][part].get(key, float('nan')):>16.3f}" for k in PLUGINS]
            print(
                f"  {label:28}{''.join(cells)}{_ratio(r['vgpu'][part], r['null'][part], key):>11}"
            )
        inside = r["vgpu"].get("server_side_mean_ms") or {}
        if inside:
            print(
                "  inside vgpu (mean ms, its own histogram): "
                + ", ".join(f"{m} {v}" for m, v in inside.items())
            )
        loads = ", ".join(f"{k} {r[k]['load_1m']}" for k in PLUGINS)
        print(f"  load (1 min) at start: {loads}")
    for t in result["targets"]:
        verdict = "PASS" if t["passed"] else "MISS"
        print(f"[{verdict}] {t['name']}: {t['value']} {t['unit']} (target <= {t['limit']})")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["null"]:  # the null plugin's process: null SOCKET_DIR GPUS
        serve_null(Path(argv[1]), argv[2] if len(argv) > 2 else GPUS)
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.realnode", description=__doc__)
    parser.add_argument("--pods", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpus", default=GPUS)
    parser.add_argument("--only", choices=PLUGINS, help="one plugin, one run (profiling)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.only:
        result: Json = one(args.only, args.pods, args.gpus)
    else:
        result = run(args.pods, args.rounds, args.gpus, keep_samples=args.out is not None)
        _print(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    elif args.only:
        result.pop("samples", None)
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
