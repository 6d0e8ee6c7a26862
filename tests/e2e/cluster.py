"""What the e2e suite (test_cluster.py) needs of a real cluster: its settings
from the environment and a profile, kubectl, Helm's own engine
(helm-python-sdk, as deploy/render.py uses it) and slice pods.

Works against any cluster a kubeconfig reaches; nothing here is specific to
../shared/realk8s (its needs are chart values in profiles/realk8s.yaml).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.e2e.kit import exec_sections, run_kubectl

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "vgpu"
DOMAIN = "vendor.io"
CORE = f"{DOMAIN}/vcuda-core"
MEMORY = f"{DOMAIN}/vcuda-memory"
MEMORY_UNIT_MIB = 256
# The mock cards every install gets (value daemon.mockGpus): two H200s, so
# capacity 200 cores and 2 x 561 memory units; idle (process_utilization {}),
# so that the compute arbiter runs and a burst cap shows.
CARD_MEMORY_MIB = 143771
CARD_MEMORY_UNITS = CARD_MEMORY_MIB // MEMORY_UNIT_MIB
MOCK_GPUS = [
    {
        "uuid": f"GPU-e2e0000{i}-0000-4000-8000-000000000000",
        "name": "NVIDIA H200",
        "memory_mib": CARD_MEMORY_MIB,
        "minor": i,
        "process_utilization": {},
    }
    for i in range(2)
]
LABEL = "e2e=vgpu-suite"

ENV_VARS = {
    "VGPU_E2E_KUBECONFIG": "the cluster's kubeconfig (setting it turns the suite on)",
    "VGPU_E2E_IMAGE": "the vgpu image the nodes can run (default ghcr.io/vgpu-project/vgpu:0.1.0)",
    "VGPU_E2E_PROFILE": "a profile file (tests/e2e/profiles/*.yaml); default: none",
    "VGPU_E2E_KUBECTL": "the kubectl binary (default: kubectl on PATH)",
    "VGPU_E2E_NODE": "the node to label and use (default: the profile's, else the only node)",
}


class Unfinished(AssertionError):
    """A wait ran out: what was waited for and the last thing seen."""


def wait_until(
    what: str, probe: Callable[[], Any], timeout_s: float, step_s: float = 0.25
) -> tuple[Any, float]:
    """Poll `probe` until it returns something truthy; that value and the seconds taken."""
    t0 = time.monotonic()
    last: Any = None
    while True:
        last = probe()
        if last:
            return last, time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise Unfinished(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(step_s)


def _expand(text: str, where: Path) -> str:
    """${NAME} from the environment; an unset one is an error naming it."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in os.environ:
            raise RuntimeError(f"{where}: ${{{name}}} is not set in the environment")
        return os.environ[name]

    return re.sub(r"\$\{([A-Z0-9_]+)\}", sub, text)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


@dataclass
class Profile:
    """Chart values and pod settings for one kind of cluster."""

    name: str = "plain"
    values: dict[str, Any] = field(default_factory=dict)
    pods: dict[str, Any] = field(default_factory=dict)
    node: str | None = None
    cannot: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | None) -> Profile:
        if not path:
            return cls()
        p = Path(path)
        doc = yaml.safe_load(_expand(p.read_text(), p)) or {}
        unknown = set(doc) - {"values", "pods", "node", "cannot"}
        if unknown:
            raise RuntimeError(f"{p}: unknown keys {sorted(unknown)}")
        return cls(
            name=p.stem,
            values=doc.get("values") or {},
            pods=doc.get("pods") or {},
            node=doc.get("node"),
            cannot={str(k): str(v) for k, v in (doc.get("cannot") or {}).items()},
        )


@dataclass
class Cluster:
    kubeconfig: str
    image: str
    profile: Profile
    kubectl_bin: str = "kubectl"
    namespace: str = "vgpu-system"
    release: str = "vgpu"
    pods_ns: str = "vgpu-e2e"
    node: str = ""

    @classmethod
    def from_env(cls) -> Cluster:
        c = cls(
            kubeconfig=os.environ["VGPU_E2E_KUBECONFIG"],
            image=os.environ.get("VGPU_E2E_IMAGE") or "ghcr.io/vgpu-project/vgpu:0.1.0",
            profile=Profile.load(os.environ.get("VGPU_E2E_PROFILE")),
            kubectl_bin=os.environ.get("VGPU_E2E_KUBECTL") or "kubectl",
        )
        c.node = os.environ.get("VGPU_E2E_NODE") or c.profile.node or c._only_node()
        return c

    # ------------------------------------------------------------ kubectl

    def kubectl(
        self, *args: str, stdin: str | None = None, timeout_s: float = 60, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return run_kubectl(self.kubectl_bin, self.kubeconfig, args, stdin, timeout_s, check)

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def _only_node(self) -> str:
        names = [n["metadata"]["name"] for n in self.get("nodes")["items"]]
        if len(names) != 1:
            raise RuntimeError(f"{len(names)} nodes: name one with VGPU_E2E_NODE")
        return str(names[0])

    def node_resources(self) -> tuple[dict[str, str], dict[str, str]]:
        st = self.get("node", self.node)["status"]
        return st.get("capacity", {}), st.get("allocatable", {})

    # ------------------------------------------------------------ helm

    def values(self, **over: Any) -> dict[str, Any]:
        """The suite's values (mock GPUs, the image), the profile's, then `over`."""
        repo, _, tag = self.image.rpartition(":")
        if "/" in tag or not repo:
            repo, tag = self.image, "latest"
        base: dict[str, Any] = {
            "image": {"repository": repo, "tag": tag},
            "daemon": {"mockGpus": MOCK_GPUS},
        }
        return deep_merge(deep_merge(base, self.profile.values), over)

    def helm(self) -> Any:
        import helm_python

        return helm_python.Config(kubeconfig_path=self.kubeconfig, namespace=self.namespace)

    def upgrade(self, **over: Any) -> None:
        """`helm upgrade` of the release with the chart, the profile and `over`."""
        self.helm().upgrade(
            str(CHART), self.release, self.values(**over), namespace=self.namespace, timeout=120
        )

    # ------------------------------------------------------------ pods

    def pod(
        self,
        name: str,
        limits: dict[str, str] | None = None,
        *,
        annotations: dict[str, str] | None = None,
        claims: list[dict[str, str]] | None = None,
    ) -> dict[str, Any]:
        """A busybox-like pod that sleeps, with `limits` (and DRA `claims`)."""
        p = self.profile.pods
        container: dict[str, Any] = {
            "name": "main",
            "image": p.get("image", "busybox:1.36"),
            "imagePullPolicy": p.get("imagePullPolicy", "IfNotPresent"),
            "command": ["sleep", "3600"],
            "resources": {"limits": limits or {}},
        }
        spec: dict[str, Any] = {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [container],
        }
        if p.get("hostNetwork"):
            spec["hostNetwork"] = True
        if claims:
            spec["resourceClaims"] = claims
            container["resources"]["claims"] = [{"name": c["name"]} for c in claims]
        meta: dict[str, Any] = {
            "name": name,
            "namespace": self.pods_ns,
            "labels": dict([LABEL.split("=", 1)]),
        }
        if annotations:
            meta["annotations"] = annotations
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}

    def slice_pod(self, name: str, core: int, mem_units: int, **kw: Any) -> dict[str, Any]:
        limits = {}
        if core:
            limits[CORE] = str(core)
        if mem_units:
            limits[MEMORY] = str(mem_units)
        return self.pod(name, limits, **kw)

    def create(self, *objs: dict[str, Any], check: bool = True) -> subprocess.CompletedProcess[str]:
        text = "\n---\n".join(json.dumps(o) for o in objs) + "\n"
        return self.kubectl("create", "-f", "-", stdin=text, check=check)

    def pod_json(self, name: str) -> dict[str, Any] | None:
        done = self.kubectl("get", "pod", "-n", self.pods_ns, name, "-o", "json", check=False)
        return json.loads(done.stdout) if done.returncode == 0 else None

    def wait_running(self, name: str, timeout_s: float = 60) -> tuple[dict[str, Any], float]:
        def probe() -> dict[str, Any] | None:
            pod = self.pod_json(name)
            if pod is None:
                return None
            phase = pod.get("status", {}).get("phase")
            if phase in ("Failed", "Succeeded"):
                raise AssertionError(f"pod {name} is {phase}: {pod.get('status')}")
            return pod if phase == "Running" else None

        pod, waited = wait_until(f"pod {name} Running", probe, timeout_s)
        return pod, waited

    def delete_pods(self, *names: str, timeout_s: float = 60) -> None:
        """Delete (all the suite's pods when no name) and wait until they are gone."""
        sel = list(names) if names else ["-l", LABEL]
        self.kubectl("delete", "pod", "-n", self.pods_ns, *sel, "--wait=false", check=False)

        def gone() -> bool:
            items = self.get("pods", "-n", self.pods_ns, "-l", LABEL)["items"]
            left = {p["metadata"]["name"] for p in items}
            return not (left & set(names)) if names else not left

        wait_until("deleted pods gone", gone, timeout_s)

    def contract(self, name: str) -> dict[str, Any]:
        """What a running container got: env, /etc/vgpu/config.json, /etc/ld.so.preload,
        the volume-mounts card list."""
        script = (
            "echo @@env; env; echo @@config; cat /etc/vgpu/config.json 2>&1; echo; "
            "echo @@preload; cat /etc/ld.so.preload 2>&1; "
            "echo @@devices; ls /var/run/nvidia-container-devices 2>/dev/null; true"
        )
        done = self.kubectl(
            "exec", "-n", self.pods_ns, name, "-c", "main", "--", "sh", "-c", script
        )
        sections = exec_sections(done.stdout)
        env = dict(ln.split("=", 1) for ln in sections.get("env", []) if "=" in ln)
        got: dict[str, Any] = {
            "env": {k: v for k, v in env.items() if k.startswith(("VGPU_", "NVIDIA_"))},
            "preload": sections.get("preload", []),
            "devices": sections.get("devices", []),
        }
        text = "\n".join(sections.get("config", [])).strip()
        try:
            got["config"] = json.loads(text)
        except ValueError:
            got["config"] = {"unreadable": text[:300]}
        return got

    def assert_limits(self, name: str, core: int, mem_units: int) -> dict[str, Any]:
        """The container's env and config.json carry exactly its own request, and
        /etc/ld.so.preload names the hook."""
        got = self.contract(name)
        mib = mem_units * MEMORY_UNIT_MIB
        assert got["env"].get("VGPU_CORE_LIMIT") == str(core), (name, got["env"])
        assert got["env"].get("VGPU_MEMORY_LIMIT_MIB") == str(mib), (name, got["env"])
        cfg = got["config"]
        assert cfg.get("core_units") == core, (name, cfg)
        assert cfg.get("memory_limit_mib") == mib, (name, cfg)
        assert any("libvgpu" in ln for ln in got["preload"]), (name, got["preload"])
        return got

    # ------------------------------------------------------------ the release's pods

    def release_pods(self, component: str | None = None) -> list[dict[str, Any]]:
        sel = f"app.kubernetes.io/instance={self.release}"
        if component:
            sel += f",app.kubernetes.io/component={component}"
        items: list[dict[str, Any]] = self.get("pods", "-n", self.namespace, "-l", sel)["items"]
        return items

    def exec_in(self, component: str, container: str, *argv: str) -> str:
        pods = [p for p in self.release_pods(component) if ready(p)]
        assert pods, f"no Ready {component} pod"
        done = self.kubectl(
            "exec", "-n", self.namespace, pods[0]["metadata"]["name"], "-c", container, "--", *argv
        )
        return done.stdout

    def status(self) -> dict[str, Any]:
        """`vgpu status -o json` inside the daemon's pod."""
        doc: dict[str, Any] = json.loads(
            self.exec_in("device-plugin", "vgpu", "vgpu", "status", "-o", "json")
        )
        return doc

    def metrics(self, component: str, container: str, port: int, https: bool = False) -> str:
        """A component's /metrics, fetched inside its own container (its image has Python)."""
        host = self.profile.values.get("bindAddress", "0.0.0.0")
        host = "127.0.0.1" if host == "0.0.0.0" else host
        url = f"{'https' if https else 'http'}://{host}:{port}/metrics"
        code = (
            "import ssl,sys,urllib.request as u;"
            "c=ssl.create_default_context();c.check_hostname=False;c.verify_mode=ssl.CERT_NONE;"
            f"sys.stdout.write(u.urlopen({url!r},context=c,timeout=10).read().decode())"
        )
        return self.exec_in(component, container, "python", "-c", code)


def ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in pod.get("status", {}).get("conditions", [])
    )


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The sum of a metric's samples whose labels include `labels`; None if absent."""
    total: float | None = None
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total = (total or 0.0) + float(m.group(4))
    return total
