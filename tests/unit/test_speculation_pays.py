"""The standing "does speculation pay" test on synthetic latencies: it finds a slower live arm,
stays unknown or says pays when live is as fast or faster, starts over when the set-up changes,
keeps its false alarms on equal arms within alpha, and plans another k from the live counts.
Also the routing weights a standing no-speculation share implies."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from controlplane.drafters.weights import canary_weights, standing_share, standing_weights
from controlplane.speculation_check.sequential import (
    BASELINE,
    LIVE,
    NOT_PAYING,
    PAYS,
    UNKNOWN,
    PaysTest,
)

KEY = {
    "mode": "draft_model",
    "drafter_version": 1,
    "draft_model": None,
    "k": 4,
    "draft_confidence_threshold": None,
}
ALPHA = 0.05
MIN_PER_ARM = 30


def request(ms_per_token: float, *, arm: str = LIVE, tokens_per_step: float = 2.0, hit: float = 0.3) -> Any:
    """One record's fields as the test reads them (live: k = 4 drafts per step)."""
    steps = 16
    if arm == BASELINE:
        return SimpleNamespace(
            generated_tokens=32, verify_steps=32, drafted_tokens=0, accepted_tokens=0,
            accepted_per_position=[], inter_token_ms=ms_per_token, total_ms=None, ttft_ms=None,
        )  # fmt: skip
    generated = int(round(steps * tokens_per_step))
    accepted = generated - steps
    first = min(steps, accepted)
    per_position = [first, max(0, accepted - first) // 2, 0, 0]
    return SimpleNamespace(
        generated_tokens=generated, verify_steps=steps, drafted_tokens=steps * 4,
        accepted_tokens=sum(per_position), accepted_per_position=per_position,
        inter_token_ms=ms_per_token, total_ms=None, ttft_ms=None,
    )  # fmt: skip


def drive(
    test: PaysTest, rng: random.Random, *, n: int, live_factor: float, share: float = 0.05, every: int = 25
) -> tuple[str, int]:
    """Route ``n`` requests (share to baseline), reading the verdict every ``every``; returns the
    first verdict other than unknown and when, else ("unknown", n)."""
    for i in range(1, n + 1):
        arm = BASELINE if rng.random() < share else LIVE
        base = rng.lognormvariate(2.0, 0.25)
        test.add(arm, request(base * (live_factor if arm == LIVE else 1.0), arm=arm))
        if i % every == 0:
            verdict = test.verdict(alpha=ALPHA, min_requests_per_arm=MIN_PER_ARM).verdict
            if verdict != UNKNOWN:
                return verdict, i
    return UNKNOWN, n


def test_a_live_arm_20_percent_slower_is_found_not_paying_within_2000_requests() -> None:
    test = PaysTest(KEY)
    verdict, at = drive(test, random.Random(7), n=2000, live_factor=1.2)
    # Deterministic: seeded (random.Random(7)).
    assert verdict == NOT_PAYING and at <= 2000
    answer = test.verdict(alpha=ALPHA, min_requests_per_arm=MIN_PER_ARM)
    assert answer.ratio is not None and answer.ratio_low is not None and answer.ratio_low > 1.0
    assert answer.p_slower <= ALPHA and "slower than no speculation" in answer.reason


def test_a_faster_live_arm_is_found_paying_and_never_not_paying() -> None:
    test = PaysTest(KEY)
    verdict, _ = drive(test, random.Random(3), n=2000, live_factor=0.7)
    assert verdict == PAYS
    answer = test.verdict(alpha=ALPHA, min_requests_per_arm=MIN_PER_ARM)
    assert answer.ratio_high is not None and answer.ratio_high < 1.0


def test_no_verdict_before_the_minimum_requests_in_each_arm() -> None:
    test = PaysTest(KEY)
    for _ in range(500):  # a hugely slower live arm, but no baseline request yet
        test.add(LIVE, request(50.0))
    for _ in range(MIN_PER_ARM - 1):
        test.add(BASELINE, request(5.0, arm=BASELINE))
    answer = test.verdict(alpha=ALPHA, min_requests_per_arm=MIN_PER_ARM)
    assert answer.verdict == UNKNOWN and "waiting for" in answer.reason
    test.add(BASELINE, request(5.1, arm=BASELINE))
    assert test.verdict(alpha=ALPHA, min_requests_per_arm=MIN_PER_ARM).verdict == NOT_PAYING


def test_equal_arms_rarely_raise_a_false_alarm_however_often_it_is_read() -> None:
    # 40 seeded tests of 500 requests each, the verdict read every 25 (20 looks apiece): the
    # anytime guarantee bounds the share of tests ever saying not_paying by alpha.
    runs = 40
    alarms = sum(
        drive(PaysTest(KEY), random.Random(seed), n=500, live_factor=1.0, share=0.25, every=25)[0]
        == NOT_PAYING
        for seed in range(runs)
    )
    # Deterministic: seeded (random.Random(0..39)), fails only if the code changes; over fresh seeds
    # Binomial(40, 0.05) >= 3 would be 0.32, which is why it stays seeded.
    assert alarms / runs <= ALPHA


def test_state_round_trips_through_json_and_keeps_its_key() -> None:
    import json

    test = PaysTest(KEY)
    drive(test, random.Random(1), n=300, live_factor=1.1, share=0.3)
    restored = PaysTest.from_state(json.loads(json.dumps(test.to_state())))
    assert restored.key == KEY
    assert restored.verdict(alpha=ALPHA, min_requests_per_arm=5) == test.verdict(
        alpha=ALPHA, min_requests_per_arm=5
    )
    with pytest.raises(ValueError, match="version"):
        PaysTest.from_state({**test.to_state(), "version": 99})
    with pytest.raises(ValueError, match="malformed"):
        PaysTest.from_state({"version": 1, "key": KEY, "arms": {}})


def test_a_new_set_up_restarts_from_nothing() -> None:
    # The service starts a new test when the key changes: the slow figures of k = 4 do not
    # follow the deployment to k = 2.
    slow = PaysTest(KEY)
    drive(slow, random.Random(5), n=1500, live_factor=1.3, share=0.2)
    assert slow.verdict(alpha=ALPHA, min_requests_per_arm=MIN_PER_ARM).verdict == NOT_PAYING
    fresh = PaysTest({**KEY, "k": 2})
    assert fresh.key != slow.key
    assert fresh.requests(LIVE) == fresh.requests(BASELINE) == 0
    assert fresh.verdict(alpha=ALPHA, min_requests_per_arm=MIN_PER_ARM).verdict == UNKNOWN


def _half_accepted_at_k4() -> PaysTest:
    """Position 1 accepted half the time, deeper positions never: drafting 4 costs four drafter
    steps for half a token. Live 10 ms/token at 1.5 tokens/step against 8 without: a live step
    costs ~1.9 one-token steps."""
    test = PaysTest(KEY)
    rng = random.Random(2)
    for _ in range(200):
        test.add(LIVE, request(10.0 * rng.uniform(0.95, 1.05), tokens_per_step=1.5))
    for _ in range(40):
        test.add(BASELINE, request(8.0 * rng.uniform(0.95, 1.05), arm=BASELINE))
    return test


# A wider verify pass almost free (a memory-bound target) and one where it is not (the 12M
# reference target on a CPU: a 2-token verify costs 1.44 one-token steps).
FLAT_VERIFY = {k: 1.0 + 0.02 * k for k in range(1, 9)}
CPU_VERIFY = {1: 1.44, 2: 1.50, 3: 1.55, 4: 1.60, 5: 1.66, 6: 1.72, 7: 1.78, 8: 1.84}


def test_the_draft_length_plan_uses_the_measured_step_cost() -> None:
    test = _half_accepted_at_k4()
    plan = test.draft_length_plan(k=4)
    assert plan is not None
    assert plan["measured_step_cost"] == pytest.approx(10.0 / 8.0 * 1.5, rel=0.05)
    # Leviathan's flat verify puts all of it on the drafter and likes k = 1, but without a
    # measured curve that table is shown, never acted on: at worst k = 1 costs the live step too.
    assert plan["cost_model"] == "flat_verify_unmeasured" and plan["verify_cost_source"] is None
    assert plan["best_k"] == 1 and plan["best_speedup"] > 1.0
    assert plan["cost_ratio"] == pytest.approx((plan["measured_step_cost"] - 1.0) / 4)
    assert not plan["actionable"] and "no measured verify cost" in plan["why"]
    assert plan["worst_case_speedup"] == pytest.approx(1.5 / plan["measured_step_cost"])
    assert plan["worst_case_speedup"] < 1.0
    assert PaysTest(KEY).draft_length_plan(k=4) is None  # nothing measured yet


def test_a_measured_near_flat_verify_cost_lets_the_plan_shorten_k() -> None:
    plan = _half_accepted_at_k4().draft_length_plan(k=4, verify_cost=FLAT_VERIFY, verify_cost_source="replay")
    assert plan is not None and plan["cost_model"] == "measured_verify_cost"
    # The live step splits into the measured verify of 5 tokens and the drafter's rest.
    assert plan["verify_cost_at_live_k"] == pytest.approx(1.08)
    assert plan["cost_ratio"] == pytest.approx((plan["measured_step_cost"] - 1.08) / 4)
    assert plan["best_k"] == 1 and plan["verify_cost_at_best_k"] == pytest.approx(1.02)
    assert plan["best_speedup"] >= 1.05 and plan["actionable"]
    assert plan["verify_cost_source"] == "replay"


def test_a_measured_verify_cost_of_1_44_at_k1_stops_the_flat_models_k1() -> None:
    test = _half_accepted_at_k4()
    # Same live counts and step cost; only the verify curve differs. k = 1 now costs the drafter's
    # share plus 1.44: 1.5 tokens for ~1.5 steps, no better than no speculation.
    plan = test.draft_length_plan(k=4, verify_cost=CPU_VERIFY, verify_cost_source="replay")
    assert plan is not None and plan["cost_model"] == "measured_verify_cost"
    assert plan["rows"][1]["cost_per_step"] == pytest.approx(plan["cost_ratio"] + 1.44)
    assert plan["rows"][1]["expected_speedup"] < 1.0
    assert plan["best_k"] == 0 and not plan["actionable"]
    # A curve it cannot read is no curve: the flat table, not acted on.
    unreadable = test.draft_length_plan(k=4, verify_cost={1: -1.0})
    assert unreadable is not None and unreadable["cost_model"] == "flat_verify_unmeasured"


def test_a_verify_curve_costlier_than_the_live_step_is_not_acted_on() -> None:
    # Measured elsewhere: verifying 5 tokens alone would cost more than the whole live step.
    costly = dict.fromkeys(range(1, 9), 2.5)
    plan = _half_accepted_at_k4().draft_length_plan(k=4, verify_cost=costly, verify_cost_source="replay")
    assert plan is not None and not plan["actionable"]
    assert "does not describe this server" in plan["why"]


def test_standing_weights_and_the_canary_split() -> None:
    assert standing_weights(0.05) == {"live": 0.95, "baseline": 0.05}
    assert standing_weights(0.0) == {"live": 1.0}
    assert canary_weights(0.1, 0.1, 0.05) == {"live": 0.8, "candidate": 0.1, "baseline": 0.1}
    assert canary_weights(0.1, 0.1, 0.3) == {"live": 0.6, "candidate": 0.1, "baseline": 0.3}
    # The incumbent keeps at least 10 % whatever the share.
    assert canary_weights(0.45, 0.1, 0.5)["live"] == pytest.approx(0.1)
    assert standing_share({}) == 0.05
    assert standing_share({"standing_baseline_share": 0}) == 0.0
    assert standing_share({"standing_baseline_share": 0.9}) == 0.05  # out of range: the default
    assert standing_share({"standing_baseline_share": 0.2}, speculating=False) == 0.0


def test_a_gateway_export_without_a_baseline_pool_sends_the_standing_share_to_the_live_arm() -> None:
    from controlplane.drafters.exports import ExportError, weighted_backends

    backends = [{"name": "inc", "pool": "incumbent", "url": "http://inc:8000", "drafter_version": None}]
    standing = {
        "arms": [{"arm": "live", "weight": 0.95}, {"arm": "baseline", "weight": 0.05}],
        "backends": backends,
    }
    assert [(b["name"], arm, w) for b, arm, w in weighted_backends(standing)] == [("inc", "live", 10_000)]
    # During a canary the baseline arm is part of the judged split: it must have somewhere to go.
    canary = {
        "arms": [
            {"arm": "live", "weight": 0.8},
            {"arm": "canary:2", "weight": 0.1, "drafter_version": 2},
            {"arm": "baseline", "weight": 0.1},
        ],
        "backends": [
            *backends,
            {"name": "cand", "pool": "candidate", "url": "http://c:8000", "drafter_version": 2},
        ],
    }
    with pytest.raises(ExportError, match="baseline pool has no backend"):
        weighted_backends(canary)
