"""`vgpu webhook` admission latency: /validate and /mutate for a pod of 10
containers, each asking for a vgpu slice, over real TLS.

The webhook runs in-process with a self-managed certificate against the fake
API server; the client is a separate process (as the API server is), so the
two do not share a GIL. Two ways of calling: over one kept-alive connection,
as the API server's HTTP client does (the target), and with a new connection
and TLS handshake per review (the worst case: the first review of each
connection). The handler's own time (parse, decide, serialise) is beside it.
"""

from __future__ import annotations

import http.client
import json
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Json, Target, ms, percentile
from vgpu.daemon.webhook import Webhook, WebhookSettings
from vgpu.sim.apiserver import FakeApiServer

DOMAIN = "vendor.io"
P99_MS = 10.0
CONTAINERS = 10


def review_body(containers: int = CONTAINERS) -> bytes:
    core, mem = f"{DOMAIN}/vcuda-core", f"{DOMAIN}/vcuda-memory"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "bench-", "namespace": "team-a", "labels": {"app": "x"}},
        "spec": {
            "schedulerName": "default-scheduler",
            "containers": [
                {
                    "name": f"c{i}",
                    "image": "nvcr.io/nvidia/cuda:12.4.0-base-ubuntu22.04",
                    "command": ["python", "train.py"],
                    "env": [{"name": "RANK", "value": str(i)}],
                    "resources": {
                        "limits": {core: "10", mem: "16", "cpu": "1", "memory": "1Gi"},
                        "requests": {core: "10", mem: "16", "cpu": "1", "memory": "1Gi"},
                    },
                }
                for i in range(containers)
            ],
        },
    }
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "00000000-0000-4000-8000-000000000000",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": "team-a",
                "operation": "CREATE",
                "object": pod,
            },
        }
    ).encode()


def _stats(samples: list[float]) -> Json:
    return {
        "requests": len(samples),
        "p50_ms": ms(percentile(samples, 50)),
        "p99_ms": ms(percentile(samples, 99)),
        "max_ms": ms(max(samples)),
    }


def client(port: int, cafile: str, path: str, requests: int, keep: bool) -> list[float]:
    """Seconds per review, warm-up left out (run in its own process)."""
    body = review_body()
    context = ssl.create_default_context(cafile=cafile)
    samples: list[float] = []
    conn: http.client.HTTPSConnection | None = None
    for i in range(requests + 20):
        t0 = time.perf_counter()
        if conn is None:
            conn = http.client.HTTPSConnection("127.0.0.1", port, context=context)
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        data = reply.read()
        if not keep or reply.getheader("Connection", "") == "close":
            conn.close()
            conn = None
        elapsed = time.perf_counter() - t0
        if reply.status != 200:
            raise RuntimeError(f"{path}: HTTP {reply.status}: {data[:200]!r}")
        answer = json.loads(data)["response"]
        if path == "/validate" and not answer["allowed"]:
            raise RuntimeError(f"/validate refused the bench pod: {answer}")
        if path == "/mutate" and "patch" not in answer:
            raise RuntimeError("/mutate did not patch the bench pod")
        if i >= 20:
            samples.append(elapsed)
    return samples


def _client_process(port: int, cafile: str, path: str, requests: int, keep: bool) -> list[float]:
    code = (
        "import json, sys; from bench.webhook import client; "
        f"print(json.dumps(client({port}, {cafile!r}, {path!r}, {requests}, {keep})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"bench client failed: {proc.stderr[-2000:]}")
    samples: list[float] = json.loads(proc.stdout)
    return samples


def run(requests: int) -> Json:
    body = review_body()
    with FakeApiServer() as api, tempfile.TemporaryDirectory(prefix="vgbench") as tmp:
        for resource, kind in (
            ("mutatingwebhookconfigurations", "MutatingWebhookConfiguration"),
            ("validatingwebhookconfigurations", "ValidatingWebhookConfiguration"),
        ):
            api.add_webhook_object(
                resource,
                {
                    "kind": kind,
                    "metadata": {"name": "vgpu-webhook"},
                    "webhooks": [
                        {
                            "name": f"{kind.lower()}.vgpu.{DOMAIN}",
                            "clientConfig": {
                                "service": {"namespace": "vgpu-system", "name": "vgpu-webhook"}
                            },
                            "admissionReviewVersions": ["v1"],
                            "sideEffects": "None",
                        }
                    ],
                },
            )
        kubeconfig = Path(tmp) / "kubeconfig"
        api.write_kubeconfig(kubeconfig)
        webhook = Webhook(
            WebhookSettings(
                listen="127.0.0.1:0",
                kubeconfig=kubeconfig,
                cert_dir=Path(tmp) / "certs",
                tls_san=("127.0.0.1",),
                secret="vgpu-system/vgpu-webhook-tls",
                service="vgpu-system/vgpu-webhook",
                mutating_config="vgpu-webhook",
                validating_config="vgpu-webhook",
                resource_domain=DOMAIN,
            )
        )
        webhook.start()
        try:
            assert webhook.http is not None
            port = webhook.http.port
            cafile = str(Path(tmp) / "certs" / "ca.crt")
            out: Json = {"containers": CONTAINERS, "body_bytes": len(body)}
            targets = []
            for path in ("/validate", "/mutate"):
                name = path.strip("/")
                kept = _client_process(port, cafile, path, requests, keep=True)
                fresh = _client_process(port, cafile, path, requests // 2, keep=False)
                handler = []
                for _ in range(requests):
                    h0 = time.perf_counter()
                    webhook.admit(path, body)
                    handler.append(time.perf_counter() - h0)
                out[name] = {
                    "kept_alive": _stats(kept),
                    "new_connection": _stats(fresh),
                    "handler": _stats(handler),
                }
                targets.append(
                    Target(
                        f"{name} p99 over TLS (kept-alive), pod of {CONTAINERS} containers",
                        out[name]["kept_alive"]["p99_ms"],
                        P99_MS,
                        "ms",
                    ).to_json()
                )
            out["targets"] = targets
            return out
        finally:
            webhook.shutdown()
