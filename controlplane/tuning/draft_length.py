"""Draft-token-count choice: expected tokens per target step and speed-up for each k, and the best k.

Owns the arithmetic only (no I/O). Leviathan et al. 2023 give, for an i.i.d. per-token acceptance
``alpha``, ``E[tokens per target step] = (1 - alpha^(k+1)) / (1 - alpha)`` and a wall-time
speed-up ``E / (k c + 1)`` with ``c`` = drafter step time / target step time. Real drafters
do not accept i.i.d.: the chance of accepting position ``j`` given positions ``1..j-1`` were
accepted (the *conditional* rate ``beta_j``) varies with depth. Generalised::

    E(k)    = 1 + sum_{j=1..k} prod_{i<=j} beta_i      (the 1 is the target's own token)
    cost(k) = k c + v(k)                               (in target single-token step times)
    S(k)    = E(k) / cost(k)

where ``v(k)`` is the measured cost of verifying ``k + 1`` tokens relative to one (1 for all k
when not measured: Leviathan's assumption that a wider verify pass is free). ``k = 0`` is no
speculation (``S = 1``), so a drafter that does not pay is told so.

The conditional rates come from vLLM-style per-position counters: ``accepted_per_position[i]``
is the number of verify steps in which at least ``i + 1`` draft tokens were accepted
(non-increasing in ``i``), out of ``verify_steps`` drafts, so ``beta_1 = a_0 / N`` and
``beta_j = a_{j-1} / a_{j-2}``. It is assumed, as in the references, that the first ``k``
positions are accepted the same way whether or not more are drafted after them.

The i.i.d. closed form and the speed-up of a round are :mod:`controlplane.speculation_math`'s
(``controlplane.tuning`` re-exports ``leviathan_speedup``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from controlplane.speculation_math import expected_speedup

# One-sided 90 % normal quantile for the Wilson lower bound used in extrapolation.
_EXTRAPOLATION_Z = 1.2815515655446004


@dataclass(frozen=True, slots=True)
class DraftLengthRow:
    k: int
    conditional_acceptance: float | None  # beta_k (None for k = 0)
    expected_tokens_per_step: float
    cost_per_step: float  # in target single-token step times
    expected_speedup: float
    extrapolated: bool  # beta_k was not observed (k beyond the drafted length)


@dataclass(frozen=True, slots=True)
class DraftLengthPlan:
    best_k: int
    best_speedup: float
    observed_k: int
    cost_ratio: float
    extrapolated_acceptance: float | None  # rate assumed for every position beyond observed_k
    rows: tuple[DraftLengthRow, ...]

    def row(self, k: int) -> DraftLengthRow:
        return self.rows[k]

    def as_dict(self) -> dict[str, Any]:
        return {
            "best_k": self.best_k,
            "best_speedup": self.best_speedup,
            "observed_k": self.observed_k,
            "cost_ratio": self.cost_ratio,
            "extrapolated_acceptance": self.extrapolated_acceptance,
            "rows": [
                {
                    "k": r.k,
                    "conditional_acceptance": r.conditional_acceptance,
                    "expected_tokens_per_step": r.expected_tokens_per_step,
                    "cost_per_step": r.cost_per_step,
                    "expected_speedup": r.expected_speedup,
                    "extrapolated": r.extrapolated,
                }
                for r in self.rows
            ],
        }


def conditional_acceptance(accepted_per_position: Sequence[int], verify_steps: int) -> list[float]:
    """Per-position conditional rates ``beta_1..beta_K`` from at-least-``i+1``-accepted counters."""
    _check_counts(accepted_per_position, verify_steps)
    rates = []
    trials = verify_steps
    for accepted in accepted_per_position:
        rates.append(accepted / trials if trials > 0 else 0.0)
        trials = accepted
    return rates


def _check_counts(accepted_per_position: Sequence[int], verify_steps: int) -> None:
    if verify_steps < 0 or any(a < 0 for a in accepted_per_position):
        raise ValueError("counts must be non-negative")
    previous = verify_steps
    for i, accepted in enumerate(accepted_per_position):
        if accepted > previous:
            raise ValueError(
                f"accepted_per_position must be non-increasing and at most verify_steps "
                f"(position {i}: {accepted} > {previous})"
            )
        previous = accepted


def _wilson_lower(successes: float, trials: float, z: float) -> float:
    if trials <= 0:
        return 0.0
    p = successes / trials
    denominator = 1.0 + z * z / trials
    centre = p + z * z / (2 * trials)
    spread = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return max(0.0, (centre - spread) / denominator)


def verify_cost_function(verify_cost: Mapping[int, float] | None) -> dict[int, float]:
    """Measured ``v(k)`` points with ``v(0) = 1``; validated."""
    points = {0: 1.0}
    for k, value in (verify_cost or {}).items():
        if k < 0 or not math.isfinite(value) or value <= 0:
            raise ValueError(f"verify_cost must map k >= 0 to a positive cost, got {k}: {value}")
        points[int(k)] = float(value)
    return points


def verify_cost_at(points: Mapping[int, float], k: float) -> float:
    """``v(k)`` at a draft count ``k`` (a mean over rounds may be fractional): linear interpolation
    between measured points; beyond the last, continue the last segment's slope
    (never downwards): a wider verify pass is assumed to cost at least as much as the trend says."""
    if float(k).is_integer() and int(k) in points:
        return points[int(k)]
    known = sorted(points)
    below = [x for x in known if x < k]
    above = [x for x in known if x > k]
    if above:
        lo, hi = below[-1], above[0]
        return points[lo] + (points[hi] - points[lo]) * (k - lo) / (hi - lo)
    if len(known) == 1:
        return points[known[0]]
    lo, hi = known[-2], known[-1]
    slope = max(0.0, (points[hi] - points[lo]) / (hi - lo))
    return points[hi] + slope * (k - hi)


def plan_from_conditional_rates(
    rates: Sequence[float],
    cost_ratio: float,
    *,
    trials: Sequence[float] | None = None,
    verify_cost: Mapping[int, float] | None = None,
    max_k: int | None = None,
) -> DraftLengthPlan:
    """Speed-up table for k = 0..max_k from conditional rates ``beta_1..beta_K`` (see module doc).

    Positions beyond the observed ``K`` are extrapolated conservatively: every one of them gets
    the *smallest* 90 % Wilson lower bound among the observed positions (with ``trials``, the
    number of drafts that reached each position) or the smallest observed rate (without). That
    assumes no recovery with depth and penalises thinly observed positions, so a longer k is
    chosen only if even a pessimistic continuation pays. ``max_k`` defaults to ``max(8, K)``.
    """
    if not math.isfinite(cost_ratio) or cost_ratio < 0:
        raise ValueError("cost_ratio must be a non-negative number")
    if any(not 0.0 <= r <= 1.0 for r in rates):
        raise ValueError("conditional rates must be in [0, 1]")
    if trials is not None and len(trials) != len(rates):
        raise ValueError("trials must have one entry per rate")
    observed_k = len(rates)
    limit = max(8, observed_k) if max_k is None else max_k
    if limit < 0:
        raise ValueError("max_k must be non-negative")
    extrapolated_rate: float | None = None
    if limit > observed_k:
        if observed_k == 0:
            extrapolated_rate = 0.0  # nothing observed: assume nothing would be accepted
        elif trials is not None:
            extrapolated_rate = min(
                _wilson_lower(r * n, n, _EXTRAPOLATION_Z) for r, n in zip(rates, trials, strict=True)
            )
        else:
            extrapolated_rate = min(rates)
    costs = verify_cost_function(verify_cost)

    rows = [DraftLengthRow(0, None, 1.0, 1.0, 1.0, False)]
    tokens, reach = 1.0, 1.0  # reach: probability that every position so far was accepted
    for k in range(1, limit + 1):
        observed = k <= observed_k
        beta = rates[k - 1] if observed else extrapolated_rate
        assert beta is not None
        reach *= beta
        tokens += reach
        cost = k * cost_ratio + verify_cost_at(costs, k)
        rows.append(DraftLengthRow(k, beta, tokens, cost, expected_speedup(tokens, cost), not observed))
    # Ties go to the smaller k: the same speed for less drafting and verify work.
    best = max(rows, key=lambda r: (r.expected_speedup, -r.k))
    return DraftLengthPlan(
        best.k, best.expected_speedup, observed_k, cost_ratio, extrapolated_rate, tuple(rows)
    )


def plan_draft_length(
    accepted_per_position: Sequence[int],
    verify_steps: int,
    cost_ratio: float,
    *,
    verify_cost: Mapping[int, float] | None = None,
    max_k: int | None = None,
) -> DraftLengthPlan:
    """Speed-up table and best k from per-position counters (vLLM's
    ``spec_decode_num_accepted_tokens_per_pos_total`` and ``spec_decode_num_drafts_total``).

    ``cost_ratio``: drafter step time / target step time; ``verify_cost``: measured cost of
    verifying ``k + 1`` tokens relative to one, by k (interpolated, extrapolated upwards).
    """
    rates = conditional_acceptance(accepted_per_position, verify_steps)
    trials = [float(verify_steps), *(float(a) for a in accepted_per_position[:-1])]
    return plan_from_conditional_rates(
        rates, cost_ratio, trials=trials[: len(rates)], verify_cost=verify_cost, max_k=max_k
    )
