"""`vgpu demo --cluster`: three mock nodes, the fake API server, the node
daemons, the scheduler extender and a kube-scheduler stand-in.

Shows a pod that fits a node's total but no card there failing at admission
when bound by node totals alone, the same pod steered by the extender to a
node where one card fits, and a pod that fits no card anywhere staying
Pending with the extender's reason. No GPU, no cluster.
"""

from __future__ import annotations

import shutil
import sys
import time

from vgpu.cli.status_cluster import collect_cluster, render_cluster
from vgpu.sim.cluster import SimCluster


def _say(text: str = "") -> None:
    print(text, flush=True)


def run_cluster_demo(keep: bool = False) -> int:
    started = time.monotonic()
    cluster = SimCluster(
        {"node-a": "preset:2xH200", "node-b": "preset:2xH200", "node-c": "preset:1xH200"}
    )
    core, mem = cluster.core, cluster.memory
    try:
        _say("vgpu demo --cluster: three mock nodes, their vgpu daemons, the fake API server,")
        _say("`vgpu extender` and a kube-scheduler stand-in calling it over HTTP")
        _say(f"  working directory {cluster.root}")
        cluster.start()
        _say(
            "  node-a: 2 x H200, node-b: 2 x H200, node-c: 1 x H200; extender at "
            f"{cluster.extender_url}\n"
        )

        _say("Running pods (already bound): 60% + 60% on node-a, 70% + 70% on node-b")
        for name, node, share in (
            ("a1", "node-a", 60),
            ("a2", "node-a", 60),
            ("b1", "node-b", 70),
            ("b2", "node-b", 70),
        ):
            cluster.pod(name, {core: share, mem: 40}, node=node)
        if not cluster.wait(
            lambda: all(cluster.phase(n) == "Running" for n in ("a1", "a2", "b1", "b2"))
        ):
            raise RuntimeError("the running pods were not admitted")
        _say("  node-a has 80% core free in total, but only 40% on each card\n")

        _say("1. Without the extender, the scheduler sees node totals only and binds a")
        _say("   50% pod to node-a; the kubelet then refuses it for good:")
        cluster.pod("by-totals", {core: 50, mem: 40}, node="node-a")
        cluster.wait(lambda: cluster.phase("by-totals") in ("Running", "Failed"))
        pod = cluster.get_pod("by-totals") or {}
        status = pod.get("status") or {}
        _say(f"   by-totals: {status.get('phase')} ({status.get('reason', '')})")
        _say(f"   {str(status.get('message', ''))[:300]}...\n")

        _say("2. The same pod for schedulerName: vgpu-scheduler; the extender filters per card:")
        cluster.pod("steered", {core: 50, mem: 40})
        cluster.wait(lambda: cluster.phase("steered") in ("Running", "Failed"))
        pod = cluster.get_pod("steered") or {}
        assignment = (pod.get("metadata", {}).get("annotations") or {}).get(
            f"{cluster.domain}/vgpu-assignment"
        )
        _say(f"   steered: {cluster.phase('steered')} on {pod.get('spec', {}).get('nodeName')}")
        _say(f"   assignment written at bind: {assignment}\n")

        _say("3. A 60% pod fits node-a's and node-b's totals but no card anywhere:")
        cluster.pod("nowhere", {core: 60, mem: 40})
        cluster.wait(lambda: "vgpu:" in cluster.condition("nowhere"), 10.0)
        _say(f"   nowhere: {cluster.phase('nowhere')}, PodScheduled=False:")
        for part in cluster.condition("nowhere").split(", "):
            _say(f"     {part}")

        cluster.wait(
            lambda: all(
                c["pods"] or c["core_allocated"] == 0
                for n in collect_cluster(cluster.kubeconfig, cluster.domain)["nodes"]
                for c in n["cards"]
            ),
            5.0,
        )
        _say("\nPer card across the cluster (what `vgpu status --cluster` shows):\n")
        _say(render_cluster(collect_cluster(cluster.kubeconfig, cluster.domain)))
        cluster.scheduler.stop()
        rc = cluster.stop_extender()
        codes = [node.stop_daemon() for node in cluster.nodes.values()]
        _say(
            f"extender exit code {rc}, node daemons {codes}; demo took "
            f"{time.monotonic() - started:.1f}s"
        )
        return 0 if rc == 0 and all(c == 0 for c in codes) else 1
    except Exception as exc:
        print(
            f"vgpu demo --cluster failed: {exc}\n--- extender log ---\n"
            f"{cluster.extender_text()[-3000:]}",
            file=sys.stderr,
        )
        return 1
    finally:
        cluster.close()
        if not keep:
            shutil.rmtree(cluster.root, ignore_errors=True)
