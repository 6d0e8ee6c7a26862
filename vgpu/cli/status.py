"""`vgpu status`: every card, slice and container on this node.

Reads only the daemon's --state-dir (node.json and the per-container
records), so it works without an API server and after a daemon crash.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from vgpu.adapters import budget
from vgpu.adapters.dra.state import ClaimStore
from vgpu.adapters.fs import ContainerPaths, ContainerStore, placement_record
from vgpu.core.dra import claim_key
from vgpu.core.model import Placement
from vgpu.core.slicing import id_names_card

DEFAULT_STATE_DIR = Path("/var/lib/vgpu")


class StatusError(Exception):
    pass


def compute_shares(budget_file: Path, guarantee: int) -> dict[str, Any]:
    """The compute arbiter's last words for a container (its budget file):
    guarantee, burst cap, allowed and achieved share (percent); cap, allowed and
    achieved are None where no arbiter wrote them (the guarantee is then a fixed cap)."""
    view = budget.read_arbiter(budget_file)
    return {
        "core_guarantee": guarantee,
        "core_cap": view.cap_percent if view else None,
        "core_allowed": view.allowed_percent if view else None,
        "core_achieved": view.achieved_percent if view else None,
    }


def hook_usage_mib(budget_file: Path) -> int | None:
    """Memory the container's live processes hold, as the hook records it in its
    budget file; None when unknown (no hook ran there, or the file is not a
    budget file: never followed, never blocked on)."""
    return budget.usage_mib(budget_file)


def _card_entry(c: dict[str, Any], health: str | None = None) -> dict[str, Any]:
    """One card of the status document, from node.json's record of it."""
    return {
        "uuid": c["uuid"],
        "index": c["index"],
        "name": c["name"],
        "health": health or ("Healthy" if c.get("healthy", True) else "Unhealthy"),
        "xid": c.get("xid"),
        "problem": c.get("problem"),
        "memory_mib": c["memory_mib"],
        "numa_node": c.get("numa_node"),
        "minor": c.get("minor"),
        "core_allocated": 0,
        "memory_allocated_mib": 0,
        "containers": 0,
        "memory_used_mib": c.get("memory_used_mib"),
        "utilization_percent": c.get("utilization_percent"),
    }


def collect(state_dir: Path, now_s: float | None = None) -> dict[str, Any]:
    """The status document (the `-o json` contract)."""
    node_file = state_dir / "node.json"
    try:
        node = json.loads(node_file.read_text())
    except FileNotFoundError:
        raise StatusError(
            f"nothing to show: {node_file} does not exist. Is `vgpu serve` running on this node "
            f"with --state-dir {state_dir}? Pass --state-dir to point elsewhere."
        ) from None
    except (OSError, ValueError) as exc:
        raise StatusError(f"{node_file} is unreadable: {exc}") from None
    unit = int(node.get("memory_unit_mib", 256))
    store = ContainerStore(state_dir, unit)
    placements, bad = store.load_all()
    now = time.time() if now_s is None else now_s
    cards = {c["uuid"]: _card_entry(c) for c in node.get("cards", [])}
    containers = []
    # Count each device ID once: an app container that reuses its init
    # container's IDs shares them with the init's placement.
    held: dict[str, dict[str, set[str]]] = {}
    for p in sorted(placements, key=lambda p: p.created_s):
        record = placement_record(p, unit)
        for uuid in p.cards:
            _holding(cards, uuid)
            mine = held.setdefault(uuid, {"vcuda-core": set(), "vcuda-memory": set()})
            for resource, ids in record["device_ids"].items():
                mine[resource] |= {
                    d for d in ids if id_names_card(d, uuid, cards.get(uuid, {}).get("index"))
                }
        owner = p.owner
        who = {
            "namespace": owner.namespace if owner else None,
            "pod": owner.pod if owner else None,
            "container": owner.container if owner else None,
            "pod_uid": owner.pod_uid if owner else None,
        }
        containers.append(
            _slice_entry(who, p, store.paths(p.key), now, record["device_ids"], cards)
        )
    for card_uuid, mine in held.items():
        cards[card_uuid]["core_allocated"] = len(mine["vcuda-core"])
        cards[card_uuid]["memory_allocated_mib"] = len(mine["vcuda-memory"]) * unit
    dra, dra_bad = _dra_entries(state_dir, unit, cards, now)
    containers += dra
    bad += dra_bad
    return {
        "node_file": str(node_file),
        "updated_s": node.get("updated_s"),
        "domain": node.get("domain"),
        "memory_unit_mib": unit,
        "cards": sorted(cards.values(), key=lambda c: c["index"]),
        "containers": containers,
        "unreadable_records": bad,
    }


def _holding(cards: dict[str, dict[str, Any]], uuid: str) -> dict[str, Any]:
    """The card a slice is on, counted; a "Gone" entry if it disappeared meanwhile."""
    card = cards.get(uuid)
    if card is None:
        gone = {"uuid": uuid, "index": -1, "name": "(gone)", "memory_mib": 0}
        cards[uuid] = card = _card_entry(gone, health="Gone")
    card["containers"] += 1
    return card


def _slice_entry(
    who: dict[str, Any],
    p: Placement,
    paths: ContainerPaths,
    now: float,
    device_ids: dict[str, Any],
    cards: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """One row of `containers`: who holds it, then the slice."""
    return {
        **who,
        "key": p.key,
        "cards": list(p.cards),
        "core": p.core_percent,
        "whole_cards": p.whole,
        "memory_mib": p.memory_mib,
        "memory_used_mib": hook_usage_mib(paths.budget_file),
        **compute_shares(paths.budget_file, p.core_percent),
        "age_s": max(0.0, now - p.created_s),
        "device_ids": device_ids,
        "config_path": str(paths.config_file),
        "card_health": [cards[u]["health"] for u in p.cards],
    }


def _dra_entries(
    state_dir: Path, unit: int, cards: dict[str, dict[str, Any]], now: float
) -> tuple[list[dict[str, Any]], list[str]]:
    """DRA mode's prepared claims, one entry per request, like device-plugin slices."""
    dra_dir = state_dir / "dra"
    records, bad = ClaimStore(dra_dir, unit).load_all()
    store = ContainerStore(dra_dir, unit)
    entries = []
    for record in sorted(records, key=lambda r: r.created_s):
        pod, pod_uid = record.pods[0] if record.pods else (None, None)
        requests = {claim_key(record.claim.uid, d.request): d.request for d in record.devices}
        for p in record.placements:
            for uuid in p.cards:
                card = _holding(cards, uuid)
                card["core_allocated"] += p.core_percent
                whole_mib = card["memory_mib"] // unit * unit if p.whole else 0
                card["memory_allocated_mib"] += p.memory_mib or whole_mib
            who = {
                "namespace": record.claim.namespace,
                "pod": pod,
                "container": None,
                "pod_uid": pod_uid,
                "claim": {
                    "namespace": record.claim.namespace,
                    "name": record.claim.name,
                    "uid": record.claim.uid,
                    "request": requests.get(p.key, ""),
                },
            }
            entry = _slice_entry(who, p, store.paths(p.key), now, {}, cards)
            entry["cdi_devices"] = [i for d in record.devices for i in d.cdi_ids]
            entries.append(entry)
    return entries, [f"dra/claims/{name}" for name in bad]


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def _bar(fraction: float, width: int = 20) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * width)
    return "#" * filled + "." * (width - filled)


class _Paint:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.enabled else text


def render(doc: dict[str, Any], wide: bool = False, color: bool = False) -> str:
    paint = _Paint(color)
    lines: list[str] = []
    by_card: dict[str, list[dict[str, Any]]] = {}
    for c in doc["containers"]:
        for uuid in c["cards"]:
            by_card.setdefault(uuid, []).append(c)
    for card in doc["cards"]:
        health = card["health"]
        if health == "Healthy":
            health_text = paint(health, "32")
        else:
            xid = f" (XID {card['xid']})" if card.get("xid") else ""
            xid = xid or (f" ({card['problem']})" if card.get("problem") else "")
            health_text = paint(health + xid, "31;1")
        mem_total = card["memory_mib"] or 1
        lines.append(
            paint(f"GPU {card['index']}", "1")
            + f"  {card['name']}  {card['uuid']}  {health_text}"
            + (f"  NUMA {card['numa_node']}" if wide else "")
        )
        core_pct = card["core_allocated"]
        mem_gib = card["memory_allocated_mib"] / 1024
        lines.append(f"  core    [{_bar(core_pct / 100)}] {core_pct:>3}% allocated")
        lines.append(
            f"  memory  [{_bar(card['memory_allocated_mib'] / mem_total)}] "
            f"{mem_gib:.1f} / {card['memory_mib'] / 1024:.1f} GiB allocated"
        )
        real = []
        if card.get("memory_used_mib") is not None:
            real.append(f"{card['memory_used_mib'] / 1024:.1f} GiB in use")
        if card.get("utilization_percent") is not None:
            real.append(f"{card['utilization_percent']}% busy")
        if real:
            lines.append(f"  real    {', '.join(real)}")
        rows = by_card.get(card["uuid"], [])
        if not rows:
            lines.append("  (no containers)")
        for c in rows:
            if c.get("claim"):
                who = f"{c['namespace']}/{c['pod']}" if c["pod"] else c["namespace"]
                name = f"{who} claim {c['claim']['name']}"
            elif c["pod"]:
                name = f"{c['namespace']}/{c['pod']}/{c['container']}"
            else:
                name = f"(owner not known yet: {c['key']})"
            core = (
                "whole card"
                if c["whole_cards"]
                else (f"{c['core']}%" if c["core"] else "best effort")
            )
            mem = f"{c['memory_mib'] / 1024:.1f} GiB" if c["memory_mib"] else "no limit"
            used = (
                f"{c['memory_used_mib'] / 1024:.1f} GiB used"
                if c["memory_used_mib"] is not None
                else "usage n/a"
            )
            lines.append(
                f"  - {name:<48} core {core:<11} mem {mem:<10} {used:<14} age {_age(c['age_s'])}"
            )
            if c.get("core_allowed") is not None:
                lines.append(
                    f"      compute: guarantee {c['core_guarantee']}%, cap {c['core_cap']:g}%, "
                    f"allowed {c['core_allowed']:g}%, achieved {c['core_achieved']:g}%"
                )
            if wide:
                lines.append(f"      config {c['config_path']}")
                for cdi in c.get("cdi_devices", []):
                    lines.append(f"      CDI {cdi}")
                for resource, ids in c["device_ids"].items():
                    shown = ", ".join(ids[:4]) + (f" (+{len(ids) - 4})" if len(ids) > 4 else "")
                    lines.append(f"      {resource}: {shown}")
        lines.append("")
    if doc["unreadable_records"]:
        lines.append(
            paint("unreadable records (the daemon rebuilds them from the kubelet): ", "33")
            + ", ".join(doc["unreadable_records"])
        )
    return "\n".join(lines).rstrip() + "\n"


def run_status(state_dir: Path | None, output: str, color: str) -> int:
    directory = state_dir or DEFAULT_STATE_DIR
    try:
        doc = collect(directory)
    except StatusError as exc:
        print(f"vgpu status: {exc}", file=sys.stderr)
        return 1
    if output == "json":
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    use_color = color == "always" or (
        color == "auto" and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    )
    sys.stdout.write(render(doc, wide=output == "wide", color=use_color))
    return 0
