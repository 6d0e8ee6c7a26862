"""Prepared claims on disk: one record per claim, the driver's durable state.

Layout under --state-dir (next to the device plugin's, never mixed with it):

    <state>/dra/claims/<claim uid>.json        what was prepared: placements, CDI spec
    <state>/dra/containers/<key>/config.json   a request's limit config (ContainerStore)
    <state>/dra/containers/<key>/shared/vgpu.shm  the hook's budget file (only it is mounted)

A record is written before the files it names, so a crash part-way leaves a
record from which everything can be rewritten (next prepare, or start-up) or
removed (unprepare); files no record names are orphans and are swept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vgpu.adapters.fs import atomic_write, placement_from_record, placement_record
from vgpu.core.dra import ClaimRef, PreparedDevice
from vgpu.core.model import Placement

log = logging.getLogger(__name__)

CLAIM_RECORD_VERSION = 1


@dataclass(frozen=True)
class ClaimRecord:
    claim: ClaimRef
    pods: tuple[tuple[str, str], ...]
    signature: str
    placements: tuple[Placement, ...]
    devices: tuple[PreparedDevice, ...]
    cdi_file: str
    cdi_spec: dict[str, Any] = field(hash=False)
    created_s: float = 0.0
    # The burst cap of each fractional request, from the claim's opaque config
    # (fixed once allocated). A request not here (a record written before caps
    # existed) gets the cluster default, else its guarantee.
    core_caps: tuple[tuple[str, int], ...] = ()

    def core_cap(self, request: str) -> int | None:
        return dict(self.core_caps).get(request)

    def to_json(self, memory_unit_mib: int) -> dict[str, Any]:
        return {
            "version": CLAIM_RECORD_VERSION,
            "claim": {
                "namespace": self.claim.namespace,
                "name": self.claim.name,
                "uid": self.claim.uid,
            },
            "pods": [{"name": name, "uid": uid} for name, uid in self.pods],
            "signature": self.signature,
            "placements": [placement_record(p, memory_unit_mib) for p in self.placements],
            "devices": [
                {
                    "request": d.request,
                    "pool": d.pool,
                    "device": d.device,
                    "cdi_ids": list(d.cdi_ids),
                    "share_id": d.share_id,
                }
                for d in self.devices
            ],
            "cdi_file": self.cdi_file,
            "cdi_spec": self.cdi_spec,
            "created_s": self.created_s,
            "core_caps": dict(self.core_caps),
        }

    @classmethod
    def from_json(cls, data: Any) -> ClaimRecord:
        """Inverse of to_json; ValueError/KeyError/TypeError on anything malformed."""
        if not isinstance(data, dict) or data.get("version") != CLAIM_RECORD_VERSION:
            raise ValueError("not a vgpu claim record of a known version")
        claim = data["claim"]
        cdi_file = str(data["cdi_file"])
        if "/" in cdi_file or not cdi_file.endswith(".json"):
            raise ValueError(f"cdi_file {cdi_file!r} is not a file name")
        return cls(
            claim=ClaimRef(str(claim["namespace"]), str(claim["uid"]), str(claim["name"])),
            pods=tuple((str(p["name"]), str(p["uid"])) for p in data["pods"]),
            signature=str(data["signature"]),
            placements=tuple(placement_from_record(p) for p in data["placements"]),
            devices=tuple(
                PreparedDevice(
                    request=str(d["request"]),
                    pool=str(d["pool"]),
                    device=str(d["device"]),
                    cdi_ids=tuple(str(i) for i in d["cdi_ids"]),
                    share_id=str(d["share_id"]) if d.get("share_id") else None,
                )
                for d in data["devices"]
            ),
            cdi_file=cdi_file,
            cdi_spec=dict(data["cdi_spec"]),
            created_s=float(data["created_s"]),
            core_caps=_core_caps(data.get("core_caps")),
        )


def _core_caps(raw: Any) -> tuple[tuple[str, int], ...]:
    """A record's caps; absent (an older record) or a bad entry: none, so the
    request falls back to the cluster default rather than the record being lost."""
    if not isinstance(raw, dict):
        return ()
    return tuple(
        (str(request), cap)
        for request, cap in raw.items()
        if isinstance(cap, int) and not isinstance(cap, bool) and 0 < cap <= 100
    )


class ClaimStore:
    """<state>/dra/claims/<uid>.json, written atomically."""

    def __init__(self, dra_dir: Path, memory_unit_mib: int) -> None:
        self.root = dra_dir / "claims"
        self.memory_unit_mib = memory_unit_mib

    def path(self, uid: str) -> Path:
        return self.root / f"{uid}.json"

    def write(self, record: ClaimRecord) -> None:
        body = json.dumps(record.to_json(self.memory_unit_mib), indent=1).encode()
        atomic_write(self.path(record.claim.uid), body)

    def remove(self, uid: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(uid))

    def load_all(self) -> tuple[list[ClaimRecord], list[str]]:
        """Every readable record, and the names of unreadable ones (left in place)."""
        good: list[ClaimRecord] = []
        bad: list[str] = []
        try:
            entries = sorted(self.root.iterdir())
        except FileNotFoundError:
            return good, bad
        for entry in entries:
            if entry.name.startswith(".") or entry.suffix != ".json":
                continue
            try:
                record = ClaimRecord.from_json(json.loads(entry.read_text()))
                if entry.name != f"{record.claim.uid}.json":
                    raise ValueError(f"record names claim {record.claim.uid}")
                good.append(record)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("claim record %s is unreadable (%s); ignoring it", entry.name, exc)
                bad.append(entry.name)
        return good, bad


def sweep_temp_files(directory: Path, prefix: str = "") -> None:
    """Remove atomic_write's leftovers (".<name>.*.tmp") of a crash mid-write;
    with `prefix`, only those of files named so (a shared directory)."""
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.name.startswith(f".{prefix}") and entry.name.endswith(".tmp"):
            with contextlib.suppress(OSError):
                entry.unlink()
