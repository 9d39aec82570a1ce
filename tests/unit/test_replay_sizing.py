"""The replay-sizing rule: how many pre-drift rows a realignment replays, from which categories."""

from __future__ import annotations

import pytest

from workers.training.replay import (
    KNOWN_AGREEMENT,
    MAX_REPLAY_SHARE,
    absent_by_category,
    allocate,
    plan_replay,
    protection_for,
)


def test_a_complete_shift_with_a_knowing_incumbent_replays_the_most() -> None:
    plan = plan_replay(
        recent_rows=300, recent_categories={"structured": 330}, available={"prose": 500}, old_agreement=0.8
    )
    assert plan.absent_share == 1.0 and plan.protection == 1.0
    assert plan.share == MAX_REPLAY_SHARE
    assert plan.rows == 300 and plan.per_category == {"prose": 300}  # r / (300 + r) = 0.5


def test_old_traffic_still_arriving_needs_less_replay() -> None:
    # Before: all prose. Now: half prose, half code. Half the old traffic is still in the window.
    plan = plan_replay(
        recent_rows=200,
        recent_categories={"prose": 100, "code": 100},
        available={"prose": 400},
        old_agreement=0.9,
    )
    assert plan.absent_share == pytest.approx(0.5)
    assert plan.share == pytest.approx(0.25)
    assert plan.rows == round(200 * 0.25 / 0.75)
    # All of it still arriving: nothing to replay.
    none = plan_replay(
        recent_rows=200, recent_categories={"prose": 10}, available={"prose": 400}, old_agreement=0.9
    )
    assert none.rows == 0 and "still carries" in none.reason


def test_the_less_the_incumbent_knows_the_old_traffic_the_less_is_replayed() -> None:
    rows = [
        plan_replay(
            recent_rows=300, recent_categories={"new": 1}, available={"old": 1000}, old_agreement=a
        ).rows
        for a in (0.0, 0.2, 0.4, 0.6, KNOWN_AGREEMENT, 0.95)
    ]
    assert rows[0] == 0
    assert rows == sorted(rows) and len(set(rows[:5])) == 5  # strictly more up to KNOWN_AGREEMENT
    assert rows[-1] == rows[-2]  # above it the protection is full
    assert protection_for(None) == 1.0 and protection_for(0.35) == pytest.approx(0.35 / KNOWN_AGREEMENT)


def test_uncategorized_traffic_counts_as_absent() -> None:
    # Neither window names a category: whether the old traffic still arrives cannot be told.
    assert absent_by_category({"": 50}, {"": 80}) == {"": 1.0}
    plan = plan_replay(recent_rows=100, recent_categories={"": 80}, available={"": 50}, old_agreement=None)
    assert plan.rows == 50  # wanted 100 (share 0.5), capped by the 50 available
    assert "50 available" in plan.reason


def test_replay_goes_to_the_categories_the_recent_window_lacks() -> None:
    # Old: 60% prose, 40% code. Recent: code only. Prose is absent, code still arrives.
    missing = absent_by_category({"prose": 60, "code": 40}, {"code": 90, "structured": 10})
    assert missing == pytest.approx({"prose": 0.6})
    plan = plan_replay(
        recent_rows=100,
        recent_categories={"code": 90, "structured": 10},
        available={"prose": 60, "code": 40},
        old_agreement=0.7,
    )
    assert set(plan.per_category) == {"prose"}
    assert plan.share == pytest.approx(0.3) and plan.rows == round(100 * 0.3 / 0.7)


def test_allocation_is_proportional_within_what_each_category_has() -> None:
    assert allocate(10, {"a": 0.5, "b": 0.5}, {"a": 100, "b": 100}) == {"a": 5, "b": 5}
    # b has only 2: the rest goes to a.
    assert allocate(10, {"a": 0.5, "b": 0.5}, {"a": 100, "b": 2}) == {"a": 8, "b": 2}
    # Fractions: the largest remainders get the odd rows, and the total is kept.
    got = allocate(5, {"a": 0.45, "b": 0.35, "c": 0.2}, {"a": 9, "b": 9, "c": 9})
    assert sum(got.values()) == 5 and got["a"] >= got["b"] >= got["c"]
    assert allocate(50, {"a": 1.0}, {"a": 3}) == {"a": 3}
    assert allocate(3, {"a": 1.0}, {}) == {}


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        plan_replay(
            recent_rows=10, recent_categories={}, available={"a": 1}, old_agreement=0.5, max_share=1.0
        )
    with pytest.raises(ValueError):
        plan_replay(recent_rows=-1, recent_categories={}, available={"a": 1}, old_agreement=0.5)
    empty = plan_replay(recent_rows=10, recent_categories={"a": 3}, available={}, old_agreement=0.5)
    assert empty.rows == 0 and empty.reason == "no old traffic to replay"
