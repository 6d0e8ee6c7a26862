"""`vgpu webhook`'s composition root: a TLS admission webhook for pods that ask
for vgpu resources (a sibling of the node daemon and the extender, sharing the
core's request rules with the node).

    start-up   settings checked; the serving certificate made or adopted
               (self-managed: the --secret) or read (--cert-dir, e.g. mounted
               by cert-manager); the TLS port bound
    main loop  serve /mutate and /validate; every cert_check_interval_s look at
               the Secret or the files again: adopt another replica's renewal,
               renew at 2/3 of the validity, re-patch a caBundle that drifted
               (a `helm upgrade` re-applies the configurations), and swap the
               SSL context for new connections when the certificate changed
    shutdown   first SIGTERM/SIGINT: stop serving, exit 0; a second forces it

Certificate sources: with --secret NAMESPACE/NAME (self-managed) the webhook
creates a CA and a serving certificate when the Secret is absent (create-if-
absent: a replica that loses the race adopts the winner's), stores them there
with an ownerReference to the MutatingWebhookConfiguration (so deleting it
garbage-collects the Secret), writes them to --cert-dir and patches the
caBundle of both webhook configurations. Without --secret, the certificate is
whatever --cert-dir holds (cert-manager's mounted Secret): it is only read, and
reloaded when it changes; cert-manager's CA injector keeps the caBundle.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from vgpu import __version__
from vgpu.adapters import certs
from vgpu.adapters.httpserver import BoundedHttpServer, HttpLimits
from vgpu.adapters.kube import KubeUnavailable, container_specs
from vgpu.adapters.kube_webhook import MUTATING, VALIDATING, Conflict, WebhookApi
from vgpu.core import admission
from vgpu.core.errors import ConfigError
from vgpu.daemon.lifecycle import stop_on_signals

log = logging.getLogger("vgpu.webhook")

RENEW_AT_FRACTION = 2 / 3  # of the serving certificate's validity


@dataclass(frozen=True)
class WebhookSettings:
    """Everything `vgpu webhook` can be told."""

    listen: str = "0.0.0.0:8443"
    kubeconfig: Path | None = None
    cert_dir: Path = Path("/var/run/vgpu-webhook/certs")
    tls_san: tuple[str, ...] = ()
    secret: str = ""  # NAMESPACE/NAME; "" = read-only certificate in cert_dir
    service: str = ""  # NAMESPACE/NAME of the webhook's Service
    mutating_config: str = ""
    validating_config: str = ""
    scheduler_name: str = "vgpu-scheduler"  # "" = no mutation
    resource_domain: str = "vendor.io"
    memory_unit_mib: int = 256
    cert_validity_s: float = 365 * 86400.0
    # Short: a `helm upgrade` re-applies the configurations with an empty
    # caBundle, and vgpu pods are refused until it is patched again.
    cert_check_interval_s: float = 10.0
    log_format: str = "text"
    log_level: str = "info"

    def public(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def check(self) -> None:
        """ConfigError naming the flag and the fix."""
        _, sep, port = self.listen.rpartition(":")
        if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError(f"--listen {self.listen!r} is not HOST:PORT")
        for flag, value in (("--secret", self.secret), ("--service", self.service)):
            if value and (value.count("/") != 1 or not all(value.split("/"))):
                raise ConfigError(f"{flag} {value!r} is not NAMESPACE/NAME")
        if self.secret and not self.service and not self.tls_san:
            raise ConfigError(
                "--secret needs the names to certify: pass --service NAMESPACE/NAME "
                "(and --tls-san for a webhook reached by URL)"
            )
        try:
            admission.match_condition_expression(self.resource_domain)
        except ValueError as exc:
            raise ConfigError(f"--resource-domain: {exc}") from None
        if not 2 <= self.cert_validity_s <= 10 * 365 * 86400:
            raise ConfigError("--cert-validity-s must be 2 to 315360000 (10 years)")
        if not 0.1 <= self.cert_check_interval_s <= 3600:
            raise ConfigError("--cert-check-interval-s must be 0.1 to 3600")

    def dns_names(self) -> list[str]:
        """The serving certificate's names: the Service's DNS names, then --tls-san."""
        names: list[str] = []
        if self.service:
            ns, svc = self.service.split("/")
            names += [svc, f"{svc}.{ns}", f"{svc}.{ns}.svc", f"{svc}.{ns}.svc.cluster.local"]
        names += [n for n in self.tls_san if n not in names]
        return names


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


# ------------------------------------------------------------------ metrics


class WebhookMetrics:
    def __init__(self, keeper: CertKeeper) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "vgpu_webhook_requests",
            "Admission requests by path and outcome (allowed, patched, denied, bad_request, error)",
            ["path", "outcome"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "vgpu_webhook_request_duration_seconds",
            "Time to answer an admission request (after the body arrived)",
            ["path"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
            registry=self.registry,
        )
        self.registry.register(_CertCollector(keeper))


class _CertCollector(Collector):
    def __init__(self, keeper: CertKeeper) -> None:
        self.keeper = keeper

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "vgpu_webhook_cert_not_after_seconds",
            "Expiry of the serving certificate, seconds since the epoch (0: none loaded)",
            value=self.keeper.not_after_s,
        )
        yield GaugeMetricFamily(
            "vgpu_webhook_cert_reloads", "Serving certificates loaded", value=self.keeper.reloads
        )


# ---------------------------------------------------------------- certificates


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bundle_of(secret: dict[str, Any] | None) -> certs.CertBundle | None:
    data = (secret or {}).get("data") or {}
    try:
        return certs.CertBundle(
            ca_crt=base64.b64decode(data["ca.crt"]),
            tls_crt=base64.b64decode(data["tls.crt"]),
            tls_key=base64.b64decode(data["tls.key"]),
        )
    except (KeyError, ValueError, TypeError):
        return None


class CertKeeper:
    """The serving certificate: made, adopted, renewed, written and reloaded."""

    def __init__(self, settings: WebhookSettings, api: WebhookApi | None) -> None:
        self.settings = settings
        self.api = api
        self.not_after_s = 0.0
        self.reloads = 0
        self.loaded: certs.CertBundle | None = None
        self.on_reload: list[Any] = []  # callables taking the cert dir

    # -- what is good enough

    def usable(self, bundle: certs.CertBundle | None, now_s: float) -> str:
        """'' when the bundle can serve now and is not yet due for renewal, else why not."""
        if bundle is None:
            return "absent"
        try:
            certs.check_bundle(bundle)
            facts = certs.cert_facts(bundle.tls_crt)
        except ValueError as exc:
            return f"unreadable ({exc})"
        missing = set(self.settings.dns_names()) - facts.names
        if missing:
            return f"does not name {', '.join(sorted(missing))}"
        # not_before is backdated by certs.SKEW_S for clocks a little behind.
        lifetime = facts.not_after_s - facts.not_before_s - certs.SKEW_S
        renew_at = facts.not_after_s - lifetime * (1 - RENEW_AT_FRACTION)
        if now_s >= renew_at:
            expires = time.strftime("%FT%TZ", time.gmtime(facts.not_after_s))
            return f"due for renewal (expires {expires})"
        return ""

    # -- self-managed

    def _owner(self) -> list[dict[str, Any]]:
        assert self.api is not None
        name = self.settings.mutating_config
        if not name:
            return []
        config = self.api.read_config(MUTATING, name)
        if config is None:
            log.warning(
                "MutatingWebhookConfiguration %s not found: the certificate Secret gets no "
                "ownerReference and outlives an uninstall; check --mutating-config",
                name,
            )
            return []
        return [
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "MutatingWebhookConfiguration",
                "name": name,
                "uid": config["metadata"]["uid"],
            }
        ]

    def _fresh(self, previous: certs.CertBundle | None, now_s: float) -> certs.CertBundle:
        bundle = certs.make_bundle(self.settings.dns_names(), self.settings.cert_validity_s, now_s)
        if previous is not None:
            # Keep trusting the old CA until it expires, so the API server accepts
            # both certificates while replicas switch.
            old_ca = previous.ca_crt.split(b"-----END CERTIFICATE-----")[0]
            try:
                facts = certs.cert_facts(previous.ca_crt)
                if facts.not_after_s > now_s and old_ca.strip():
                    old = old_ca + b"-----END CERTIFICATE-----\n"
                    bundle = dataclasses.replace(bundle, ca_crt=bundle.ca_crt + old)
            except ValueError:
                pass
        return bundle

    def sync_secret(self, now_s: float) -> certs.CertBundle:
        """The Secret's bundle: adopted if usable, else made (create-if-absent) or renewed."""
        assert self.api is not None
        ns, name = self.settings.secret.split("/")
        for _ in range(5):
            secret = self.api.read_secret(ns, name)
            bundle = _bundle_of(secret)
            why = self.usable(bundle, now_s)
            if not why:
                return bundle  # type: ignore[return-value]
            fresh = self._fresh(bundle, now_s)
            data = {
                "ca.crt": _b64(fresh.ca_crt),
                "tls.crt": _b64(fresh.tls_crt),
                "tls.key": _b64(fresh.tls_key),
            }
            try:
                if secret is None:
                    body = {
                        "apiVersion": "v1",
                        "kind": "Secret",
                        "type": "kubernetes.io/tls",
                        "metadata": {
                            "name": name,
                            "namespace": ns,
                            "labels": {"app.kubernetes.io/managed-by": "vgpu-webhook"},
                            "ownerReferences": self._owner(),
                        },
                        "data": data,
                    }
                    self.api.create_secret(ns, body)
                    log.info("created the serving certificate in Secret %s/%s", ns, name)
                else:
                    secret["data"] = data
                    secret["type"] = secret.get("type") or "kubernetes.io/tls"
                    self.api.replace_secret(ns, secret)
                    log.info("renewed the serving certificate in Secret %s/%s: %s", ns, name, why)
                return fresh
            except Conflict:
                log.info("Secret %s/%s was written by another replica: adopting it", ns, name)
        raise KubeUnavailable(f"Secret {ns}/{name} kept changing under five writes in a row")

    def patch_ca_bundles(self, ca_crt: bytes) -> None:
        assert self.api is not None
        wanted = _b64(ca_crt)
        for resource, name in (
            (MUTATING, self.settings.mutating_config),
            (VALIDATING, self.settings.validating_config),
        ):
            if not name:
                continue
            for _ in range(5):
                config = self.api.read_config(resource, name)
                if config is None:
                    log.warning("%s %s not found: caBundle not set", resource, name)
                    break
                hooks = config.get("webhooks") or []
                if all((h.get("clientConfig") or {}).get("caBundle") == wanted for h in hooks):
                    break
                for hook in hooks:
                    hook.setdefault("clientConfig", {})["caBundle"] = wanted
                try:
                    self.api.replace_config(resource, config)
                    log.info("set the caBundle of %s %s (%d webhooks)", resource, name, len(hooks))
                    break
                except Conflict:
                    continue

    # -- both sources

    def refresh(self, now_s: float | None = None) -> bool:
        """Bring the certificate up to date; True when a new one was loaded."""
        now_s = time.time() if now_s is None else now_s
        directory = self.settings.cert_dir
        if self.settings.secret:
            bundle = self.sync_secret(now_s)
            if certs.read_cert_dir(directory) != bundle:
                certs.write_cert_dir(directory, bundle)
            self.patch_ca_bundles(bundle.ca_crt)
        else:
            found = certs.read_cert_dir(directory)
            if found is None:
                raise ConfigError(
                    f"no tls.crt and tls.key in {directory}: mount the certificate Secret "
                    "there (cert-manager), or pass --secret NAMESPACE/NAME to make one"
                )
            bundle = found
        if bundle == self.loaded:
            return False
        not_after_s = certs.cert_facts(bundle.tls_crt).not_after_s
        for callback in self.on_reload:
            callback(directory)  # raises (and is tried again next time) on a bad pair
        self.not_after_s = not_after_s
        self.loaded = bundle
        self.reloads += 1
        log.info(
            "serving certificate loaded from %s (expires %s)",
            directory,
            time.strftime("%FT%TZ", time.gmtime(self.not_after_s)),
        )
        return True


# ------------------------------------------------------------------- the server


class Webhook:
    """Everything `vgpu webhook` runs."""

    def __init__(self, settings: WebhookSettings) -> None:
        settings.check()
        self.settings = settings
        self.stop = threading.Event()
        api = None
        if settings.secret:
            if settings.kubeconfig is None and not os.environ.get("KUBERNETES_SERVICE_HOST"):
                raise ConfigError(
                    "--secret needs an API server: pass --kubeconfig FILE, or run in a cluster "
                    "(the in-cluster service account is used there)"
                )
            try:
                api = WebhookApi(settings.kubeconfig)
            except Exception as exc:  # the client's config errors, a missing file
                raise ConfigError(
                    f"cannot use kubeconfig {settings.kubeconfig or '(in-cluster)'}: {exc}"
                ) from None
        self.keeper = CertKeeper(settings, api)
        self.metrics = WebhookMetrics(self.keeper)
        self.http: BoundedHttpServer | None = None
        self.ready_reason = "no serving certificate loaded yet"
        self.keeper.on_reload.append(self._reload)

    # -- admission

    def admit(self, path: str, body: bytes) -> tuple[int, str, bytes]:
        start = time.perf_counter()
        outcome = "error"
        try:
            status, ctype, answer, outcome = self._admit(path, body)
            return status, ctype, answer
        finally:
            if path in ("/mutate", "/validate"):
                self.metrics.requests.labels(path, outcome).inc()
                self.metrics.duration.labels(path).observe(time.perf_counter() - start)

    def _admit(self, path: str, body: bytes) -> tuple[int, str, bytes, str]:
        if path not in ("/mutate", "/validate"):
            return 404, "text/plain", b"not found: POST /mutate or /validate\n", "not_found"
        try:
            review = admission.parse_review(body)
        except admission.BadReview as exc:
            log.warning("%s: bad AdmissionReview: %s", path, exc)
            return 400, "text/plain", f"bad AdmissionReview: {exc}\n".encode(), "bad_request"
        s = self.settings
        try:
            if path == "/mutate":
                answer = admission.mutate(review, s.resource_domain, s.scheduler_name)
            else:
                specs = (
                    container_specs(admission.named_pod(review), s.resource_domain)
                    if review.is_pod
                    else []
                )
                answer = admission.validate(review, specs, s.resource_domain, s.memory_unit_mib)
        except (AttributeError, TypeError, ValueError, KeyError) as exc:
            log.warning("%s: unreadable pod in review %s: %r", path, review.uid, exc)
            msg = f"bad AdmissionReview: the pod is not a valid Pod object ({exc!r})\n"
            return 400, "text/plain", msg.encode(), "bad_request"
        reply = answer["response"]
        outcome = (
            "denied" if not reply["allowed"] else "patched" if reply.get("patch") else "allowed"
        )
        if outcome == "denied":
            log.info("denied pod in %s: %s", review.namespace, reply["status"]["message"])
        return 200, "application/json", json.dumps(answer).encode(), outcome

    def answer_get(self, path: str) -> tuple[int, str, bytes]:
        if path == "/healthz":
            if self.stop.is_set():
                return 503, "text/plain", b"stopping\n"
            return 200, "text/plain", b"ok\n"
        if path == "/readyz":
            if self.stop.is_set():
                return 503, "text/plain", b"not ready: stopping\n"
            if self.ready_reason:
                return 503, "text/plain", f"not ready: {self.ready_reason}\n".encode()
            return 200, "text/plain", b"ok\n"
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.metrics.registry)
        return 404, "text/plain", b"not found\n"

    # -- lifecycle

    def _reload(self, directory: Path) -> None:
        context = certs.server_context(directory)
        if self.http is not None:
            self.http.set_ssl_context(context)

    def start(self) -> None:
        s = self.settings
        log.info("vgpu %s webhook starting; effective settings: %s", __version__, s.public())
        self.keeper.refresh()
        host, _, port = s.listen.rpartition(":")
        limits = HttpLimits(
            # The API server is one peer that opens many connections.
            max_connections=256,
            max_per_peer=256,
            header_timeout_s=5.0,
            write_timeout_s=5.0,
            body_timeout_s=5.0,
            keep_alive_s=30.0,
            max_body_bytes=admission.MAX_REVIEW_BYTES,
            workers=4,
        )
        self.http = BoundedHttpServer(
            host.strip("[]") or "0.0.0.0",
            int(port),
            self.answer_get,
            inline=("/healthz", "/readyz"),
            limits=limits,
            ssl_context=certs.server_context(s.cert_dir),
            post_handler=self.admit,
        )
        try:
            self.http.start()
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {s.listen}: {exc.strerror or exc}; pick another --listen"
            ) from None
        self.ready_reason = ""
        log.info(
            "serving /mutate and /validate on https://%s:%d (scheduler name %r)",
            self.http.host,
            self.http.port,
            s.scheduler_name,
        )
        threading.Thread(target=self._keep, name="webhook-certs", daemon=True).start()

    def _keep(self) -> None:
        while not self.stop.wait(self.settings.cert_check_interval_s):
            try:
                self.keeper.refresh()
            except (KubeUnavailable, ConfigError, OSError, ValueError) as exc:
                log.warning("certificate check failed, serving the loaded one: %s", exc)
            except Exception:  # never let the renewal loop die
                log.exception("certificate check failed, serving the loaded one")

    def shutdown(self) -> None:
        self.stop.set()
        if self.http is not None:
            self.http.close()
        log.info("stopped")


def run(settings: WebhookSettings) -> int:
    """Run until SIGTERM/SIGINT. Exit codes: 0 clean stop, 2 bad config, 1 no certificate."""
    try:
        webhook = Webhook(settings)
    except ConfigError as exc:
        print(f"vgpu webhook: {exc.message}", file=sys.stderr)
        return 2
    stop_on_signals(webhook.stop, log)
    deadline = time.monotonic() + 300
    while True:
        try:
            webhook.start()
            break
        except ConfigError as exc:
            print(f"vgpu webhook: {exc.message}", file=sys.stderr)
            return 2
        except (KubeUnavailable, OSError, ValueError) as exc:
            if time.monotonic() > deadline or webhook.stop.is_set():
                print(f"vgpu webhook: no serving certificate: {exc}", file=sys.stderr)
                return 1
            log.warning("no serving certificate yet, retrying in 2s: %s", exc)
            if webhook.stop.wait(2.0):
                return 0
    while not webhook.stop.wait(1.0):
        pass
    webhook.shutdown()
    return 0
