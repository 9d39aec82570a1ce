"""How many pre-drift traces a realignment replays, and from which categories: a pure rule.

Replay guards against forgetting the traffic before the drift. How much of it a run needs follows
from two measured facts rather than from a fixed share:

- how much of the old traffic is *absent* from the recent window. Per category c, with P(c) the
  old traffic's share and Q(c) the recent window's, the recent traces already carry
  min(P(c), Q(c)) of the old traffic, so the absent share is sum_c max(0, P(c) - Q(c)) (one minus
  the overlap of the two distributions). Traces without a category cannot be matched across the
  windows and count as absent: replaying traffic that is still arriving costs a little budget,
  forgetting traffic that is gone costs hit rate;
- how much the incumbent drafter *knows* about the old traffic: its greedy agreement with the
  target on held-out old rows, scored before training. Knowledge it does not have cannot be lost,
  so agreement near zero asks for little replay and agreement at or above ``KNOWN_AGREEMENT`` asks
  for the most.

The replay share of the training rows is ``max_share * absent * protection`` (protection =
agreement / KNOWN_AGREEMENT, capped at 1), turned into a row count against the recent training rows
and spread over the absent categories in proportion to their missing mass, within the rows each
category has. No torch here: the trainer calls it with counts and one score.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# Held-out greedy agreement at which the incumbent counts as knowing the old traffic fully.
KNOWN_AGREEMENT = 0.7
# The largest replay share of the training rows: at 0.5 the old traffic weighs as much as the new
# traffic the drafter is retrained for (more would trade the new traffic for the old).
MAX_REPLAY_SHARE = 0.5
# Protection when there is no held-out old row to score the incumbent on: assume it knows the
# old traffic (forgetting is the costly mistake).
UNSCORED_PROTECTION = 1.0
UNCATEGORIZED = ""


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """How many old rows to replay, per category, and the figures that decided it."""

    rows: int
    per_category: dict[str, int] = field(default_factory=dict)
    share: float = 0.0  # the planned replay share of the training rows (before the availability cap)
    absent_share: float = 0.0  # share of the old traffic that the recent window no longer carries
    protection: float = 0.0  # 0..1, from the incumbent's agreement on held-out old rows
    old_agreement: float | None = None
    reason: str = ""

    def as_dict(self) -> dict[str, object]:
        return {
            "rows": self.rows,
            "per_category": dict(self.per_category),
            "share": round(self.share, 4),
            "absent_share": round(self.absent_share, 4),
            "protection": round(self.protection, 4),
            "old_agreement": None if self.old_agreement is None else round(self.old_agreement, 4),
            "reason": self.reason,
        }


def distribution(counts: Mapping[str, int]) -> dict[str, float]:
    """Counts per category -> shares that sum to 1 (empty when there are no counts)."""
    total = sum(max(0, n) for n in counts.values())
    if total <= 0:
        return {}
    return {c: max(0, n) / total for c, n in counts.items() if n > 0}


def absent_by_category(old: Mapping[str, int], recent: Mapping[str, int]) -> dict[str, float]:
    """Per old category, the share of *all* old traffic the recent window no longer carries:
    max(0, P(c) - Q(c)), with uncategorized old traffic wholly absent. Sums to the absent share."""
    p, q = distribution(old), distribution(recent)
    out: dict[str, float] = {}
    for category, share in p.items():
        still = 0.0 if category == UNCATEGORIZED else min(share, q.get(category, 0.0))
        if share - still > 0:
            out[category] = share - still
    return out


def protection_for(agreement: float | None) -> float:
    """How much of the old traffic's knowledge is at stake, 0..1, from the incumbent's agreement."""
    if agreement is None:
        return UNSCORED_PROTECTION
    return min(1.0, max(0.0, agreement / KNOWN_AGREEMENT))


def plan_replay(
    *,
    recent_rows: int,
    recent_categories: Mapping[str, int],
    available: Mapping[str, int],
    old_agreement: float | None,
    max_share: float = MAX_REPLAY_SHARE,
) -> ReplayPlan:
    """The replay for a run with ``recent_rows`` recent training rows.

    ``recent_categories``: the recent window's traces per category; ``available``: the old traces
    that may be replayed, per category (held-out old rows excluded; they also set the old traffic's
    distribution). ``old_agreement``: the incumbent's held-out greedy agreement on old rows (None:
    none were scored).
    """
    if not 0.0 <= max_share < 1.0:
        raise ValueError(f"max_share must be in [0, 1), got {max_share}")
    if recent_rows < 0 or any(n < 0 for n in (*recent_categories.values(), *available.values())):
        raise ValueError("row counts cannot be negative")
    protection = protection_for(old_agreement)
    missing = absent_by_category(available, recent_categories)
    absent = sum(missing.values())
    share = max_share * absent * protection
    if recent_rows == 0 or share <= 0:
        why = (
            "no old traffic to replay"
            if not sum(available.values())
            else (
                "the recent window still carries the old traffic"
                if absent <= 0
                else "the incumbent does not know the old traffic"
                if protection <= 0
                else "no recent rows"
            )
        )
        return ReplayPlan(0, {}, share, absent, protection, old_agreement, why)
    # r / (n + r) = share  =>  r = n * share / (1 - share)
    wanted = round(recent_rows * share / (1 - share))
    per_category = allocate(wanted, missing, available)
    rows = sum(per_category.values())
    reason = (
        f"{absent:.0%} of the old traffic is absent from the recent window and the incumbent agrees "
        f"{'(unscored)' if old_agreement is None else f'{old_agreement:.2f}'} on it: replay share "
        f"{share:.2f} -> {wanted} rows"
    )
    if rows < wanted:
        reason += f", {rows} available"
    return ReplayPlan(rows, per_category, share, absent, protection, old_agreement, reason)


def allocate(total: int, weights: Mapping[str, float], available: Mapping[str, int]) -> dict[str, int]:
    """``total`` rows over categories in proportion to ``weights``, at most ``available[c]`` each;
    what a full category cannot take goes to the others (largest remainders first, ties by name)."""
    out = {c: 0 for c in weights if weights[c] > 0 and available.get(c, 0) > 0}
    left = total
    while left > 0 and out:
        open_ = [c for c in sorted(out) if out[c] < available[c]]
        if not open_:
            break
        mass = sum(weights[c] for c in open_)
        exact = {c: left * weights[c] / mass for c in open_}
        given = 0
        for c in open_:
            add = min(int(exact[c]), available[c] - out[c])
            out[c] += add
            given += add
        if given == 0:  # every share rounds to zero: one row to each largest remainder in turn
            for c in sorted(open_, key=lambda c: (-(exact[c] - int(exact[c])), c))[:left]:
                out[c] += 1
                given += 1
        left -= given
    return {c: n for c, n in out.items() if n > 0}
