"""Window aggregates against the same requests one by one: the judge's tally merges a window's sums
to what adding its requests gives (integers exactly, floats to rounding), and a window's rollup
sums match the records' (counts exactly, latency histograms and totals within the sketch's
accuracy)."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime
from typing import Any

import pytest

from controlplane.canary.statistics import LATENCY_MS_PER_TOKEN, TOKENS_PER_STEP, MetricAccumulator
from controlplane.canary.tally import ArmTally, JudgeTally
from controlplane.ingest.aggregate_rollups import (
    deltas_by_deployment,
    rollup_delta_of,
    sketch_counts,
    sketches_counts,
)
from controlplane.ingest.aggregate_store import aggregate_from_row, aggregate_sums
from controlplane.ingest.aggregates import WindowAccumulator, WindowAggregate
from controlplane.ingest.record import AcceptanceRecord
from controlplane.ingest.rollups import HISTOGRAMS, aggregate, hist_from_counts, hist_quantiles

K = 4
MINUTE = datetime(2026, 11, 30, 12, 7, tzinfo=UTC)


def served(rng: random.Random, arm: str, category: str | None) -> AcceptanceRecord:
    steps = rng.randint(5, 30)
    per_step = [min(K, int(rng.expovariate(0.6))) for _ in range(steps)]
    baseline = arm == "baseline"
    accepted = 0 if baseline else sum(per_step)
    shape = rng.random()
    # Latency as engines report it: mostly inter-token, some only total and TTFT, some none, and
    # one total equal to its TTFT (a zero latency per token, timed but outside the statistics).
    inter = rng.lognormvariate(2.0, 0.4) if shape < 0.7 else None
    ttft = rng.lognormvariate(3.0, 0.5)
    total = None if 0.9 <= shape < 0.95 else ttft + rng.lognormvariate(5.0, 0.6)
    if shape >= 0.95:
        inter, total = None, ttft
    return AcceptanceRecord(
        request_id=f"r{rng.random()}",
        drafted_tokens=0 if baseline else steps * K,
        accepted_tokens=accepted,
        verify_steps=steps,
        generated_tokens=(steps if baseline else accepted + steps),
        accepted_per_position=[] if baseline else [sum(1 for a in per_step if a > j) for j in range(K)],
        k=0 if baseline else K,
        prompt_tokens=rng.randint(10, 400),
        ttft_ms=ttft,
        inter_token_ms=inter,
        total_ms=total,
        arm=arm,
        drafter_version=2 if arm.startswith("canary:") else None,
        category=category,
        created_at=MINUTE,
    )


def traffic(seed: int, n: int = 600) -> list[AcceptanceRecord]:
    rng = random.Random(seed)
    arms = ("live", "canary:2", "baseline")
    categories = ("prose", "code", None)
    return [served(rng, rng.choice(arms), rng.choice(categories)) for _ in range(n)]


def windowed(records: list[AcceptanceRecord]) -> list[WindowAggregate]:
    acc = WindowAccumulator(k=K)
    for record in records:
        acc.add("svc", record)
    return acc.aggregates()


def test_welford_state_from_sums_merges_as_the_observations_would() -> None:
    rng = random.Random(1)
    values = [rng.lognormvariate(1.0, 0.3) for _ in range(5_000)]
    one_by_one, merged = MetricAccumulator(), MetricAccumulator()
    for value in values[:1000]:
        one_by_one.add(value)
        merged.add(value)
    for value in values[1000:]:
        one_by_one.add(value)
    rest = values[1000:]
    merged.merge(MetricAccumulator.from_sums(len(rest), sum(rest), sum(v * v for v in rest)))
    assert merged.n == one_by_one.n
    assert merged.mean == pytest.approx(one_by_one.mean, rel=1e-12)
    assert merged.variance == pytest.approx(one_by_one.variance, rel=1e-9)
    assert MetricAccumulator.from_sums(0, 0.0, 0.0) == MetricAccumulator()
    # One observation: no spread, whatever the rounding of its square.
    assert MetricAccumulator.from_sums(1, 0.1, 0.1 * 0.1).m2 == 0.0
    with pytest.raises(ValueError):
        MetricAccumulator.from_sums(2, 1.0, math.inf)


def test_a_window_folds_into_the_judge_tally_as_its_requests_do() -> None:
    records = traffic(2)
    arms = {"live": "incumbent", "canary:2": "candidate", "baseline": "baseline"}
    by_record = JudgeTally.empty(arms.values())
    for record in records:
        by_record.fold(arms[record.arm], record)
    by_window = JudgeTally.empty(arms.values())
    for agg in windowed(records):
        # As the judge reads it: stored and read back.
        row = type("Row", (), {**agg.to_dict(), "sums": aggregate_sums(agg)})()
        by_window.fold_aggregate(arms[agg.arm], aggregate_from_row(row))
    assert by_window.records == by_record.records == len(records)
    assert by_window.aggregated_requests == len(records) and by_record.aggregated_requests == 0
    assert set(by_window.categories) == set(by_record.categories) == {"prose", "code", ""}
    pairs = [(by_record.arms, by_window.arms)]
    pairs += [(by_record.categories[c], by_window.categories[c]) for c in by_record.categories]
    for expected_arms, got_arms in pairs:
        for name, expected in expected_arms.items():
            got = got_arms[name]
            assert_tallies_match(expected, got)


def assert_tallies_match(expected: ArmTally, got: ArmTally) -> None:
    exact = (
        *("timed", "drafted", "accepted", "verify_steps", "accepted_per_position", "spread_requests"),
        *("spread_drafted", "spread_accepted", "drafted_squared", "accepted_drafted", "accepted_squared"),
    )
    for name in exact:
        assert getattr(got, name) == getattr(expected, name), name
    assert got.hit_rate_spread() == expected.hit_rate_spread()
    assert got.ms_per_token_sum == pytest.approx(expected.ms_per_token_sum, rel=1e-12)
    # Zero-latency requests are counted at the window's mean tokens per step.
    # Deterministic: traffic() is seeded; the tolerances here are the sketches' resolution.
    assert got.tokens_per_step_sum == pytest.approx(expected.tokens_per_step_sum, rel=0.02)
    for metric in (TOKENS_PER_STEP, LATENCY_MS_PER_TOKEN):
        want, have = expected.stats.metrics[metric], got.stats.metrics[metric]
        assert have.n == want.n > 0
        assert have.mean == pytest.approx(want.mean, rel=1e-12)
        assert have.variance == pytest.approx(want.variance, rel=1e-9)


def test_a_window_rolls_up_as_its_requests_do() -> None:
    records = traffic(3, n=3_000)
    expected = aggregate(records, when_default=MINUTE)
    rows = []
    for agg in windowed(records):
        fields = agg.to_dict()
        fields["drafter_version"] = agg.drafter_version or 0
        rows.append(type("Row", (), {**fields, "deployment_id": 7, "window_start": MINUTE})())
    got = deltas_by_deployment(rows)[7]
    assert set(got) == set(expected)
    for key, want in expected.items():
        have = got[key]
        for name in ("requests", "drafted_tokens", "accepted_tokens", "verify_steps", "generated_tokens"):
            assert getattr(have, name) == getattr(want, name), (key, name)
        assert have.prompt_tokens == want.prompt_tokens
        assert have.accepted_per_position == want.accepted_per_position
        assert have.timed_requests == want.timed_requests
        assert have.total_ms_sum == pytest.approx(want.total_ms_sum, rel=0.01)
        for name in HISTOGRAMS:
            want_hist, have_hist = getattr(want, name), getattr(have, name)
            assert sum(have_hist.values()) == sum(want_hist.values()), name
            quantiles = (0.1, 0.5, 0.9)
            for a, b in zip(
                hist_quantiles(hist_from_counts(have_hist), quantiles),
                hist_quantiles(hist_from_counts(want_hist), quantiles),
                strict=True,
            ):
                assert a is not None and b is not None and a == pytest.approx(b, rel=0.06)


def test_a_sketch_becomes_rollup_counts_with_an_estimated_sum() -> None:
    values = [0.0, 0.0, 3.0, 3.01, 250.0]
    acc = WindowAccumulator(k=K)
    for value in values:
        acc.add(
            "svc",
            AcceptanceRecord(
                request_id="-", drafted_tokens=0, accepted_tokens=0, verify_steps=1, generated_tokens=1,
                total_ms=value,
            ),
        )  # fmt: skip
    counts = sketch_counts(acc.aggregates()[0].latency["total_ms"])
    assert counts.requests == 5 and counts.histogram[0] == 2
    assert counts.estimated_sum_ms == pytest.approx(sum(values), rel=0.01)
    assert sketch_counts(None).requests == 0
    assert (
        rollup_delta_of(type("Row", (), {**WindowAggregate("svc").to_dict(), "latency": {}})()).timed_requests
        == 0
    )


def test_sketches_convert_at_once_as_one_by_one() -> None:
    """sketches_counts (NumPy, all of a fold's sketches together) gives exactly sketch_counts'
    values: the same buckets and counts, the same estimated sums to the last bit."""
    rng = random.Random(23)

    def sketch() -> dict[str, Any] | None:
        shape = rng.random()
        if shape < 0.05:
            return None
        if shape < 0.1:
            return {"bins": [], "zeros": rng.choice([0.0, 2.0, 0.5, 1.5])}
        low = rng.randint(-300, 600)
        keys = sorted(rng.sample(range(low, low + 400), rng.randint(1, 150)))
        if rng.random() < 0.2:  # not written by sketch_to_dict: keys in any order
            rng.shuffle(keys)
        counts = (0.0, 0.5, 1.5, 2.5, 3, float(rng.randint(1, 10**6)), rng.random() * 10)
        return {"bins": [[key, rng.choice(counts)] for key in keys], "zeros": rng.choice([0.0, 1.0, 2.5])}

    sketches = [sketch() for _ in range(2_000)]
    one_by_one = [sketch_counts(s) for s in sketches]
    at_once = sketches_counts(sketches)
    assert at_once == one_by_one
    assert [c.estimated_sum_ms.hex() for c in at_once] == [c.estimated_sum_ms.hex() for c in one_by_one]
    without_sums = sketches_counts(sketches, sums=False)
    assert [(c.histogram, c.requests) for c in without_sums] == [
        (c.histogram, c.requests) for c in one_by_one
    ]
    assert {c.estimated_sum_ms for c in without_sums} == {0.0}
    # Each gets a histogram of its own (deltas made of them are summed in place).
    empty = sketches_counts([None, {}])
    assert empty[0].histogram is not empty[1].histogram
    # What NumPy cannot hold exactly is left to sketch_counts.
    for odd in ({"bins": [[1, 1e300]]}, {"bins": [[1.5, 2]]}):
        assert sketches_counts([odd]) == [sketch_counts(odd)]
    for broken in ({"bins": [[1, 2, 3]]}, {"bins": [[3, 2.0], [4, float("nan")]]}):
        with pytest.raises(ValueError):  # as sketch_counts fails on it
            sketches_counts([broken])
