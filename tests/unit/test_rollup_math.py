"""Rollup aggregation and log-histogram percentiles, against brute-force answers."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from controlplane.ingest.record import AcceptanceRecord
from controlplane.ingest.rollups import aggregate, hist_index, hist_percentile, hist_value
from controlplane.stats.service import BucketSums, summarise


def test_histogram_percentiles_are_within_the_bucket_resolution() -> None:
    rng = random.Random(7)
    values = [rng.lognormvariate(2.0, 0.8) for _ in range(20_000)]
    hist: dict[str, int] = {}
    for value in values:
        key = str(hist_index(value))
        hist[key] = hist.get(key, 0) + 1
    ordered = sorted(values)
    for q in (0.5, 0.95, 0.99):
        exact = ordered[int(q * len(ordered)) - 1]
        approx = hist_percentile(hist, q)
        assert approx is not None
        assert abs(approx - exact) / exact < 0.03, (q, approx, exact)
    assert hist_percentile({}, 0.5) is None
    assert hist_value(hist_index(12.3)) == hist_value(hist_index(12.3 * 1.0001))


def _record(i: int, when: datetime, arm: str = "live") -> AcceptanceRecord:
    return AcceptanceRecord(
        request_id=f"r{i}",
        drafted_tokens=8,
        accepted_tokens=5,
        verify_steps=3,
        generated_tokens=8,
        accepted_per_position=[3, 2],
        k=2,
        total_ms=100.0 + i,
        inter_token_ms=10.0,
        arm=arm,
        created_at=when,
    )


def test_aggregate_groups_by_minute_arm_and_version() -> None:
    t0 = datetime(2026, 1, 1, 12, 0, 30, tzinfo=UTC)
    records = [_record(i, t0 + timedelta(seconds=20 * i)) for i in range(6)]
    records.append(_record(99, t0, arm="baseline"))
    deltas = aggregate(records, when_default=t0)
    minutes = sorted({key[0] for key in deltas if key[1] == "live"})
    # :30 :50 | 1:10 1:30 1:50 | 2:10
    assert minutes == [t0.replace(minute=m, second=0) for m in (0, 1, 2)]
    assert deltas[(t0.replace(minute=1, second=0), "live", 0)].requests == 3
    live_first = deltas[(t0.replace(second=0), "live", 0)]
    assert live_first.requests == 2  # :30 and :50
    assert live_first.accepted_per_position == [6, 4]
    assert sum(d.requests for d in deltas.values()) == 7
    assert deltas[(t0.replace(second=0), "baseline", 0)].requests == 1


def test_summary_ratios_come_from_counts() -> None:
    sums = BucketSums(
        requests=2,
        drafted_tokens=16,
        accepted_tokens=10,
        verify_steps=6,
        generated_tokens=16,
        total_ms_sum=2000.0,
        timed_requests=2,
        accepted_per_position=[6, 4],
    )
    summary = summarise(sums, bucket_seconds=60)
    assert summary["hit_rate"] == 10 / 16
    assert summary["mean_accepted_length"] == 1 + 10 / 6
    assert summary["per_position_acceptance"] == [1.0, 4 / 6]
    assert summary["per_position_conditional_acceptance"] == [1.0, 4 / 6]
    assert summary["decode_tokens_per_s"] == 8.0
    empty = summarise(BucketSums(), bucket_seconds=60)
    assert empty["hit_rate"] is None and empty["mean_accepted_length"] is None
