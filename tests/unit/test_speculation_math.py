"""The figures users see, each from its one definition: the conventions (None for nothing counted,
fractions, decode time) and the Leviathan speed-up against its worked example."""

from __future__ import annotations

import pytest

from controlplane.speculation_math import (
    ASSUMED_DRAFTER_COST_RATIO,
    alpha_from_hit_rate,
    expected_speedup,
    hit_rate,
    leviathan_speedup,
    mean_accepted_length,
    mean_of,
    ms_per_token,
    speedup,
    speedup_from_hit_rate,
    tokens_per_step,
)


def test_nothing_counted_is_none_never_nan() -> None:
    assert hit_rate(0, 0) is None and hit_rate(3, 4) == 0.75
    assert mean_accepted_length(6, 0) is None and mean_accepted_length(6, 4) == 2.5
    assert mean_of(0.0, 0) is None and mean_of(9.0, 3) == 3.0
    assert tokens_per_step(7, 0) == 1.0 and tokens_per_step(9, 3) == 3.0


def test_ms_per_token_is_decode_time_unless_wall_time_is_asked() -> None:
    assert ms_per_token(12.5, 400.0, 100.0, 11) == 12.5  # the engine's inter-token figure first
    assert ms_per_token(None, 400.0, 100.0, 11) == 30.0  # (400 - 100) / (11 - 1): TTFT left out
    assert ms_per_token(None, 400.0, 100.0, 1) is None
    assert ms_per_token(None, 400.0, 100.0, 10, include_ttft=True) == 40.0
    assert ms_per_token(None, 400.0, None, 0, include_ttft=True) is None


def test_speedup_of_times_and_of_rates() -> None:
    assert speedup(30.0, 20.0) == 1.5  # ms per token: the baseline's over the candidate's
    assert speedup(20.0, 30.0, higher_is_faster=True) == 1.5  # tokens per second
    assert speedup(None, 20.0) is None and speedup(30.0, 0.0) is None
    assert expected_speedup(3.0, 1.5) == 2.0
    with pytest.raises(ValueError):
        expected_speedup(3.0, 0.0)


def test_leviathan_worked_example_and_verify_cost() -> None:
    # k = 4, c = 0.1: alpha 0.29 -> 1.00x, alpha 0.76 -> 2.2x.
    assert leviathan_speedup(0.29, 4, 0.1) == pytest.approx(1.00, abs=0.01)
    assert leviathan_speedup(0.76, 4, 0.1) == pytest.approx(2.22, abs=0.01)
    assert leviathan_speedup(1.0, 4, 0.0) == 5.0
    # A verify pass of k + 1 tokens that costs 1.5 one-token steps divides the speed-up by 1.5 / 1.
    assert leviathan_speedup(0.76, 4, 0.0, verify_cost=1.5) == pytest.approx(
        leviathan_speedup(0.76, 4, 0.0) / 1.5
    )


def test_speedup_from_hit_rate_inverts_the_hit_rate() -> None:
    alpha, k, cost = 0.8, 4, 0.05
    rate = alpha * (1 - alpha**k) / (k * (1 - alpha))
    assert alpha_from_hit_rate(rate, k) == pytest.approx(alpha, rel=1e-6)
    expected = (1 - alpha ** (k + 1)) / (1 - alpha) / (1 + k * cost)
    assert speedup_from_hit_rate(rate, k, cost) == pytest.approx(expected, rel=1e-6)
    assert speedup_from_hit_rate(None, k, cost) is None
    assert speedup_from_hit_rate(0.5, None, cost) is None
    assert 0 < ASSUMED_DRAFTER_COST_RATIO < 1
