"""Card health: which XID errors take a card out of service.

Pure: the NVML adapter reports events, this module decides.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from vgpu.core.model import Card, CardUuid

# Application-level XIDs: caused by a user program (bad kernel, page fault,
# watchdog, preemption), the card itself is fine. Ignored by default.
DEFAULT_IGNORED_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})

# XIDs that mean the card is gone or broken; documented examples. Any XID not
# ignored marks the card unhealthy, these are just the ones we name in logs.
CRITICAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remap pending",
    64: "ECC page retirement or row remap failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
}


def describe_xid(xid: int) -> str:
    return CRITICAL_XIDS.get(xid, "driver-reported error")


@dataclass(frozen=True)
class HealthEvent:
    """Something the backend saw on a card."""

    card: CardUuid
    xid: int | None = None  # an XID event
    healthy: bool | None = None  # an explicit state (mock file, NVML probe after recovery)


class HealthTracker:
    """Folds events into per-card health; tells which cards changed."""

    def __init__(self, ignored_xids: Iterable[int] = DEFAULT_IGNORED_XIDS) -> None:
        self.ignored_xids = frozenset(ignored_xids)

    def judge(self, card: Card) -> Card:
        """A card as a backend reported it (Card.xid: an XID still to be judged)."""
        if card.xid is not None and card.healthy:
            return self.apply(replace(card, xid=None), HealthEvent(card.uuid, xid=card.xid))
        return card

    def apply(self, card: Card, event: HealthEvent) -> Card:
        """The card after `event`; the same object when nothing changed."""
        if event.xid is not None:
            if event.xid in self.ignored_xids:
                return card
            if not card.healthy and card.xid == event.xid:
                return card
            return replace(card, healthy=False, xid=event.xid)
        if event.healthy is None or event.healthy == card.healthy:
            return card
        return replace(card, healthy=event.healthy, xid=None if event.healthy else card.xid)
