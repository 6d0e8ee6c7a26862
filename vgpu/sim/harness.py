"""A whole simulated node: kubelet simulator + fake API server + the real
vgpu daemon as a subprocess, talking over real gRPC and real HTTP.

Several SimNodes may share one FakeApiServer (a simulated cluster): pass it
as `api`; each node then registers its Node object there. With
`auto_admit()` the node's kubelet simulator admits, like a kubelet, every
pod the API server binds to its node.

Used by `vgpu demo`, the integration tests and the benchmarks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vgpu.sim.apiserver import FakeApiServer, make_node, make_pod
from vgpu.sim.kubelet import Admission, KubeletSimulator, SimContainer, SimPod

Requests = Mapping[str, int]


class SimNode:
    def __init__(
        self,
        root: Path | None = None,
        *,
        gpus: str | Path = "preset:2xH200",
        node: str = "sim-node",
        domain: str = "vendor.io",
        api: bool | FakeApiServer = True,
        seed: int | None = 0,
        daemon_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.root = root or Path(tempfile.mkdtemp(prefix="vgpu-", dir="/tmp"))
        self.gpus = str(gpus)
        self.node = node
        self.domain = domain
        self.core = f"{domain}/vcuda-core"
        self.memory = f"{domain}/vcuda-memory"
        self.plugin_dir = self.root / "dp"
        self.podres_socket = self.root / "pr.sock"
        self.state_dir = self.root / "state"
        self.kubeconfig = self.root / "kubeconfig"
        self.log_path = self.root / "daemon.log"
        # Bookmarks about once a minute, as a real API server sends them.
        self._owns_api = api is True
        self.api: FakeApiServer | None = (
            api
            if isinstance(api, FakeApiServer)
            else (FakeApiServer(bookmark_interval_s=60.0) if api else None)
        )
        self.kubelet = KubeletSimulator(self.plugin_dir, self.podres_socket, seed=seed)
        self.daemon_args = list(daemon_args)
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_fh: Any = None
        self.admissions: dict[str, Admission] = {}  # pod uid -> what auto_admit got
        self._admit_stop = threading.Event()
        self._admit_thread: threading.Thread | None = None
        self._running_after_s = 0.0

    # --------------------------------------------------------- lifecycle

    def start(self, timeout_s: float = 20.0) -> None:
        if self.api is not None:
            if self._owns_api:
                self.api.start()
            self.api.write_kubeconfig(self.kubeconfig)
            if self.api.get_node(self.node) is None:
                self.api.add_node(make_node(self.node, labels={f"{self.domain}/vgpu": "true"}))
        self.kubelet.start()
        self.start_daemon(timeout_s=timeout_s)
        self.publish_allocatable()

    def publish_allocatable(self) -> None:
        """Write the node's allocatable (healthy device counts) to its Node, as the kubelet
        does; the scheduler's node-total check reads it."""
        if self.api is None:
            return
        counts = {
            r: str(sum(1 for h in self.kubelet.devices(r).values() if h == "Healthy"))
            for r in (self.core, self.memory)
        }

        def mutate(node: dict[str, Any]) -> None:
            status = node.setdefault("status", {})
            status["capacity"] = dict(counts)
            status["allocatable"] = dict(counts)

        self.api.update_node(self.node, mutate)

    def daemon_command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "vgpu",
            "serve",
            "--backend",
            "mock",
            "--mock-gpus",
            self.gpus,
            "--device-plugin-dir",
            str(self.plugin_dir),
            "--pod-resources-socket",
            str(self.podres_socket),
            "--state-dir",
            str(self.state_dir),
            "--node-name",
            self.node,
            "--resource-domain",
            self.domain,
        ]
        if self.api is not None:
            cmd += ["--kubeconfig", str(self.kubeconfig)]
        return cmd + self.daemon_args

    def start_daemon(self, wait: bool = True, timeout_s: float = 20.0) -> None:
        """Start `vgpu serve`; with `wait`, return once it registered both resources
        and the kubelet got a fresh device list from each (so devices a previous
        run left Unhealthy are current again)."""
        before = self.registrations()
        messages = {r: self.kubelet.stream_messages(r) for r in (self.core, self.memory)}
        env = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_")}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        env.update(self.env)
        self._log_fh = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop_daemon
        self.proc = subprocess.Popen(
            self.daemon_command(), stdout=self._log_fh, stderr=subprocess.STDOUT, env=env
        )
        if wait and not self.kubelet.wait_for(
            lambda: (
                self.registrations() > before
                and all(self.kubelet.stream_messages(r) > n for r, n in messages.items())
                and self.kubelet.capacity(self.core) > 0
                and self.kubelet.capacity(self.memory) > 0
            ),
            timeout_s,
        ):
            raise RuntimeError(f"vgpu did not register in {timeout_s}s; log:\n{self.log()}")

    def registrations(self) -> int:
        return min(self.kubelet.registrations(self.core), self.kubelet.registrations(self.memory))

    def stop_daemon(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int | None:
        proc, self.proc = self.proc, None
        log_fh, self._log_fh = self._log_fh, None
        return stop_process(proc, log_fh, sig, timeout_s)

    def kill_daemon(self) -> None:
        self.stop_daemon(signal.SIGKILL)

    def close(self) -> None:
        self.stop_auto_admit()
        self.stop_daemon()
        self.kubelet.stop()
        if self.api is not None and self._owns_api:
            self.api.stop()

    def __enter__(self) -> SimNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # -------------------------------------------------------------- pods

    def pod(
        self,
        name: str,
        containers: Mapping[str, Requests] | Requests,
        init: Mapping[str, Requests] | None = None,
        namespace: str = "default",
    ) -> SimPod:
        """A pod; `containers` maps container name -> requests, or is one container's requests."""
        named: Mapping[str, Any] = containers
        if containers and all(isinstance(v, int) for v in containers.values()):
            named = {"main": containers}
        apps = [SimContainer(n, dict(r)) for n, r in named.items()]
        inits = [SimContainer(n, dict(r)) for n, r in (init or {}).items()]
        return SimPod.new(name, apps, inits, namespace=namespace)

    def _api_pod(self, pod: SimPod) -> dict[str, Any]:
        def spec(c: SimContainer) -> dict[str, Any]:
            limits = {k: str(v) for k, v in c.requests.items()}
            return {"name": c.name, "resources": {"limits": limits, "requests": limits}}

        return make_pod(
            pod.name,
            node=self.node,
            namespace=pod.namespace,
            containers=[spec(c) for c in pod.containers],
            init_containers=[spec(c) for c in pod.init_containers] or None,
        )

    def create(self, pod: SimPod) -> None:
        """The pod is bound to this node (the API server knows it)."""
        if self.api is not None:
            self.api.add_pod(self._api_pod(pod))

    def admit(self, pod: SimPod, order: Sequence[str] | None = None) -> Admission:
        """The kubelet admits the pod; a failed admission marks it Failed, like the kubelet."""
        result = self.kubelet.admit(pod, order)
        if not result.ok and self.api is not None:
            with contextlib.suppress(Exception):
                self.api.set_pod_phase(pod.namespace, pod.name, "Failed")
        return result

    def submit(self, pod: SimPod, order: Sequence[str] | None = None) -> Admission:
        self.create(pod)
        return self.admit(pod, order)

    def delete(self, pod: SimPod) -> None:
        if self.api is not None:
            with contextlib.suppress(Exception):
                self.api.delete_pod(pod.namespace, pod.name)
        self.kubelet.remove_pod(pod.uid)

    def finish(self, pod: SimPod, phase: str = "Succeeded") -> None:
        if self.api is not None:
            with contextlib.suppress(Exception):
                self.api.set_pod_phase(pod.namespace, pod.name, phase)
        self.kubelet.remove_pod(pod.uid)

    def wait(
        self, predicate: Callable[[], bool], timeout_s: float = 10.0, interval_s: float = 0.05
    ) -> bool:
        return wait_until(predicate, timeout_s, interval_s)

    # ------------------------------------------------------- auto-admit

    def auto_admit(self, running_after_s: float = 0.0) -> None:
        """Admit every pod the API server binds to this node, one at a time in creation
        order, like the kubelet: a pod admitted turns Running (`running_after_s` later,
        as a real node starts its containers; Pending until then), one refused turns
        Failed (UnexpectedAdmissionError); a pod deleted or finished frees its devices."""
        if self.api is None or self._admit_thread is not None:
            return
        self._running_after_s = running_after_s
        self._admit_stop.clear()
        self._admit_thread = threading.Thread(
            target=self._admit_loop, name=f"sim-kubelet-{self.node}", daemon=True
        )
        self._admit_thread.start()

    def stop_auto_admit(self) -> None:
        thread, self._admit_thread = self._admit_thread, None
        if thread is not None:
            self._admit_stop.set()
            thread.join(5.0)

    def _admit_loop(self) -> None:
        assert self.api is not None
        seen = 0
        while not self._admit_stop.is_set():
            seen = self.api.wait_for_change(seen, 0.2)
            mine = [
                p for p in self.api.pods() if (p.get("spec") or {}).get("nodeName") == self.node
            ]
            active = {
                p["metadata"]["uid"]
                for p in mine
                if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            }
            for uid in [u for u in self.admissions if u not in active]:
                self.kubelet.remove_pod(uid)
                self.admissions.pop(uid, None)
            new = [
                p
                for p in mine
                if p["metadata"]["uid"] in active
                and p["metadata"]["uid"] not in self.admissions
                and (p.get("status") or {}).get("phase") == "Pending"
            ]
            # In the order they were bound here (a pod's resourceVersion until it is
            # admitted), as the kubelet's watch delivers them one by one.
            new.sort(key=lambda p: int(p["metadata"]["resourceVersion"]))
            for pod in new:
                if self._admit_stop.is_set():
                    return
                # Like the kubelet, skip a pod deleted or finished since it arrived.
                now = self.api.get_pod(pod["metadata"]["namespace"], pod["metadata"]["name"])
                if now is None or now["metadata"]["uid"] != pod["metadata"]["uid"]:
                    continue
                if (now.get("status") or {}).get("phase") != "Pending":
                    continue
                self._admit_api_pod(now)

    def _admit_api_pod(self, pod: dict[str, Any]) -> None:
        assert self.api is not None
        meta, spec = pod["metadata"], pod.get("spec") or {}

        def sim(c: dict[str, Any]) -> SimContainer:
            limits = (c.get("resources") or {}).get("limits") or {}
            asked = {r: int(str(limits[r])) for r in (self.core, self.memory) if r in limits}
            return SimContainer(c["name"], {r: n for r, n in asked.items() if n})

        sim_pod = SimPod.new(
            meta["name"],
            [sim(c) for c in spec.get("containers") or []],
            [sim(c) for c in spec.get("initContainers") or []],
            namespace=meta["namespace"],
            uid=meta["uid"],
        )
        result = self.kubelet.admit(sim_pod)
        self.admissions[meta["uid"]] = result

        uid = meta["uid"]

        def mutate(obj: dict[str, Any]) -> None:
            status = obj.setdefault("status", {})
            if obj["metadata"]["uid"] != uid or status.get("phase") != "Pending":
                return  # replaced, deleted or finished meanwhile
            if result.ok:
                status["phase"] = "Running"
            else:
                status.update(
                    phase="Failed", reason="UnexpectedAdmissionError", message=result.error
                )

        def update() -> None:
            assert self.api is not None
            with contextlib.suppress(KeyError):  # deleted meanwhile
                self.api.update_pod(meta["namespace"], meta["name"], mutate)

        if result.ok and self._running_after_s > 0:
            timer = threading.Timer(self._running_after_s, update)
            timer.daemon = True
            timer.start()
        else:
            update()


def stop_process(
    proc: subprocess.Popen[bytes] | None, log_fh: Any, sig: int, timeout_s: float
) -> int | None:
    """Signal a child, wait for it (kill it after `timeout_s`), close its log; its exit code."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    if log_fh is not None:
        log_fh.close()
    return rc


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.02) -> bool:
    """Poll `predicate` until it holds or the deadline passes (tests, demo, bench)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())
