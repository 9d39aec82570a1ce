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
from controlplane.tuning.draft_length import plan_draft_length, verify_cost_at, verify_cost_function

PAYS_STATE_VERSION = 1
LIVE, BASELINE = "live", "baseline"
Verdict = Literal["unknown", "pays", "not_paying"]
UNKNOWN: Verdict = "unknown"
PAYS: Verdict = "pays"
NOT_PAYING: Verdict = "not_paying"
# Effective requests per arm pair at which the confidence sequence is tightest: near where a 5 %
# standing share has seen enough no-speculation requests to tell a 10 % slowdown.
TUNING_EFFECTIVE_REQUESTS = 100.0
# How the draft-length plan priced a step (``draft_length_plan``'s ``cost_model``).
COST_MODEL_MEASURED = "measured_verify_cost"
COST_MODEL_FLAT = "flat_verify_unmeasured"
# A planned k must be expected to beat no speculation by this much before k changes: the live step
# cost it starts from is a ratio of two means (a few percent of sampling error at the minimum
# request counts) and the verify curve was measured by a replay, not in this server's traffic.
PLANNED_SPEEDUP_MARGIN = 1.05


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

    def draft_length_plan(
        self,
        *,
        k: int,
        verify_cost: Mapping[int, float] | None = None,
        verify_cost_source: str | None = None,
    ) -> dict[str, Any] | None:
        """The k the live arm's per-position acceptance and costs say pays best, and whether that
        is enough to change k (``actionable``). None without the counts.

        The cost of one live verify step at the live ``k``, in no-speculation token times, is
        measured directly: ``S = (live ms/token ÷ baseline ms/token) x live tokens per step``. It
        is one number, and the tuner needs a curve: ``cost(j) = j c + v(j)`` (drafter share
        ``c`` per drafted token, ``v(j)`` the cost of verifying ``j + 1`` tokens).

        - ``measured_verify_cost``: with a measured ``verify_cost`` curve for this target (a
          shadow replay's), ``v(k)`` is taken from it and the rest of ``S`` is the drafter's:
          ``c = (S - v(k)) / k``. The plan is actionable when its best k differs from the live
          one and its expected speed-up over no speculation is at least
          ``PLANNED_SPEEDUP_MARGIN``. A curve whose ``v(k)`` alone exceeds ``S`` does not
          describe this server (it was measured elsewhere or under another load): not actionable.
        - ``flat_verify_unmeasured``: without a curve, the table is Leviathan's (``v = 1``,
          ``c = (S - 1) / k``), shown but never acted on. Its only guard would be a worst case,
          and the worst case of the cost model refuses every other k: with ``v`` non-decreasing
          and ``c >= 0``, all of ``S`` may be verify cost, so a shorter ``j`` may cost ``S`` per
          step while accepting no more than the live ``k`` (``E(j) <= E(k)``): its worst-case
          speed-up ``E(j) / S`` is at most the live arm's, which did not pay; a longer ``j`` has no
          bound at all. ``worst_case_speedup`` records that figure. On a compute-bound target a
          2-token verify costing 1.44 one-token steps made a flat-model k = 1 ("1.18x") run at
          0.91-0.96x no speculation; the check moves down its ladder instead.
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
        counts = live.accepted_per_position[:k]
        try:
            curve = verify_cost_function(verify_cost) if verify_cost else None
        except ValueError:
            curve = None  # a stored curve this code cannot read is no measurement
        # Without a curve, v = 1 at every k (verify_cost_function(None) is that flat curve).
        points = curve if curve is not None else verify_cost_function(None)
        verify_at_k = verify_cost_at(points, k)
        cost_ratio = max(0.0, (step_cost - verify_at_k) / k)
        try:
            plan = plan_draft_length(
                counts, live.verify_steps, cost_ratio, verify_cost=curve, max_k=max(8, k)
            )
        except ValueError:
            return None  # counts from mixed draft lengths: nothing trustworthy to plan with
        best = plan.row(plan.best_k)
        worst_case = (
            best.expected_tokens_per_step / step_cost if 0 < plan.best_k <= k and step_cost > 0 else None
        )
        changes_k = plan.best_k not in (0, k)
        if curve is None:
            cost_model = COST_MODEL_FLAT
            actionable = False
            why = (
                "no measured verify cost for this target: a flat-verify plan is not acted on "
                "(at worst every k costs the live step)"
            )
        elif verify_at_k > step_cost:
            cost_model = COST_MODEL_MEASURED
            actionable = False
            why = (
                f"the measured verify cost at k {k} ({verify_at_k:.2f}) exceeds the live step cost "
                f"({step_cost:.2f}): the curve does not describe this server"
            )
        else:
            cost_model = COST_MODEL_MEASURED
            actionable = changes_k and plan.best_speedup >= PLANNED_SPEEDUP_MARGIN
            why = f"the measured costs expect {plan.best_speedup:.2f}x no speculation at k {plan.best_k}" + (
                "" if actionable else f" (a change needs another k at >= {PLANNED_SPEEDUP_MARGIN:g}x)"
            )
        return {
            **plan.as_dict(),
            "measured_step_cost": step_cost,
            "cost_model": cost_model,
            "verify_cost_source": verify_cost_source if curve is not None else None,
            "verify_cost_at_live_k": verify_at_k,
            "verify_cost_at_best_k": verify_cost_at(points, plan.best_k),
            "worst_case_speedup": worst_case,
            "actionable": actionable,
            "why": why,
        }

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
