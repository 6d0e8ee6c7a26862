"""`vgpu status --cluster`: every vgpu node and card of the cluster, like
`kubectl inspect gpushare` but per card.

Reads the API server once: each Node's vgpu-node inventory and every active
pod's placements (written by the node daemons after admission) or
assignment (written by the extender at bind). Needs no extender.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from vgpu.adapters.kube_cluster import KubeUnreachable, snapshot
from vgpu.core.model import CORE_UNITS_PER_CARD
from vgpu.core.scheduling import ClusterBook

DEFAULT_KUBECONFIG = Path.home() / ".kube" / "config"


def _kubeconfig(given: Path | None) -> Path | None:
    if given is not None:
        return given
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return None  # in-cluster service account
    env = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    return Path(env) if env else DEFAULT_KUBECONFIG


def collect_cluster(kubeconfig: Path | None, domain: str = "vendor.io") -> dict[str, Any]:
    nodes, pods = snapshot(kubeconfig, domain)
    book = ClusterBook(domain)
    for name, (inventory, problem) in nodes.items():
        if inventory is not None:
            book.set_node(name, inventory, problem)
    book.replace_pods(pods)
    out: list[dict[str, Any]] = []
    for name in sorted(book.nodes):
        inventory = book.nodes[name].inventory
        assert inventory is not None
        unit = inventory.memory_unit_mib
        cards = []
        for view in book.node_cards(name):
            u = view.usage
            cards.append(
                {
                    "uuid": u.card.uuid,
                    "index": u.card.index,
                    "model": u.card.name,
                    "health": "Healthy" if u.card.healthy else "Unhealthy",
                    "memory_mib": u.card.memory_mib,
                    "core_allocated": u.core_used,
                    "core_free": 0 if u.exclusive else CORE_UNITS_PER_CARD - u.core_used,
                    "memory_allocated_mib": u.memory_used_units * unit,
                    "memory_free_mib": 0 if u.exclusive else u.memory_free_units(unit) * unit,
                    "whole": u.exclusive,
                    "pods": [f"{ns}/{pod}/{container}" for ns, pod, container in view.pods],
                }
            )
        out.append(
            {
                "name": name,
                "memory_unit_mib": unit,
                "policy": inventory.policy.value,
                "cards": cards,
            }
        )
    unusable = {
        name: problem
        for name, (inventory, problem) in nodes.items()
        if inventory is None and problem.startswith("unreadable")
    }
    return {"domain": domain, "nodes": out, "unreadable_nodes": unusable}


def render_cluster(data: dict[str, Any]) -> str:
    rows = [["NODE", "GPU", "MODEL", "HEALTH", "CORE USED/FREE", "MEMORY USED/FREE", "PODS"]]
    for node in data["nodes"]:
        for card in node["cards"]:
            core = f"{card['core_allocated']}%/{card['core_free']}%"
            used_gib = card["memory_allocated_mib"] / 1024
            memory = f"{used_gib:.1f}/{card['memory_free_mib'] / 1024:.1f} GiB"
            if card["whole"]:
                core = "whole card"
            pods = ", ".join(card["pods"]) or "-"
            rows.append(
                [
                    node["name"],
                    str(card["index"]),
                    card["model"],
                    card["health"],
                    core,
                    memory,
                    pods,
                ]
            )
    if len(rows) == 1:
        return "no node publishes a vgpu inventory (is vgpu serve running, same domain?)\n"
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = [
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])) + "  " + row[-1]
        for row in rows
    ]
    for name, problem in sorted(data.get("unreadable_nodes", {}).items()):
        lines.append(f"node {name}: {problem}")
    return "\n".join(lines) + "\n"


def run_cluster_status(kubeconfig: Path | None, output: str, color: str, domain: str) -> int:
    try:
        data = collect_cluster(_kubeconfig(kubeconfig), domain)
    except KubeUnreachable as exc:
        print(f"vgpu status: cannot read the cluster: {exc}", file=sys.stderr)
        return 1
    if output == "json":
        print(json.dumps(data, indent=1))
    else:
        sys.stdout.write(render_cluster(data))
    return 0
