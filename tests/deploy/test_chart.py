"""charts/vgpu rendered and linted by Helm's own engine (helm-python-sdk, Helm v4's Go SDK).

Every combination of mode x scheduler x webhook x monitoring is rendered and
each object validated strictly against the oldest supported and the newest
Kubernetes schema; the objects Kubernetes' schemas do not know (the
Prometheus Operator's ServiceMonitor, cert-manager's Certificate and Issuer)
are checked field by field here. The webhook's CEL matchCondition is
evaluated with cel-python against pods that do and do not ask for vgpu.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import celpy
import helm_python
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from vgpu import config

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "vgpu"
NS = "vgpu-system"
OLDEST = "1.30"
OLDEST_DRA = "1.34"  # resource.k8s.io/v1 DeviceClass
NEWEST = latest_version()
CRD_KINDS = {"ServiceMonitor", "Certificate", "Issuer"}

_spec = importlib.util.spec_from_file_location("vgpu_deploy_render", ROOT / "deploy" / "render.py")
assert _spec and _spec.loader
render_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_module)


def render(values: dict[str, Any], name: str = "vgpu", namespace: str = NS) -> list[dict[str, Any]]:
    return [yaml.safe_load(doc) for doc in render_module.render(values, name, namespace)]


def kinds(objects: list[dict[str, Any]]) -> set[str]:
    return {o["kind"] for o in objects}


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"{kind} {name}: {len(found)}"
    return found[0]


MONITORING_ON = {
    "serviceMonitor": {"enabled": True, "force": True},
    "dashboard": {"enabled": True},
}
COMBOS = [
    {
        "mode": mode,
        "scheduler": {"enabled": scheduler},
        "webhook": {"enabled": webhook},
        **({"monitoring": MONITORING_ON} if monitoring else {}),
    }
    for mode, scheduler, webhook, monitoring in itertools.product(
        ["device-plugin", "dra"], [None, True, False], [None, True, False], [False, True]
    )
    if not (mode == "dra" and (scheduler or webhook))
]
COMBOS.append(
    {"webhook": {"certManager": {"enabled": True}, "tlsSans": ["gpu.example", "10.0.0.7"]}}
)
# A kubelet with another root directory, every component on the host network.
K0S_ROOT = "/var/lib/k0s/kubelet"
HOST_NETWORK = {
    "kubeletRootDir": K0S_ROOT,
    "daemon": {"hostNetwork": True},
    "scheduler": {"hostNetwork": True, "kubeScheduler": {"securePort": 10269}},
    "webhook": {"hostNetwork": True, "port": 9443},
}
COMBOS.append(HOST_NETWORK)
COMBOS.append({"mode": "dra", "kubeletRootDir": K0S_ROOT, "daemon": {"hostNetwork": True}})
# A cluster reached only on loopback with no kube-proxy (as ../shared/realk8s):
# the e2e profile's values, with its ${...} filled in.
MOCK_CARD = {"uuid": "GPU-8f0e3c7a-0000-4000-8000-000000000000", "name": "NVIDIA H200"}
SANDBOX = {
    "apiServer": {"host": "127.0.0.1", "port": 6443},
    "bindAddress": "127.0.0.1",
    "kubeletRootDir": "/tmp/node/kubelet",
    "cdiSpecDir": "/tmp/node/cdi",
    "deviceListStrategy": "cdi",
    "daemon": {"hostNetwork": True, "mockGpus": [{**MOCK_CARD, "memory_mib": 143771}]},
    "scheduler": {"hostNetwork": True, "replicas": 1},
    "webhook": {
        "hostNetwork": True,
        "replicas": 1,
        "url": "https://127.0.0.1:8443",
        "tlsSans": ["127.0.0.1"],
    },
}
COMBOS.append(SANDBOX)
COMBOS.append({**SANDBOX, "mode": "dra", "scheduler": {}, "webhook": {}})
COMBO_IDS = [json.dumps(c, separators=(",", ":")) for c in COMBOS]
RENDERED = {cid: render(c) for cid, c in zip(COMBO_IDS, COMBOS, strict=True)}


# ------------------------------------------------------------ one source


def test_deploy_and_schema_are_rendered_from_the_chart() -> None:
    assert render_module.stale(render_module.all_files()) == [], "run `make deploy`"


def test_render_check_names_a_stale_file(tmp_path: Path) -> None:
    # The currency check can fail: a file that differs is named.
    files = render_module.all_files()
    path = next(p for p in files if p.name == "04-daemonset.yaml")
    changed = {**files, path: files[path] + "# edited\n"}
    assert render_module.stale(changed) == [str(path.relative_to(ROOT))]


LINTED = [
    {},
    {"mode": "dra"},
    {"monitoring": MONITORING_ON, "scheduler": {"enabled": False}},
    {"webhook": {"certManager": {"enabled": True}}},
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("values", LINTED, ids=[json.dumps(v) for v in LINTED])
def test_helm_lint_is_clean(values: dict[str, Any]) -> None:
    for version in ("v1.30.0", "v1.37.0"):
        report = helm_python.lint(CHART, values, strict=True, kube_version=version, namespace=NS)
        assert report["errors"] == []
        # Severity 1 is information only ("icon is recommended").
        assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_helm_lint_reports_a_broken_value() -> None:
    report = helm_python.lint(CHART, {"webhook": {"enabld": True}}, strict=True, namespace=NS)
    assert any("enabld" in m["error"] for m in report["messages"] if m["severity"] >= 3) or any(
        "enabld" in e for e in report["errors"]
    )


# ------------------------------------------------------ every combination


_VALID: set[tuple[str, str]] = set()


# The first objects of each kind load that version's JSON schemas: seconds
# alone, minutes on a loaded machine.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("combo", COMBO_IDS)
def test_every_combination_renders_valid_objects(combo: str) -> None:
    objects = RENDERED[combo]
    values = json.loads(combo)
    dra = values.get("mode") == "dra"
    versions = [OLDEST_DRA if dra else OLDEST, NEWEST]
    assert NEWEST.startswith("1.37"), NEWEST
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            check_crd_object(obj)
            continue
        for version in versions:
            key = (json.dumps(obj, sort_keys=True), version)
            if key in _VALID:
                continue  # the same object, already valid in another combination
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} {version}: {exc.message}")
            _VALID.add(key)
    # What is rendered follows the switches.
    scheduler = (
        not dra and values["scheduler"].get("enabled") is not False
        if "scheduler" in values
        else not dra
    )
    webhook = not dra and values["webhook"].get("enabled") is not False
    assert ("Deployment" in kinds(objects)) == (scheduler or webhook)
    assert any(o["metadata"]["name"] == "vgpu-scheduler" for o in objects) == scheduler
    assert ("MutatingWebhookConfiguration" in kinds(objects)) == webhook
    assert ("ServiceMonitor" in kinds(objects)) == ("monitoring" in values)
    assert ("DeviceClass" in kinds(objects)) == dra
    assert one(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "vgpu",
        "serve",
    ]


def test_dra_mode_refuses_the_scheduler_and_the_webhook_by_name() -> None:
    chart = helm_python.Chart.load(CHART)
    for key in ("scheduler", "webhook"):
        with pytest.raises(helm_python.HelmError, match=rf"{key}\.enabled"):
            chart.render({"mode": "dra", key: {"enabled": True}}, name="vgpu", namespace=NS)


def test_default_install_is_device_plugin_with_per_card_scheduling() -> None:
    objects = render({})
    assert kinds(objects) >= {"DaemonSet", "Deployment", "MutatingWebhookConfiguration"}
    webhook = one(objects, "Deployment", "vgpu-webhook")
    args = webhook["spec"]["template"]["spec"]["containers"][0]["args"]
    ksc = yaml.safe_load(
        one(objects, "ConfigMap", "vgpu-scheduler-config")["data"]["scheduler-config.yaml"]
    )
    assert f"--scheduler-name={ksc['profiles'][0]['schedulerName']}" in args
    assert one(objects, "Deployment", "vgpu-scheduler")["spec"]["replicas"] == 2
    assert one(objects, "PodDisruptionBudget", "vgpu-scheduler")["spec"]["maxUnavailable"] == 1
    # Not rendered offline: the cluster does not serve monitoring.coreos.com/v1.
    assert "ServiceMonitor" not in kinds(
        render({"monitoring": {"serviceMonitor": {"enabled": True}}})
    )


def test_no_scheduler_means_no_mutation() -> None:
    objects = render({"scheduler": {"enabled": False}})
    args = one(objects, "Deployment", "vgpu-webhook")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert "--scheduler-name=" in args


# ------------------------------------------------------------- uninstall


@pytest.mark.parametrize("combo", COMBO_IDS)
def test_helm_uninstall_leaves_nothing_behind(combo: str) -> None:
    for obj in RENDERED[combo]:
        meta = obj["metadata"]
        annotations = meta.get("annotations") or {}
        assert not any(k.startswith("helm.sh/hook") for k in annotations), meta["name"]
        assert annotations.get("helm.sh/resource-policy") != "keep", meta["name"]
        assert meta["labels"]["app.kubernetes.io/instance"] == "vgpu", meta["name"]
        # The webhook's Secret is made at run time, owned by the webhook configuration.
        assert obj["kind"] != "Secret"
    assert not (CHART / "crds").exists()


# ------------------------------------------------------------- webhook


def test_webhook_configurations_fail_closed_only_for_vgpu_pods() -> None:
    objects = render({"webhook": {"excludeNamespaces": ["batch-system"]}})
    mutating = one(objects, "MutatingWebhookConfiguration")
    validating = one(objects, "ValidatingWebhookConfiguration")
    for configuration, path in ((mutating, "/mutate"), (validating, "/validate")):
        (hook,) = configuration["webhooks"]
        assert hook["failurePolicy"] == "Fail"
        assert hook["timeoutSeconds"] == 5
        assert hook["sideEffects"] == "None"
        assert hook["admissionReviewVersions"] == ["v1"]
        assert hook["clientConfig"]["service"] == {
            "name": "vgpu-webhook",
            "namespace": NS,
            "path": path,
            "port": 443,
        }
        (expr,) = hook["namespaceSelector"]["matchExpressions"]
        assert expr["key"] == "kubernetes.io/metadata.name" and expr["operator"] == "NotIn"
        assert set(expr["values"]) == {"kube-system", NS, "batch-system"}
        assert [c["name"] for c in hook["matchConditions"]] == ["asks-for-vgpu"]
        assert hook["rules"] == [
            {
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "operations": ["CREATE"],
                "resources": ["pods"],
                "scope": "Namespaced",
            }
        ]
        assert "caBundle" not in hook["clientConfig"]  # written by the webhook
    assert mutating["webhooks"][0]["reinvocationPolicy"] == "IfNeeded"
    service = one(objects, "Service", "vgpu-webhook")
    deployment = one(objects, "Deployment", "vgpu-webhook")
    assert (
        service["spec"]["selector"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )


def test_webhook_args_are_the_agreed_flags() -> None:
    objects = render({"webhook": {"tlsSans": ["gpu.example"]}})
    container = one(objects, "Deployment", "vgpu-webhook")["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert container["command"] == ["vgpu", "webhook"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    assert flags == {
        "listen": "0.0.0.0:8443",
        "cert-dir": "/var/run/vgpu-webhook/certs",
        "secret": f"{NS}/vgpu-webhook-tls",
        "service": f"{NS}/vgpu-webhook",
        "mutating-config": one(objects, "MutatingWebhookConfiguration")["metadata"]["name"],
        "validating-config": one(objects, "ValidatingWebhookConfiguration")["metadata"]["name"],
        "tls-san": "gpu.example",
        "scheduler-name": "vgpu-scheduler",
        "resource-domain": "vendor.io",
    }
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "certs")
    assert mount["mountPath"] == flags["cert-dir"]


def test_webhook_rbac_is_its_secret_and_its_two_configurations() -> None:
    objects = render({})
    role = one(objects, "Role", "vgpu-webhook")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": ["vgpu-webhook-tls"],
            "verbs": ["get", "update"],
        },
    ]
    assert role["metadata"]["namespace"] == NS
    cluster_role = one(objects, "ClusterRole", "vgpu-webhook")
    names = {r["resources"][0]: (r["resourceNames"], r["verbs"]) for r in cluster_role["rules"]}
    assert names == {
        "mutatingwebhookconfigurations": (
            [one(objects, "MutatingWebhookConfiguration")["metadata"]["name"]],
            ["get", "update"],
        ),
        "validatingwebhookconfigurations": (
            [one(objects, "ValidatingWebhookConfiguration")["metadata"]["name"]],
            ["get", "update"],
        ),
    }
    for obj in objects:
        if obj["kind"] in ("Role", "ClusterRole"):
            assert "*" not in yaml.safe_dump(obj), obj["metadata"]["name"]


def test_cert_manager_mode_injects_the_ca_and_makes_no_secret() -> None:
    objects = render(
        {"webhook": {"certManager": {"enabled": True}, "tlsSans": ["gpu.example", "10.0.0.7"]}}
    )
    certificate = one(objects, "Certificate")
    assert certificate["spec"]["secretName"] == "vgpu-webhook-tls"
    assert certificate["spec"]["dnsNames"] == [
        f"vgpu-webhook.{NS}.svc",
        f"vgpu-webhook.{NS}.svc.cluster.local",
        "gpu.example",
    ]
    assert certificate["spec"]["ipAddresses"] == ["10.0.0.7"]
    assert certificate["spec"]["issuerRef"] == {
        "name": "vgpu-webhook",
        "kind": "Issuer",
        "group": "cert-manager.io",
    }
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        annotations = one(objects, kind)["metadata"]["annotations"]
        assert annotations == {"cert-manager.io/inject-ca-from": f"{NS}/vgpu-webhook"}
    spec = one(objects, "Deployment", "vgpu-webhook")["spec"]["template"]["spec"]
    assert spec["volumes"][0]["secret"] == {"secretName": "vgpu-webhook-tls"}
    args = spec["containers"][0]["args"]
    assert not any(a.startswith(("--secret=", "--mutating-config=")) for a in args)
    assert not (
        {"Role", "RoleBinding"} & {o["kind"] for o in objects if "webhook" in o["metadata"]["name"]}
    )


# --------------------------------------------------------- matchConditions

POD_BASE: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}


def _pod(
    containers: list[dict[str, Any]], init: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": containers}
    if init is not None:
        spec["initContainers"] = init
    return {**POD_BASE, "spec": spec}


def _c(
    requests: dict[str, str] | None = None, limits: dict[str, str] | None = None
) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "c", "image": "i"}
    resources: dict[str, Any] = {}
    if requests is not None:
        resources["requests"] = requests
    if limits is not None:
        resources["limits"] = limits
    if resources or requests == {}:
        container["resources"] = resources
    return container


def _match_expression(domain: str = "vendor.io") -> str:
    hook = one(render({"resourceDomain": domain}), "ValidatingWebhookConfiguration")["webhooks"][0]
    expression: str = hook["matchConditions"][0]["expression"]
    return expression


CEL_CASES = [
    (
        "core-limit",
        _pod([_c(limits={"vendor.io/vcuda-core": "30", "vendor.io/vcuda-memory": "4"})]),
        True,
    ),
    ("memory-request-only", _pod([_c(requests={"vendor.io/vcuda-memory": "4"})]), True),
    ("core-request-only", _pod([_c(requests={"vendor.io/vcuda-core": "50"})]), True),
    (
        "second-container",
        _pod([_c(), _c(limits={"cpu": "1"}), _c(limits={"vendor.io/vcuda-core": "100"})]),
        True,
    ),
    (
        "init-container",
        _pod([_c(limits={"cpu": "1"})], [_c(limits={"vendor.io/vcuda-memory": "1"})]),
        True,
    ),
    ("no-resources", _pod([_c()]), False),
    ("empty-resources", _pod([_c(requests={})]), False),
    ("cpu-only", _pod([_c(requests={"cpu": "1"}, limits={"memory": "1Gi"})]), False),
    ("whole-gpu", _pod([_c(limits={"nvidia.com/gpu": "1"})]), False),
    ("other-domain", _pod([_c(limits={"example.com/vcuda-core": "30"})]), False),
    ("init-without", _pod([_c()], [_c(limits={"cpu": "1"})]), False),
    ("lookalike", _pod([_c(limits={"vendor.io/vcuda-core-limit": "1"})]), False),
]


@pytest.fixture(scope="module")
def match_program() -> Any:
    env = celpy.Environment()
    return env.program(env.compile(_match_expression()))


@pytest.mark.parametrize(
    ("pod", "expected"), [(p, e) for _, p, e in CEL_CASES], ids=[i for i, _, _ in CEL_CASES]
)
def test_match_condition_selects_only_vgpu_pods(
    match_program: Any, pod: dict[str, Any], expected: bool
) -> None:
    result = match_program.evaluate({"object": celpy.json_to_cel(pod)})
    assert bool(result) is expected


def test_match_condition_follows_the_resource_domain() -> None:
    env = celpy.Environment()
    program = env.program(env.compile(_match_expression("gpu.example.com")))
    ours = _pod([_c(limits={"gpu.example.com/vcuda-core": "30"})])
    theirs = _pod([_c(limits={"vendor.io/vcuda-core": "30"})])
    assert bool(program.evaluate({"object": celpy.json_to_cel(ours)})) is True
    assert bool(program.evaluate({"object": celpy.json_to_cel(theirs)})) is False


# ---------------------------------------------------------------- schema

BAD_VALUES = [
    ({"mode": "gpu"}, "/mode"),
    ({"schedular": {"enabled": True}}, "schedular"),
    ({"webhook": {"enabld": True}}, "enabld"),
    ({"webhook": {"failurePolicy": "ignore"}}, "failurePolicy"),
    ({"daemon": {"config": {"polcy": "binpack"}}}, "polcy"),
    ({"daemon": {"config": {"memory_unit_mib": "256"}}}, "memory_unit_mib"),
    ({"daemon": {"resources": {"limit": {"cpu": "1"}}}}, "limit"),
    ({"scheduler": {"kubeScheduler": {"image": {"tag": "latest"}}}}, "tag"),
    ({"monitoring": {"dashboard": {"enable": True}}}, "enable"),
    ({"deviceListStrategy": "nvidia"}, "deviceListStrategy"),
    ({"hookInjection": "preload"}, "hookInjection"),
    ({"scheduler": {"extender": {"nodeChoice": "kube"}}}, "nodeChoice"),
    ({"image": {"repo": "x"}}, "repo"),
    ({"kubeletRootDir": "var/lib/kubelet"}, "kubeletRootDir"),
    ({"kubeletRootDir": "/var/lib/kubelet/"}, "kubeletRootDir"),
    ({"kubeletDevicePluginDir": ""}, "kubeletDevicePluginDir"),
    ({"webhook": {"hostNetwork": "yes"}}, "hostNetwork"),
    ({"scheduler": {"kubeScheduler": {"securePort": 0}}}, "securePort"),
    ({"webhook": {"url": "http://127.0.0.1:8443"}}, "url"),
    ({"bindAddress": "localhost"}, "bindAddress"),
    ({"cdiSpecDir": "run/cdi"}, "cdiSpecDir"),
    ({"apiServer": {"hostname": "127.0.0.1"}}, "hostname"),
    ({"apiServer": {"host": "127.0.0.1", "port": 0}}, "port"),
    ({"daemon": {"mockGpus": "preset:2xH200"}}, "mockGpus"),
]


@pytest.mark.parametrize(("values", "key"), BAD_VALUES, ids=[k for _, k in BAD_VALUES])
def test_schema_refuses_bad_values_naming_the_key(values: dict[str, Any], key: str) -> None:
    chart = helm_python.Chart.load(CHART)
    with pytest.raises(helm_python.HelmValuesError, match=re.escape(key)):
        chart.validate_schema(values)
    with pytest.raises(helm_python.HelmError, match=re.escape(key)):
        chart.render(values, name="vgpu", namespace=NS)


def test_schema_sets_additional_properties_false_on_every_object() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    seen = 0

    def walk(node: dict[str, Any], where: str) -> None:
        nonlocal seen
        if "properties" in node:
            seen += 1
            assert node.get("additionalProperties") is False, where
            for name, child in node["properties"].items():
                walk(child, f"{where}.{name}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{where}[]")

    walk(schema, "values")
    assert seen > 20
    config_keys = set(schema["properties"]["daemon"]["properties"]["config"]["properties"])
    assert config_keys == {"version", *config.KEYS}


def test_defaults_pass_the_schema() -> None:
    helm_python.Chart.load(CHART).validate_schema({})


# --------------------------------------------------------------- config


def test_config_values_reach_the_daemon_and_load(tmp_path: Path) -> None:
    objects = render(
        {
            "resourceDomain": "gpu.example.com",
            "daemon": {
                "config": {"policy": "spread", "ignored_xids": [13, 31], "log_format": "json"}
            },
        }
    )
    path = tmp_path / "config.yaml"
    path.write_text(one(objects, "ConfigMap", "vgpu-config")["data"]["config.yaml"])
    settings = config.load({}, {}, path)
    assert settings.resource_domain == "gpu.example.com"
    assert settings.policy.value == "spread"
    assert settings.ignored_xids == (13, 31)
    assert settings.log_format == "json"
    ds = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    assert ds["nodeSelector"] == {"gpu.example.com/vgpu": "true"}
    ext = yaml.safe_load(
        one(objects, "ConfigMap", "vgpu-scheduler-config")["data"]["extender.yaml"]
    )
    assert ext["resource_domain"] == "gpu.example.com"


def test_node_choice_reaches_the_extender_config(tmp_path: Path) -> None:
    def node_choice(values: dict[str, Any]) -> str:
        text = one(render(values), "ConfigMap", "vgpu-scheduler-config")["data"]["extender.yaml"]
        path = tmp_path / "extender.yaml"
        path.write_text(text)
        return config.load_extender({}, {}, path).node_choice

    assert node_choice({}) == "extender"
    assert node_choice({"scheduler": {"extender": {"nodeChoice": "scheduler"}}}) == "scheduler"


def test_strategy_and_injection_values_are_written_only_when_set() -> None:
    default = yaml.safe_load(one(render({}), "ConfigMap", "vgpu-config")["data"]["config.yaml"])
    assert "device_list_strategy" not in default and "hook_injection" not in default
    objects = render({"deviceListStrategy": "cdi", "hookInjection": "env"})
    data = yaml.safe_load(one(objects, "ConfigMap", "vgpu-config")["data"]["config.yaml"])
    assert (data["device_list_strategy"], data["hook_injection"]) == ("cdi", "env")
    volumes = {
        v["name"]: v for v in one(objects, "DaemonSet")["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["cdi"]["hostPath"]["path"] == "/var/run/cdi"


def test_placement_values_reach_every_workload() -> None:
    placement = {
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [{"key": "k", "operator": "Exists"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "a", "operator": "Exists"}]}
                    ]
                }
            }
        },
        "priorityClassName": "high",
    }
    objects = render(
        {
            "imagePullSecrets": ["regcred"],
            "image": {"repository": "reg.example/vgpu", "tag": "1.2.3"},
            "daemon": {**placement, "resources": {"limits": {"cpu": "2", "memory": "1Gi"}}},
            "scheduler": placement,
            "webhook": placement,
        }
    )
    for obj in objects:
        if obj["kind"] in ("DaemonSet", "Deployment"):
            spec = obj["spec"]["template"]["spec"]
            assert spec["imagePullSecrets"] == [{"name": "regcred"}]
            assert spec["nodeSelector"] == {"pool": "gpu"}
            assert spec["tolerations"] == placement["tolerations"]
            assert spec["affinity"] == placement["affinity"]
            assert spec["priorityClassName"] == "high"
            images = {c["name"]: c["image"] for c in spec["containers"]}
            assert "reg.example/vgpu:1.2.3" in images.values()
    ds = one(objects, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    assert ds["resources"]["limits"] == {"cpu": "2", "memory": "1Gi"}


# ---------------------------------------------------- two releases, one cluster


def _identity(obj: dict[str, Any]) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def test_two_releases_with_different_node_selectors_coexist() -> None:
    # The migration path: the device-plugin release keeps the scheduler and the
    # webhook; a DRA release takes the nodes labelled for DRA.
    a = render({"daemon": {"nodeSelector": {"vendor.io/vgpu": "true"}}}, name="vgpu")
    b = render(
        {"mode": "dra", "daemon": {"nodeSelector": {"vendor.io/vgpu": "dra"}}}, name="vgpu-dra"
    )
    assert not {_identity(o) for o in a} & {_identity(o) for o in b}
    # Two device-plugin releases (e.g. two node pools): the second brings no scheduler/webhook.
    c = render(
        {
            "daemon": {"nodeSelector": {"pool": "b"}},
            "scheduler": {"enabled": False},
            "webhook": {"enabled": False},
        },
        name="vgpu-pool-b",
    )
    assert not {_identity(o) for o in a} & {_identity(o) for o in c}
    selectors = [one(objs, "DaemonSet")["spec"]["selector"]["matchLabels"] for objs in (a, b, c)]
    assert len({json.dumps(s, sort_keys=True) for s in selectors}) == 3
    # A second DRA release shares the cluster-wide DeviceClass.
    d = render({"mode": "dra", "dra": {"deviceClass": {"create": False}}}, name="vgpu-dra-2")
    assert "DeviceClass" not in kinds(d)
    assert not {_identity(o) for o in b} & {_identity(o) for o in d}


# ------------------------------------------------------------- monitoring


def test_service_monitor_scrapes_every_metrics_port() -> None:
    objects = render({"monitoring": MONITORING_ON})
    monitor = one(objects, "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [o for o in objects if o["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} == {
        "vgpu-metrics",
        "vgpu-scheduler-metrics",
        "vgpu-webhook",
    }
    ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    for service in services:
        assert selector.items() <= service["metadata"]["labels"].items()
        assert {p["name"] for p in service["spec"]["ports"]} & ports
    https = next(e for e in monitor["spec"]["endpoints"] if e["port"] == "https")
    assert https["tlsConfig"]["ca"]["secret"] == {"name": "vgpu-webhook-tls", "key": "ca.crt"}


def check_crd_object(obj: dict[str, Any]) -> None:
    """The fields of the custom objects the chart renders, as their CRDs define them."""
    meta = obj["metadata"]
    assert set(meta) <= {"name", "namespace", "labels", "annotations"}
    spec = obj["spec"]
    if obj["kind"] == "ServiceMonitor":
        assert obj["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(spec) <= {"namespaceSelector", "selector", "endpoints"}
        assert set(spec["namespaceSelector"]) == {"matchNames"}
        for endpoint in spec["endpoints"]:
            assert set(endpoint) <= {"port", "path", "scheme", "interval", "tlsConfig"}
            assert re.fullmatch(r"[0-9]+(ms|s|m|h)", endpoint["interval"])
            if "tlsConfig" in endpoint:
                assert set(endpoint["tlsConfig"]) <= {"serverName", "ca"}
    elif obj["kind"] == "Certificate":
        assert obj["apiVersion"] == "cert-manager.io/v1"
        assert set(spec) <= {
            "secretName",
            "dnsNames",
            "ipAddresses",
            "duration",
            "renewBefore",
            "privateKey",
            "issuerRef",
        }
        assert spec["privateKey"]["algorithm"] in ("RSA", "ECDSA", "Ed25519")
        assert spec["privateKey"]["rotationPolicy"] in ("Never", "Always")
        assert set(spec["issuerRef"]) <= {"name", "kind", "group"}
    elif obj["kind"] == "Issuer":
        assert obj["apiVersion"] == "cert-manager.io/v1"
        assert spec == {"selfSigned": {}}
    else:  # pragma: no cover - CRD_KINDS lists the three above
        pytest.fail(obj["kind"])


def test_crd_checker_refuses_a_misspelt_field() -> None:
    monitor = one(render({"monitoring": MONITORING_ON}), "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    with pytest.raises(AssertionError):
        check_crd_object(monitor)


def test_dashboard_is_a_grafana_dashboard_of_exported_metrics() -> None:
    objects = render({"monitoring": MONITORING_ON})
    configmap = one(objects, "ConfigMap", "vgpu-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(configmap["data"]["vgpu.json"])
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    titles = " | ".join(p["title"] for p in panels).lower()
    for topic in ("per card", "per-container", "refusals", "admission latency", "extender latency"):
        assert topic in titles, topic
    source = "\n".join(p.read_text() for p in (ROOT / "vgpu").rglob("*.py"))
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            for metric in set(re.findall(r"\bvgpu_[a-z_]+", target["expr"])):
                base = re.sub(r"_(total|bucket|sum|count)$", "", metric)
                assert f'"{base}"' in source, f"{panel['title']}: {metric} is not exported"


def test_dashboard_file_is_the_configmaps_content() -> None:
    objects = render({"monitoring": {"dashboard": {"enabled": True}}})
    text = one(objects, "ConfigMap", "vgpu-dashboard")["data"]["vgpu.json"]
    assert json.loads(text) == json.loads((CHART / "dashboards" / "vgpu.json").read_text())


def test_render_script_runs_as_make_deploy_does() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "render.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_the_leader_election_lease_belongs_to_the_release() -> None:
    # Rendered empty so that `helm uninstall` removes what kube-scheduler fills in.
    objects = render({"scheduler": {"name": "gpu-scheduler"}}, namespace="gpu-ops")
    ksc = yaml.safe_load(
        one(objects, "ConfigMap", "vgpu-scheduler-config")["data"]["scheduler-config.yaml"]
    )
    election = ksc["leaderElection"]
    lease = one(objects, "Lease")
    assert (
        (lease["metadata"]["namespace"], lease["metadata"]["name"])
        == (
            election["resourceNamespace"],
            election["resourceName"],
        )
        == ("gpu-ops", "gpu-scheduler")
    )
    assert lease["spec"] == {}  # the holder fields stay kube-scheduler's
    role = one(objects, "Role", "vgpu-scheduler-leader-election")
    assert any(r.get("resourceNames") == ["gpu-scheduler"] for r in role["rules"])


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("resource_domain", "gpu.example.com", "resourceDomain"),
        ("metrics_address", "0.0.0.0:9999", "daemon.metricsPort"),
        ("mode", "dra", "mode"),
        ("hook_injection", "env", "hookInjection"),
        ("state_dir", "/data/vgpu", "mounts this path"),
        ("device_plugin_dir", "/k/device-plugins", "kubeletDevicePluginDir"),
        ("pod_resources_socket", "/k/pod-resources/kubelet.sock", "kubeletRootDir"),
        ("kubelet_registry_dir", "/k/plugins_registry", "kubeletRootDir"),
        ("kubelet_plugin_dir", "/k/plugins/vgpu.vendor.io", "kubeletRootDir"),
        ("cdi_dir", "/etc/cdi", "cdiSpecDir"),
        ("metrics_address", "127.0.0.1:9400", "bindAddress"),
    ],
)
def test_config_keys_the_chart_owns_are_refused_with_the_value_to_use(
    key: str, value: str, named: str
) -> None:
    # A config key that would contradict a mount, a port or a top-level value
    # fails the install naming both, instead of a daemon that cannot start.
    chart = helm_python.Chart.load(CHART)
    with pytest.raises(
        helm_python.HelmError, match=rf"daemon\.config\.{key}: .*{re.escape(named)}"
    ):
        chart.render({"daemon": {"config": {key: value}}}, name="vgpu", namespace=NS)


@pytest.mark.parametrize("combo", COMBO_IDS)
def test_every_workload_keeps_the_narrow_security_settings(combo: str) -> None:
    for obj in RENDERED[combo]:
        if obj["kind"] not in ("DaemonSet", "Deployment"):
            continue
        spec = obj["spec"]["template"]["spec"]
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for key in ("hostPID", "hostIPC"):
            assert not spec.get(key), (obj["metadata"]["name"], key)
        # The host network only where a value asks for it (HOST_NETWORK).
        asked = any(
            part.get("hostNetwork") for part in json.loads(combo).values() if isinstance(part, dict)
        )
        assert not spec.get("hostNetwork") or asked, obj["metadata"]["name"]
        if obj["kind"] == "Deployment":  # only the node daemon needs root (kubelet's files)
            assert spec["securityContext"]["runAsNonRoot"] is True
        for container in spec["containers"]:
            sc = container["securityContext"]
            where = (obj["metadata"]["name"], container["name"])
            assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert set(container["resources"]["limits"]) == {"cpu", "memory"}, where
            assert container["livenessProbe"] and container["readinessProbe"], where


DEPLOY_DIRS = ["deploy", "deploy/scheduler", "deploy/webhook", "deploy/dra"]


@pytest.mark.parametrize("directory", DEPLOY_DIRS)
def test_each_deploy_directory_works_with_apply_f_and_apply_k(directory: str) -> None:
    path = ROOT / directory
    files = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml", ".json"))
    kustomization = yaml.safe_load((path / "Kustomization").read_text())
    assert kustomization["resources"] == [p.name for p in files]
    objects = [d for p in files for d in yaml.safe_load_all(p.read_text()) if d]
    assert all({"apiVersion", "kind", "metadata"} <= o.keys() for o in objects)
    # Together the directories hold exactly what the chart renders with its defaults.
    if directory == "deploy/webhook":
        rendered = {
            _identity(o)
            for o in render({"namespace": {"create": True}})
            if o["metadata"]["labels"].get("app.kubernetes.io/component") == "webhook"
        }
        assert {_identity(o) for o in objects} == rendered


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("directory", DEPLOY_DIRS)
def test_kustomize_builds_each_deploy_directory(directory: str) -> None:
    # kubectl's built-in kustomize, offline: it must find the extensionless file.
    path = ROOT / directory
    files = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml", ".json"))
    objects = [d for p in files for d in yaml.safe_load_all(p.read_text()) if d]
    built = subprocess.run(
        ["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=30
    )
    assert built.returncode == 0, built.stderr
    assert sorted(_identity(o) for o in yaml.safe_load_all(built.stdout) if o) == sorted(
        _identity(o) for o in objects
    )


def test_dashboard_layout_is_well_formed() -> None:
    dashboard = json.loads((CHART / "dashboards" / "vgpu.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "instance"}


def test_chart_versions_follow_the_package() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = (ROOT / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', project, re.MULTILINE)
    assert version and chart["appVersion"] == version.group(1)
    assert chart["apiVersion"] == "v2"
    image = one(render({}), "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.endswith(f":{chart['appVersion']}")


def _render_with_api_versions(values: dict[str, Any], api_versions: list[str]) -> str:
    # Chart.render does not expose Helm's --api-versions; the native call it wraps does.
    from helm_python import _native

    chart = helm_python.Chart.load(CHART)
    options = {"name": "vgpu", "namespace": NS, "api_versions": api_versions}
    out = _native.call_string("helm_render", chart._raw(), json.dumps(values), json.dumps(options))
    return "".join(json.loads(out).values())


def test_service_monitor_follows_the_clusters_api_versions() -> None:
    wanted = {"monitoring": {"serviceMonitor": {"enabled": True}}}
    assert "kind: ServiceMonitor" in _render_with_api_versions(wanted, ["monitoring.coreos.com/v1"])
    assert "kind: ServiceMonitor" not in _render_with_api_versions(wanted, ["apps/v1"])
    off = {"monitoring": {"serviceMonitor": {"enabled": False}}}
    assert "kind: ServiceMonitor" not in _render_with_api_versions(
        off, ["monitoring.coreos.com/v1"]
    )


# ------------------------------------------- the kubelet's directories


def _daemon_paths(objects: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, str]]:
    """The DaemonSet's hostPaths and mountPaths by volume name."""
    spec = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounted = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    return host, mounted


def _daemon_settings(objects: list[dict[str, Any]], tmp_path: Path) -> config.Settings:
    path = tmp_path / "config.yaml"
    path.write_text(one(objects, "ConfigMap", "vgpu-config")["data"]["config.yaml"])
    return config.load({}, {}, path)


@pytest.mark.parametrize("root", ["/var/lib/kubelet", K0S_ROOT])
def test_kubelet_root_dir_moves_pod_resources_in_device_plugin_mode(
    root: str, tmp_path: Path
) -> None:
    objects = render({"kubeletRootDir": root})
    host, mounted = _daemon_paths(objects)
    # The hostPath, the mount and the daemon's config name the same path.
    assert host["pod-resources"] == mounted["pod-resources"] == f"{root}/pod-resources"
    settings = _daemon_settings(objects, tmp_path)
    assert settings.pod_resources_socket == Path(f"{root}/pod-resources/kubelet.sock")
    # The device manager's directory is the kubelet's fixed path, not under the root dir.
    assert host["device-plugins"] == mounted["device-plugins"] == "/var/lib/kubelet/device-plugins"
    assert settings.device_plugin_dir == Path("/var/lib/kubelet/device-plugins")
    if root != "/var/lib/kubelet":
        moved = [p for p in host.values() if p.startswith("/var/lib/kubelet/")]
        assert moved == ["/var/lib/kubelet/device-plugins"], host


@pytest.mark.parametrize("root", ["/var/lib/kubelet", K0S_ROOT])
def test_kubelet_root_dir_moves_the_dra_directories(root: str, tmp_path: Path) -> None:
    objects = render({"mode": "dra", "kubeletRootDir": root, "resourceDomain": "gpu.example.com"})
    host, mounted = _daemon_paths(objects)
    registry, plugin = f"{root}/plugins_registry", f"{root}/plugins/vgpu.gpu.example.com"
    assert host["plugins-registry"] == mounted["plugins-registry"] == registry
    # The kubelet dials the socket the registration names: the path inside the
    # container must be the host's.
    assert host["plugin-dir"] == mounted["plugin-dir"] == plugin
    settings = _daemon_settings(objects, tmp_path)
    assert settings.kubelet_registry_dir == Path(registry)
    assert settings.dra_plugin_dir() == Path(plugin)
    assert not any(p.startswith("/var/lib/kubelet/") for p in host.values()) or root == (
        "/var/lib/kubelet"
    )


def test_device_plugin_dir_has_its_own_value(tmp_path: Path) -> None:
    objects = render({"kubeletRootDir": K0S_ROOT, "kubeletDevicePluginDir": "/opt/kubelet/dp"})
    host, mounted = _daemon_paths(objects)
    assert host["device-plugins"] == mounted["device-plugins"] == "/opt/kubelet/dp"
    assert _daemon_settings(objects, tmp_path).device_plugin_dir == Path("/opt/kubelet/dp")
    assert host["pod-resources"] == f"{K0S_ROOT}/pod-resources"


# ------------------------------------------------------ host network, ports


def _pod_spec(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = one(objects, kind, name)["spec"]["template"]["spec"]
    return spec


WORKLOADS = [
    ("daemon", "DaemonSet", "vgpu"),
    ("scheduler", "Deployment", "vgpu-scheduler"),
    ("webhook", "Deployment", "vgpu-webhook"),
]


def test_no_workload_is_on_the_host_network_by_default() -> None:
    objects = render({})
    for _, kind, name in WORKLOADS:
        spec = _pod_spec(objects, kind, name)
        assert "hostNetwork" not in spec and "dnsPolicy" not in spec, name


@pytest.mark.parametrize(("component", "kind", "name"), WORKLOADS, ids=[w[0] for w in WORKLOADS])
def test_host_network_is_per_component_with_its_dns_policy(
    component: str, kind: str, name: str
) -> None:
    objects = render({component: {"hostNetwork": True}})
    for _, other_kind, other in WORKLOADS:
        spec = _pod_spec(objects, other_kind, other)
        if other == name:
            assert spec["hostNetwork"] is True
            # Without it a host-network pod resolves with the node's resolv.conf
            # and loses the cluster's Service names.
            assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        else:
            assert "hostNetwork" not in spec and "dnsPolicy" not in spec, other


def test_ports_reach_every_component() -> None:
    objects = render(
        {
            **HOST_NETWORK,
            "daemon": {"hostNetwork": True, "metricsPort": 19400},
            "scheduler": {
                "hostNetwork": True,
                "kubeScheduler": {"securePort": 10269},
                "extender": {"port": 18888, "metricsPort": 19401},
            },
        }
    )
    daemon = _pod_spec(objects, "DaemonSet", "vgpu")["containers"][0]
    # On the host network no port is declared (it would be a host port, and
    # an upgrade's surge pod could not be scheduled beside the old one).
    assert "ports" not in daemon
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert daemon[probe]["httpGet"]["port"] == 19400, probe
    pod_net = _pod_spec(render({"daemon": {"metricsPort": 19400}}), "DaemonSet", "vgpu")
    assert pod_net["containers"][0]["ports"] == [
        {"name": "metrics", "containerPort": 19400, "protocol": "TCP"}
    ]
    cm = yaml.safe_load(one(objects, "ConfigMap", "vgpu-config")["data"]["config.yaml"])
    assert cm["metrics_address"] == "0.0.0.0:19400"

    webhook = _pod_spec(objects, "Deployment", "vgpu-webhook")["containers"][0]
    assert "--listen=0.0.0.0:9443" in webhook["args"]
    assert webhook["ports"] == [{"name": "https", "containerPort": 9443, "protocol": "TCP"}]
    service = one(objects, "Service", "vgpu-webhook")["spec"]["ports"]
    assert service == [{"name": "https", "port": 443, "targetPort": "https", "protocol": "TCP"}]

    containers = {
        c["name"]: c for c in _pod_spec(objects, "Deployment", "vgpu-scheduler")["containers"]
    }
    ks = containers["kube-scheduler"]
    assert "--secure-port=10269" in ks["command"]
    assert ks["ports"] == [{"name": "https", "containerPort": 10269, "protocol": "TCP"}]
    assert ks["livenessProbe"]["httpGet"]["port"] == "https"
    assert ks["readinessProbe"]["httpGet"]["port"] == "https"
    # On the host network the extender's loopback port is declared too, so that
    # two replicas never share a node's port.
    assert {p["name"]: p["containerPort"] for p in containers["extender"]["ports"]} == {
        "metrics": 19401,
        "extender": 18888,
    }
    data = one(objects, "ConfigMap", "vgpu-scheduler-config")["data"]
    assert yaml.safe_load(data["extender.yaml"])["listen"] == "127.0.0.1:18888"
    assert yaml.safe_load(data["extender.yaml"])["metrics_address"] == "0.0.0.0:19401"
    ksc = yaml.safe_load(data["scheduler-config.yaml"])
    assert ksc["extenders"][0]["urlPrefix"] == "http://127.0.0.1:18888"


def test_config_comment_says_where_metrics_listen() -> None:
    def comment(values: dict[str, Any]) -> str:
        docs: list[str] = render_module.render(values, "vgpu", NS)
        return next(d for d in docs if "name: vgpu-config\n" in d)

    assert "(no hostNetwork)" in comment({})
    on = comment({"daemon": {"hostNetwork": True}})
    assert "(no hostNetwork)" not in on and "every address of the node" in on


# ------------------------------------- a cluster without kube-proxy or pod network


def _containers(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (o["metadata"]["name"], c["name"]): c
        for o in objects
        if o["kind"] in ("DaemonSet", "Deployment")
        for c in o["spec"]["template"]["spec"]["containers"]
    }


@pytest.mark.parametrize("mode", ["device-plugin", "dra"])
def test_api_server_address_reaches_every_container(mode: str) -> None:
    containers = _containers(
        render({"mode": mode, "apiServer": {"host": "10.1.2.3", "port": 6443}})
    )
    assert len(containers) == (4 if mode == "device-plugin" else 1)
    for where, c in containers.items():
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        # A container's own env wins over the kubelet's service variables.
        assert env["KUBERNETES_SERVICE_HOST"] == "10.1.2.3", where
        assert env["KUBERNETES_SERVICE_PORT"] == "6443", where
    for where, c in _containers(render({"mode": mode})).items():
        names = {e["name"] for e in c.get("env", [])}
        assert not names & {"KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"}, where


@pytest.mark.parametrize("url", ["https://127.0.0.1:8443", "https://hooks.example/vgpu/"])
def test_webhook_url_replaces_the_service_in_both_configurations(url: str) -> None:
    objects = render({"webhook": {"url": url}})
    base = url.rstrip("/")
    for kind, path in (
        ("MutatingWebhookConfiguration", "/mutate"),
        ("ValidatingWebhookConfiguration", "/validate"),
    ):
        (hook,) = one(objects, kind)["webhooks"]
        assert hook["clientConfig"] == {"url": base + path}, kind
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        (hook,) = one(render({}), kind)["webhooks"]
        assert hook["clientConfig"]["service"]["name"] == "vgpu-webhook"
        assert "url" not in hook["clientConfig"]


def test_bind_address_reaches_every_listener() -> None:
    def listeners(values: dict[str, Any]) -> list[str]:
        objects = render(values)
        daemon = yaml.safe_load(one(objects, "ConfigMap", "vgpu-config")["data"]["config.yaml"])
        data = one(objects, "ConfigMap", "vgpu-scheduler-config")["data"]
        ext = yaml.safe_load(data["extender.yaml"])
        containers = _containers(objects)
        webhook = containers[("vgpu-webhook", "webhook")]["args"]
        scheduler = containers[("vgpu-scheduler", "kube-scheduler")]["command"]
        return [
            daemon["metrics_address"],
            ext["metrics_address"],
            next(a for a in webhook if a.startswith("--listen=")),
            next(a for a in scheduler if a.startswith("--bind-address=")),
        ]

    assert listeners({}) == [
        "0.0.0.0:9400",
        "0.0.0.0:9401",
        "--listen=0.0.0.0:8443",
        "--bind-address=0.0.0.0",
    ]
    assert listeners({"bindAddress": "127.0.0.1"}) == [
        "127.0.0.1:9400",
        "127.0.0.1:9401",
        "--listen=127.0.0.1:8443",
        "--bind-address=127.0.0.1",
    ]


@pytest.mark.parametrize(
    "values",
    [{"mode": "dra"}, {"deviceListStrategy": "cdi"}],
    ids=["dra", "cdi-strategy"],
)
def test_cdi_spec_dir_moves_the_hostpath_and_the_config(
    values: dict[str, Any], tmp_path: Path
) -> None:
    objects = render({**values, "cdiSpecDir": "/tmp/node/cdi"})
    host, mounted = _daemon_paths(objects)
    assert host["cdi"] == mounted["cdi"] == "/tmp/node/cdi"
    assert _daemon_settings(objects, tmp_path).cdi_dir == Path("/tmp/node/cdi")
    host, mounted = _daemon_paths(render(values))
    assert host["cdi"] == mounted["cdi"] == "/var/run/cdi"
    assert "cdi" not in _daemon_paths(render({}))[0]


def test_mock_gpus_value_puts_the_card_file_in_the_configmap(tmp_path: Path) -> None:
    from vgpu.adapters.gpus import parse_mock

    cards = [
        {**MOCK_CARD, "memory_mib": 143771, "process_utilization": {}},
        {
            "uuid": "GPU-8f0e3c7a-0000-4000-8000-000000000001",
            "name": "NVIDIA H200",
            "memory_mib": 143771,
            "healthy": False,
        },
    ]
    objects = render({"daemon": {"mockGpus": cards}})
    data = one(objects, "ConfigMap", "vgpu-config")["data"]
    settings = _daemon_settings(objects, tmp_path)
    assert settings.backend == "mock"
    # the ConfigMap is mounted at /etc/vgpu: the file is there
    assert str(settings.mock_gpus) == "/etc/vgpu/mock-gpus.yaml"
    parsed = parse_mock(yaml.safe_load(data["mock-gpus.yaml"]), "mock-gpus.yaml")
    assert [(c.uuid, c.memory_mib, c.healthy) for c in parsed] == [
        (cards[0]["uuid"], 143771, True),
        (cards[1]["uuid"], 143771, False),
    ]
    assert "mock-gpus.yaml" not in one(render({}), "ConfigMap", "vgpu-config")["data"]


def test_the_e2e_profile_passes_the_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    # tests/e2e/profiles/realk8s.yaml is chart values only: it renders with them
    from tests.e2e.cluster import Cluster, Profile

    monkeypatch.setenv("VGPU_E2E_APISERVER_PORT", "6443")
    monkeypatch.setenv("VGPU_E2E_KUBELET_ROOT_DIR", "/tmp/node/kubelet")
    monkeypatch.setenv("VGPU_E2E_CDI_DIR", "/tmp/node/cdi")
    profile = Profile.load(str(ROOT / "tests" / "e2e" / "profiles" / "realk8s.yaml"))
    values = Cluster(kubeconfig="-", image="vgpu:dev", profile=profile).values()
    helm_python.Chart.load(CHART).validate_schema(values)
    containers = _containers(render(values))
    for where, c in containers.items():
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert env.get("KUBERNETES_SERVICE_PORT") == "6443", where


# ------------------------------------------------------ upgrades


def test_the_daemon_rolls_with_a_surge_and_the_dra_driver_one_at_a_time() -> None:
    """The device plugin hands the node over to its surge pod (no gap); the
    DRA driver has no handover, so two must never run on one node."""
    plugin = one(render({}), "DaemonSet", "vgpu")["spec"]["updateStrategy"]
    assert plugin["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    dra = one(render({"mode": "dra"}), "DaemonSet")["spec"]["updateStrategy"]
    assert dra["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    # The old device plugin may wait 20 s for its successor; the DRA driver not.
    grace = {
        mode: one(render({"mode": mode}), "DaemonSet")["spec"]["template"]["spec"][
            "terminationGracePeriodSeconds"
        ]
        for mode in ("device-plugin", "dra")
    }
    assert grace == {"device-plugin": 30, "dra": 10}
    env = {
        e["name"]
        for e in one(render({"mode": "dra"}), "DaemonSet")["spec"]["template"]["spec"][
            "containers"
        ][0]["env"]
    }
    assert "POD_NAME" not in env
