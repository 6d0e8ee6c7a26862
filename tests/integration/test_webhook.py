"""`vgpu webhook` over real TLS against the fake API server: certificate
creation, adoption by a second replica, rotation, caBundle patching, mutation
and validation of pods built with the official client's models and as raw
AdmissionReview JSON, bad input, and the command as a real subprocess."""

from __future__ import annotations

import base64
import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from vgpu.daemon.webhook import Webhook, WebhookSettings
from vgpu.sim.apiserver import FakeApiServer

D = "vendor.io"
CORE = f"{D}/vcuda-core"
MEM = f"{D}/vcuda-memory"
NS = "vgpu-system"
SECRET = "vgpu-webhook-tls"
MUT = "vgpu-webhook"
VAL = "vgpu-webhook"
SERVICE_DNS = f"vgpu-webhook.{NS}.svc"


def wait_for(cond: Callable[[], Any], timeout_s: float = 10.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or cond}")


def _config(kind: str, path: str) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": kind,
        "metadata": {"name": MUT},
        "webhooks": [
            {
                "name": f"{path.strip('/')}.vgpu.{D}",
                "clientConfig": {
                    "service": {"namespace": NS, "name": "vgpu-webhook", "path": path}
                },
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
            }
        ],
    }


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        server.add_webhook_object(
            "mutatingwebhookconfigurations", _config("MutatingWebhookConfiguration", "/mutate")
        )
        server.add_webhook_object(
            "validatingwebhookconfigurations",
            _config("ValidatingWebhookConfiguration", "/validate"),
        )
        yield server


@pytest.fixture
def kubeconfig(api: FakeApiServer) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="vgwh") as d:
        path = Path(d) / "kubeconfig"
        api.write_kubeconfig(path)
        yield path


Start = Callable[..., Webhook]


@pytest.fixture
def start(kubeconfig: Path) -> Iterator[Start]:
    running: list[Webhook] = []
    dirs: list[tempfile.TemporaryDirectory[str]] = []

    def go(**overrides: Any) -> Webhook:
        d = tempfile.TemporaryDirectory(prefix="vgwh")
        dirs.append(d)
        values: dict[str, Any] = {
            "listen": "127.0.0.1:0",
            "kubeconfig": kubeconfig,
            "cert_dir": Path(d.name) / "certs",
            "tls_san": ("127.0.0.1",),
            "secret": f"{NS}/{SECRET}",
            "service": f"{NS}/vgpu-webhook",
            "mutating_config": MUT,
            "validating_config": VAL,
            "resource_domain": D,
            "cert_check_interval_s": 0.2,
        }
        values.update(overrides)
        webhook = Webhook(WebhookSettings(**values))
        webhook.start()
        running.append(webhook)
        return webhook

    yield go
    for webhook in running:
        webhook.shutdown()
    for d in dirs:
        d.cleanup()


def tls_context(webhook: Webhook) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(webhook.settings.cert_dir / "ca.crt"))


def call(
    webhook: Webhook,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    assert webhook.http is not None
    conn = http.client.HTTPSConnection(
        "127.0.0.1", webhook.http.port, context=tls_context(webhook), timeout=10
    )
    try:
        conn.request(method, path, body, headers or {"Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def review(obj: dict[str, Any], operation: str = "CREATE", kind: str = "Pod") -> bytes:
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "0b5ef8a1-7a3b-4b6c-9d44-000000000001",
                "kind": {"group": "", "version": "v1", "kind": kind},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": "team-a",
                "operation": operation,
                "object": obj,
            },
        }
    ).encode()


def admit(webhook: Webhook, path: str, obj: dict[str, Any]) -> dict[str, Any]:
    status, body = call(webhook, "POST", path, review(obj))
    assert status == 200, body
    answer = json.loads(body)
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    assert answer["response"]["uid"] == "0b5ef8a1-7a3b-4b6c-9d44-000000000001"
    return dict(answer["response"])


def model_pod(
    limits: dict[str, str], init_limits: dict[str, str] | None = None, scheduler: str = ""
) -> dict[str, Any]:
    """A pod built with the official client's models, serialized as the API server sends it."""
    init = (
        [
            k8s.V1Container(
                name="setup",
                image="busybox",
                resources=k8s.V1ResourceRequirements(limits=init_limits),
            )
        ]
        if init_limits
        else None
    )
    pod = k8s.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=k8s.V1ObjectMeta(generate_name="train-", namespace="team-a"),
        spec=k8s.V1PodSpec(
            scheduler_name=scheduler or None,
            init_containers=init,
            containers=[
                k8s.V1Container(
                    name="main",
                    image="cuda",
                    resources=k8s.V1ResourceRequirements(limits=limits, requests=limits),
                )
            ],
        ),
    )
    out: dict[str, Any] = k8s.ApiClient().sanitize_for_serialization(pod)
    return out


def apply_patch(obj: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    ops = json.loads(base64.b64decode(response["patch"]))
    out = json.loads(json.dumps(obj))
    for op in ops:
        assert op["path"] == "/spec/schedulerName" and op["op"] in ("add", "replace")
        out["spec"]["schedulerName"] = op["value"]
    return out


# ------------------------------------------------------------------ certificates


def test_certificate_created_stored_and_trusted(api: FakeApiServer, start: Start) -> None:
    webhook = start()
    secret = api.get_webhook_object("secrets", SECRET, NS)
    assert secret is not None and secret["type"] == "kubernetes.io/tls"
    mutating = api.get_webhook_object("mutatingwebhookconfigurations", MUT)
    assert mutating is not None
    (owner,) = secret["metadata"]["ownerReferences"]
    assert owner["kind"] == "MutatingWebhookConfiguration"
    assert owner["uid"] == mutating["metadata"]["uid"]
    cert_dir = webhook.settings.cert_dir
    for name in ("ca.crt", "tls.crt", "tls.key"):
        assert base64.b64decode(secret["data"][name]) == (cert_dir / name).read_bytes()
    assert (cert_dir / "tls.key").stat().st_mode & 0o777 == 0o600
    for resource, name in (
        ("mutatingwebhookconfigurations", MUT),
        ("validatingwebhookconfigurations", VAL),
    ):
        config = api.get_webhook_object(resource, name)
        assert config is not None
        for hook in config["webhooks"]:
            assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    # Every Service DNS name verifies against the CA, as the API server checks it.
    assert webhook.http is not None
    for name in (
        "vgpu-webhook",
        f"vgpu-webhook.{NS}",
        SERVICE_DNS,
        f"{SERVICE_DNS}.cluster.local",
    ):
        with (
            socket.create_connection(("127.0.0.1", webhook.http.port), timeout=5) as raw,
            tls_context(webhook).wrap_socket(raw, server_hostname=name) as tls,
        ):
            assert tls.version() in ("TLSv1.2", "TLSv1.3")
    with (
        socket.create_connection(("127.0.0.1", webhook.http.port), timeout=5) as raw,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        tls_context(webhook).wrap_socket(raw, server_hostname="evil.example.com")


def test_uninstall_garbage_collects_the_secret(api: FakeApiServer, start: Start) -> None:
    start()
    assert api.get_webhook_object("secrets", SECRET, NS) is not None
    api.delete_webhook_object("mutatingwebhookconfigurations", MUT)
    assert api.get_webhook_object("secrets", SECRET, NS) is None


def test_two_replicas_racing_share_one_certificate(api: FakeApiServer, start: Start) -> None:
    started: list[Webhook] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            started.append(start())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(started) == 2
    a, b = started
    assert (a.settings.cert_dir / "tls.crt").read_bytes() == (
        b.settings.cert_dir / "tls.crt"
    ).read_bytes()
    # A third replica started later adopts it without writing.
    posts = sum(1 for m, p in api.requests() if m in ("POST", "PUT") and "/secrets" in p)
    c = start()
    assert (c.settings.cert_dir / "tls.key").read_bytes() == (
        a.settings.cert_dir / "tls.key"
    ).read_bytes()
    assert sum(1 for m, p in api.requests() if m in ("POST", "PUT") and "/secrets" in p) == posts
    # Each serves the shared certificate.
    for webhook in (a, b, c):
        assert call(webhook, "GET", "/readyz")[0] == 200


def served_cert(webhook: Webhook, verify: bool = True, sni: str | None = SERVICE_DNS) -> bytes:
    assert webhook.http is not None
    ctx = tls_context(webhook)
    if not verify:  # the files may be half-way through a change
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    with (
        socket.create_connection(("127.0.0.1", webhook.http.port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname=sni) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
        assert der is not None
        return der


def test_rotation_before_expiry_without_restart(api: FakeApiServer, start: Start) -> None:
    # 6 s validity: renewed at 4 s (then every 4 s), checked every 0.2 s.
    a = start(cert_validity_s=6.0)
    b = start(cert_validity_s=6.0)
    first = served_cert(a)
    first_secret = api.get_webhook_object("secrets", SECRET, NS)
    assert first_secret is not None
    wait_for(lambda: a.keeper.reloads >= 2 and b.keeper.reloads >= 2, 15, "a renewal")
    second = wait_for(lambda: (c := served_cert(a)) != first and c, 5, "the new certificate")
    assert served_cert(b) == second  # the other replica adopted the renewal
    # A client reaching it by IP sends no SNI (--tls-san 127.0.0.1): swapped too.
    ctx = tls_context(a)
    ctx.check_hostname = False
    assert a.http is not None
    with (
        socket.create_connection(("127.0.0.1", a.http.port), timeout=5) as raw,
        ctx.wrap_socket(raw) as tls,
    ):
        assert tls.getpeercert(binary_form=True) == second
    secret = api.get_webhook_object("secrets", SECRET, NS)
    assert secret is not None
    assert secret["data"]["tls.crt"] != first_secret["data"]["tls.crt"]
    # The caBundle trusts the new CA and (until it expires) the old one.
    bundle = base64.b64decode(
        api.get_webhook_object("validatingwebhookconfigurations", VAL)["webhooks"][0][  # type: ignore[index]
            "clientConfig"
        ]["caBundle"]
    )
    assert bundle.count(b"BEGIN CERTIFICATE") >= 2
    assert status_of(a, "/mutate", model_pod({CORE: "100"})) == 200


def status_of(webhook: Webhook, path: str, obj: dict[str, Any]) -> int:
    return call(webhook, "POST", path, review(obj))[0]


def test_drifted_ca_bundle_is_patched_again(api: FakeApiServer, start: Start) -> None:
    start()

    def reset(config: dict[str, Any]) -> None:
        config["webhooks"][0]["clientConfig"].pop("caBundle", None)

    config = api.get_webhook_object("mutatingwebhookconfigurations", MUT)
    assert config is not None
    reset(config)
    del config["metadata"]["resourceVersion"]
    api._wh_replace(("mutatingwebhookconfigurations", "", MUT), config)  # a helm upgrade
    wait_for(
        lambda: (
            api.get_webhook_object("mutatingwebhookconfigurations", MUT) or {"webhooks": [{}]}
        )["webhooks"][0]["clientConfig"].get("caBundle"),
        5,
        "the caBundle again",
    )


def test_mounted_certificate_mode_reads_and_reloads(
    api: FakeApiServer, start: Start, tmp_path: Path
) -> None:
    """Without --secret (cert-manager): the cert dir is only read, and reloaded on change."""
    from vgpu.adapters import certs

    cert_dir = tmp_path / "mounted"
    names = [SERVICE_DNS, "127.0.0.1"]
    certs.write_cert_dir(cert_dir, certs.make_bundle(names, 3600, time.time()))
    webhook = start(secret="", cert_dir=cert_dir, mutating_config="", validating_config="")
    first = served_cert(webhook)
    # A key that does not match the certificate (a half-done update) is not loaded.
    other = certs.make_bundle(names, 3600, time.time())
    (cert_dir / "tls.key").write_bytes(other.tls_key)
    reloads = webhook.keeper.reloads
    time.sleep(1.0)  # five checks
    assert webhook.keeper.reloads == reloads
    assert served_cert(webhook, verify=False) == first
    certs.write_cert_dir(cert_dir, certs.make_bundle(names, 3600, time.time()))
    wait_for(lambda: served_cert(webhook, verify=False) != first, 5, "the reloaded certificate")
    served_cert(webhook)  # and it verifies against the new CA
    assert api.get_webhook_object("secrets", SECRET, NS) is None  # nothing written


# ------------------------------------------------------------------ admission


def test_mutation_of_a_model_pod(start: Start) -> None:
    webhook = start()
    pod = model_pod({CORE: "30", MEM: "16"})
    response = admit(webhook, "/mutate", pod)
    assert response["allowed"] is True and response["patchType"] == "JSONPatch"
    assert apply_patch(pod, response)["spec"]["schedulerName"] == "vgpu-scheduler"
    # Reinvocation (IfNeeded) after the patch changes nothing more.
    assert "patch" not in admit(webhook, "/mutate", apply_patch(pod, response))
    # Init containers count; another scheduler's pods and plain pods are untouched.
    init_only = model_pod({"cpu": "1"}, init_limits={MEM: "4"}, scheduler="default-scheduler")
    assert "patch" in admit(webhook, "/mutate", init_only)
    assert "patch" not in admit(webhook, "/mutate", model_pod({CORE: "100"}, scheduler="other"))
    assert "patch" not in admit(webhook, "/mutate", model_pod({"cpu": "1"}))


def test_empty_scheduler_name_disables_mutation(start: Start) -> None:
    webhook = start(scheduler_name="")
    assert "patch" not in admit(webhook, "/mutate", model_pod({CORE: "100"}))


def test_dra_pods_are_never_mutated(start: Start) -> None:
    webhook = start()
    pod = model_pod({CORE: "100"})
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "slice"}]
    assert "patch" not in admit(webhook, "/mutate", pod)


RULES = [
    ("fraction-without-memory", {CORE: "30"}, "must come with vendor.io/vcuda-memory"),
    ("core-150", {CORE: "150", MEM: "8"}, "request 100 or 200"),
    ("non-integer-core", {CORE: "0.5", MEM: "8"}, "is not a whole number"),
    ("non-integer-memory", {CORE: "50", MEM: "1500m"}, "write a whole number"),
]


@pytest.mark.parametrize(("limits", "fragment"), [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_validation_refuses_with_the_node_message(
    start: Start, limits: dict[str, str], fragment: str
) -> None:
    webhook = start()
    response = admit(webhook, "/validate", model_pod(limits))
    assert response["allowed"] is False
    message = response["status"]["message"]
    assert fragment in message and "team-a/train-<generated>/main" in message
    assert response["status"]["code"] == 422


def test_validation_names_an_init_container(start: Start) -> None:
    webhook = start()
    response = admit(webhook, "/validate", model_pod({CORE: "100"}, init_limits={CORE: "20"}))
    assert response["allowed"] is False
    assert "init container team-a/train-<generated>/setup" in response["status"]["message"]


def test_raw_review_json(start: Start) -> None:
    webhook = start()
    raw = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "team-a"},
        "spec": {
            "schedulerName": "default-scheduler",
            "containers": [
                {"name": "a", "image": "x", "resources": {"limits": {CORE: 50, MEM: 4}}},
                {"name": "b", "image": "x", "resources": {"limits": {CORE: "200"}}},
            ],
        },
    }
    assert admit(webhook, "/validate", raw)["allowed"] is True
    assert apply_patch(raw, admit(webhook, "/mutate", raw))["spec"]["schedulerName"] == (
        "vgpu-scheduler"
    )
    # UPDATE is not judged (resources of a pod are immutable).
    raw["spec"]["containers"][0]["resources"]["limits"] = {CORE: 30}
    assert admit(webhook, "/validate", raw)["allowed"] is False
    status, body = call(webhook, "POST", "/validate", review(raw, operation="UPDATE"))
    assert status == 200 and json.loads(body)["response"]["allowed"] is True


def test_bad_input_gets_400_or_a_warning_never_a_crash(start: Start) -> None:
    webhook = start()
    assert call(webhook, "POST", "/validate", b"{not json")[0] == 400
    assert call(webhook, "POST", "/mutate", b'{"apiVersion":"v1"}')[0] == 400
    status, body = call(webhook, "POST", "/validate", review({"spec": {"containers": 5}}))
    assert status in (200, 400), body
    status, body = call(
        webhook, "POST", "/validate", review({"spec": {"containers": [{"resources": []}]}})
    )
    assert status in (200, 400), body
    status, body = call(webhook, "POST", "/mutate", review({}, kind="Deployment"))
    assert status == 200 and "Pods only" in json.loads(body)["response"]["warnings"][0]
    assert call(webhook, "POST", "/nope", review({}))[0] == 404
    # An oversized body is refused from its Content-Length, before it is read.
    assert webhook.http is not None
    with (
        socket.create_connection(("127.0.0.1", webhook.http.port), timeout=5) as raw,
        tls_context(webhook).wrap_socket(raw, server_hostname=SERVICE_DNS) as tls,
    ):
        tls.sendall(b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n")
        assert tls.recv(100).startswith(b"HTTP/1.1 413")
    # A body that never arrives, and no Content-Length at all.
    with (
        socket.create_connection(("127.0.0.1", webhook.http.port), timeout=5) as raw,
        tls_context(webhook).wrap_socket(raw, server_hostname=SERVICE_DNS) as tls,
    ):
        tls.sendall(b"POST /validate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert tls.recv(100).startswith(b"HTTP/1.1 411")
    # Still serving, and counting.
    assert call(webhook, "GET", "/healthz")[0] == 200
    status, metrics = call(webhook, "GET", "/metrics")
    assert status == 200
    assert b'vgpu_webhook_requests_total{outcome="bad_request",path="/validate"}' in metrics
    assert b"vgpu_webhook_cert_not_after_seconds" in metrics


def test_plain_tcp_and_slow_handshakes_do_not_stall_it(start: Start) -> None:
    webhook = start()
    assert webhook.http is not None
    port = webhook.http.port
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(20)]
    try:
        for s in idle[:10]:
            s.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")  # plain HTTP on a TLS port
        assert admit(webhook, "/validate", model_pod({CORE: "100"}))["allowed"] is True
    finally:
        for s in idle:
            s.close()


# ------------------------------------------------------------------ the command


def test_vgpu_webhook_as_a_subprocess(api: FakeApiServer, kubeconfig: Path) -> None:
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="vgwh") as d:
        cert_dir = Path(d) / "certs"
        proc = _spawn(kubeconfig, port, cert_dir, "--resource-domain", D)
        try:
            ctx: ssl.SSLContext | None = None

            def ready() -> bool:
                nonlocal ctx
                if not (cert_dir / "ca.crt").exists():
                    return False
                ctx = ssl.create_default_context(cafile=str(cert_dir / "ca.crt"))
                try:
                    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=2)
                    conn.request("GET", "/readyz")
                    return conn.getresponse().status == 200
                except OSError:
                    return False

            wait_for(ready, 30, "the webhook subprocess to be ready")
            assert ctx is not None
            conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=5)
            pod = model_pod({CORE: "30", MEM: "8"})
            conn.request("POST", "/mutate", review(pod), {"Content-Type": "application/json"})
            reply = conn.getresponse()
            answer = json.loads(reply.read())
            assert apply_patch(pod, answer["response"])["spec"]["schedulerName"] == (
                "vgpu-scheduler"
            )
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(15) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        output = proc.stdout.read().decode() if proc.stdout else ""
        assert "created the serving certificate" in output


def test_reviews_reuse_one_kept_alive_connection(start: Start) -> None:
    """As the API server does: no TLS handshake per review."""
    webhook = start()
    assert webhook.http is not None
    conn = http.client.HTTPSConnection(
        "127.0.0.1", webhook.http.port, context=tls_context(webhook), timeout=10
    )
    try:
        socks = set()
        for path in ("/mutate", "/validate", "/mutate"):
            conn.request("POST", path, review(model_pod({CORE: "100"})))
            reply = conn.getresponse()
            assert reply.status == 200 and reply.getheader("Connection") == "keep-alive"
            assert json.loads(reply.read())["response"]["allowed"] is True
            assert conn.sock is not None
            socks.add(id(conn.sock))
        assert len(socks) == 1
        # A refused body closes the connection.
        conn.request("POST", "/validate", b"{")
        reply = conn.getresponse()
        assert reply.status == 400 and reply.getheader("Connection") == "close"
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--secret", "no-slash"], "--secret 'no-slash' is not NAMESPACE/NAME"),
        (["--secret", "ns/s"], "--secret needs the names to certify"),
        (["--secret", "ns/s", "--service", "ns/svc"], "needs an API server"),
        (["--listen", "nowhere"], "--listen 'nowhere' is not HOST:PORT"),
        (["--cert-dir", "/nonexistent/vgpu"], "no tls.crt and tls.key in /nonexistent/vgpu"),
        (["--cert-validity-s", "1"], "--cert-validity-s must be"),
    ],
)
def test_bad_flags_exit_2_naming_the_fix(args: list[str], fragment: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    proc = subprocess.run(
        [sys.executable, "-m", "vgpu", "webhook", "--listen", "127.0.0.1:0", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr, proc.stderr


def test_a_slow_head_or_handshake_is_cut(start: Start) -> None:
    """Slowloris: a head that never ends, or a TLS handshake never started, is
    cut after the 5 s header timeout while other reviews are answered."""
    webhook = start()
    assert webhook.http is not None
    port = webhook.http.port
    with (
        socket.create_connection(("127.0.0.1", port), timeout=15) as silent,
        socket.create_connection(("127.0.0.1", port), timeout=15) as raw,
        tls_context(webhook).wrap_socket(raw, server_hostname=SERVICE_DNS) as tls,
    ):
        tls.sendall(b"POST /validate HTTP/1.1\r\nHost: x\r\n")  # never finished
        assert admit(webhook, "/validate", model_pod({CORE: "100"}))["allowed"] is True
        t0 = time.monotonic()
        assert tls.recv(100) == b""  # closed by the server
        assert silent.recv(100) == b""
        assert time.monotonic() - t0 < 10


def _spawn(kubeconfig: Path, port: int, cert_dir: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vgpu",
            "webhook",
            "--listen",
            f"127.0.0.1:{port}",
            "--kubeconfig",
            str(kubeconfig),
            "--cert-dir",
            str(cert_dir),
            "--secret",
            f"{NS}/{SECRET}",
            "--service",
            f"{NS}/vgpu-webhook",
            "--tls-san",
            "127.0.0.1",
            "--mutating-config",
            MUT,
            "--validating-config",
            VAL,
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _peer_cert(port: int, cafile: Path) -> bytes | None:
    try:
        ctx = ssl.create_default_context(cafile=str(cafile))
        with (
            socket.create_connection(("127.0.0.1", port), timeout=2) as raw,
            ctx.wrap_socket(raw, server_hostname=SERVICE_DNS) as tls,
        ):
            return tls.getpeercert(binary_form=True)
    except (OSError, ValueError):
        return None


@pytest.mark.timeout(120)
def test_two_webhook_processes_race_for_one_secret(api: FakeApiServer, kubeconfig: Path) -> None:
    """Two replicas as real processes, started together: one Secret, one certificate."""
    with tempfile.TemporaryDirectory(prefix="vgwh") as d:
        dirs = [Path(d) / "a", Path(d) / "b"]
        ports = [_free_port(), _free_port()]
        procs = [
            _spawn(kubeconfig, port, cert_dir) for port, cert_dir in zip(ports, dirs, strict=True)
        ]
        try:
            served = [
                wait_for(
                    lambda p=port, c=cert_dir: _peer_cert(p, c / "ca.crt"), 40, "both replicas"
                )
                for port, cert_dir in zip(ports, dirs, strict=True)
            ]
            assert served[0] == served[1]
            assert (dirs[0] / "tls.key").read_bytes() == (dirs[1] / "tls.key").read_bytes()
            secret = api.get_webhook_object("secrets", SECRET, NS)
            assert secret is not None
            assert base64.b64decode(secret["data"]["tls.crt"]) == (dirs[0] / "tls.crt").read_bytes()
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            assert [proc.wait(15) for proc in procs] == [0, 0]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        logs = [proc.stdout.read().decode() if proc.stdout else "" for proc in procs]
        created = sum("created the serving certificate" in log for log in logs)
        adopted = sum("written by another replica" in log for log in logs)
        assert created == 1, logs
        assert adopted <= 1, logs
