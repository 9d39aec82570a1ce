"""The adaptation policy's validation, its GPU budget arithmetic and its trigger rules, as pure
functions (no database)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from controlplane.adaptation_policy import (
    CONTINUOUS,
    FIRST_DRAFTER,
    AdaptationPolicy,
    AdaptationPolicyError,
    DeploymentFacts,
    choose_trigger,
    gpu_seconds_used,
)

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def test_defaults_are_the_shared_vocabulary() -> None:
    assert AdaptationPolicy().as_dict() == {
        "standing_baseline_share": 0.05,
        "pays_alpha": 0.05,
        "pays_min_requests_per_arm": 30,
        "continuous": False,
        "continuous_every_traces": 2000,
        "continuous_every_minutes": 0.0,
        "gpu_seconds_per_day": 3600.0,
        "first_drafter": True,
    }


def test_every_bad_field_is_named_at_once() -> None:
    with pytest.raises(AdaptationPolicyError) as caught:
        AdaptationPolicy.validate_changes(
            {
                "standing_baseline_share": 0.7,
                "pays_alpha": 0,
                "continuous": "yes",
                "continuous_every_traces": 5,
                "continuous_every_minutes": 0.5,
                "gpu_seconds_per_day": -1,
                "first_drafter": 1,
                "pays_min_requests_per_arm": 12.5,
                "colour": "blue",
            }
        )
    fields = [p["field"] for p in caught.value.problems]
    assert sorted(fields) == sorted(
        [
            "colour",
            "standing_baseline_share",
            "pays_alpha",
            "continuous",
            "continuous_every_traces",
            "continuous_every_minutes",
            "gpu_seconds_per_day",
            "first_drafter",
            "pays_min_requests_per_arm",
        ]
    )
    assert "unknown field" in caught.value.problems[0]["message"]


def test_edges_are_accepted() -> None:
    valid = AdaptationPolicy.validate_changes(
        {"standing_baseline_share": 0, "gpu_seconds_per_day": 0, "continuous_every_minutes": 1}
    )
    assert valid == {"standing_baseline_share": 0, "continuous_every_minutes": 1, "gpu_seconds_per_day": 0}
    assert AdaptationPolicy(standing_baseline_share=0.5).standing_baseline_share == 0.5
    with pytest.raises(AdaptationPolicyError):
        AdaptationPolicy(standing_baseline_share=0.51)
    with pytest.raises(AdaptationPolicyError):
        AdaptationPolicy.validate_changes({"gpu_seconds_per_day": float("nan")})
    with pytest.raises(AdaptationPolicyError):
        AdaptationPolicy.validate_changes({"continuous": True, "first_drafter": None})


def test_stored_values_over_defaults_and_a_stale_value_falls_back() -> None:
    policy = AdaptationPolicy.for_deployment(
        {"continuous": True, "continuous_every_traces": 500, "pays_alpha": 7, "other_key": 1}
    )
    assert policy.continuous is True
    assert policy.continuous_every_traces == 500
    assert policy.pays_alpha == 0.05  # out of range when stored: the default, not a crash
    assert AdaptationPolicy.for_deployment(None) == AdaptationPolicy()


# --- the GPU budget ---------------------------------------------------------------------------


def test_gpu_seconds_clip_runs_to_the_last_24_hours() -> None:
    hour = timedelta(hours=1)
    runs = [
        (NOW - 30 * hour, NOW - 23 * hour),  # 1 h inside the window
        (NOW - 2 * hour, NOW - 2 * hour + timedelta(seconds=90)),  # 90 s
        (NOW - timedelta(seconds=40), None),  # still running: 40 s so far
        (None, None),  # never started
        (NOW - 50 * hour, NOW - 48 * hour),  # before the window
    ]
    assert gpu_seconds_used(runs, now=NOW) == pytest.approx(3600 + 90 + 40)
    assert gpu_seconds_used([], now=NOW) == 0.0


# --- the triggers -----------------------------------------------------------------------------

FACTS = DeploymentFacts(
    auto_realign=True,
    has_drafter=False,
    had_drafter=False,
    in_guardrail_fallback=False,
    busy=None,
    new_traces=0,
    minutes_since_last=0.0,
    gpu_seconds_used=0.0,
    min_traces=200,
)


def test_first_drafter_waits_for_enough_traces() -> None:
    policy = AdaptationPolicy()
    waiting = choose_trigger(policy, replace(FACTS, new_traces=199))
    assert waiting.trigger is None and "199/200" in waiting.reason
    due = choose_trigger(policy, replace(FACTS, new_traces=200))
    assert due.trigger == FIRST_DRAFTER and not due.skipped
    off = choose_trigger(AdaptationPolicy(first_drafter=False), replace(FACTS, new_traces=5000))
    assert off.trigger is None and "first_drafter is off" in off.reason
    # Speculation switched off after a trained drafter served: a choice, not day 0.
    switched_off = choose_trigger(policy, replace(FACTS, new_traces=5000, had_drafter=True))
    assert switched_off.trigger is None and "not day 0" in switched_off.reason


def test_nothing_starts_beside_a_job_or_canary_or_a_guardrail_or_without_auto_realign() -> None:
    policy = AdaptationPolicy(continuous=True)
    ready = replace(FACTS, new_traces=10_000)
    assert choose_trigger(policy, replace(ready, busy="canary 3 is live")).reason == "canary 3 is live"
    assert choose_trigger(policy, replace(ready, busy="canary 3 is live")).trigger is None
    assert choose_trigger(policy, replace(ready, in_guardrail_fallback=True)).trigger is None
    assert choose_trigger(policy, replace(ready, auto_realign=False)).trigger is None


def test_continuous_every_traces_or_every_minutes() -> None:
    with_drafter = replace(FACTS, has_drafter=True)
    assert choose_trigger(AdaptationPolicy(), replace(with_drafter, new_traces=10**6)).trigger is None
    policy = AdaptationPolicy(continuous=True, continuous_every_traces=1000, continuous_every_minutes=30)
    assert choose_trigger(policy, replace(with_drafter, new_traces=999)).trigger is None
    assert choose_trigger(policy, replace(with_drafter, new_traces=1000)).trigger == CONTINUOUS
    # Time alone is not enough: there must be something new to learn from.
    assert (
        choose_trigger(policy, replace(with_drafter, new_traces=150, minutes_since_last=45)).trigger is None
    )
    timed = choose_trigger(policy, replace(with_drafter, new_traces=250, minutes_since_last=45))
    assert timed.trigger == CONTINUOUS and "45 min" in timed.reason
    assert (
        choose_trigger(policy, replace(with_drafter, new_traces=250, minutes_since_last=29)).trigger is None
    )


def test_over_budget_is_skipped_with_the_reason() -> None:
    policy = AdaptationPolicy(continuous=True, continuous_every_traces=100, gpu_seconds_per_day=600)
    facts = replace(FACTS, has_drafter=True, new_traces=100, gpu_seconds_used=600.0)
    decision = choose_trigger(policy, facts)
    assert decision.trigger == CONTINUOUS and decision.skipped
    assert "600 s in the last 24 h" in decision.reason and "gpu_seconds_per_day (600 s)" in decision.reason
    under = choose_trigger(policy, replace(facts, gpu_seconds_used=599.0))
    assert under.trigger == CONTINUOUS and not under.skipped
    # A zero budget turns the automatic realignments off.
    zero = choose_trigger(AdaptationPolicy(gpu_seconds_per_day=0), replace(FACTS, new_traces=500))
    assert zero.trigger == FIRST_DRAFTER and zero.skipped
