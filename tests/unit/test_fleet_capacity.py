"""bench/fleet.py's pure parts: the load search that finds the capacity, window lags with
unconsumed windows as infinite, and traffic drawn request by request with overdispersed
acceptance (not from the detector's own model)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_fleet_under_test", ROOT / "bench" / "fleet.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


fleet = _load()


def run_search(search: object, capacity_interval: float) -> list[float]:
    """Drive the search against a pipeline that keeps up exactly at intervals >= capacity_interval."""
    tried = []
    while (interval := search.next_interval()) is not None:  # type: ignore[attr-defined]
        tried.append(interval)
        search.record(interval, interval >= capacity_interval)  # type: ignore[attr-defined]
    return tried


def test_the_search_halves_until_a_step_fails_then_bisects_the_bracket() -> None:
    search = fleet.LoadSearch(start=16.0, refine=2)
    tried = run_search(search, capacity_interval=3.0)
    assert tried[:4] == [16.0, 8.0, 4.0, 2.0]  # coarse: double the load until 2 s fails
    assert tried[4] == pytest.approx(math.sqrt(8.0))  # then between 4 (pass) and 2 (fail): fails
    assert tried[5] == pytest.approx(math.sqrt(4.0 * math.sqrt(8.0)))  # between 4 and 2.83: passes
    assert len(tried) == 6 and not search.capacity_is_lower_bound()
    assert search.capacity_interval() == pytest.approx(tried[5])
    best, failing = search.bracket()
    assert failing < 3.0 <= best < 4.0


def test_the_search_backs_off_when_the_first_load_fails_and_says_when_nothing_passed() -> None:
    search = fleet.LoadSearch(start=4.0, refine=1)
    tried = run_search(search, capacity_interval=20.0)
    assert tried[:4] == [4.0, 8.0, 16.0, 32.0]
    assert search.capacity_interval() == pytest.approx(math.sqrt(32.0 * 16.0))
    hopeless = fleet.LoadSearch(start=4.0, refine=1, max_interval=16.0)
    assert run_search(hopeless, capacity_interval=1e9) == [4.0, 8.0, 16.0]
    assert hopeless.capacity_interval() is None and not hopeless.capacity_is_lower_bound()


def test_a_search_that_never_fails_reports_a_lower_bound() -> None:
    search = fleet.LoadSearch(start=2.0, refine=3, min_interval=0.5)
    assert run_search(search, capacity_interval=0.0) == [2.0, 1.0, 0.5]
    assert search.capacity_interval() == 0.5 and search.capacity_is_lower_bound()


def test_a_window_some_shard_never_consumed_is_infinitely_late() -> None:
    due = {1: 100.0, 2: 100.0, 3: 160.0}
    needed = {1: frozenset({0, 1}), 2: frozenset({0, 1}), 3: frozenset({0})}
    consumed = {1: {0: 102.0, 1: 104.5}, 2: {0: 101.0}, 3: {0: 200.0}}
    lags = fleet.window_lags(due, consumed, needed, until=190.0)
    assert lags[1] == pytest.approx(4.5)  # the slower shard decides
    assert math.isinf(lags[2])  # shard 1 never consumed it
    assert math.isinf(lags[3])  # consumed, but after the observation ended
    assert math.isinf(fleet.percentile(list(lags.values()), 0.99))
    assert fleet.percentile([1.0, 2.0, math.inf], 0.5) == 2.0


def test_request_level_acceptance_is_overdispersed() -> None:
    rng = np.random.default_rng(5)
    x = fleet.request_counts(np.full(40_000, 0.7), rng)
    steps, first = x[:, 0], x[:, 1]
    share = first / steps
    binomial_only = np.mean(0.7 * 0.3 / steps)
    # Beta(14, 6) rates add p(1 - p) / (kappa + 1) = 0.01 to the binomial part (about 0.0105 at
    # 1 + Poisson(20) steps): the ratio is near 1.95. The sample variance of 40,000 requests has a
    # relative standard error under 1.5 %, so the bounds sit over 15 standard errors away: a false
    # failure has probability below 1e-40.
    assert 1.6 < share.var() / binomial_only < 2.4
    # Each position is tried only where the previous one was accepted.
    assert np.all(x[:, 1:] <= x[:, :-1])


def test_window_sums_add_up_and_carry_the_injected_changes() -> None:
    model = fleet.FleetModel.draw(200, seed=3)
    d = int(model.drifted[0])
    before = fleet.draw_window_sums(model, 0, 100, rows=[d])
    after = fleet.draw_window_sums(model, 9, 100, rows=[d])  # changes happen by minute 6
    for sums in (before, after):
        assert sums.requests.sum() == 100 * 60
        sx, sxx = sums.sx[0], sums.sxx[0]
        assert np.array_equal(sx[:, fleet.K + 1 :], sx[:, : fleet.K - 1])  # t_{i+1} = s_i
        assert np.array_equal(sxx, np.transpose(sxx, (0, 2, 1)))
        # Squares are summed request by request: x * x >= x for every non-negative integer count.
        assert np.all(np.diagonal(sxx, axis1=1, axis2=2) >= sx)
    rate = lambda sums: sums.sx[0, 0, 0] / sums.sx[0, 0, fleet.K]  # noqa: E731  prose position 0
    # A 10-25 % drop of a ~0.75 rate over ~100,000 verify steps, against a standard error of the
    # ratio near 0.01 (request-level overdispersion included): over 6 standard errors even at the
    # smallest drop, false-failure probability below 1e-9.
    assert rate(after) < rate(before) * 0.95
    # The code share of a mix-shifted deployment moves from 0.2 to 0.6: 6,000 requests put the
    # share within 0.03 of its mean at over 5 standard errors (false failure below 1e-6).
    mixed = int(model.mixed[0])
    late = fleet.draw_window_sums(model, 9, 100, rows=[mixed])
    early = fleet.draw_window_sums(model, 0, 100, rows=[mixed])
    assert abs(early.requests[0, 1] / 6000 - 0.2) < 0.03 and abs(late.requests[0, 1] / 6000 - 0.6) < 0.03


def test_a_minute_is_the_same_whichever_process_draws_it() -> None:
    model = fleet.FleetModel.draw(100, seed=1)
    one, two = fleet.draw_window_sums(model, 4, 20), fleet.draw_window_sums(model, 4, 20)
    assert np.array_equal(one.sxx, two.sxx)
    assert not np.array_equal(one.sx, fleet.draw_window_sums(model, 5, 20).sx)


def test_slow_steps_send_fewer_minutes_but_never_fewer_than_two() -> None:
    assert fleet.step_minutes(15.0, 3) == 3
    assert fleet.step_minutes(fleet.STEP_BUDGET_S / 2, 3) == 2
    assert fleet.step_minutes(fleet.STEP_BUDGET_S * 4, 3) == 2
