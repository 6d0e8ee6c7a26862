"""<state>/node.json: the cards as last seen, for `vgpu status` (both modes)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vgpu.adapters.fs import atomic_write
from vgpu.adapters.gpus import CardReading
from vgpu.core.model import Card, CardUuid

log = logging.getLogger(__name__)


def node_document(
    cards: Iterable[Card],
    readings: Mapping[CardUuid, CardReading],
    *,
    domain: str,
    memory_unit_mib: int,
    now_s: float,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    def card_json(c: Card) -> dict[str, Any]:
        reading = readings.get(c.uuid, CardReading())
        return {
            "uuid": c.uuid,
            "index": c.index,
            "name": c.name,
            "memory_mib": c.memory_mib,
            "minor": c.minor,
            "numa_node": c.numa_node,
            "healthy": c.healthy,
            "xid": c.xid,
            "problem": c.problem,
            "memory_used_mib": reading.memory_used_mib,
            "utilization_percent": reading.utilization_percent,
        }

    return {
        "domain": domain,
        "memory_unit_mib": memory_unit_mib,
        "cards": [card_json(c) for c in sorted(cards, key=lambda c: c.index)],
        "updated_s": now_s,
        **(extra or {}),
    }


def write_node_file(path: Path, document: Mapping[str, Any]) -> None:
    """Write node.json atomically; a failure is logged, never raised."""
    try:
        atomic_write(path, json.dumps(document, indent=1).encode())
    except OSError as exc:
        log.warning("cannot write %s: %s", path, exc)
