"""The standing test of whether speculation pays: latency per output token of the live arm
against the no-speculation (``baseline``) arm, sequential and anytime-valid. Pure: no database.

Each arm's requests are folded into the canary's running sums (:class:`controlplane.canary.tally.
ArmTally`: the same latency per token the canary judges, Welford sums that round-trip through
JSON), and the two arms are compared by the relative difference of their means with the canary's
confidence sequences (:mod:`controlplane.canary.statistics`), so the verdict may be read after
every batch without inflating its errors:

- ``not_paying``: live is slower than no speculation (one-sided anytime p-value <= ``alpha``);
- ``pays``: live is faster (the other one-sided p-value <= ``alpha``);
- ``unknown``: fewer than the minimum requests in an arm, or no evidence either way yet.

With equal arms, the chance that one test *ever* says ``not_paying`` is at most ``alpha``.
A test belongs to one serving set-up (mode, drafter, k, draft-stop threshold): its ``key``; the
service starts a new test when the key changes, since the old figures describe another set-up.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from controlplane.canary.statistics import (
    LATENCY_MS_PER_TOKEN,
    TOKENS_PER_STEP,
    confidence_bounds,
    one_sided_p_value,
    relative_difference,
)
from controlplane.canary.tally import ArmTally
from controlplane.tuning.draft_length import plan_draft_length

PAYS_STATE_VERSION = 1
LIVE, BASELINE = "live", "baseline"
Verdict = Literal["unknown", "pays", "not_paying"]
UNKNOWN: Verdict = "unknown"
PAYS: Verdict = "pays"
NOT_PAYING: Verdict = "not_paying"
# Effective requests per arm pair at which the confidence sequence is tightest: near where a 5 %
# standing share has seen enough no-speculation requests to tell a 10 % slowdown.
TUNING_EFFECTIVE_REQUESTS = 100.0


@dataclass(frozen=True, slots=True)
class PaysVerdict:
    """The test's answer now, with the figures that justify it."""

    verdict: Verdict
    reason: str
    live_requests: int
    baseline_requests: int
    live_ms_per_token: float | None
    baseline_ms_per_token: float | None
    ratio: float | None  # live / baseline latency per token: above 1 speculation slows serving
    ratio_low: float | None  # one-sided bounds, each at level alpha (anytime-valid)
    ratio_high: float | None
    p_slower: float
    p_faster: float
    alpha: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


class PaysTest:
    """Running sums of one serving set-up's live and baseline requests."""

    __slots__ = ("arms", "key")

    def __init__(self, key: Mapping[str, Any], arms: Mapping[str, ArmTally] | None = None) -> None:
        self.key = dict(key)
        self.arms = {LIVE: ArmTally(), BASELINE: ArmTally()}
        self.arms.update(arms or {})

    def add(self, arm: str, row: Any) -> None:
        """Fold one acceptance record of ``arm`` (``live`` or ``baseline``)."""
        self.arms[arm].add(row)

    def requests(self, arm: str) -> int:
        return self.arms[arm].stats.metrics[LATENCY_MS_PER_TOKEN].n

    def verdict(self, *, alpha: float, min_requests_per_arm: int) -> PaysVerdict:
        live = self.arms[LIVE].stats.summary(LATENCY_MS_PER_TOKEN)
        baseline = self.arms[BASELINE].stats.summary(LATENCY_MS_PER_TOKEN)
        n_live, n_base = int(live.n), int(baseline.n)
        diff = relative_difference(live, baseline)
        tuning_n = TUNING_EFFECTIVE_REQUESTS
        p_slower = float(one_sided_p_value(diff, 0.0, "greater", tuning_n=tuning_n, alpha=alpha))
        p_faster = float(one_sided_p_value(diff, 0.0, "less", tuning_n=tuning_n, alpha=alpha))
        low, high = confidence_bounds(
            diff.estimate, diff.se, diff.n_eff, alpha, tuning_n=tuning_n, alpha=alpha
        )
        ratio = 1.0 + float(diff.estimate) if n_live >= 2 and n_base >= 2 else None
        ratio_low = _finite(1.0 + float(low)) if ratio is not None else None
        ratio_high = _finite(1.0 + float(high)) if ratio is not None else None

        def answer(verdict: Verdict, reason: str) -> PaysVerdict:
            return PaysVerdict(
                verdict,
                reason,
                live_requests=n_live,
                baseline_requests=n_base,
                live_ms_per_token=float(live.mean) if n_live else None,
                baseline_ms_per_token=float(baseline.mean) if n_base else None,
                ratio=ratio,
                ratio_low=ratio_low,
                ratio_high=ratio_high,
                p_slower=p_slower,
                p_faster=p_faster,
                alpha=alpha,
            )

        if min(n_live, n_base) < min_requests_per_arm or ratio is None:
            return answer(
                UNKNOWN,
                f"waiting for {min_requests_per_arm} requests in each arm "
                f"(live {n_live}, no speculation {n_base})",
            )
        over = f"over {n_live} live and {n_base} no-speculation requests"
        if p_slower <= alpha:
            return answer(
                NOT_PAYING,
                f"speculation is slower than no speculation: {ratio:.3f}x the latency per token "
                f"(at least {ratio_low or ratio:.3f}x, anytime p = {p_slower:.2g} <= {alpha:g}) {over}",
            )
        if p_faster <= alpha:
            return answer(
                PAYS,
                f"speculation pays: {ratio:.3f}x the latency per token of no speculation "
                f"(at most {ratio_high or ratio:.3f}x, anytime p = {p_faster:.2g} <= {alpha:g}) {over}",
            )
        return answer(
            UNKNOWN,
            f"no evidence either way yet: {ratio:.3f}x the latency per token of no speculation {over}",
        )

    def draft_length_plan(self, *, k: int) -> dict[str, Any] | None:
        """The k the live arm's per-position acceptance and measured costs say pays best.

        The cost of one live verify step, in no-speculation token times, is measured directly:
        ``(live ms/token ÷ baseline ms/token) x live tokens per step``; with Leviathan's
        assumption that verifying k + 1 tokens costs one step, the drafter's share of it gives
        the cost ratio ``c = (cost - 1) / k`` the tuner needs. None without the counts.
        """
        live = self.arms[LIVE]
        base = self.arms[BASELINE]
        tokens_per_step = live.stats.metrics[TOKENS_PER_STEP]
        live_ms = live.stats.metrics[LATENCY_MS_PER_TOKEN]
        base_ms = base.stats.metrics[LATENCY_MS_PER_TOKEN]
        if k <= 0 or live.verify_steps <= 0 or not live.accepted_per_position:
            return None
        if tokens_per_step.n == 0 or live_ms.n == 0 or base_ms.n == 0 or base_ms.mean <= 0:
            return None
        step_cost = live_ms.mean / base_ms.mean * tokens_per_step.mean
        cost_ratio = max(0.0, (step_cost - 1.0) / k)
        try:
            plan = plan_draft_length(
                live.accepted_per_position[:k], live.verify_steps, cost_ratio, max_k=max(8, k)
            )
        except ValueError:
            return None  # counts from mixed draft lengths: nothing trustworthy to plan with
        return {**plan.as_dict(), "measured_step_cost": step_cost}

    def to_state(self) -> dict[str, Any]:
        return {
            "version": PAYS_STATE_VERSION,
            "key": self.key,
            "arms": {name: tally.to_state() for name, tally in self.arms.items()},
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> PaysTest:
        """Restore a stored test; ValueError for a state this code did not write."""
        if state.get("version") != PAYS_STATE_VERSION:
            raise ValueError(f"unsupported speculation-check state version {state.get('version')!r}")
        try:
            arms = {name: ArmTally.from_state(state["arms"][name]) for name in (LIVE, BASELINE)}
            return cls(dict(state["key"]), arms)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed speculation-check state: {exc!r}") from exc
