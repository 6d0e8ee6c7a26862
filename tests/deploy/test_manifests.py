"""The deploy/ manifests: schema-valid, least-privilege, and tied to the code's config."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions, latest_version

from vgpu import config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUSTOMIZATION = DEPLOY / "Kustomization"
# What `kubectl apply -f deploy/` reads: every file with one of these endings.
KUBECTL_EXTENSIONS = (".yaml", ".yml", ".json")
OLDEST_SUPPORTED = "1.30"
NAMESPACE = "vgpu-system"
POD_VERBS = {"get", "list", "watch", "patch"}
NODE_VERBS = {"get", "patch"}  # the vgpu-node inventory annotation on the daemon's own Node
HOST_DIRS = {
    "/var/lib/kubelet/device-plugins",
    "/var/lib/kubelet/pod-resources",
    "/var/lib/vgpu",
    "/usr/local/vgpu",
    # /var/run/cdi only with deviceListStrategy: cdi (tests/deploy/test_chart.py)
    "/dev",  # read-only at /host/dev: which device nodes the host has
    "/proc",  # read-only at /host/proc: its locks file names hook processes' host pids
}


def _manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.iterdir() if p.suffix in KUBECTL_EXTENSIONS)


def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


OBJECTS: list[tuple[str, dict[str, Any]]] = [
    (f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc)
    for path in _manifest_files()
    for doc in _load(path)
]


def _only(kind: str) -> dict[str, Any]:
    found = [obj for _, obj in OBJECTS if obj["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _newest_schema() -> str:
    # The package ships one schema directory per Kubernetes version
    # (kubernetes-json-schema/v1.NN.0-local[-strict]); take the highest.
    return latest_version()


@pytest.fixture(scope="module")
def daemonset() -> dict[str, Any]:
    return _only("DaemonSet")


@pytest.fixture(scope="module")
def pod_spec(daemonset: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    return spec


@pytest.fixture(scope="module")
def container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    containers = pod_spec["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def test_deploy_holds_the_expected_objects() -> None:
    kinds = sorted(obj["kind"] for _, obj in OBJECTS)
    assert kinds == sorted(
        [
            "Namespace",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "DaemonSet",
            "NetworkPolicy",
        ]
    )


def test_every_file_kubectl_reads_is_a_kubernetes_object() -> None:
    # `kubectl apply -f deploy/` fails on any *.yaml that is not an API object,
    # which is why the kustomization file has no extension.
    for path in _manifest_files():
        docs = _load(path)
        assert docs, f"{path.name} holds no object"
        for doc in docs:
            assert {"apiVersion", "kind", "metadata"} <= doc.keys(), path.name
            assert doc["kind"] != "Kustomization", f"{path.name}: kubectl -f cannot apply it"


def test_namespace_is_created_first_by_kubectl_apply_f() -> None:
    # kubectl reads a directory in file-name order.
    first = _load(_manifest_files()[0])
    assert [doc["kind"] for doc in first] == ["Namespace"]
    for _, obj in OBJECTS:
        if obj["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert obj["metadata"]["namespace"] == NAMESPACE


def test_schema_versions_cover_the_oldest_supported_and_the_newest() -> None:
    versions = all_versions()
    assert any(v.startswith(OLDEST_SUPPORTED + ".") for v in versions)
    newest = _newest_schema()
    assert tuple(int(x) for x in newest.split(".")[:2]) >= (1, 30)


@pytest.mark.parametrize("version", [OLDEST_SUPPORTED, _newest_schema()])
@pytest.mark.parametrize("obj", [obj for _, obj in OBJECTS], ids=[name for name, _ in OBJECTS])
def test_manifest_is_valid_strictly(obj: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{obj['kind']} invalid for Kubernetes {version}: {exc.message}")


# --------------------------------------------------------------------- RBAC


def test_cluster_role_grants_exactly_what_vgpu_uses() -> None:
    rules = _only("ClusterRole")["rules"]
    granted: dict[str, set[str]] = {}
    for rule in rules:
        assert rule["apiGroups"] == [""], rule
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for resource in rule["resources"]:
            granted.setdefault(resource, set()).update(rule["verbs"])
    assert granted == {
        "pods": POD_VERBS,
        "nodes": NODE_VERBS,
        "events": {"create"},  # the guard's Warning Event
        "pods/eviction": {"create"},  # unallocated_policy: evict
    }


def test_rbac_has_no_wildcard_and_no_secrets() -> None:
    for kind in ("ClusterRole", "ClusterRoleBinding"):
        text = yaml.safe_dump(_only(kind))
        assert "*" not in text, kind
        assert "secret" not in text.lower(), kind


def test_binding_ties_the_role_to_the_daemonset_service_account(pod_spec: dict[str, Any]) -> None:
    binding = _only("ClusterRoleBinding")
    account = _only("ServiceAccount")["metadata"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": _only("ClusterRole")["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}
    ]
    assert pod_spec["serviceAccountName"] == account["name"]


# ------------------------------------------------------------ config file


def _config_text() -> str:
    text: str = _only("ConfigMap")["data"]["config.yaml"]
    return text


def test_configmap_config_loads_with_the_daemons_own_loader(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(_config_text())
    settings = config.load({}, {}, path)
    assert settings.backend == "nvml"
    assert settings.metrics_address == "0.0.0.0:9400"
    assert settings.hook_library == Path("/usr/lib/vgpu/libvgpu.so")
    assert settings.hook_dir == Path("/usr/local/vgpu")
    assert settings.state_dir == Path("/var/lib/vgpu")
    assert settings.device_plugin_dir == Path("/var/lib/kubelet/device-plugins")
    assert settings.pod_resources_socket == Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    # node_name comes from the downward API, as the DaemonSet sets it.
    assert settings.node_name is None
    assert config.load({}, {"NODE_NAME": "gpu-1"}, path).node_name == "gpu-1"


def test_configmap_paths_are_mounted(container: dict[str, Any]) -> None:
    settings = yaml.safe_load(_config_text())
    mounts = [Path(m["mountPath"]) for m in container["volumeMounts"]]
    for key in ("device_plugin_dir", "pod_resources_socket", "state_dir", "hook_dir"):
        path = Path(settings[key])
        assert any(path == m or m in path.parents for m in mounts), f"{key}={path} not mounted"


def test_only_labelled_namespaces_reach_the_metrics_port(
    daemonset: dict[str, Any], container: dict[str, Any]
) -> None:
    policy = _only("NetworkPolicy")
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"vendor.io/vgpu-metrics": "allow"}}}
    ]
    (port,) = container["ports"]
    assert rule["ports"] == [{"protocol": "TCP", "port": port["containerPort"]}]
    # Per-tenant names stay off the unauthenticated endpoint.
    assert not yaml.safe_load(_config_text()).get("metrics_container_names", False)


def test_metrics_port_matches_the_config(container: dict[str, Any]) -> None:
    port = int(yaml.safe_load(_config_text())["metrics_address"].rpartition(":")[2])
    assert container["ports"] == [{"name": "metrics", "containerPort": port, "protocol": "TCP"}]
    annotations = _only("DaemonSet")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(port)
    # Alive while it serves; Ready only while the API server is reachable too
    # (api_unready_after_s): /readyz says why it is not.
    # By number: on the host network no port is declared to name.
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}


# --------------------------------------------------------------- DaemonSet


def test_command_reads_the_mounted_config(
    pod_spec: dict[str, Any], container: dict[str, Any]
) -> None:
    assert container["command"] == ["vgpu", "serve"]
    args = container["args"]
    config_path = Path(args[args.index("--config") + 1])
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    volume = next(v for v in pod_spec["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == _only("ConfigMap")["metadata"]["name"]
    assert config_path.parent == Path(mount["mountPath"])
    assert config_path.name in _only("ConfigMap")["data"]


def test_host_paths_cover_the_four_directories(
    pod_spec: dict[str, Any], container: dict[str, Any]
) -> None:
    host = {v["name"]: v["hostPath"] for v in pod_spec["volumes"] if "hostPath" in v}
    assert {h["path"] for h in host.values()} == HOST_DIRS
    mounted = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    for name, source in host.items():
        want = {"/dev": "/host/dev", "/proc": "/host/proc"}.get(source["path"], source["path"])
        assert mounted[name] == want, name
    for read_only in ("/host/dev", "/host/proc"):
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == read_only)
        assert mount["readOnly"] is True, read_only
    by_path = {h["path"]: h["type"] for h in host.values()}
    assert by_path["/var/lib/vgpu"] == "DirectoryOrCreate"
    assert by_path["/usr/local/vgpu"] == "DirectoryOrCreate"
    # The kubelet's own directories must already exist: a wrong kubelet root
    # fails visibly instead of serving sockets nobody reads.
    assert by_path["/var/lib/kubelet/device-plugins"] == "Directory"
    assert by_path["/var/lib/kubelet/pod-resources"] == "Directory"


def test_node_name_comes_from_the_downward_api(container: dict[str, Any]) -> None:
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
    # Its own pod, to find the surge pod of an upgrade at SIGTERM.
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_scheduling(daemonset: dict[str, Any], pod_spec: dict[str, Any]) -> None:
    assert pod_spec["nodeSelector"] == {"vendor.io/vgpu": "true"}
    assert pod_spec["priorityClassName"] == "system-node-critical"
    # Room for the handover wait (20 s) and the shutdown after it.
    assert pod_spec["terminationGracePeriodSeconds"] == 30
    assert {
        "key": "nvidia.com/gpu",
        "operator": "Exists",
        "effect": "NoSchedule",
    } in pod_spec["tolerations"]
    assert daemonset["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        # The new daemon starts beside the old one, which hands it the node.
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }


def test_security_context_is_narrow(pod_spec: dict[str, Any], container: dict[str, Any]) -> None:
    sc = container["securityContext"]
    assert sc["privileged"] is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod_spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod_spec.get(key), key


def test_resources_are_bounded(container: dict[str, Any]) -> None:
    resources = container["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert set(resources["limits"]) == {"cpu", "memory"}


def test_image_is_pinned_to_a_version(container: dict[str, Any]) -> None:
    image = container["image"]
    assert re.fullmatch(r"[\w./-]+/vgpu:\d+\.\d+\.\d+", image), image


# ----------------------------------------------------------- kustomization


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
    assert kustomization["kind"] == "Kustomization"
    assert kustomization["resources"] == [p.name for p in _manifest_files()]
    # kustomize refuses a directory holding two kustomization files.
    others = {"kustomization.yaml", "kustomization.yml"} & {p.name for p in DEPLOY.iterdir()}
    assert not others


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_builds_the_same_objects() -> None:
    # kubectl's built-in kustomize, offline: it must find the extensionless file.
    built = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=20
    )
    assert built.returncode == 0, built.stderr
    objects = [doc for doc in yaml.safe_load_all(built.stdout) if doc]

    def key(obj: dict[str, Any]) -> tuple[str, str]:
        return obj["kind"], obj["metadata"]["name"]

    # No transformers: kustomize must yield exactly the objects `kubectl apply -f` reads.
    assert {key(o): o for o in objects} == {key(o): o for _, o in OBJECTS}
