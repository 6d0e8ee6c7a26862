"""docs/webhook.md quotes the code's own matchConditions expression and the
denial message the webhook really gives, so neither drifts."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from vgpu.adapters.kube import container_specs
from vgpu.core import admission

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "webhook.md"
WEBHOOK_CONFIGS = ROOT / "deploy" / "webhook" / "06-webhookconfiguration.yaml"


def test_doc_quotes_the_match_condition() -> None:
    assert admission.match_condition_expression("vendor.io") in DOC.read_text()


def test_doc_quotes_the_denial_message() -> None:
    pod = {
        "metadata": {"generateName": "train-", "namespace": "team-a"},
        "spec": {
            "containers": [
                {"name": "main", "resources": {"limits": {"vendor.io/vcuda-core": "30"}}}
            ]
        },
    }
    review = admission.Review("u", "", "Pod", "CREATE", "team-a", pod)
    specs = container_specs(admission.named_pod(review), "vendor.io")
    status = admission.validate(review, specs, "vendor.io", 256)["response"]["status"]
    quoted = re.search(
        r"^\s*([^\n]*) admission webhook \"([^\"]+)\" denied the request:\s*(vgpu: .*?)\s*```",
        DOC.read_text(),
        re.S | re.M,
    )
    assert quoted is not None
    prefix, webhook, text = quoted.groups()
    assert " ".join(text.split()) == status["message"]
    # A 422 (reason Invalid) with no details: kubectl says "The request is invalid".
    assert (status["code"], status["reason"]) == (422, "Invalid")
    assert prefix == "The request is invalid:"
    assert webhook == _rendered_webhook_names()["ValidatingWebhookConfiguration"]


def _rendered_webhook_names() -> dict[str, str]:
    """The one webhook name of each configuration, as deploy/ (the chart) renders it."""
    names = {}
    for obj in yaml.safe_load_all(WEBHOOK_CONFIGS.read_text()):
        (webhook,) = obj["webhooks"]
        names[obj["kind"]] = webhook["name"]
    return names


def test_doc_names_the_webhooks_as_the_chart_renders_them() -> None:
    text = DOC.read_text()
    quoted = set(re.findall(r"\b(?:mutate|validate)\.[a-z0-9.-]+\.[a-z]+\b", text))
    rendered = set(_rendered_webhook_names().values())
    assert rendered == {"mutate.vgpu.vgpu-system.vendor.io", "validate.vgpu.vgpu-system.vendor.io"}
    # Every concrete webhook name the page quotes is one the chart renders.
    assert quoted == rendered, quoted - rendered
