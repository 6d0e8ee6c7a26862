"""deploy/dra/: the DRA driver's manifests, schema-valid and least-privilege,
and tied to the code (driver name, config keys, socket paths)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from vgpu import config
from vgpu.core.dra import driver_name

DRA = Path(__file__).resolve().parents[2] / "deploy" / "dra"
DEVICE_PLUGIN = DRA.parent
# resource.k8s.io/v1 is GA from 1.34; consumable capacity is beta and on from 1.36.
OLDEST_DRA = "1.34"
HOST_DIRS = {
    "/var/lib/kubelet/plugins_registry": "Directory",
    "/var/lib/kubelet/plugins/vgpu.vendor.io": "DirectoryOrCreate",
    "/var/run/cdi": "DirectoryOrCreate",
    "/var/lib/vgpu": "DirectoryOrCreate",
    "/usr/local/vgpu": "DirectoryOrCreate",
    "/dev": "Directory",  # read-only at /host/dev: which device nodes the host has
    "/proc": "Directory",  # read-only at /host/proc: hook processes' host pids
}


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml", ".json"))


def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


OBJECTS = [
    (f"{p.name}:{d['kind']}/{d['metadata']['name']}", d) for p in _files(DRA) for d in _load(p)
]


def _only(kind: str) -> dict[str, Any]:
    found = [obj for _, obj in OBJECTS if obj["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = _only("DaemonSet")["spec"]["template"]["spec"]
    return spec


def _container() -> dict[str, Any]:
    (container,) = _pod_spec()["containers"]
    return dict(container)


def test_dra_holds_the_expected_objects() -> None:
    assert sorted(obj["kind"] for _, obj in OBJECTS) == sorted(
        [
            "Namespace",
            "DeviceClass",
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "DaemonSet",
            # The metrics port, as in deploy/ (rendered from the same chart).
            "NetworkPolicy",
        ]
    )
    assert [d["kind"] for d in _load(_files(DRA)[0])] == ["Namespace"]


@pytest.mark.parametrize("version", [OLDEST_DRA, latest_version()])
@pytest.mark.parametrize("obj", [o for _, o in OBJECTS], ids=[n for n, _ in OBJECTS])
def test_manifest_is_valid_strictly(obj: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{obj['kind']} invalid for Kubernetes {version}: {exc.message}")


def test_device_class_selects_the_drivers_devices() -> None:
    device_class = _only("DeviceClass")
    driver = driver_name(config.Settings().resource_domain)
    assert device_class["metadata"]["name"] == driver
    assert device_class["spec"]["selectors"] == [
        {"cel": {"expression": f'device.driver == "{driver}"'}}
    ]


def test_cluster_role_grants_exactly_what_the_driver_uses() -> None:
    granted: dict[str, set[str]] = {}
    named: dict[str, list[str]] = {}
    for rule in _only("ClusterRole")["rules"]:
        assert rule["apiGroups"] in (["resource.k8s.io"], [""]), rule
        assert "nonResourceURLs" not in rule
        for resource in rule["resources"]:
            granted.setdefault(resource, set()).update(rule["verbs"])
            if "resourceNames" in rule:
                named[resource] = rule["resourceNames"]
    assert granted == {
        "resourceslices": {"create", "update", "delete", "list", "watch"},
        "resourceclaims": {"get", "list", "watch"},
        "resourceclaims/status": {"update"},  # status.devices of prepared claims
        # 1.36's granular status authorization: this driver's entries, from its node
        "resourceclaims/driver": {"associated-node:update"},
        "pods": {"get"},  # which containers use a claim
        "events": {"create"},  # InvalidCoreLimit on the pod of a claim with a bad coreLimit
    }
    assert named == {"resourceclaims/driver": ["vgpu.vendor.io"]}
    text = yaml.safe_dump(_only("ClusterRole"))
    assert "*" not in text and "secret" not in text.lower()


def test_binding_ties_the_role_to_the_daemonsets_account() -> None:
    binding = _only("ClusterRoleBinding")
    account = _only("ServiceAccount")["metadata"]
    assert binding["roleRef"]["name"] == _only("ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}
    ]
    assert _pod_spec()["serviceAccountName"] == account["name"]


def test_config_is_dra_mode_and_its_paths_are_mounted(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(_only("ConfigMap")["data"]["config.yaml"])
    settings = config.load({}, {"NODE_NAME": "gpu-1"}, path)
    assert settings.mode == "dra"
    assert settings.dra_plugin_dir() == Path("/var/lib/kubelet/plugins/vgpu.vendor.io")
    assert settings.dra_plugin_dir() == config.Settings().dra_plugin_dir()
    assert settings.kubelet_registry_dir == config.Settings().kubelet_registry_dir
    assert settings.cdi_dir == config.Settings().cdi_dir
    mounts = {m["mountPath"]: m for m in _container()["volumeMounts"]}
    for directory in (
        settings.kubelet_registry_dir,
        settings.dra_plugin_dir(),
        settings.cdi_dir,
        settings.state_dir,
        settings.hook_dir,
    ):
        assert str(directory) in mounts, directory
        assert not mounts[str(directory)].get("readOnly"), directory


def test_host_paths_and_their_types() -> None:
    volumes = {v["name"]: v for v in _pod_spec()["volumes"]}
    host = {
        v["hostPath"]["path"]: v["hostPath"]["type"] for v in volumes.values() if "hostPath" in v
    }
    assert host == HOST_DIRS
    mounted = {m["name"]: m["mountPath"] for m in _container()["volumeMounts"]}
    for name, volume in volumes.items():
        if "hostPath" in volume:
            path = volume["hostPath"]["path"]
            want = {"/dev": "/host/dev", "/proc": "/host/proc"}.get(path, path)
            assert mounted[name] == want, name


def test_a_node_runs_one_mode() -> None:
    device_plugin = next(
        d for p in _files(DEVICE_PLUGIN) for d in _load(p) if d["kind"] == "DaemonSet"
    )
    ours = _pod_spec()["nodeSelector"]
    theirs = device_plugin["spec"]["template"]["spec"]["nodeSelector"]
    assert ours.keys() == theirs.keys()  # one label key, two values: never both on a node
    assert ours != theirs
    assert _only("DaemonSet")["metadata"]["name"] != device_plugin["metadata"]["name"]


def test_security_context_is_narrow() -> None:
    sc = _container()["securityContext"]
    assert sc["privileged"] is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert not _pod_spec().get(key), key
    env = {e["name"]: e for e in _container()["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((DRA / "Kustomization").read_text())
    assert kustomization["resources"] == [p.name for p in _files(DRA)]
