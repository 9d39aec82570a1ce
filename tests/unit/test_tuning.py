"""Draft-length tuning: Leviathan's closed form, brute-force enumeration of acceptance patterns,
verify cost, conservative extrapolation, and the choice of k."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from controlplane.tuning import (
    conditional_acceptance,
    leviathan_speedup,
    plan_draft_length,
    plan_from_conditional_rates,
)


def test_leviathan_worked_example() -> None:
    # REFERENCES.md: k = 4, c = 0.1: alpha 0.29 -> 1.00x, alpha 0.76 -> 2.2x.
    assert leviathan_speedup(0.29, 4, 0.1) == pytest.approx(1.00, abs=0.01)
    assert leviathan_speedup(0.76, 4, 0.1) == pytest.approx(2.22, abs=0.01)


def test_iid_rates_reproduce_the_closed_form() -> None:
    plan = plan_from_conditional_rates([0.7] * 6, 0.05, max_k=6)
    for row in plan.rows:
        assert row.expected_tokens_per_step == pytest.approx((1 - 0.7 ** (row.k + 1)) / 0.3)
        assert row.expected_speedup == pytest.approx(leviathan_speedup(0.7, row.k, 0.05))


def brute_force_tokens(rates: list[float], k: int) -> float:
    """Expected tokens per verify step by enumerating every accept/reject pattern of k drafts."""
    expected = 0.0
    for pattern in itertools.product((True, False), repeat=k):
        probability, accepted, alive = 1.0, 0, True
        for position, ok in enumerate(pattern):
            if not alive:
                # After the first rejection later drafts are discarded: split the path evenly over
                # both outcomes so the probabilities still sum to one.
                probability *= 0.5 if ok else 0.5
                continue
            probability *= rates[position] if ok else 1 - rates[position]
            accepted += ok
            alive = ok
        expected += probability * (1 + accepted)
    return expected


@pytest.mark.parametrize("seed", range(5))
def test_choice_matches_brute_force_enumeration(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rates = list(rng.uniform(0.3, 0.95, size=7))
    cost_ratio = float(rng.uniform(0.02, 0.3))
    verify = {k: 1.0 + 0.03 * k for k in range(1, 8)}
    plan = plan_from_conditional_rates(rates, cost_ratio, verify_cost=verify, max_k=7)
    brute = [brute_force_tokens(rates, k) / (k * cost_ratio + (verify.get(k, 1.0))) for k in range(8)]
    for row in plan.rows:
        assert row.expected_speedup == pytest.approx(brute[row.k], rel=1e-12)
    assert plan.best_k == int(np.argmax(brute))


def test_counts_to_conditional_rates() -> None:
    # 1,000 drafts; at least 1 accepted in 800, at least 2 in 600, 3 in 300, 4 in 30.
    assert conditional_acceptance([800, 600, 300, 30], 1_000) == pytest.approx([0.8, 0.75, 0.5, 0.1])
    with pytest.raises(ValueError):
        conditional_acceptance([800, 900], 1_000)  # counters must be non-increasing
    with pytest.raises(ValueError):
        conditional_acceptance([1_200], 1_000)


def test_falling_acceptance_chooses_a_short_draft() -> None:
    # Deep positions are nearly always rejected: drafting them costs more than they bring.
    plan = plan_draft_length([800, 600, 300, 30], 1_000, 0.1)
    assert plan.best_k == 3
    assert plan.row(4).expected_speedup < plan.row(3).expected_speedup


def test_dead_drafter_chooses_no_speculation() -> None:
    plan = plan_draft_length([20, 1, 0, 0], 1_000, 0.1)
    assert plan.best_k == 0 and plan.best_speedup == 1.0


def test_measured_verify_cost_shortens_k() -> None:
    counts = [700, 490, 343, 240]
    free = plan_draft_length(counts, 1_000, 0.02, max_k=4)
    costly = plan_draft_length(counts, 1_000, 0.02, verify_cost={1: 1.3, 2: 1.6}, max_k=4)
    assert free.best_k == 4
    assert costly.best_k < free.best_k
    # Beyond the last measured k the cost keeps the last slope (0.3 per token).
    assert costly.row(4).cost_per_step == pytest.approx(4 * 0.02 + 2.2)


def test_extrapolation_is_conservative_and_marked() -> None:
    # Observed k = 4 with high, flat acceptance on few drafts.
    plan = plan_draft_length([45, 40, 36, 32], 50, 0.05, max_k=10)
    observed = conditional_acceptance([45, 40, 36, 32], 50)
    assert plan.extrapolated_acceptance is not None
    assert plan.extrapolated_acceptance < min(observed)  # below every observed rate
    assert [r.extrapolated for r in plan.rows] == [False] * 5 + [True] * 6
    # With plenty of drafts the lower bound tightens towards the smallest observed rate.
    many = plan_draft_length([45_000, 40_000, 36_000, 32_000], 50_000, 0.05, max_k=10)
    assert many.extrapolated_acceptance is not None
    assert min(observed) - 0.01 < many.extrapolated_acceptance < min(observed)
    assert many.best_k >= plan.best_k


def test_plan_is_json() -> None:
    plan = plan_draft_length([700, 500, 350, 240], 1_000, 0.1)
    data = json.loads(json.dumps(plan.as_dict(), allow_nan=False))
    assert data["best_k"] == plan.best_k and len(data["rows"]) == 9
    assert all(math.isfinite(r["expected_speedup"]) for r in data["rows"])
    with pytest.raises(ValueError):
        plan_from_conditional_rates([1.2], 0.1)
