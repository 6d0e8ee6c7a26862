"""The API calls `vgpu webhook` makes: its certificate Secret and the caBundle of
its two webhook configurations. Raw JSON in and out (no model objects); the
client's exceptions never leak: NotFound is None, 409 is Conflict, the rest is
KubeUnavailable with the address, the status or OS error and what to check.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vgpu.adapters.kube import KubeUnavailable, api_client
from vgpu.adapters.kube_errors import api_error_text

JSON = dict[str, Any]
MUTATING = "mutatingwebhookconfigurations"
VALIDATING = "validatingwebhookconfigurations"


class Conflict(Exception):
    """409: the object exists already (create) or changed since it was read (replace)."""


class WebhookApi:
    def __init__(self, kubeconfig: Path | None, timeout_s: float = 10.0) -> None:
        from kubernetes import client

        self._client = api_client(kubeconfig)
        self.address = str(self._client.configuration.host)
        self._core = client.CoreV1Api(self._client)
        self._adm = client.AdmissionregistrationV1Api(self._client)
        self.timeout_s = timeout_s

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> JSON | None:
        from kubernetes.client.exceptions import ApiException

        try:
            reply = fn(*args, _preload_content=False, _request_timeout=self.timeout_s)
            data = reply.data
            reply.release_conn()
            out = json.loads(data)
        except ApiException as exc:
            if exc.status == 404:
                return None
            if exc.status == 409:
                raise Conflict(f"{what}: {api_error_text(exc, self.address)}") from None
            raise KubeUnavailable(f"{what}: {api_error_text(exc, self.address)}") from None
        except Exception as exc:  # urllib3, socket and decoding errors alike
            raise KubeUnavailable(f"{what}: {api_error_text(exc, self.address)}") from None
        if not isinstance(out, dict):
            raise KubeUnavailable(f"{what}: API server {self.address} answered no JSON object")
        return out

    def read_secret(self, namespace: str, name: str) -> JSON | None:
        return self._call(
            f"reading Secret {namespace}/{name}",
            self._core.read_namespaced_secret,
            name,
            namespace,
        )

    def create_secret(self, namespace: str, body: JSON) -> JSON:
        name = body["metadata"]["name"]
        out = self._call(
            f"creating Secret {namespace}/{name}",
            self._core.create_namespaced_secret,
            namespace,
            body,
        )
        if out is None:
            raise KubeUnavailable(f"creating Secret {namespace}/{name}: namespace not found")
        return out

    def replace_secret(self, namespace: str, body: JSON) -> JSON:
        """Replace with body's metadata.resourceVersion as the precondition (409 if stale)."""
        name = body["metadata"]["name"]
        out = self._call(
            f"replacing Secret {namespace}/{name}",
            self._core.replace_namespaced_secret,
            name,
            namespace,
            body,
        )
        if out is None:
            raise Conflict(f"Secret {namespace}/{name} is gone")
        return out

    def read_config(self, resource: str, name: str) -> JSON | None:
        fn = (
            self._adm.read_mutating_webhook_configuration
            if resource == MUTATING
            else self._adm.read_validating_webhook_configuration
        )
        return self._call(f"reading {resource} {name}", fn, name)

    def replace_config(self, resource: str, body: JSON) -> JSON:
        name = body["metadata"]["name"]
        fn = (
            self._adm.replace_mutating_webhook_configuration
            if resource == MUTATING
            else self._adm.replace_validating_webhook_configuration
        )
        out = self._call(f"replacing {resource} {name}", fn, name, body)
        if out is None:
            raise Conflict(f"{resource} {name} is gone")
        return out
