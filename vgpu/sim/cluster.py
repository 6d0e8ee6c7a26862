"""A simulated cluster: one fake API server, several SimNodes (each the real
`vgpu serve` with its kubelet simulator admitting the pods bound to it), the
real `vgpu extender` as a subprocess, and the kube-scheduler stand-in
calling it over HTTP. Used by `vgpu demo --cluster`, the tests and bench/.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vgpu.sim.apiserver import FakeApiServer, make_pod
from vgpu.sim.harness import SimNode, stop_process, wait_until
from vgpu.sim.scheduler import SchedulerStandIn

SCHEDULER_NAME = "vgpu-scheduler"
Requests = Mapping[str, int]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def extender_command(kubeconfig: Path, port: int, *args: str) -> list[str]:
    """`vgpu extender` on 127.0.0.1:`port` against the API server of `kubeconfig`."""
    return [
        sys.executable,
        "-m",
        "vgpu",
        "extender",
        "--kubeconfig",
        str(kubeconfig),
        "--listen",
        f"127.0.0.1:{port}",
        *args,
    ]


class SimCluster:
    def __init__(
        self,
        nodes: Mapping[str, str],
        root: Path | None = None,
        *,
        domain: str = "vendor.io",
        daemon_args: Sequence[str] = (),
        extender_args: Sequence[str] = (),
        scheduler: Mapping[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        """`nodes` maps node name -> mock GPUs (e.g. "preset:2xH200" or a file)."""
        self.root = root or Path(tempfile.mkdtemp(prefix="vgpu-cl-", dir="/tmp"))
        self.domain = domain
        self.core = f"{domain}/vcuda-core"
        self.memory = f"{domain}/vcuda-memory"
        self.api = FakeApiServer(bookmark_interval_s=60.0)
        self.kubeconfig = self.root / "kubeconfig"
        self.nodes = {
            name: SimNode(
                self.root / f"n{i}",
                gpus=gpus,
                node=name,
                domain=domain,
                api=self.api,
                seed=seed + i,
                daemon_args=[*daemon_args, "--reconcile-interval-s", "1"],
            )
            for i, (name, gpus) in enumerate(nodes.items())
        }
        for node in self.nodes.values():
            node.root.mkdir(parents=True, exist_ok=True)
        self.extender_port = free_port()
        self.extender_args = list(extender_args)
        self.extender_log = self.root / "extender.log"
        self.extender: subprocess.Popen[bytes] | None = None
        self._extender_fh: Any = None
        self.scheduler = SchedulerStandIn(
            self.api,
            self.extender_url,
            scheduler_name=SCHEDULER_NAME,
            managed_resources=(self.core, self.memory),
            seed=seed,
            **dict(scheduler or {}),
        )

    @property
    def extender_url(self) -> str:
        return f"http://127.0.0.1:{self.extender_port}"

    # ---------------------------------------------------------- lifecycle

    def start(self, timeout_s: float = 30.0) -> None:
        """Start everything; on any failure, stop what was started (no daemon
        is left running behind a failed test) and raise."""
        try:
            self._start(timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self, timeout_s: float) -> None:
        self.api.start()
        self.api.write_kubeconfig(self.kubeconfig)
        for node in self.nodes.values():
            node.start(timeout_s=timeout_s)
            node.auto_admit()
        key = f"{self.domain}/vgpu-node"
        if not wait_until(
            lambda: all(
                key in ((self.api.get_node(n) or {}).get("metadata", {}).get("annotations") or {})
                for n in self.nodes
            ),
            timeout_s,
        ):
            raise RuntimeError("the node daemons did not publish their inventory")
        self.start_extender(timeout_s=timeout_s)
        self.scheduler.start()

    def extender_command(self) -> list[str]:
        return extender_command(
            self.kubeconfig,
            self.extender_port,
            "--resource-domain",
            self.domain,
            *self.extender_args,
        )

    def start_extender(self, wait: bool = True, timeout_s: float = 30.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_")}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self._extender_fh = open(self.extender_log, "ab")  # noqa: SIM115 - closed at stop
        self.extender = subprocess.Popen(
            self.extender_command(), stdout=self._extender_fh, stderr=subprocess.STDOUT, env=env
        )
        proc = self.extender
        if wait and not (
            wait_until(lambda: proc.poll() is not None or self.extender_ready(), timeout_s, 0.05)
            and proc.poll() is None
        ):
            raise RuntimeError(f"the extender did not get ready; log:\n{self.extender_text()}")

    def extender_ready(self) -> bool:
        return self.get("/readyz")[0] == 200

    def get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.extender_port, timeout=5)
        try:
            conn.request("GET", path)
            reply = conn.getresponse()
            return reply.status, reply.read()
        except OSError:
            return 0, b""
        finally:
            conn.close()

    def stop_extender(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int | None:
        proc, self.extender = self.extender, None
        log_fh, self._extender_fh = self._extender_fh, None
        return stop_process(proc, log_fh, sig, timeout_s)

    def extender_text(self) -> str:
        try:
            return self.extender_log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.scheduler.stop()
        self.stop_extender()
        for node in self.nodes.values():
            node.close()
        self.api.stop()

    def __enter__(self) -> SimCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- pods

    def pod(
        self,
        name: str,
        containers: Mapping[str, Requests] | Requests,
        *,
        init: Mapping[str, Requests] | None = None,
        node: str | None = None,
        namespace: str = "default",
        created: str | None = None,
    ) -> dict[str, Any]:
        """Create a pod: for the vgpu scheduler, or (with `node`) bound directly, as the
        default scheduler would bind it."""
        named: Mapping[str, Any] = containers
        if containers and all(isinstance(v, int) for v in containers.values()):
            named = {"main": containers}

        def spec(cname: str, requests: Requests) -> dict[str, Any]:
            limits = {k: str(v) for k, v in requests.items() if v}
            return {"name": cname, "resources": {"limits": limits, "requests": limits}}

        return self.api.add_pod(
            make_pod(
                name,
                node=node,
                namespace=namespace,
                containers=[spec(n, r) for n, r in named.items()],
                init_containers=[spec(n, r) for n, r in (init or {}).items()] or None,
                scheduler_name=None if node else SCHEDULER_NAME,
                creation_timestamp=created,
            )
        )

    def get_pod(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        return self.api.get_pod(namespace, name)

    def phase(self, name: str, namespace: str = "default") -> str:
        pod = self.get_pod(name, namespace)
        return str(((pod or {}).get("status") or {}).get("phase", "")) if pod else "Deleted"

    def condition(self, name: str, namespace: str = "default") -> str:
        """The PodScheduled condition's message ('' if none)."""
        pod = self.get_pod(name, namespace) or {}
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled":
                return str(cond.get("message", ""))
        return ""

    def wait(self, predicate: Callable[[], bool], timeout_s: float = 20.0) -> bool:
        return wait_until(predicate, timeout_s, 0.05)

    def delete(self, name: str, namespace: str = "default") -> None:
        with contextlib.suppress(KeyError):
            self.api.delete_pod(namespace, name)
