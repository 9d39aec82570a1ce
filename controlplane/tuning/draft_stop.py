"""Draft-stop threshold choice: the expected speed-up of each confidence threshold from
counterfactual draft counts and measured costs, and the threshold to serve (or none).

Owns the arithmetic only (no I/O). A round that stops at the first draft its drafter gives less
than probability t drafts fewer tokens (cheaper drafting and verification) and keeps at most the
accepted prefix it still drafted. Engines that count it report, per request, for a grid of t:
``rounds`` drafting rounds, and the tokens each t would have drafted and had accepted
(workers.engine.metrics ``DraftStopCounts``; ingest field ``draft_stop_counts``). Summed over
requests, with ``d_t`` = drafted / rounds and ``a_t`` = accepted / rounds::

    tokens per round  E(t) = a_t + 1                      (the 1 is the target's own token)
    cost per round    C(t) = v(d_t) + d_t * c             (target single-token step times)
    speed-up          S(t) = E(t) / C(t)

with ``c`` the drafter/target step cost ratio and ``v(d)`` the measured cost of verifying ``d + 1``
tokens (the same cost model as controlplane.tuning.draft_length; ``v`` is evaluated at the mean
draft count, exact where ``v`` is linear). The reference is what actually ran: drafting without a
threshold (or at the threshold already serving, when one was), whose counts are the requests'
own drafted and accepted tokens.

The tuner never makes things worse: a threshold is chosen only when, with the tokens it would
lose taken at an upper confidence bound and the drafts it would save at a lower one, it still
beats the reference by ``margin``, over at least ``min_rounds`` rounds. Otherwise the reference
stands (off, when nothing was serving).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from controlplane.speculation_math import expected_speedup, hit_rate
from controlplane.tuning.draft_length import verify_cost_at, verify_cost_function

# A threshold must beat the reference by this share of speed-up, pessimistically counted.
DEFAULT_MARGIN = 0.02
# Rounds the counts must cover before any threshold is chosen (a few hundred requests).
DEFAULT_MIN_ROUNDS = 2000
# One-sided 95 % normal quantile for the pessimistic counts.
DEFAULT_Z = 1.6448536269514722


@dataclass(frozen=True, slots=True)
class SummedDraftStopCounts:
    """Counterfactual counts summed over requests, with what actually ran on the same rounds."""

    thresholds: tuple[float, ...]
    rounds: int
    drafted: tuple[int, ...]
    accepted: tuple[int, ...]
    reference_drafted: int
    reference_accepted: int
    reference_threshold: float | None = None  # None: the requests drafted without a threshold
    requests: int = 0

    def __post_init__(self) -> None:
        n = len(self.thresholds)
        if len(self.drafted) != n or len(self.accepted) != n:
            raise ValueError("drafted and accepted need one entry per threshold")
        if any(not 0.0 < t < 1.0 for t in self.thresholds) or any(
            b <= a for a, b in zip(self.thresholds, self.thresholds[1:], strict=False)
        ):
            raise ValueError("thresholds must be strictly increasing within (0, 1)")
        if self.rounds < 0 or self.reference_accepted > self.reference_drafted:
            raise ValueError("counts must be non-negative and accepted at most drafted")
        for d, a in zip(self.drafted, self.accepted, strict=True):
            if not 0 <= a <= d <= self.reference_drafted or a > self.reference_accepted:
                raise ValueError(
                    "per-threshold counts must satisfy 0 <= accepted <= drafted and stay within "
                    "what was drafted and accepted"
                )


def sum_counts(
    records: Iterable[tuple[Mapping[str, Any] | None, int, int]],
    *,
    reference_threshold: float | None = None,
) -> SummedDraftStopCounts | None:
    """Sum ``(draft_stop_counts, drafted_tokens, accepted_tokens)`` of records (validated ingest
    dicts; records without counts are left out, their rounds being unknown). Thresholds missing
    from any counted record are dropped: their sums would cover only part of the rounds. Only
    thresholds at or above ``reference_threshold`` are kept. None when no record has counts."""
    sums: dict[float, list[int]] = {}
    common: set[float] | None = None
    rounds = ref_drafted = ref_accepted = requests = 0
    for counts, drafted_tokens, accepted_tokens in records:
        if not counts:
            continue
        thresholds = [float(t) for t in counts["thresholds"]]
        common = set(thresholds) if common is None else common & set(thresholds)
        for t, d, a in zip(thresholds, counts["drafted"], counts["accepted"], strict=True):
            pair = sums.setdefault(t, [0, 0])
            pair[0] += int(d)
            pair[1] += int(a)
        rounds += int(counts["rounds"])
        ref_drafted += int(drafted_tokens)
        ref_accepted += int(accepted_tokens)
        requests += 1
    if common is None:
        return None
    floor = reference_threshold or 0.0
    kept = sorted(t for t in common if t >= floor)
    return SummedDraftStopCounts(
        thresholds=tuple(kept),
        rounds=rounds,
        drafted=tuple(sums[t][0] for t in kept),
        accepted=tuple(sums[t][1] for t in kept),
        reference_drafted=ref_drafted,
        reference_accepted=ref_accepted,
        reference_threshold=reference_threshold,
        requests=requests,
    )


@dataclass(frozen=True, slots=True)
class DraftStopRow:
    threshold: float | None  # None: drafting without a threshold
    reference: bool  # what ran
    drafted_per_round: float
    accepted_per_round: float
    hit_rate: float | None
    tokens_per_round: float
    cost_per_round: float
    expected_speedup: float
    # With lost tokens at their upper bound and saved drafts at their lower one.
    pessimistic_speedup: float


@dataclass(frozen=True, slots=True)
class DraftStopPlan:
    choice: float | None  # the threshold to serve; None: none
    changed: bool  # choice differs from what ran
    reason: str
    rounds: int
    requests: int
    cost_ratio: float
    margin: float
    min_rounds: int
    reference_threshold: float | None
    # pessimistic speed-up of the choice over the reference's (1.0 when the reference stands)
    gain: float
    rows: tuple[DraftStopRow, ...]

    def row(self, threshold: float | None) -> DraftStopRow | None:
        return next((r for r in self.rows if r.threshold == threshold), None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "choice": self.choice,
            "changed": self.changed,
            "reason": self.reason,
            "rounds": self.rounds,
            "requests": self.requests,
            "cost_ratio": self.cost_ratio,
            "margin": self.margin,
            "min_rounds": self.min_rounds,
            "reference_threshold": self.reference_threshold,
            "gain": self.gain,
            "rows": [
                {
                    "threshold": r.threshold,
                    "reference": r.reference,
                    "drafted_per_round": r.drafted_per_round,
                    "accepted_per_round": r.accepted_per_round,
                    "hit_rate": r.hit_rate,
                    "tokens_per_round": r.tokens_per_round,
                    "cost_per_round": r.cost_per_round,
                    "expected_speedup": r.expected_speedup,
                    "pessimistic_speedup": r.pessimistic_speedup,
                }
                for r in self.rows
            ],
        }


def _per_round(
    drafted: float, accepted: float, rounds: int, cost_ratio: float, costs: Mapping[int, float]
) -> tuple[float, float, float]:
    """(tokens per round, cost per round, speed-up) for summed counts over ``rounds``."""
    d, a = drafted / rounds, accepted / rounds
    tokens = a + 1.0
    cost = verify_cost_at(costs, d) + d * cost_ratio
    return tokens, cost, expected_speedup(tokens, cost)


def plan_draft_stop(
    counts: SummedDraftStopCounts,
    cost_ratio: float,
    *,
    verify_cost: Mapping[int, float] | None = None,
    margin: float = DEFAULT_MARGIN,
    min_rounds: int = DEFAULT_MIN_ROUNDS,
    z: float = DEFAULT_Z,
) -> DraftStopPlan:
    """Speed-up per threshold and the choice (see the module doc)."""
    if not math.isfinite(cost_ratio) or cost_ratio < 0:
        raise ValueError("cost_ratio must be a non-negative number")
    if not math.isfinite(margin) or margin < 0 or min_rounds < 1:
        raise ValueError("margin must be >= 0 and min_rounds >= 1")
    costs = verify_cost_function(verify_cost)
    reference = counts.reference_threshold

    def plan(choice: float | None, reason: str, gain: float, rows: Sequence[DraftStopRow]) -> DraftStopPlan:
        return DraftStopPlan(
            choice=choice,
            changed=choice != reference,
            reason=reason,
            rounds=counts.rounds,
            requests=counts.requests,
            cost_ratio=cost_ratio,
            margin=margin,
            min_rounds=min_rounds,
            reference_threshold=reference,
            gain=gain,
            rows=tuple(rows),
        )

    if counts.rounds == 0:
        return plan(reference, "no drafting rounds counted", 1.0, ())
    ref_tokens, ref_cost, ref_speedup = _per_round(
        counts.reference_drafted, counts.reference_accepted, counts.rounds, cost_ratio, costs
    )
    rows = [
        DraftStopRow(
            reference,
            True,
            counts.reference_drafted / counts.rounds,
            counts.reference_accepted / counts.rounds,
            hit_rate(counts.reference_accepted, counts.reference_drafted),
            ref_tokens,
            ref_cost,
            ref_speedup,
            ref_speedup,
        )
    ]
    for t, drafted, accepted in zip(counts.thresholds, counts.drafted, counts.accepted, strict=True):
        if t == reference:
            continue  # the reference row already is this threshold
        tokens, cost, speedup = _per_round(drafted, accepted, counts.rounds, cost_ratio, costs)
        lost = counts.reference_accepted - accepted
        saved = counts.reference_drafted - drafted
        lost_high = lost + z * math.sqrt(lost) + z * z
        saved_low = max(0.0, saved - z * math.sqrt(saved))
        pessimistic = _per_round(
            counts.reference_drafted - saved_low,
            max(0.0, counts.reference_accepted - lost_high),
            counts.rounds,
            cost_ratio,
            costs,
        )[2]
        rows.append(
            DraftStopRow(
                t,
                False,
                drafted / counts.rounds,
                accepted / counts.rounds,
                hit_rate(accepted, drafted),
                tokens,
                cost,
                speedup,
                pessimistic,
            )
        )
    candidates = [r for r in rows if not r.reference]
    # Ties go to the lower threshold: the same speed with fewer rounds cut short.
    best = max(candidates, key=lambda r: (r.pessimistic_speedup, -(r.threshold or 0.0)), default=None)
    if best is None:
        return plan(reference, "no threshold above the serving one was counted", 1.0, rows)
    gain = best.pessimistic_speedup / ref_speedup
    what_ran = "no threshold" if reference is None else f"threshold {reference}"
    if counts.rounds < min_rounds:
        reason = (
            f"{counts.rounds} rounds counted, fewer than the {min_rounds} a choice needs: {what_ran} stays"
        )
        return plan(reference, reason, 1.0, rows)
    if gain < 1.0 + margin:
        reason = (
            f"no threshold beats {what_ran} by {margin:.0%} (best: {best.threshold}, pessimistic "
            f"speed-up x{gain:.3f} of it): {what_ran} stays"
        )
        return plan(reference, reason, 1.0, rows)
    reason = (
        f"threshold {best.threshold}: expected speed-up {best.expected_speedup:.3f} vs {ref_speedup:.3f} "
        f"with {what_ran} (pessimistically x{gain:.3f}) over {counts.rounds} rounds"
    )
    return plan(best.threshold, reason, gain, rows)
