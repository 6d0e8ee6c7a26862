"""docs/webhook.md quotes the code's own matchConditions expression and the
denial message the webhook really gives, so neither drifts."""

from __future__ import annotations

import re
from pathlib import Path

from vgpu.adapters.kube import container_specs
from vgpu.core import admission

DOC = Path(__file__).resolve().parents[2] / "docs" / "webhook.md"


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
    message = admission.validate(review, specs, "vendor.io", 256)["response"]["status"]["message"]
    quoted = re.search(r"denied the request:\s*(vgpu: .*?)\s*```", DOC.read_text(), re.S)
    assert quoted is not None
    assert " ".join(quoted.group(1).split()) == message
