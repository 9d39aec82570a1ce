"""The canary rules: promote / reject / inconclusive / continue, guardrails, post-promotion rollback.

Pure functions over :mod:`controlplane.canary.statistics`; the service stores inputs and results.

**Decision** (:func:`decide`). Three arms: ``baseline`` (no speculation), ``incumbent``,
``candidate``; two primary metrics per request: tokens per verify step (higher is better) and
latency per output token (lower is better). Every comparison is a relative difference of the
candidate's mean to another arm's, tested with anytime-valid p-values, so the rule may be
evaluated after every ingested batch without inflating its errors.

- *Promote* needs all of: tokens/step not worse than the incumbent's by more than the
  non-inferiority margin (relative); better than the incumbent on at least one primary (Holm
  across the two at ``alpha``); latency/token lower than no speculation. Conditions joined by
  "and" each test at ``alpha`` (an intersection-union test needs no split), so the chance of
  promoting a candidate that is not better than the incumbent is at most ``alpha``.
- *Reject* as soon as harm is shown (Holm across the three at ``harm_alpha``): tokens/step worse
  than the incumbent's beyond the margin, latency/token above the incumbent's beyond
  ``latency_harm_margin``, or latency/token above no speculation's.
- *Inconclusive* at ``max_requests`` (all arms) or ``max_duration_s``: keep the incumbent. Also
  when the arm counts do not fit the routing weights (sample-ratio mismatch): no comparison of
  a broken split can be trusted.
- *Continue* otherwise, and always before ``min_samples_per_arm`` requests in every arm.
- *Per category* (:func:`judge_categories`, ``judge_per_category``): the overall mix can hide a
  loss on one kind of traffic, so the candidate is also compared with the incumbent within each
  request category; harm shown on any category rejects even when the mix wins. A promotion waits
  while a category with enough samples looks worse beyond the margin, and while a category that
  holds a real share of the traffic has too few samples to be judged (the candidate's arm is
  small, so the overall rule can be ready long before a minority category is).

:func:`decision_codes` is the same rule vectorised over many streams (the benchmark runs it);
:func:`decide` wraps it for one canary and adds the report.

**Guardrails** (:func:`guardrail_check`) read live figures and return typed findings; the
service acts on them. **Rollback** (:func:`rollback_check`) is a one-sided sequential test of the
live hit rate after a promotion against the canary's estimate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from controlplane import speculation_math
from controlplane.canary.statistics import (
    LATENCY_MS_PER_TOKEN,
    PRIMARY_METRICS,
    TOKENS_PER_STEP,
    Alternative,
    ArmAccumulator,
    MetricSummary,
    RelativeDifference,
    confidence_bounds,
    holm_levels,
    holm_reject,
    mean_confidence_interval,
    one_sided_p_value,
    relative_difference,
    sample_ratio_check,
)
from controlplane.canary_policy import ARM_BASELINE, ARM_CANDIDATE, ARM_INCUMBENT, ARMS, CanaryPolicy

CONTINUE, PROMOTE, REJECT, INCONCLUSIVE = 0, 1, 2, 3
DECISION_NAMES = {CONTINUE: "continue", PROMOTE: "promote", REJECT: "reject", INCONCLUSIVE: "inconclusive"}
DecisionName = Literal["continue", "promote", "reject", "inconclusive"]


# --------------------------------------------------------------------------------- the tests


@dataclass(frozen=True, slots=True)
class _Comparison:
    name: str
    metric: str
    control: str  # the treatment is always the candidate


@dataclass(frozen=True, slots=True)
class _Test:
    name: str
    comparison: str
    alternative: Alternative
    family: Literal["promote", "better", "harm"]
    description: str


COMPARISONS = (
    _Comparison("tokens_per_step_vs_incumbent", TOKENS_PER_STEP, ARM_INCUMBENT),
    _Comparison("latency_vs_incumbent", LATENCY_MS_PER_TOKEN, ARM_INCUMBENT),
    _Comparison("latency_vs_no_speculation", LATENCY_MS_PER_TOKEN, ARM_BASELINE),
)
# "promote": each must hold (intersection-union, each at alpha); "better": Holm at alpha, one
# must hold; "harm": Holm at harm_alpha, any one rejects.
TESTS = (
    _Test("non_inferior_tokens_per_step", "tokens_per_step_vs_incumbent", "greater", "promote",
          "tokens/step not worse than the incumbent beyond the margin"),
    _Test("faster_than_no_speculation", "latency_vs_no_speculation", "less", "promote",
          "latency/token below no speculation"),
    _Test("better_tokens_per_step", "tokens_per_step_vs_incumbent", "greater", "better",
          "tokens/step above the incumbent"),
    _Test("better_latency", "latency_vs_incumbent", "less", "better", "latency/token below the incumbent"),
    _Test("worse_tokens_per_step", "tokens_per_step_vs_incumbent", "less", "harm",
          "tokens/step below the incumbent beyond the margin"),
    _Test("slower_than_incumbent", "latency_vs_incumbent", "greater", "harm",
          "latency/token above the incumbent beyond the latency margin"),
    _Test("slower_than_no_speculation", "latency_vs_no_speculation", "greater", "harm",
          "latency/token above no speculation"),
)  # fmt: skip


def _null_value(test: _Test, policy: CanaryPolicy) -> float:
    if test.name in ("non_inferior_tokens_per_step", "worse_tokens_per_step"):
        return -policy.non_inferiority_margin
    if test.name == "slower_than_incumbent":
        return policy.latency_harm_margin
    return 0.0


@dataclass(frozen=True, slots=True)
class Evaluation:
    """Arrays (one element per stream, or 0-d for one canary) behind a decision."""

    codes: npt.NDArray[np.int64]
    comparisons: dict[str, RelativeDifference]
    p_values: dict[str, npt.NDArray[np.float64]]
    rejected: dict[str, npt.NDArray[np.bool_]]
    ready: npt.NDArray[np.bool_]
    exhausted: npt.NDArray[np.bool_]


def decision_codes(
    arms: Mapping[str, Mapping[str, MetricSummary]],
    policy: CanaryPolicy,
    *,
    elapsed_s: npt.ArrayLike = 0.0,
) -> Evaluation:
    """The decision rule, elementwise over arrays of per-arm summaries (see the module docstring).

    ``arms[arm][metric]`` is a :class:`MetricSummary` whose fields are floats or same-shaped
    arrays. Codes: CONTINUE, PROMOTE, REJECT, INCONCLUSIVE.
    """
    counts = [np.asarray(arms[arm][LATENCY_MS_PER_TOKEN].n, dtype=np.float64) for arm in ARMS]
    ready = np.minimum.reduce(counts) >= policy.min_samples_per_arm
    exhausted = (np.add.reduce(counts) >= policy.max_requests) | (
        np.asarray(elapsed_s, dtype=np.float64) >= policy.max_duration_s
    )
    comparisons = {
        c.name: relative_difference(arms[ARM_CANDIDATE][c.metric], arms[c.control][c.metric])
        for c in COMPARISONS
    }
    p_values = {
        t.name: one_sided_p_value(
            comparisons[t.comparison],
            _null_value(t, policy),
            t.alternative,
            tuning_n=policy.tuning_requests,
            alpha=policy.alpha,
        )
        for t in TESTS
    }
    rejected: dict[str, npt.NDArray[np.bool_]] = {}
    for family, family_alpha in _family_alpha(policy).items():
        names = [t.name for t in TESTS if t.family == family]
        family_rejected = holm_reject(np.stack([p_values[n] for n in names], axis=-1), family_alpha)
        for i, name in enumerate(names):
            rejected[name] = family_rejected[..., i]
    for t in TESTS:
        if t.family == "promote":
            rejected[t.name] = p_values[t.name] <= policy.alpha

    harm = (
        rejected["worse_tokens_per_step"]
        | rejected["slower_than_incumbent"]
        | rejected["slower_than_no_speculation"]
    )
    better = rejected["better_tokens_per_step"] | rejected["better_latency"]
    promote = rejected["non_inferior_tokens_per_step"] & rejected["faster_than_no_speculation"] & better
    undecided = np.where(exhausted, INCONCLUSIVE, CONTINUE)
    codes = np.where(ready, np.where(harm, REJECT, np.where(promote, PROMOTE, undecided)), undecided)
    return Evaluation(codes.astype(np.int64), comparisons, p_values, rejected, ready, exhausted)


def _family_alpha(policy: CanaryPolicy) -> dict[str, float]:
    return {"better": policy.alpha, "harm": policy.effective_harm_alpha}


def held_levels(evaluation: Evaluation, policy: CanaryPolicy) -> dict[str, npt.NDArray[np.float64]]:
    """The level each test was held to: Holm's ``alpha / (m - rank)`` in a family, ``alpha`` alone."""
    levels: dict[str, npt.NDArray[np.float64]] = {}
    for family, family_alpha in _family_alpha(policy).items():
        names = [t.name for t in TESTS if t.family == family]
        family_levels = holm_levels(np.stack([evaluation.p_values[n] for n in names], axis=-1), family_alpha)
        for i, name in enumerate(names):
            levels[name] = family_levels[..., i]
    for t in TESTS:
        if t.family == "promote":
            levels[t.name] = np.full_like(evaluation.p_values[t.name], policy.alpha)
    return levels


# ---------------------------------------------------------------------------------- one canary


@dataclass(frozen=True, slots=True)
class Decision:
    """A decision, a sentence a human can act on, and every figure behind it (JSON-serialisable)."""

    decision: DecisionName
    reason: str
    figures: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"decision": self.decision, "reason": self.reason, "figures": self.figures}


def _finite(value: float) -> float | None:
    """JSON has no infinity: unbounded figures are reported as null."""
    return value if math.isfinite(value) else None


def _pct(value: float) -> str:
    return f"{value * 100:+.1f}%" if math.isfinite(value) else "n/a"


def decide(
    arms_stats: Mapping[str, ArmAccumulator],
    policy: CanaryPolicy,
    *,
    elapsed_s: float = 0.0,
    routing_weights: Mapping[str, float] | None = None,
    categories: Mapping[str, Mapping[str, ArmAccumulator]] | None = None,
) -> Decision:
    """Judge one canary from its arms' running state (``baseline``, ``incumbent``, ``candidate``).

    A missing arm counts as empty. ``routing_weights`` (arm -> share), when given, turns on the
    sample-ratio check. ``elapsed_s``: time since the live canary started. ``categories``: the
    same running state split by request category (:func:`judge_categories`): harm shown on any
    category rejects, even when the overall mix wins; a promotion waits while a category with
    enough samples looks worse beyond the margin without it being shown yet (at the limits it
    ends inconclusive). Categories with too few samples never block; the reason lists them.
    """
    unknown = set(arms_stats) - set(ARMS)
    if unknown:
        raise ValueError(f"unknown arm(s) {sorted(unknown)}; expected {ARMS}")
    accumulators = {arm: arms_stats.get(arm) or ArmAccumulator() for arm in ARMS}
    summaries = {arm: {m: acc.summary(m) for m in PRIMARY_METRICS} for arm, acc in accumulators.items()}
    evaluation = decision_codes(summaries, policy, elapsed_s=elapsed_s)
    code = int(evaluation.codes)

    figures: dict[str, Any] = {
        "policy": policy.as_dict(),
        "elapsed_s": elapsed_s,
        "total_requests": sum(acc.n for acc in accumulators.values()),
        "arms": _arm_figures(accumulators, policy),
        "comparisons": _comparison_figures(evaluation, policy),
    }
    judgement = judge_categories(categories or {}, policy)
    figures["categories"] = judgement.as_dict()
    srm = None
    if routing_weights is not None:
        srm = sample_ratio_check(
            {arm: acc.n for arm, acc in accumulators.items() if arm in routing_weights},
            routing_weights,
            alpha=policy.srm_alpha,
        )
        figures["sample_ratio"] = srm.as_dict()

    comparisons = figures["comparisons"]
    if srm is not None and srm.flagged:
        observed = ", ".join(f"{a} {srm.observed_shares[a]:.3f}" for a in sorted(srm.counts))
        expected = ", ".join(f"{a} {srm.expected_shares[a]:.3f}" for a in sorted(srm.counts))
        reason = (
            f"sample-ratio mismatch: arm shares {observed} do not fit the routing weights {expected} "
            f"(sequential p = {srm.sequential_p_value:.2g}); routing is broken, so no comparison is "
            "trusted; keeping the incumbent"
        )
        return Decision("inconclusive", reason, figures)
    worse_categories = "; ".join(v.sentence() for v in judgement.having("worse"))
    if code == REJECT:
        shown = [t for t in TESTS if t.family == "harm" and bool(evaluation.rejected[t.name])]
        reason = "harm shown: " + "; ".join(_test_sentence(t, comparisons) for t in shown)
        if worse_categories:
            reason += f"; also {worse_categories}"
        return Decision("reject", reason, figures)
    if worse_categories:
        overall = "even though it wins overall" if code == PROMOTE else "whatever the overall mix shows"
        return Decision("reject", f"harm shown on a category, {overall}: {worse_categories}", figures)
    if code == PROMOTE:
        doubtful = judgement.having("looks worse")
        if doubtful:
            seen = "; ".join(v.sentence() for v in doubtful)
            if bool(evaluation.exhausted):
                return Decision(
                    "inconclusive",
                    f"limit reached while a category looks worse than the incumbent, not shown: {seen}; "
                    "keeping the incumbent",
                    figures,
                )
            return Decision(
                "continue",
                f"promotion held: a category looks worse than the incumbent, not yet shown: {seen}",
                figures,
            )
        awaited = [v for v in judgement.having("too few samples") if v.awaited]
        if awaited and not bool(evaluation.exhausted):
            listed = ", ".join(
                f"{category_label(v.category)} ({v.share:.0%} of requests; candidate "
                f"{v.requests[ARM_CANDIDATE]}, incumbent {v.requests[ARM_INCUMBENT]})"
                for v in awaited
            )
            return Decision(
                "continue",
                f"promotion waits for {policy.min_samples_per_arm} requests per arm in every category "
                f"holding at least {policy.category_min_share:.0%} of the traffic: {listed}",
                figures,
            )
        held = [t for t in TESTS if t.family in ("promote", "better") and bool(evaluation.rejected[t.name])]
        reason = "candidate promoted: " + "; ".join(_test_sentence(t, comparisons) for t in held)
        if judgement.judged:
            judged = len(judgement.having("no harm shown"))
            reason += f"; no harm shown on {judged} of {judgement.family_size} categories"
            reason += _too_few_text(judgement, policy)
        return Decision("promote", reason, figures)
    if not bool(evaluation.ready):
        short = {arm: acc.n for arm, acc in accumulators.items() if acc.n < policy.min_samples_per_arm}
        waiting = ", ".join(f"{arm} has {n}" for arm, n in short.items())
        if code == INCONCLUSIVE:
            reason = (
                f"limit reached before {policy.min_samples_per_arm} requests per arm ({waiting}); "
                "keeping the incumbent"
            )
            return Decision("inconclusive", reason, figures)
        return Decision(
            "continue",
            f"collecting: {policy.min_samples_per_arm} requests per arm needed ({waiting})",
            figures,
        )
    pending = [t for t in TESTS if t.family != "harm" and not bool(evaluation.rejected[t.name])]
    pending_text = ", ".join(t.description for t in pending if not _superfluous(t, evaluation))
    if code == INCONCLUSIVE:
        limit = (
            f"{policy.max_requests} requests"
            if figures["total_requests"] >= policy.max_requests
            else f"{policy.max_duration_s:.0f} s"
        )
        return Decision(
            "inconclusive", f"{limit} reached without showing: {pending_text}; keeping the incumbent", figures
        )
    return Decision("continue", f"not yet shown: {pending_text}", figures)


def _superfluous(test: _Test, evaluation: Evaluation) -> bool:
    """One "better" test is enough: do not list the other as pending once one holds."""
    if test.family != "better":
        return False
    return any(bool(evaluation.rejected[t.name]) for t in TESTS if t.family == "better")


def _test_sentence(test: _Test, comparisons: dict[str, Any]) -> str:
    c = comparisons[test.comparison]
    bound = c["tests"][test.name]["bound"]
    bound_text = _pct(bound if bound is not None else math.nan)
    return f"{test.description} ({c['metric']} {_pct(c['estimate'])}, bound {bound_text})"


def _arm_figures(accumulators: Mapping[str, ArmAccumulator], policy: CanaryPolicy) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm, acc in accumulators.items():
        metrics: dict[str, Any] = {}
        for metric in PRIMARY_METRICS:
            summary = acc.summary(metric)
            low, high = mean_confidence_interval(
                summary, policy.alpha, tuning_n=policy.tuning_requests, alpha=policy.alpha
            )
            metrics[metric] = {
                "n": summary.n,
                "mean": summary.mean if summary.n else None,
                "sd": _finite(math.sqrt(summary.variance)) if summary.n >= 2 else None,
                "ci_low": _finite(low),
                "ci_high": _finite(high),
            }
        out[arm] = {"n": acc.n, "metrics": metrics}
    return out


def _comparison_figures(evaluation: Evaluation, policy: CanaryPolicy) -> dict[str, Any]:
    """Per comparison: relative estimate, a two-sided 1 - alpha confidence sequence, and each test on it."""
    out: dict[str, Any] = {}
    levels = held_levels(evaluation, policy)
    for c in COMPARISONS:
        diff = evaluation.comparisons[c.name]
        est, se, n_eff = float(diff.estimate), float(diff.se), float(diff.n_eff)
        low, high = confidence_bounds(
            est, se, n_eff, policy.alpha / 2, tuning_n=policy.tuning_requests, alpha=policy.alpha
        )
        tests: dict[str, Any] = {}
        for t in TESTS:
            if t.comparison != c.name:
                continue
            level = float(levels[t.name])
            t_low, t_high = confidence_bounds(
                est, se, n_eff, level, tuning_n=policy.tuning_requests, alpha=policy.alpha
            )
            # The verdict compares this bound with the null value: lower for "greater", upper for "less".
            bound = float(t_low) if t.alternative == "greater" else float(t_high)
            tests[t.name] = {
                "family": t.family,
                "hypothesis": t.description,
                "null_value": _null_value(t, policy),
                "alternative": t.alternative,
                "p_value": float(evaluation.p_values[t.name]),
                "level": level,
                "bound": _finite(bound),
                "shown": bool(evaluation.rejected[t.name]),
            }
        out[c.name] = {
            "metric": c.metric,
            "treatment": ARM_CANDIDATE,
            "control": c.control,
            "estimate": est,
            "se": _finite(se),
            "effective_n": n_eff,
            "ci_low": _finite(float(low)),
            "ci_high": _finite(float(high)),
            "ci_level": 1 - policy.alpha,
            "verdict": _verdict(c, tests),
            "tests": tests,
        }
    return out


def _verdict(comparison: _Comparison, tests: Mapping[str, Any]) -> str:
    if any(t["shown"] for t in tests.values() if t["family"] == "harm"):
        return "worse"
    if any(t["shown"] for name, t in tests.items() if name.startswith(("better", "faster"))):
        return "better"
    if tests.get("non_inferior_tokens_per_step", {}).get("shown"):
        return "not worse"
    return "undetermined"


# --------------------------------------------------------------------------------- per category

# Candidate vs incumbent within one category; both against ``non_inferiority_margin``, since a
# slice of the traffic may be a little worse without anyone noticing, but not by more.
CATEGORY_TESTS = (
    _Test("worse_tokens_per_step", "tokens_per_step_vs_incumbent", "less", "harm",
          "tokens/step below the incumbent beyond the margin"),
    _Test("slower_than_incumbent", "latency_vs_incumbent", "greater", "harm",
          "latency/token above the incumbent beyond the margin"),
)  # fmt: skip
_CATEGORY_METRICS = {
    "tokens_per_step_vs_incumbent": TOKENS_PER_STEP,
    "latency_vs_incumbent": LATENCY_MS_PER_TOKEN,
}
CategoryVerdictName = Literal["worse", "looks worse", "no harm shown", "too few samples", "not judged"]


def category_label(category: str) -> str:
    """How a reason names a category bucket (the empty name is the uncategorised requests)."""
    return repr(category) if category else "uncategorised requests"


@dataclass(frozen=True, slots=True)
class CategoryVerdict:
    """One category's candidate-vs-incumbent comparison.

    ``worse``: harm shown (rejects); ``looks worse``: enough samples and an estimate beyond the
    margin, not yet shown (holds a promotion); ``no harm shown``; ``too few samples`` (does not
    block); ``not judged`` (per-category judging is off or there is one category only).
    """

    category: str
    verdict: CategoryVerdictName
    requests: dict[str, int]
    comparisons: dict[str, Any]
    share: float = 0.0  # of the requests in every category, all arms
    awaited: bool = False  # too few samples, but a share that must be judged before a promotion

    def sentence(self) -> str:
        """The category, what was shown (or seen) and the figures behind it."""
        parts = []
        for test in CATEGORY_TESTS:
            figures = self.comparisons[test.name]
            if self.verdict == "worse" and not figures["shown"]:
                continue
            if self.verdict == "looks worse" and not figures["beyond_margin"]:
                continue
            bound = figures["bound"]
            parts.append(
                f"{test.description} ({figures['metric']} {_pct(figures['estimate'])}, "
                f"bound {_pct(bound if bound is not None else math.nan)}, "
                f"margin {_pct(figures['null_value'])}, p = {figures['p_value']:.2g} "
                f"at level {figures['level']:.2g})"
            )
        counts = (
            f"candidate {self.requests[ARM_CANDIDATE]} vs incumbent {self.requests[ARM_INCUMBENT]} requests"
        )
        return f"category {category_label(self.category)}: " + "; ".join(parts) + f" [{counts}]"

    def as_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "requests": dict(self.requests),
            "share": self.share,
            "awaited": self.awaited,
            "comparisons": self.comparisons,
        }


@dataclass(frozen=True, slots=True)
class CategoryJudgement:
    """Every category's verdict; ``level`` is what each category's harm family was held to."""

    judged: bool
    note: str
    family_size: int
    level: float
    verdicts: tuple[CategoryVerdict, ...] = ()

    def having(self, verdict: CategoryVerdictName) -> list[CategoryVerdict]:
        return [v for v in self.verdicts if v.verdict == verdict]

    def as_dict(self) -> dict[str, Any]:
        return {
            "judged": self.judged,
            "note": self.note,
            "family_size": self.family_size,
            "level": self.level,
            "verdicts": {v.category: v.as_dict() for v in self.verdicts},
        }


def judge_categories(
    categories: Mapping[str, Mapping[str, ArmAccumulator]], policy: CanaryPolicy
) -> CategoryJudgement:
    """Is the candidate worse than the incumbent on some category of requests?

    ``categories[name][arm]``: each category's running state per arm (a missing arm is empty).
    Two harm tests per category (tokens/step below, latency/token above the incumbent's, each
    beyond ``non_inferiority_margin``), on anytime p-values like the overall rule's. The
    categories are one family: Bonferroni over the categories holding any request splits
    ``harm_alpha`` among them, and Holm runs over each category's two tests at its share, so the
    chance that a candidate within the margin on every category is rejected by this family is at
    most ``harm_alpha`` (for the categories present when the first one was tested; a category
    first seen later raises the count, so earlier looks were held to a looser level). A category is
    tested once both the incumbent and the candidate have ``min_samples_per_arm`` requests in it;
    one below that is ``awaited`` when it holds at least ``category_min_share`` of the requests.
    With a single category the overall rule already judges that traffic, so nothing is judged.
    """
    present = {
        name: {arm: per_arm.get(arm) or ArmAccumulator() for arm in ARMS}
        for name, per_arm in categories.items()
        if any(acc.n > 0 for acc in per_arm.values())
    }
    family_size = len(present)
    judged = policy.judge_per_category and family_size >= 2
    level = policy.effective_harm_alpha / max(family_size, 1)
    if not policy.judge_per_category:
        note = "per-category judging is off (judge_per_category = false)"
    elif family_size == 0:
        note = "no requests split by category"
    elif family_size == 1:
        note = "one category of requests: the overall comparison judges it"
    else:
        note = (
            f"{family_size} categories, each held to harm level {policy.effective_harm_alpha:g} / "
            f"{family_size} = {level:.3g} (Bonferroni)"
        )
    margin = policy.non_inferiority_margin
    nulls = {"worse_tokens_per_step": -margin, "slower_than_incumbent": margin}
    ordered = sorted(present.items(), key=lambda item: (-sum(a.n for a in item[1].values()), item[0]))
    total = sum(acc.n for per_arm in present.values() for acc in per_arm.values())
    verdicts = []
    for name, per_arm in ordered:
        candidate, incumbent = per_arm[ARM_CANDIDATE], per_arm[ARM_INCUMBENT]
        ready = min(candidate.n, incumbent.n) >= policy.min_samples_per_arm
        diffs = {
            t.name: relative_difference(
                candidate.summary(_CATEGORY_METRICS[t.comparison]),
                incumbent.summary(_CATEGORY_METRICS[t.comparison]),
            )
            for t in CATEGORY_TESTS
        }
        p_values = np.array(
            [
                float(
                    one_sided_p_value(
                        diffs[t.name],
                        nulls[t.name],
                        t.alternative,
                        tuning_n=policy.tuning_requests,
                        alpha=policy.alpha,
                    )
                )
                for t in CATEGORY_TESTS
            ]
        )
        shown = holm_reject(p_values, level) & (ready and judged)
        levels = holm_levels(p_values, level)
        comparisons: dict[str, Any] = {}
        for i, t in enumerate(CATEGORY_TESTS):
            diff = diffs[t.name]
            est, se, n_eff = float(diff.estimate), float(diff.se), float(diff.n_eff)
            low, high = confidence_bounds(
                est, se, n_eff, float(levels[i]), tuning_n=policy.tuning_requests, alpha=policy.alpha
            )
            bound = float(low) if t.alternative == "greater" else float(high)
            beyond = n_eff > 0 and (est < nulls[t.name] if t.alternative == "less" else est > nulls[t.name])
            comparisons[t.name] = {
                "metric": _CATEGORY_METRICS[t.comparison],
                "hypothesis": t.description,
                "estimate": est,
                "null_value": nulls[t.name],
                "p_value": float(p_values[i]),
                "level": float(levels[i]),
                "bound": _finite(bound),
                "beyond_margin": bool(beyond),
                "shown": bool(shown[i]),
            }
        verdict: CategoryVerdictName
        if not judged:
            verdict = "not judged"
        elif not ready:
            verdict = "too few samples"
        elif bool(shown.any()):
            verdict = "worse"
        elif any(c["beyond_margin"] for c in comparisons.values()):
            verdict = "looks worse"
        else:
            verdict = "no harm shown"
        requests = {arm: acc.n for arm, acc in per_arm.items()}
        share = sum(requests.values()) / total if total else 0.0
        awaited = verdict == "too few samples" and share >= policy.category_min_share
        verdicts.append(CategoryVerdict(name, verdict, requests, comparisons, share, awaited))
    return CategoryJudgement(judged, note, family_size, level, tuple(verdicts))


def _too_few_text(judgement: CategoryJudgement, policy: CanaryPolicy) -> str:
    short = judgement.having("too few samples")
    if not short:
        return ""
    listed = ", ".join(
        f"{category_label(v.category)} (candidate {v.requests[ARM_CANDIDATE]}, "
        f"incumbent {v.requests[ARM_INCUMBENT]})"
        for v in short
    )
    return f"; not judged for want of {policy.min_samples_per_arm} requests per arm: {listed}"


# ----------------------------------------------------------------------------------- guardrails

GuardrailKind = Literal["speculation_slower", "dead_drafter", "suspicious_acceptance"]
GuardrailAction = Literal["switch_to_ngram", "disable_speculation", "alert"]


@dataclass(frozen=True, slots=True)
class GuardrailThresholds:
    """When live figures trip a guardrail.

    ``alpha``: anytime level for "speculation is slower than no speculation" (checked on every
    monitor run, so it must survive repeated looks). ``dead_accepted_per_step``: mean accepted
    draft tokens per verify step below which the drafter does nothing useful.
    ``suspicious_hit_rate`` with ``looping_ngram_share``: acceptance this high together with this
    much repeated-n-gram output is a generation loop, not a good drafter.
    """

    alpha: float = 0.01
    min_requests: int = 50
    min_verify_steps: int = 200
    dead_accepted_per_step: float = 0.05
    suspicious_hit_rate: float = 0.98
    looping_ngram_share: float = 0.5
    tuning_requests: int = 500


@dataclass(frozen=True, slots=True)
class GuardrailFinding:
    kind: GuardrailKind
    action: GuardrailAction
    severity: Literal["critical", "warning", "info"]
    reason: str
    figures: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def guardrail_check(
    speculative: ArmAccumulator,
    no_speculation: ArmAccumulator | None,
    *,
    speculation_mode: str,
    drafted_tokens: int,
    accepted_tokens: int,
    verify_steps: int,
    repeated_ngram_share: float | None = None,
    expected_speedup: float | None = None,
    thresholds: GuardrailThresholds | None = None,
) -> list[GuardrailFinding]:
    """Findings on a deployment's live figures; an empty list means all is well.

    ``speculative``: per-request figures of the speculating traffic; ``no_speculation``: the
    no-speculation arm's, if any traffic runs without it. ``drafted_tokens``, ``accepted_tokens``,
    ``verify_steps``: totals over the same window. ``repeated_ngram_share``: share of output in
    repeated n-grams (None: not measured). ``expected_speedup``: the tuner's modelled speed-up,
    used only when there is no no-speculation arm to measure against.
    """
    limits = thresholds or GuardrailThresholds()
    findings: list[GuardrailFinding] = []
    slower_action: GuardrailAction = (
        "disable_speculation" if speculation_mode == "ngram" else "switch_to_ngram"
    )
    next_step = (
        "disable speculation" if slower_action == "disable_speculation" else "switch to n-gram speculation"
    )

    measured = (
        no_speculation is not None
        and speculative.n >= limits.min_requests
        and no_speculation.n >= limits.min_requests
    )
    if measured and no_speculation is not None:
        diff = relative_difference(
            speculative.summary(LATENCY_MS_PER_TOKEN), no_speculation.summary(LATENCY_MS_PER_TOKEN)
        )
        p = float(
            one_sided_p_value(diff, 0.0, "greater", tuning_n=limits.tuning_requests, alpha=limits.alpha)
        )
        low, _ = confidence_bounds(
            diff.estimate,
            diff.se,
            diff.n_eff,
            limits.alpha,
            tuning_n=limits.tuning_requests,
            alpha=limits.alpha,
        )
        if p <= limits.alpha:
            findings.append(
                GuardrailFinding(
                    "speculation_slower",
                    slower_action,
                    "critical",
                    f"{speculation_mode} speculation is slower than no speculation: latency/token "
                    f"{_pct(float(diff.estimate))} (lower bound {_pct(float(low))}, anytime p = {p:.2g}); "
                    f"{next_step} until a drafter that pays is promoted",
                    {
                        "latency_relative_difference": float(diff.estimate),
                        "lower_bound": _finite(float(low)),
                        "p_value": p,
                        "speculative_requests": speculative.n,
                        "no_speculation_requests": no_speculation.n,
                        "evidence": "measured",
                    },
                )
            )
    elif expected_speedup is not None and expected_speedup < 1.0 and speculative.n >= limits.min_requests:
        findings.append(
            GuardrailFinding(
                "speculation_slower",
                slower_action,
                "warning",
                f"modelled speed-up {expected_speedup:.2f}x < 1 from live acceptance and cost ratio "
                f"(no no-speculation traffic to measure against); {next_step} "
                "or route a no-speculation arm to confirm",
                {
                    "expected_speedup": expected_speedup,
                    "speculative_requests": speculative.n,
                    "evidence": "modelled",
                },
            )
        )

    if verify_steps >= limits.min_verify_steps and speculation_mode != "disabled":
        accepted_per_step = accepted_tokens / verify_steps
        if accepted_per_step < limits.dead_accepted_per_step:
            findings.append(
                GuardrailFinding(
                    "dead_drafter",
                    "alert",
                    "critical",
                    f"drafter is dead: {accepted_per_step:.3f} accepted draft tokens per verify step over "
                    f"{verify_steps} steps (threshold {limits.dead_accepted_per_step}); "
                    "every drafted token is wasted work",
                    {
                        "accepted_per_step": accepted_per_step,
                        "mean_accepted_length": speculation_math.mean_accepted_length(
                            accepted_tokens, verify_steps
                        ),
                        "verify_steps": verify_steps,
                        "drafted_tokens": drafted_tokens,
                        "accepted_tokens": accepted_tokens,
                    },
                )
            )

    hit_rate = speculation_math.hit_rate(accepted_tokens, drafted_tokens)
    if hit_rate is not None and verify_steps >= limits.min_verify_steps:
        if hit_rate > limits.suspicious_hit_rate:
            figures = {
                "hit_rate": hit_rate,
                "repeated_ngram_share": repeated_ngram_share,
                "drafted_tokens": drafted_tokens,
            }
            if repeated_ngram_share is not None and repeated_ngram_share >= limits.looping_ngram_share:
                findings.append(
                    GuardrailFinding(
                        "suspicious_acceptance",
                        "alert",
                        "warning",
                        f"hit rate {hit_rate:.3f} with {repeated_ngram_share:.0%} of output in repeated "
                        "n-grams: the target is looping, so acceptance says nothing about drafter quality",
                        figures,
                    )
                )
            elif repeated_ngram_share is None:
                findings.append(
                    GuardrailFinding(
                        "suspicious_acceptance",
                        "alert",
                        "info",
                        f"hit rate {hit_rate:.3f} is above {limits.suspicious_hit_rate}; repetition was not "
                        "measured, so looping output cannot be ruled out",
                        figures,
                    )
                )
    return findings


# ------------------------------------------------------------------------------------ rollback


@dataclass(frozen=True, slots=True)
class RollbackVerdict:
    rollback: bool
    watching: bool  # still inside the watch window, no rollback yet
    reason: str
    figures: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# Relative drops the rollback mixture puts weight on (uniformly): small ones need long to show,
# large ones show fast; a grid covers both without choosing one in advance.
_ROLLBACK_DROPS = np.geomspace(0.03, 0.6, 12)


def request_level_spread(per_request: Sequence[tuple[int, int]]) -> tuple[float | None, float | None]:
    """Standard error and design effect of a pooled hit rate ``sum(accepted) / sum(drafted)``.

    ``per_request`` holds each request's ``(drafted, accepted)``. Tokens of one request share its
    prompt, so requests, not tokens, are the independent units: the ratio estimator's
    cluster-robust variance is ``sum((a_i - p d_i)^2) n / (n - 1) / (sum d_i)^2``. The design
    effect is that variance over the binomial one, ``p (1 - p) / sum(d_i)``: 1 when tokens are
    independent, large when some requests are easy and others hard. ``(None, None)`` below two
    requests with drafted tokens or when ``p`` is 0 or 1.
    """
    pairs = np.asarray([(d, a) for d, a in per_request if d > 0], dtype=float).reshape(-1, 2)
    n = len(pairs)
    if n < 2:
        return None, None
    drafted, accepted = pairs[:, 0], pairs[:, 1]
    total = float(drafted.sum())
    p = float(accepted.sum()) / total
    if not 0 < p < 1:
        return None, None
    variance = float(np.sum((accepted - p * drafted) ** 2)) * n / (n - 1) / total**2
    return math.sqrt(variance), variance / (p * (1 - p) / total)


def rollback_check(
    canary_hit_rate_estimate: float,
    live_drafted: int,
    live_accepted: int,
    n_requests: int,
    *,
    watch_requests: int = 500,
    alpha: float = 0.01,
    tolerance: float = 0.02,
    intra_request_correlation: float = 0.05,
    estimate_standard_error: float = 0.0,
    per_request: Sequence[tuple[int, int]] | None = None,
    measured_design_effect: float | None = None,
) -> RollbackVerdict:
    """After a promotion: is the live hit rate significantly below the canary's estimate?

    One-sided sequential test of H0 "live hit rate >= estimate - tolerance" (``tolerance``
    absorbs the canary estimate's own error) on cumulative totals since promotion. The evidence
    is a uniform mixture over relative drops of Bernoulli likelihood ratios; each ratio is raised to
    ``1 / design_effect`` because tokens of one request are correlated
    (``design_effect = 1 + (m - 1) rho``, ``m`` drafted tokens per request, ``rho`` =
    ``intra_request_correlation``); a likelihood ratio to a power in (0, 1] is still a
    supermartingale under H0, so the mixture can be checked after every batch and rolls back
    wrongly with probability at most ``alpha``.

    Two corrections keep a good drafter from being rolled back on noise. ``per_request`` (each live
    request's ``(drafted, accepted)``) lets the design effect be measured instead of assumed: the
    larger of the assumed and the measured one is used (``measured_design_effect`` gives it directly,
    from running sums; traffic that mixes easy and hard prompts
    is far more correlated within a request than ``intra_request_correlation`` says; with the
    measured effect the guarantee is asymptotic, not exact). ``estimate_standard_error`` is the
    canary estimate's own request-level error: the tolerance widens to two of them, since a
    canary measured on a few dozen requests cannot promise its rate to the second decimal.
    """
    if not 0 < canary_hit_rate_estimate < 1:
        raise ValueError("canary_hit_rate_estimate must be in (0, 1)")
    if live_accepted < 0 or live_drafted < live_accepted or n_requests < 0:
        raise ValueError("need 0 <= live_accepted <= live_drafted and n_requests >= 0")
    if estimate_standard_error < 0 or not math.isfinite(estimate_standard_error):
        raise ValueError("estimate_standard_error must be a finite number >= 0")
    margin = max(tolerance, 2.0 * estimate_standard_error)
    null_rate = max(canary_hit_rate_estimate - margin, 1e-6)
    figures: dict[str, Any] = {
        "canary_hit_rate_estimate": canary_hit_rate_estimate,
        "null_hit_rate": null_rate,
        "live_hit_rate": speculation_math.hit_rate(live_accepted, live_drafted),
        "live_drafted": live_drafted,
        "live_accepted": live_accepted,
        "n_requests": n_requests,
        "watch_requests": watch_requests,
        "alpha": alpha,
        "margin": margin,
    }
    if live_drafted == 0 or n_requests == 0:
        return RollbackVerdict(False, n_requests < watch_requests, "no live drafted tokens yet", figures)
    per_request_drafted = live_drafted / n_requests
    design_effect = 1.0 + max(per_request_drafted - 1.0, 0.0) * intra_request_correlation
    assumed_design_effect = design_effect
    if per_request is not None:
        measured_design_effect = request_level_spread(per_request)[1]
    if measured_design_effect is not None:
        design_effect = max(design_effect, measured_design_effect)
    alt = null_rate * (1.0 - _ROLLBACK_DROPS)
    rejected = live_drafted - live_accepted
    log_lr = live_accepted * np.log(alt / null_rate) + rejected * np.log((1.0 - alt) / (1.0 - null_rate))
    tempered = log_lr / design_effect - math.log(len(_ROLLBACK_DROPS))
    top = float(np.max(tempered))
    log_evidence = top + math.log(float(np.sum(np.exp(tempered - top))))
    p_value = min(1.0, math.exp(-log_evidence)) if log_evidence > 0 else 1.0
    figures.update(
        {
            "design_effect": design_effect,
            "assumed_design_effect": assumed_design_effect,
            "measured_design_effect": measured_design_effect,
            "log_evidence": log_evidence,
            "p_value": p_value,
        }
    )
    live = figures["live_hit_rate"]  # live_drafted > 0 here
    if log_evidence >= math.log(1.0 / alpha):
        reason = (
            f"live hit rate {live:.3f} over {n_requests} requests is significantly below the canary's "
            f"{canary_hit_rate_estimate:.3f} (margin {margin:.3f}; anytime p = {p_value:.2g}); roll back"
        )
        return RollbackVerdict(True, False, reason, figures)
    watching = n_requests < watch_requests
    state = "watching" if watching else "watch over"
    reason = (
        f"{state}: live hit rate {live:.3f} vs canary {canary_hit_rate_estimate:.3f} "
        f"(anytime p = {p_value:.2g})"
    )
    return RollbackVerdict(False, watching, reason, figures)
