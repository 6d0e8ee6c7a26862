"""The fake API server's Secrets and webhook configurations, driven by the
official kubernetes client over real HTTP: create-if-absent (409
AlreadyExists), optimistic concurrency (409 Conflict on a stale
resourceVersion), 404, and garbage collection by ownerReference."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from vgpu.sim.apiserver import FakeApiServer


@pytest.fixture
def apis() -> Iterator[tuple[FakeApiServer, client.CoreV1Api, client.AdmissionregistrationV1Api]]:
    with FakeApiServer() as server, tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kubeconfig"
        server.write_kubeconfig(path)
        cfg = client.Configuration()
        config.load_kube_config(config_file=str(path), client_configuration=cfg)
        api = client.ApiClient(cfg)
        yield server, client.CoreV1Api(api), client.AdmissionregistrationV1Api(api)


def _secret(name: str, owner_uid: str | None = None) -> client.V1Secret:
    owners = (
        [
            client.V1OwnerReference(
                api_version="admissionregistration.k8s.io/v1",
                kind="MutatingWebhookConfiguration",
                name="hook",
                uid=owner_uid,
            )
        ]
        if owner_uid
        else None
    )
    return client.V1Secret(
        metadata=client.V1ObjectMeta(name=name, owner_references=owners),
        type="kubernetes.io/tls",
        data={"tls.crt": "Y3J0", "tls.key": "a2V5"},
    )


def _hook_config() -> client.V1MutatingWebhookConfiguration:
    return client.V1MutatingWebhookConfiguration(
        metadata=client.V1ObjectMeta(name="hook"),
        webhooks=[
            client.V1MutatingWebhook(
                name="mutate.vgpu.vendor.io",
                client_config=client.AdmissionregistrationV1WebhookClientConfig(
                    service=client.AdmissionregistrationV1ServiceReference(
                        namespace="ns", name="svc"
                    )
                ),
                admission_review_versions=["v1"],
                side_effects="None",
            )
        ],
    )


def test_secret_create_if_absent_and_conflicts(apis: tuple) -> None:  # type: ignore[type-arg]
    server, core, _ = apis
    created = core.create_namespaced_secret("ns", _secret("tls"))
    assert created.metadata.namespace == "ns" and created.metadata.resource_version
    with pytest.raises(ApiException) as again:
        core.create_namespaced_secret("ns", _secret("tls"))
    assert again.value.status == 409 and "AlreadyExists" in str(again.value.body)
    read = core.read_namespaced_secret("tls", "ns")
    read.data["tls.crt"] = "bmV3"
    replaced = core.replace_namespaced_secret("tls", "ns", read)
    assert replaced.metadata.resource_version != read.metadata.resource_version
    with pytest.raises(ApiException) as stale:
        core.replace_namespaced_secret("tls", "ns", read)  # read's rv is old now
    assert stale.value.status == 409
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_secret("other", "ns")
    assert missing.value.status == 404
    assert server.get_webhook_object("secrets", "tls", "ns")["data"]["tls.crt"] == "bmV3"  # type: ignore[index]


def test_webhook_configuration_replace_and_owner_gc(apis: tuple) -> None:  # type: ignore[type-arg]
    server, core, adm = apis
    made = adm.create_mutating_webhook_configuration(_hook_config())
    core.create_namespaced_secret("ns", _secret("owned", made.metadata.uid))
    core.create_namespaced_secret("ns", _secret("free"))
    read = adm.read_mutating_webhook_configuration("hook")
    read.webhooks[0].client_config.ca_bundle = "Q0E="
    adm.replace_mutating_webhook_configuration("hook", read)
    again = adm.read_mutating_webhook_configuration("hook")
    assert again.webhooks[0].client_config.ca_bundle == "Q0E="
    with pytest.raises(ApiException) as stale:
        adm.replace_mutating_webhook_configuration("hook", read)
    assert stale.value.status == 409
    adm.delete_mutating_webhook_configuration("hook")
    assert server.get_webhook_object("secrets", "owned", "ns") is None
    assert server.get_webhook_object("secrets", "free", "ns") is not None
    with pytest.raises(ApiException) as gone:
        adm.read_validating_webhook_configuration("hook")
    assert gone.value.status == 404
