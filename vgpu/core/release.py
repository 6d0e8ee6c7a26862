"""When may a placement be released? The rules, pure: times come in as values.

The kubelet's pod-resources List is the truth about who holds which device
IDs, except while the kubelet is (re)starting: a new kubelet serves the API
before it has loaded its pods, so for a moment its List is empty or partial
although every container still runs (issue 28). Releasing on such an answer
frees live slices, and the runtime then finds the released container's
budget file missing. So a placement the kubelet no longer lists is released
only when all of these hold:

1. **No hold is in force.** A hold starts whenever a kubelet (re)start is
   noticed, by whichever path sees it first: `kubelet.sock` re-created, the
   pod-resources socket re-created, a List that fails, or a kubelet that
   started less than one settle period before the daemon's first List. It
   ends once the daemon is registered with the kubelet now running (for a
   re-created socket: registered again since the hold began) *and* that
   kubelet's answers have been stable (answered, and no container dropped
   from one answer to the next, except those of pods the API server shows
   deleting or gone) for one settle period (the reconcile period,
   at most SETTLE_MAX_S). The start-up rule applies only to a daemon that
   recovered placements: a fresh one has nothing a new kubelet could forget.
2. **Two sightings agree.** The kubelet left it out of two Lists at least
   `grace_s` apart.
3. **The API server agrees** (checked by the caller): it does not show the
   owner's pod bound to this node and not terminated.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field

__all__ = ["RELEASE_GRACE_S", "SETTLE_MAX_S", "ReleaseGate"]

RELEASE_GRACE_S = 2.0  # the least time between the two sightings of a release
SETTLE_MAX_S = 30.0  # the settle period is the reconcile period, at most this
# A hold that waits for a registration which never comes (a kubelet that kept
# its kubelet.sock) stops waiting for it after this many settle periods.
REREGISTER_WAIT_SETTLES = 3


@dataclass
class ReleaseGate:
    """The hold after a kubelet (re)start, and the first sightings of missing placements."""

    settle_s: float  # how long answers must be stable before a hold ends
    grace_s: float = RELEASE_GRACE_S
    hold_since: float | None = None
    hold_why: str = ""
    # Must the daemon register again (after restarted_at) before the hold ends?
    reregister: bool = False
    restarted_at: float = 0.0  # when the new kubelet started (its socket's age)
    registered_at: float | None = None  # the daemon's last registration
    # The start of the current run of stable answers while held (None: none yet).
    stable_since: float | None = None
    _last_listed: frozenset[Hashable] | None = None
    _missing_since: dict[str, float] = field(default_factory=dict)
    holds: int = 0  # how many holds began

    # ------------------------------------------------------------ the hold

    def restart(
        self, now_s: float, why: str, reregister: bool = True, started_s: float | None = None
    ) -> bool:
        """A kubelet (re)start was noticed: hold every release. `reregister`: a
        new kubelet runs, and the daemon must have registered with it, i.e.
        since `started_s` (when it started, if known: a registration may come
        before the restart is noticed on another path; else now). True when a
        hold begins now (False: one was already in force, and starts over)."""
        began = self.hold_since is None
        if reregister:
            self.restarted_at = now_s if started_s is None else min(started_s, now_s)
        self.reregister = reregister or (self.reregister and not began)
        self.hold_since = now_s
        self.hold_why = why
        self.stable_since = None
        self._last_listed = None
        self._missing_since.clear()  # sightings before the restart prove nothing
        if began:
            self.holds += 1
        return began

    def note_registered(self, now_s: float) -> None:
        """The daemon registered its plugins with the kubelet."""
        self.registered_at = now_s

    def _registered(self, now_s: float, registered: bool) -> bool:
        """Registered with the kubelet now running, and since the hold began
        where that is needed."""
        if not registered or self.hold_since is None or not self.reregister:
            return registered
        if self.registered_at is not None and self.registered_at >= self.restarted_at:
            return True
        return now_s - self.hold_since >= REREGISTER_WAIT_SETTLES * self.settle_s

    def list_failed(self, now_s: float) -> None:
        """The kubelet did not answer: the answers are not stable."""
        self.stable_since = None
        self._last_listed = None

    def listed(
        self,
        now_s: float,
        containers: Collection[Hashable],
        registered: bool,
        leaving: Callable[[Hashable], bool] = lambda container: False,
    ) -> None:
        """An answer of the kubelet's List (the containers holding our IDs),
        with whether the daemon is registered with the kubelet now running.
        `leaving`: is a container's pod known to be deleting or gone (its
        leaving the List is expected, not a sign of an unsettled kubelet)?"""
        listed = frozenset(containers)
        if self.hold_since is not None:
            registered = self._registered(now_s, registered)
            dropped = self._last_listed is not None and any(
                not leaving(c) for c in self._last_listed - listed
            )
            if not registered or dropped or self.stable_since is None:
                self.stable_since = now_s if registered else None
        self._last_listed = listed

    def holding(self, now_s: float, registered: bool) -> str | None:
        """Why releases are held now, or None (the hold ends here once it may)."""
        if self.hold_since is None:
            return None
        if (
            self._registered(now_s, registered)
            and self.stable_since is not None
            and now_s - self.stable_since >= self.settle_s
        ):
            self.hold_since = None
            self.hold_why = ""
            return None
        return self.hold_why

    # ------------------------------------------------------- the sightings

    def confirm_missing(self, key: str, now_s: float) -> bool:
        """The kubelet does not list `key` now. True when an earlier sighting,
        at least grace_s ago, agrees (then the placement may go)."""
        first = self._missing_since.setdefault(key, now_s)
        return now_s - first >= self.grace_s

    def present(self, key: str) -> None:
        """`key` is listed (or otherwise known alive): forget its sightings."""
        self._missing_since.pop(key, None)

    def forget_except(self, keys: Collection[str]) -> None:
        """Drop the sightings of placements that no longer exist."""
        for key in [k for k in self._missing_since if k not in keys]:
            del self._missing_since[key]

    def awaiting(self) -> bool:
        """Is a placement waiting for its second sighting?"""
        return bool(self._missing_since)

    def due_in(self, now_s: float) -> float | None:
        """Seconds until the next look may change something: the earliest first
        sighting can be confirmed, or a hold that is stable can end (None: no
        such moment is known; the periodic check looks anyway)."""
        due = [first + self.grace_s for first in self._missing_since.values()]
        if self.hold_since is not None and self.stable_since is not None:
            due.append(self.stable_since + self.settle_s)
        return max(0.0, min(due) - now_s) if due else None
