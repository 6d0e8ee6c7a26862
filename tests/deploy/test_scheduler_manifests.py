"""deploy/scheduler/: the second scheduler with the vgpu extender sidecar.

Kubernetes objects are validated strictly against the oldest supported and the
newest schema; the KubeSchedulerConfiguration (not in those schemas) field by
field against a table transcribed from the upstream Go types of
kubescheduler.config.k8s.io/v1 (k8s.io/kube-scheduler/config/v1/types.go and
k8s.io/component-base/config/v1alpha1/types.go): an unknown or mistyped field
fails, as kube-scheduler's strict decoding would.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from vgpu.adapters.extender_http import VERBS
from vgpu.config import load_extender
from vgpu.core.model import Resource

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "scheduler"
OLDEST_SUPPORTED = "1.30"
NAMESPACE = "vgpu-system"
SCHEDULER = "vgpu-scheduler"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


FILES = sorted(p for p in DEPLOY.iterdir() if p.suffix in (".yaml", ".yml", ".json"))
OBJECTS = [(f"{p.name}:{d['kind']}/{d['metadata']['name']}", d) for p in FILES for d in _docs(p)]


def _only(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for _, o in OBJECTS if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _config(key: str) -> str:
    text: str = _only("ConfigMap")["data"][key]
    return text


# ---------------------------------------- KubeSchedulerConfiguration schema
# Each type: field -> kind. Kinds: "bool", "int", "float", "str", "duration"
# (metav1.Duration, e.g. "10s"), "raw" (runtime.RawExtension), a dict (an
# object of that type), or a one-item list (a list of that kind).

DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$")
PLUGIN = {"name": "str", "weight": "int"}
PLUGIN_SET = {"enabled": [PLUGIN], "disabled": [PLUGIN]}
EXTENSION_POINTS = [
    "preEnqueue",
    "queueSort",
    "preFilter",
    "filter",
    "postFilter",
    "preScore",
    "score",
    "reserve",
    "permit",
    "preBind",
    "bind",
    "postBind",
    "multiPoint",
    "placementGenerate",
    "placementScore",
    "placementFeasible",
    "podGroupPostFilter",
]
PLUGINS = {name: PLUGIN_SET for name in EXTENSION_POINTS}
PROFILE = {
    "schedulerName": "str",
    "percentageOfNodesToScore": "int",
    "percentageOfPlacementsToScore": "int",
    "plugins": PLUGINS,
    "pluginConfig": [{"name": "str", "args": "raw"}],
}
TLS = {
    "insecure": "bool",
    "serverName": "str",
    "certFile": "str",
    "keyFile": "str",
    "caFile": "str",
    "certData": "str",
    "keyData": "str",
    "caData": "str",
}
EXTENDER = {
    "urlPrefix": "str",
    "filterVerb": "str",
    "preemptVerb": "str",
    "prioritizeVerb": "str",
    "weight": "int",
    "bindVerb": "str",
    "enableHTTPS": "bool",
    "tlsConfig": TLS,
    "httpTimeout": "duration",
    "nodeCacheCapable": "bool",
    "managedResources": [{"name": "str", "ignoredByScheduler": "bool"}],
    "ignorable": "bool",
}
LEADER_ELECTION = {  # component-base LeaderElectionConfiguration
    "leaderElect": "bool",
    "leaseDuration": "duration",
    "renewDeadline": "duration",
    "retryPeriod": "duration",
    "resourceLock": "str",
    "resourceName": "str",
    "resourceNamespace": "str",
}
CLIENT_CONNECTION = {  # component-base ClientConnectionConfiguration
    "kubeconfig": "str",
    "acceptContentTypes": "str",
    "contentType": "str",
    "qps": "float",
    "burst": "int",
}
KUBE_SCHEDULER_CONFIGURATION = {
    "apiVersion": "str",
    "kind": "str",
    "parallelism": "int",
    "leaderElection": LEADER_ELECTION,
    "clientConnection": CLIENT_CONNECTION,
    "enableProfiling": "bool",  # DebuggingConfiguration, inlined
    "enableContentionProfiling": "bool",
    "percentageOfNodesToScore": "int",
    "percentageOfPlacementsToScore": "int",
    "podInitialBackoffSeconds": "int",
    "podMaxBackoffSeconds": "int",
    "profiles": [PROFILE],
    "extenders": [EXTENDER],
    "delayCacheUntilActive": "bool",
}


def check(value: Any, kind: Any, where: str) -> list[str]:
    """Every way `value` breaks the transcribed type `kind`."""
    if isinstance(kind, dict):
        if not isinstance(value, dict):
            return [f"{where}: expected an object"]
        errors = [f"{where}.{key}: unknown field" for key in value if key not in kind]
        for key, sub in value.items():
            if key in kind:
                errors += check(sub, kind[key], f"{where}.{key}")
        return errors
    if isinstance(kind, list):
        if not isinstance(value, list):
            return [f"{where}: expected a list"]
        return [e for i, item in enumerate(value) for e in check(item, kind[0], f"{where}[{i}]")]
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, int | float) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "duration": isinstance(value, str) and bool(DURATION.match(value)),
        "raw": isinstance(value, dict),
    }[kind]
    return [] if ok else [f"{where}: expected {kind}, got {value!r}"]


@pytest.fixture(scope="module")
def ksc() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(_config("scheduler-config.yaml"))
    return data


def test_the_checker_rejects_what_kube_scheduler_would() -> None:
    assert check({"extenders": [{"urlPrefx": "x"}]}, KUBE_SCHEDULER_CONFIGURATION, "c") == [
        "c.extenders[0].urlPrefx: unknown field"
    ]
    assert check({"extenders": [{"httpTimeout": 10}]}, KUBE_SCHEDULER_CONFIGURATION, "c")
    assert check({"leaderElection": {"leaderElect": "yes"}}, KUBE_SCHEDULER_CONFIGURATION, "c")


def test_kube_scheduler_configuration_matches_the_upstream_v1_types(ksc: dict[str, Any]) -> None:
    assert ksc["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert ksc["kind"] == "KubeSchedulerConfiguration"
    assert check(ksc, KUBE_SCHEDULER_CONFIGURATION, "config") == []


def test_profile_and_leader_election(ksc: dict[str, Any]) -> None:
    assert [p["schedulerName"] for p in ksc["profiles"]] == [SCHEDULER]
    election = ksc["leaderElection"]
    assert election["leaderElect"] is True and election["resourceLock"] == "leases"
    assert (election["resourceName"], election["resourceNamespace"]) == (SCHEDULER, NAMESPACE)
    role = _only("Role", "vgpu-scheduler-leader-election")
    assert role["metadata"]["namespace"] == election["resourceNamespace"]
    named = [r for r in role["rules"] if r.get("resourceNames")]
    assert named == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": [election["resourceName"]],
            "verbs": ["get", "update"],
        }
    ]


def test_extender_entry_points_at_the_sidecar(ksc: dict[str, Any], tmp_path: Path) -> None:
    (ext,) = ksc["extenders"]
    path = tmp_path / "extender.yaml"
    path.write_text(_config("extender.yaml"))
    settings = load_extender({}, {}, path)
    host, _, port = settings.listen.rpartition(":")
    assert host == "127.0.0.1"  # a sidecar: reachable from the pod only
    assert ext["urlPrefix"] == f"http://127.0.0.1:{port}"
    assert (ext["filterVerb"], ext["prioritizeVerb"], ext["bindVerb"]) == VERBS
    assert ext["weight"] > 0 and ext["nodeCacheCapable"] is True and ext["ignorable"] is False
    assert DURATION.match(ext["httpTimeout"])
    assert ext["managedResources"] == [
        {"name": r.full_name(settings.resource_domain), "ignoredByScheduler": False}
        for r in Resource
    ]
    assert "preemptVerb" not in ext and not ext.get("enableHTTPS")
    # The extender picks the node at filter: prioritize stays configured for
    # node_choice "scheduler", and is never called otherwise.
    assert settings.node_choice == "extender"


# ---------------------------------------------------------- Kubernetes objects


@pytest.mark.parametrize("version", [OLDEST_SUPPORTED, latest_version()])
@pytest.mark.parametrize("obj", [o for _, o in OBJECTS], ids=[n for n, _ in OBJECTS])
def test_manifest_is_valid_strictly(obj: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{obj['kind']} invalid for Kubernetes {version}: {exc.message}")


def test_rbac_is_the_built_in_scheduler_role_plus_what_the_extender_uses() -> None:
    account = {"kind": "ServiceAccount", "name": SCHEDULER, "namespace": NAMESPACE}
    bound = {
        (o["roleRef"]["kind"], o["roleRef"]["name"]): o
        for _, o in OBJECTS
        if o["kind"] in ("ClusterRoleBinding", "RoleBinding")
    }
    assert set(bound) == {
        ("ClusterRole", "system:kube-scheduler"),
        ("ClusterRole", "system:volume-scheduler"),
        ("Role", "extension-apiserver-authentication-reader"),
        ("ClusterRole", SCHEDULER),
        ("Role", "vgpu-scheduler-leader-election"),
    }
    for binding in bound.values():
        assert binding["subjects"] == [account]
    assert (
        bound[("Role", "extension-apiserver-authentication-reader")]["metadata"]["namespace"]
        == "kube-system"
    )
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in _only("ClusterRole", SCHEDULER)["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted.setdefault((group, resource), set()).update(rule["verbs"])
    assert granted == {
        ("", "pods"): {"get", "list", "watch"},
        ("", "pods/binding"): {"create"},
        ("", "nodes"): {"get", "list", "watch"},
        ("", "events"): {"create", "patch", "update"},
        ("events.k8s.io", "events"): {"create", "patch", "update"},
    }
    for kind in ("ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding"):
        for _, obj in OBJECTS:
            if obj["kind"] == kind:
                text = yaml.safe_dump(obj)
                assert "*" not in text and "secret" not in text.lower(), obj["metadata"]


def test_deployment_runs_kube_scheduler_with_the_extender_sidecar() -> None:
    deployment = _only("Deployment")
    spec = deployment["spec"]["template"]["spec"]
    assert deployment["metadata"]["namespace"] == NAMESPACE
    assert spec["serviceAccountName"] == SCHEDULER
    containers = {c["name"]: c for c in spec["containers"]}
    scheduler, extender = containers["kube-scheduler"], containers["extender"]
    assert re.fullmatch(r"registry\.k8s\.io/kube-scheduler:v1\.\d+\.\d+", scheduler["image"])
    config_volume = next(v for v in spec["volumes"] if v["name"] == "config")
    assert config_volume["configMap"]["name"] == _only("ConfigMap")["metadata"]["name"]
    mounts = {m["name"]: m["mountPath"] for m in scheduler["volumeMounts"]}
    assert scheduler["command"][:2] == [
        "kube-scheduler",
        f"--config={mounts['config']}/scheduler-config.yaml",
    ]
    assert extender["command"] == ["vgpu", "extender"]
    ext_mount = next(m for m in extender["volumeMounts"] if m["name"] == "config")
    assert extender["args"] == ["--config", f"{ext_mount['mountPath']}/extender.yaml"]
    metrics = yaml.safe_load(_config("extender.yaml"))["metrics_address"]
    assert extender["ports"] == [
        {"name": "metrics", "containerPort": int(metrics.rpartition(":")[2]), "protocol": "TCP"}
    ]
    assert extender["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert extender["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert spec["securityContext"]["runAsNonRoot"] is True
    for container in (scheduler, extender):
        sc = container["securityContext"]
        assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"] == {"drop": ["ALL"]}
        assert set(container["resources"]["limits"]) == {"cpu", "memory"}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(key)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((DEPLOY / "Kustomization").read_text())
    assert kustomization["resources"] == [p.name for p in FILES]
    for _, obj in OBJECTS:
        if obj["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert obj["metadata"]["namespace"] in (NAMESPACE, "kube-system"), obj["metadata"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_builds_the_same_objects() -> None:
    built = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=20
    )
    assert built.returncode == 0, built.stderr
    names = sorted((o["kind"], o["metadata"]["name"]) for o in yaml.safe_load_all(built.stdout))
    assert names == sorted((o["kind"], o["metadata"]["name"]) for _, o in OBJECTS)
