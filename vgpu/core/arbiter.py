"""Compute arbitration on one card: who may use how much of it, right now.

The node daemon runs this every arbiter period (<= 100 ms) for each card that
holds fractional slices. Inputs per container are its guarantee (the
`vcuda-core` it was placed with), its burst cap (annotation, DRA opaque
parameter or the cluster default; never below the guarantee) and what it
achieved over the last period (SM utilisation of its host pids, from NVML).

- `estimate_demand` turns what a container achieved into what it would use if
  it could, from where it stood against its last allowance;
- `share_out` divides the card: first each container's guarantee as far as it
  wants it, then what is left in proportion to the guarantees, up to each
  container's cap and demand (water-filling). The result never sums above the
  card, never exceeds a cap, and leaves nothing idle that someone below its cap
  wants (work-conserving);
- `allowed_percent` is what goes into the container's budget file: its share,
  but never below its guarantee, so a container that was idle can always climb
  back to its guarantee at once, without waiting for the next period.

Also here: the burst-cap annotations (`<domain>/vcuda-core-limit` and
`<domain>/vcuda-core-limit.<container>`), parsed strictly; a bad value is a
problem to report, never trusted. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

CARD_PERCENT = 100.0
# A container "presses" its allowance when it achieves within this much of it.
PRESS_MARGIN_PERCENT = 3.0
PRESS_MARGIN_FRACTION = 0.08
# What a container below its allowance may grow into before the next period.
HEADROOM_PERCENT = 5.0
# Below this a container counts as idle.
IDLE_PERCENT = 1.0
# The containers on a card together achieve at least this much: the card is
# full, and one below its share may be squeezed rather than want less.
SATURATED_PERCENT = 95.0
# A container seen to be its own limit is not offered its guarantee again; every
# this many periods it is offered HEADROOM_PERCENT more instead. A tenant that
# only looked self-limited (starved of CPU for a moment) and is now squeezed by
# neighbours that took its room grows into that step and is then probed fully.
RECHECK_PERIODS = 10
_EPS = 1e-9


@dataclass(frozen=True)
class Tenant:
    """One container on one card, as the arbiter sees it (percent of the card)."""

    guarantee_percent: float
    cap_percent: float
    demand_percent: float


def _press_margin(allowed_percent: float) -> float:
    return max(PRESS_MARGIN_PERCENT, PRESS_MARGIN_FRACTION * allowed_percent)


def estimate_demand(
    achieved_percent: float,
    allowed_percent: float,
    share_percent: float,
    guarantee_percent: float,
    cap_percent: float,
    throttled: bool | None = None,
    saturated: bool = False,
    settled_percent: float | None = None,
    recheck: bool = False,
) -> float:
    """What a container would use, judged from its last period.

    - Its hooks held launches back (`throttled`), or, where that is not known,
      it achieved (about) all it was allowed: it wants as much as it may (its cap).
    - It achieved all of its planned share, but the card was shared: it may be
      squeezed by its neighbours, so it wants at least its guarantee and a step more.
    - It achieved less than its share on a full card (`saturated`): neighbours
      whose throttles have not yet come down to their new allowances may be
      squeezing it (a newcomer, a returning tenant), so it keeps its share.
    - Neither of the last two while it stays at the level where it was seen to
      be its own limit (`settled_percent`: below its guarantee with room on the
      card): probing it again every other period would take its neighbours'
      allowances down and up and leave the card idle in between. On a
      `recheck` it is offered a step more than it used instead.
    - Otherwise its own program is the limit: what it achieved, plus headroom
      when that reaches above its guarantee (below it, the allowance already
      leaves room to grow).
    """
    achieved = max(0.0, min(CARD_PERCENT, achieved_percent))
    if throttled or (
        throttled is None and achieved >= allowed_percent - _press_margin(allowed_percent)
    ):
        return cap_percent
    own_limit = settled_percent is not None and achieved <= settled_percent + _press_margin(
        settled_percent
    )
    if own_limit and recheck:
        return min(cap_percent, achieved + HEADROOM_PERCENT)
    if (
        not own_limit
        and achieved > IDLE_PERCENT
        and achieved >= share_percent - _press_margin(share_percent)
    ):
        return min(cap_percent, max(guarantee_percent, share_percent + HEADROOM_PERCENT))
    if not own_limit and saturated and achieved > IDLE_PERCENT:
        return min(cap_percent, share_percent)
    if achieved + HEADROOM_PERCENT <= guarantee_percent:
        # Its allowance never falls below its guarantee, so it can grow back to
        # it at once: no headroom is held for it, which would leave capacity
        # idle that a pressing neighbour wants.
        return achieved
    return min(cap_percent, achieved + HEADROOM_PERCENT)


def share_out(tenants: Sequence[Tenant], capacity_percent: float = CARD_PERCENT) -> list[float]:
    """Each tenant's share of the card (percent), in the tenants' order.

    1. Every tenant gets min(guarantee, demand); should the guarantees ever sum
       above the card (they cannot through placement), they are scaled down alike.
    2. The rest goes to tenants still below min(cap, demand), in proportion to
       their guarantees (a tenant without a guarantee weighs as 1 %), water-filling
       until nothing is left or nobody wants more.
    """
    n = len(tenants)
    if n == 0:
        return []
    target = [max(0.0, min(t.cap_percent, t.demand_percent, capacity_percent)) for t in tenants]
    base = [min(max(0.0, t.guarantee_percent), target[i]) for i, t in enumerate(tenants)]
    total = sum(base)
    if total > capacity_percent:
        base = [b * capacity_percent / total for b in base]
    share = list(base)
    left = capacity_percent - sum(share)
    weights = [max(1.0, t.guarantee_percent) for t in tenants]
    for _ in range(n + 1):  # each round fills at least one tenant up, or ends
        hungry = [i for i in range(n) if target[i] - share[i] > _EPS]
        if left <= _EPS or not hungry:
            break
        weight = sum(weights[i] for i in hungry)
        given = 0.0
        for i in hungry:
            give = min(left * weights[i] / weight, target[i] - share[i])
            share[i] += give
            given += give
        left -= given
    return share


def allowed_percent(share: float, guarantee_percent: float, cap_percent: float) -> float:
    """The allowance written for a container: its share, never below its guarantee
    (it may always climb back to it at once), never above its cap."""
    return min(cap_percent, max(share, guarantee_percent))


@dataclass(frozen=True)
class Settled:
    """Where a container was last seen to be its own limit, and for how many
    periods since (then or at its last recheck)."""

    level_percent: float
    periods: int = 0


def settled_level(
    achieved_percent: float,
    guarantee_percent: float,
    total_percent: float,
    previous: Settled | None,
) -> Settled | None:
    """Where a container was seen to be its own limit, after this period: below
    its guarantee (so below its allowance: its hooks did not hold it) while the
    card had room for it to reach its guarantee (so no neighbour squeezed it).
    Forgotten once it is idle (it may come back wanting its guarantee) or uses
    more than that level; its periods restart when a recheck finds it still
    there."""
    achieved = max(0.0, min(CARD_PERCENT, achieved_percent))
    if achieved <= IDLE_PERCENT:
        return None
    room = CARD_PERCENT - total_percent
    if achieved + HEADROOM_PERCENT <= guarantee_percent and room >= guarantee_percent - achieved:
        return Settled(achieved)
    if previous is None:
        return None
    if achieved > previous.level_percent + _press_margin(previous.level_percent):
        return None
    if previous.periods >= RECHECK_PERIODS:
        return Settled(previous.level_percent)
    return Settled(previous.level_percent, previous.periods + 1)


@dataclass(frozen=True)
class Period:
    """One period's decision on one card, per container in the callers' order."""

    shares: list[float]
    allowed: list[float]
    settled: list[Settled | None]  # feed back as `previous_settled` next period


def arbitrate_period(
    guarantees: Sequence[float],
    caps: Sequence[float],
    achieved: Sequence[float],
    previous_allowed: Sequence[float],
    previous_share: Sequence[float],
    throttled: Sequence[bool | None] | None = None,
    previous_settled: Sequence[Settled | None] | None = None,
) -> Period:
    """One period on one card: shares, allowances and where each container was
    seen to be its own limit. `throttled`: whether each container's hooks held
    launches back (None: unknown)."""
    n = len(guarantees)
    held = list(throttled) if throttled is not None else [None] * n
    before = list(previous_settled) if previous_settled is not None else [None] * n
    total = sum(max(0.0, a) for a in achieved)
    saturated = total >= SATURATED_PERCENT
    tenants = [
        Tenant(
            guarantee_percent=g,
            cap_percent=c,
            demand_percent=estimate_demand(
                a,
                pa,
                ps,
                g,
                c,
                h,
                saturated,
                None if st is None else st.level_percent,
                st is not None and st.periods >= RECHECK_PERIODS,
            ),
        )
        for g, c, a, pa, ps, h, st in zip(
            guarantees, caps, achieved, previous_allowed, previous_share, held, before, strict=True
        )
    ]
    shares = share_out(tenants)
    allowed = [
        allowed_percent(s, t.guarantee_percent, t.cap_percent)
        for s, t in zip(shares, tenants, strict=True)
    ]
    settled = [
        settled_level(a, g, total, st)
        for a, g, st in zip(achieved, guarantees, before, strict=True)
    ]
    return Period(shares, allowed, settled)


# ---- the burst cap ----


def core_limit_key(domain: str, container: str | None = None) -> str:
    """`<domain>/vcuda-core-limit`, or its per-container form."""
    key = f"{domain}/vcuda-core-limit"
    return f"{key}.{container}" if container else key


@dataclass(frozen=True)
class CapChoice:
    """A container's burst cap and any annotation that was ignored (with why)."""

    cap_percent: int
    problems: tuple[str, ...] = ()


def default_core_cap(guarantee_percent: int, default_percent: int | None) -> int:
    """The cap where no annotation or claim config sets one: the cluster default
    (never below the guarantee, never above the card), else the guarantee."""
    if default_percent is None:
        return guarantee_percent
    return max(guarantee_percent, min(100, default_percent))


def _parse_percent(text: str) -> int | None:
    text = text.strip()
    if text.endswith("%"):
        text = text[:-1].strip()
    if not text.isdigit() or len(text) > 3:
        return None
    return int(text)


def check_cap(label: str, raw: object, guarantee_percent: int, holder: str) -> int | str:
    """A cap value as written (an int, or text with an optional trailing %): the
    whole percent, or a problem naming `label` and the fix. It must lie between
    the `holder`'s guarantee and 100."""
    value: int | None = None
    if isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    elif isinstance(raw, str) and len(raw) <= 16:
        value = _parse_percent(raw)
    if value is None:
        return (
            f"{label}={str(raw)[:32]!r} is not a whole percent; ignored "
            f"(write a number from {guarantee_percent} to 100)"
        )
    if not guarantee_percent <= value <= 100:
        return (
            f"{label}={value} is outside {guarantee_percent}-100 (the {holder}'s "
            "guarantee to the whole card); ignored"
        )
    return value


def burst_cap(
    annotations: Mapping[str, str],
    domain: str,
    container: str,
    guarantee_percent: int,
    default_percent: int | None,
) -> CapChoice:
    """The cap of one container: its own annotation, else the pod's, else the
    cluster default, else its guarantee. A cap is a whole percent between the
    guarantee and 100 (a trailing % is accepted); anything else is ignored, with a
    problem naming the annotation, and the next source applies. A cap can only
    raise the container's own ceiling: it never lowers its guarantee."""
    problems: list[str] = []
    for key in (core_limit_key(domain, container), core_limit_key(domain)):
        raw = annotations.get(key)
        if raw is None:
            continue
        checked = check_cap(f"annotation {key}", raw, guarantee_percent, "container")
        if isinstance(checked, str):
            problems.append(checked)
            continue
        return CapChoice(checked, tuple(problems))
    return CapChoice(default_core_cap(guarantee_percent, default_percent), tuple(problems))
