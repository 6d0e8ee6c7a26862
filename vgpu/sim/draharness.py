"""A whole simulated DRA node: the fake API server, the DRA kubelet stand-in,
the scheduler stand-in and the real vgpu daemon (`vgpu serve --mode dra`) as a
subprocess, over real gRPC and real HTTP.

Used by `vgpu demo --dra`, the DRA integration tests and bench/dra.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vgpu.pb import dra_v1_pb2 as pb
from vgpu.sim.allocator import Allocator, claim_body, device_class_body
from vgpu.sim.apiserver import FakeApiServer, make_pod
from vgpu.sim.drakubelet import CdiEdits, DraKubelet
from vgpu.sim.harness import wait_until

__all__ = ["DraSimNode", "PodRun"]


@dataclass
class PodRun:
    """One pod's claims, as the kubelet prepared them."""

    name: str
    namespace: str
    uid: str
    claims: list[tuple[str, str, str]]  # (namespace, uid, name)
    reply: pb.NodePrepareResourcesResponse
    edits: dict[str, CdiEdits]  # claim name -> what its CDI devices give a container

    def error(self, claim: str) -> str:
        uid = next(u for _, u, n in self.claims if n == claim)
        return self.reply.claims[uid].error

    @property
    def ok(self) -> bool:
        return all(not r.error for r in self.reply.claims.values())


class DraSimNode:
    def __init__(
        self,
        root: Path | None = None,
        *,
        gpus: str | Path = "preset:2xH200",
        node: str = "sim-node",
        domain: str = "vendor.io",
        daemon_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        wipe_delay_s: float | None = 30.0,
    ) -> None:
        self.root = root or Path(tempfile.mkdtemp(prefix="vgpu-dra-", dir="/tmp"))
        self.gpus = str(gpus)
        self.node = node
        self.domain = domain
        self.driver = f"vgpu.{domain}"
        self.registry_dir = self.root / "reg"
        self.plugin_dir = self.root / "plug"
        self.cdi_dir = self.root / "cdi"
        self.state_dir = self.root / "state"
        self.kubeconfig = self.root / "kubeconfig"
        self.log_path = self.root / "daemon.log"
        self.api = FakeApiServer(bookmark_interval_s=60.0)
        self.kubelet = DraKubelet(
            self.registry_dir, self.cdi_dir, api=self.api, node=node, wipe_delay_s=wipe_delay_s
        )
        self.daemon_args = list(daemon_args)
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_fh: Any = None
        self._allocator: Allocator | None = None

    @property
    def allocator(self) -> Allocator:
        if self._allocator is None:
            self._allocator = Allocator(self.api)
        return self._allocator

    # --------------------------------------------------------- lifecycle

    def start(self, timeout_s: float = 20.0) -> None:
        self.api.start()
        self.api.write_kubeconfig(self.kubeconfig)
        self.api.add_object("deviceclasses", device_class_body(self.driver))
        self.kubelet.start()
        self.start_daemon(timeout_s=timeout_s)

    def daemon_command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vgpu",
            "serve",
            "--mode",
            "dra",
            "--backend",
            "mock",
            "--mock-gpus",
            self.gpus,
            "--kubelet-registry-dir",
            str(self.registry_dir),
            "--kubelet-plugin-dir",
            str(self.plugin_dir),
            "--cdi-dir",
            str(self.cdi_dir),
            "--state-dir",
            str(self.state_dir),
            "--node-name",
            self.node,
            "--resource-domain",
            self.domain,
            "--kubeconfig",
            str(self.kubeconfig),
            *self.daemon_args,
        ]

    def start_daemon(self, wait: bool = True, timeout_s: float = 20.0) -> None:
        """Start the DRA driver; with `wait`, return once the kubelet registered it
        and its ResourceSlice is published."""
        before = self.kubelet.registrations(self.driver)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VGPU_")}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        env.update(self.env)
        self._log_fh = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop_daemon
        self.proc = subprocess.Popen(
            self.daemon_command(), stdout=self._log_fh, stderr=subprocess.STDOUT, env=env
        )
        if wait and not wait_until(
            lambda: self.kubelet.registrations(self.driver) > before and self.slice() is not None,
            timeout_s,
        ):
            raise RuntimeError(f"the DRA driver did not register in {timeout_s}s:\n{self.log()}")

    def stop_daemon(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int | None:
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None
        return rc

    def close(self) -> None:
        self.stop_daemon()
        self.kubelet.stop()
        self.api.stop()

    def __enter__(self) -> DraSimNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # ------------------------------------------------------------ slices

    def slice(self) -> dict[str, Any] | None:
        """This node's ResourceSlice of the driver, as the API server holds it."""
        for obj in self.api.objects("resourceslices"):
            spec = obj.get("spec") or {}
            if spec.get("nodeName") == self.node and spec.get("driver") == self.driver:
                return obj
        return None

    def published(self) -> list[str]:
        found = self.slice()
        return [d["name"] for d in (found or {}).get("spec", {}).get("devices") or []]

    def schedulable(self) -> list[str]:
        """The published devices without a taint (a sick card stays published,
        tainted NoSchedule, so that the claims on it stay visible)."""
        found = self.slice()
        devices = (found or {}).get("spec", {}).get("devices") or []
        return [d["name"] for d in devices if not d.get("taints")]

    # ------------------------------------------------------------ claims

    def claim(
        self,
        name: str,
        capacity: Mapping[str, str] | None = None,
        *,
        count: int = 1,
        selectors: Iterable[str] = (),
        namespace: str = "default",
    ) -> dict[str, Any]:
        """Create a ResourceClaim asking the driver's DeviceClass (returns it, with its uid)."""
        body = claim_body(
            name,
            namespace=namespace,
            device_class=self.driver,
            capacity=dict(capacity) if capacity else None,
            count=count,
            selectors=selectors,
        )
        return self.api.add_object("resourceclaims", body)

    def run_pod(self, name: str, claims: Sequence[str], namespace: str = "default") -> PodRun:
        """Create the pod, let the scheduler stand-in allocate and reserve its claims
        on this node, then have the kubelet prepare them in one call."""
        body = make_pod(
            name,
            node=self.node,
            namespace=namespace,
            containers=[{"name": "main", "resources": {"claims": [{"name": c} for c in claims]}}],
        )
        body["spec"]["resourceClaims"] = [{"name": c, "resourceClaimName": c} for c in claims]
        pod = self.api.add_pod(body)
        uid = pod["metadata"]["uid"]
        refs = []
        for claim in claims:
            self.allocator.allocate(namespace, claim, pod=(name, uid), node=self.node)
            stored = self.api.get_object("resourceclaims", claim, namespace)
            assert stored is not None
            refs.append((namespace, stored["metadata"]["uid"], claim))
        reply = self.kubelet.prepare(self.driver, refs)
        edits = {}
        for _, claim_uid, claim in refs:
            answer = reply.claims[claim_uid]
            if not answer.error:
                ids = [i for d in answer.devices for i in d.cdi_device_ids]
                edits[claim] = self.kubelet.resolve(ids)
        return PodRun(name, namespace, uid, refs, reply, edits)

    def end_pod(self, run: PodRun) -> pb.NodeUnprepareResourcesResponse:
        """The pod is gone: unprepare its claims, deallocate and delete them."""
        reply = self.kubelet.unprepare(self.driver, run.claims)
        for namespace, _, claim in run.claims:
            self.allocator.deallocate(namespace, claim)
        self.api.delete_pod(run.namespace, run.name)
        return reply

    def fresh_uid(self) -> str:
        return str(uuid.uuid4())
