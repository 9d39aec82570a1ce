"""The canary judges each request category as well as the overall mix: a candidate that wins
overall but loses one category beyond the margin is rejected, naming the category; categories
with too few samples never block; the tally caps how many categories get their own sums."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from controlplane.canary.policy import decide, judge_categories
from controlplane.canary.statistics import ArmAccumulator
from controlplane.canary.tally import CATEGORY_LIMIT, OTHER_CATEGORIES, UNCATEGORISED, JudgeTally
from controlplane.canary_policy import CanaryPolicy, CanaryPolicyError

POLICY = CanaryPolicy(min_samples_per_arm=30)
ARM_NAMES = ("incumbent", "candidate", "baseline")


def requests(rng: np.random.Generator, n: int, *, tps: float, ms: float) -> list[tuple[float, float]]:
    """``n`` requests of one arm: tokens per step and latency per token, each with ~10% spread."""
    return [
        (float(max(1.0, tps * rng.gamma(100.0, 1 / 100.0))), float(ms * rng.lognormal(0.0, 0.1)))
        for _ in range(n)
    ]


def accumulate(observations: list[tuple[float, float]]) -> ArmAccumulator:
    acc = ArmAccumulator()
    for tokens_per_step, ms_per_token in observations:
        acc.add(tokens_per_step=tokens_per_step, latency_ms_per_token=ms_per_token)
    return acc


# Per category and arm: (requests, tokens per step, latency ms per token).
Spec = dict[str, dict[str, tuple[int, float, float]]]


def arm_states(
    spec: Spec, seed: int = 0
) -> tuple[dict[str, ArmAccumulator], dict[str, dict[str, ArmAccumulator]]]:
    """The overall and per-category running state of a canary whose traffic ``spec`` describes."""
    rng = np.random.default_rng(seed)
    overall: dict[str, list[tuple[float, float]]] = {arm: [] for arm in ARM_NAMES}
    categories: dict[str, dict[str, ArmAccumulator]] = {}
    for category, arms in spec.items():
        categories[category] = {}
        for arm, (n, tps, ms) in arms.items():
            observations = requests(rng, n, tps=tps, ms=ms)
            overall[arm] += observations
            categories[category][arm] = accumulate(observations)
    return {arm: accumulate(obs) for arm, obs in overall.items()}, categories


def traffic(candidate_code: tuple[int, float, float]) -> Spec:
    """Mostly prose, on which the candidate is far better; some code, as ``candidate_code`` says."""
    return {
        "prose": {
            "baseline": (150, 1.0, 25.0),
            "incumbent": (600, 2.0, 16.0),
            "candidate": (150, 3.0, 11.0),
        },
        "code": {
            "baseline": (60, 1.0, 25.0),
            "incumbent": (240, 3.0, 11.0),
            "candidate": candidate_code,
        },
    }


def test_a_candidate_that_wins_overall_but_loses_a_category_is_rejected_naming_it() -> None:
    overall, categories = arm_states(traffic((60, 1.8, 17.0)))
    assert decide(overall, POLICY).decision == "promote"  # the mix alone would promote it

    decision = decide(overall, POLICY, categories=categories)
    assert decision.decision == "reject", decision.reason
    assert "'code'" in decision.reason and "'prose'" not in decision.reason
    assert "even though it wins overall" in decision.reason
    assert "latency/token above the incumbent beyond the margin" in decision.reason
    assert "candidate 60 vs incumbent 240 requests" in decision.reason
    verdicts = decision.figures["categories"]["verdicts"]
    assert verdicts["code"]["verdict"] == "worse" and verdicts["prose"]["verdict"] == "no harm shown"
    slower = verdicts["code"]["comparisons"]["slower_than_incumbent"]
    assert slower["shown"] and slower["bound"] > POLICY.non_inferiority_margin
    # Deterministic: every arm's requests come from default_rng(seed); the decision, its bound and
    # this estimate fail only if the code changes.
    assert slower["estimate"] == pytest.approx(17.0 / 11.0 - 1, abs=0.05)
    # Bonferroni over the two categories, Holm over each category's two tests.
    assert decision.figures["categories"]["level"] == pytest.approx(POLICY.alpha / 2)
    assert slower["level"] <= POLICY.alpha / 2
    json.dumps(decision.as_dict(), allow_nan=False)


def test_a_candidate_that_wins_every_category_is_promoted() -> None:
    overall, categories = arm_states(traffic((60, 4.0, 8.5)))
    decision = decide(overall, POLICY, categories=categories)
    assert decision.decision == "promote", decision.reason
    assert "no harm shown on 2 of 2 categories" in decision.reason
    verdicts = decision.figures["categories"]["verdicts"]
    assert {v["verdict"] for v in verdicts.values()} == {"no harm shown"}


def test_a_small_category_below_the_minimum_samples_does_not_block_but_is_listed() -> None:
    spec = traffic((60, 4.0, 8.5))
    # Far worse, but a few percent of the traffic and only a handful of candidate requests.
    spec["poetry"] = {"incumbent": (40, 2.0, 16.0), "candidate": (5, 1.1, 40.0), "baseline": (10, 1.0, 25.0)}
    overall, categories = arm_states(spec)
    decision = decide(overall, POLICY, categories=categories)
    assert decision.decision == "promote", decision.reason
    assert (
        "not judged for want of 30 requests per arm: 'poetry' (candidate 5, incumbent 40)" in decision.reason
    )
    judged = decision.figures["categories"]
    poetry = judged["verdicts"]["poetry"]
    assert poetry["verdict"] == "too few samples" and not poetry["awaited"] and poetry["share"] < 0.1
    assert judged["family_size"] == 3  # it still takes its share of the error budget


def test_a_large_category_too_small_in_the_candidate_arm_holds_the_promotion_until_the_limit() -> None:
    spec = traffic((60, 4.0, 8.5))
    # A quarter of the traffic, but the candidate's small arm has not served enough of it yet.
    spec["poetry"] = {
        "incumbent": (300, 2.0, 16.0),
        "candidate": (12, 1.1, 40.0),
        "baseline": (80, 1.0, 25.0),
    }
    overall, categories = arm_states(spec)
    assert (
        decide(overall, CanaryPolicy(min_samples_per_arm=30, judge_per_category=False)).decision == "promote"
    )
    waiting = decide(overall, POLICY, categories=categories)
    assert waiting.decision == "continue", waiting.reason
    assert (
        "promotion waits for 30 requests per arm" in waiting.reason
        and "'poetry' (24% of requests" in waiting.reason
    )
    assert waiting.figures["categories"]["verdicts"]["poetry"]["awaited"] is True
    # At the limit the overall evidence decides; the unjudged category is listed, not blocking.
    at_limit = decide(overall, POLICY, categories=categories, elapsed_s=POLICY.max_duration_s)
    assert at_limit.decision == "promote" and "'poetry' (candidate 12, incumbent 300)" in at_limit.reason
    # A policy that awaits no category promotes at once.
    eager = decide(
        overall, CanaryPolicy(min_samples_per_arm=30, category_min_share=1.0), categories=categories
    )
    assert eager.decision == "promote"


def test_a_category_that_looks_worse_holds_the_promotion_until_it_is_shown_or_cleared() -> None:
    # Code is 8% slower on the candidate: beyond the 2% margin, not yet shown on 40 requests.
    overall, categories = arm_states(traffic((40, 2.8, 11.9)), seed=3)
    decision = decide(overall, POLICY, categories=categories)
    assert decision.figures["categories"]["verdicts"]["code"]["verdict"] == "looks worse", decision.figures
    assert (
        decision.decision == "continue"
        and "promotion held" in decision.reason
        and "'code'" in decision.reason
    )
    at_limit = decide(overall, POLICY, categories=categories, elapsed_s=POLICY.max_duration_s)
    assert at_limit.decision == "inconclusive" and "'code'" in at_limit.reason
    # With per-category judging off the same figures promote, as the overall rule alone does.
    off = decide(
        overall, CanaryPolicy(min_samples_per_arm=30, judge_per_category=False), categories=categories
    )
    assert off.decision == "promote" and off.figures["categories"]["judged"] is False


def test_per_category_judging_off_or_one_category_leaves_the_overall_rule_alone() -> None:
    overall, categories = arm_states(traffic((60, 1.8, 17.0)))
    off = CanaryPolicy(min_samples_per_arm=30, judge_per_category=False)
    decision = decide(overall, off, categories=categories)
    assert decision.decision == "promote"
    assert {v["verdict"] for v in decision.figures["categories"]["verdicts"].values()} == {"not judged"}
    # All traffic in one category: the overall comparison already is that category's.
    single = judge_categories({"code": categories["code"]}, POLICY)
    assert not single.judged and single.having("not judged") and not single.having("worse")
    without = decide(overall, POLICY)
    assert decide(overall, POLICY, categories={UNCATEGORISED: dict(overall)}).as_dict() == {
        **without.as_dict(),
        "figures": {
            **without.figures,
            "categories": judge_categories({UNCATEGORISED: overall}, POLICY).as_dict(),
        },
    }


def test_judge_per_category_is_a_settable_boolean() -> None:
    assert "judge_per_category" in CanaryPolicy.SETTABLE and CanaryPolicy().judge_per_category is True
    assert CanaryPolicy.for_deployment({"judge_per_category": False}).judge_per_category is False
    with pytest.raises(CanaryPolicyError, match="judge_per_category must be true or false"):
        CanaryPolicy.validate_changes({"judge_per_category": "no"})


def record(category: str | None, *, ms: float = 10.0) -> SimpleNamespace:
    return SimpleNamespace(
        category=category,
        generated_tokens=40,
        verify_steps=20,
        drafted_tokens=80,
        accepted_tokens=20,
        accepted_per_position=[10, 6, 3, 1],
        inter_token_ms=ms,
        total_ms=None,
        ttft_ms=None,
    )


def test_the_category_cap_pools_the_extras_as_other() -> None:
    tally = JudgeTally.empty(ARM_NAMES)
    names = [f"tenant-{i}" for i in range(CATEGORY_LIMIT + 9)]
    for name in names:
        tally.fold("incumbent", record(name))
        tally.fold("candidate", record(name))
    for category in (None, "", OTHER_CATEGORIES, names[0], names[-1]):
        tally.fold("candidate", record(category, ms=12.0))

    named = [b for b in tally.categories if b not in (UNCATEGORISED, OTHER_CATEGORIES)]
    assert named == names[:CATEGORY_LIMIT]  # the first seen, in record order
    assert set(tally.categories) == {*names[:CATEGORY_LIMIT], UNCATEGORISED, OTHER_CATEGORIES}
    other = tally.categories[OTHER_CATEGORIES]
    # The 9 overflow names (one request per arm each), a record named "other", and a later overflow one.
    assert other["incumbent"].timed == 9 and other["candidate"].timed == 9 + 2
    assert tally.categories[UNCATEGORISED]["candidate"].timed == 2  # None and "" alike
    assert tally.categories[names[0]]["candidate"].timed == 2
    assert tally.records == tally.category_records == 2 * len(names) + 5
    assert (
        sum(per_arm["candidate"].timed for per_arm in tally.categories.values())
        == tally.arms["candidate"].timed
    )

    restored = JudgeTally.from_state(json.loads(json.dumps(tally.to_state())), ARM_NAMES)
    assert restored.to_state() == tally.to_state()
    restored.fold("incumbent", record("brand-new"))  # the cap survives a round trip
    assert "brand-new" not in restored.categories
    assert restored.categories[OTHER_CATEGORIES]["incumbent"].timed == 10


def test_a_judge_state_written_before_categories_is_still_read() -> None:
    tally = JudgeTally.empty(ARM_NAMES)
    for _ in range(3):
        tally.fold("incumbent", record("prose"))
    state = tally.to_state()
    old = {"version": 1, "records": state["records"], "arms": state["arms"]}
    restored = JudgeTally.from_state(old, ARM_NAMES)
    assert restored.records == 3 and restored.category_records == 0 and restored.categories == {}
    assert restored.arms["incumbent"].to_state() == tally.arms["incumbent"].to_state()
    restored.fold("candidate", record("code"))
    assert restored.category_records == 1 and restored.records == 4 and list(restored.categories) == ["code"]
    with pytest.raises(ValueError, match="unsupported judge state version"):
        JudgeTally.from_state({**old, "version": 99}, ARM_NAMES)
    with pytest.raises(ValueError, match="malformed judge state"):
        JudgeTally.from_state({**state, "categories": {"code": {"incumbent": {}}}}, ARM_NAMES)
