"""Rollup aggregation and log-histogram percentiles, against brute-force answers."""

from __future__ import annotations

import math
import random
from collections import Counter
from datetime import UTC, datetime, timedelta, timezone

import pytest

from controlplane.ingest.record import AcceptanceRecord
from controlplane.ingest.rollups import (
    HIST_MIN_MS,
    HIST_RATIO,
    QUANTILES,
    RollupDelta,
    aggregate,
    floor_to,
    hist_add,
    hist_from_counts,
    hist_index,
    hist_merge,
    hist_percentile,
    hist_quantiles,
    hist_value,
    row_percentiles,
    tier_deltas,
)
from controlplane.ingest.service import unfoldable_reason
from controlplane.stats.service import BucketSums, cover, plan_buckets, summarise


def test_histogram_percentiles_are_within_the_bucket_resolution() -> None:
    rng = random.Random(7)
    values = [rng.lognormvariate(2.0, 0.8) for _ in range(20_000)]
    counts: dict[int, int] = {}
    for value in values:
        index = hist_index(value)
        counts[index] = counts.get(index, 0) + 1
    hist = hist_from_counts(counts)
    ordered = sorted(values)
    for q in (0.5, 0.95, 0.99):
        exact = ordered[int(q * len(ordered)) - 1]
        approx = hist_percentile(hist, q)
        assert approx is not None
        # Deterministic: seeded values (random.Random(7)); the margin is the histogram's bucket width.
        assert abs(approx - exact) / exact < 0.03, (q, approx, exact)
    assert hist_percentile([], 0.5) is None
    assert hist_quantiles(hist, (0.5, 0.95, 0.99)) == [hist_percentile(hist, q) for q in (0.5, 0.95, 0.99)]
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
    assert deltas[(t0.replace(minute=1, second=0), "live", 0, "")].requests == 3
    live_first = deltas[(t0.replace(second=0), "live", 0, "")]
    assert live_first.requests == 2  # :30 and :50
    assert live_first.accepted_per_position == [6, 4]
    assert sum(d.requests for d in deltas.values()) == 7
    assert deltas[(t0.replace(second=0), "baseline", 0, "")].requests == 1


def test_aggregate_equals_a_record_by_record_recount() -> None:
    """Missing optional fields, ragged per-position lists, several arms, versions and time zones,
    and latencies at and below the histogram's first edge."""
    rng = random.Random(11)
    t0 = datetime(2026, 1, 1, 12, 58, tzinfo=UTC)
    zones = [UTC, timezone(timedelta(hours=2)), timezone(timedelta(hours=-5, minutes=-30))]

    def maybe(value: float) -> float | None:
        return None if rng.random() < 0.25 else value

    records = [
        AcceptanceRecord(
            request_id=f"r{i}",
            drafted_tokens=rng.randint(0, 40),
            accepted_tokens=rng.randint(0, 30),
            verify_steps=rng.randint(1, 10),
            generated_tokens=rng.randint(1, 50),
            accepted_per_position=[rng.randint(0, 9) for _ in range(rng.choice([0, 1, 3, 5]))],
            prompt_tokens=None if rng.random() < 0.3 else rng.randint(0, 900),
            ttft_ms=maybe(rng.choice([0.0, 0.01, 0.004, rng.uniform(1, 90)])),
            inter_token_ms=maybe(rng.uniform(0.001, 40)),
            total_ms=maybe(rng.uniform(50, 900)),
            arm=rng.choice(["live", "baseline", "canary:3"]),
            drafter_version=rng.choice([None, 1, 2]),
            category=rng.choice([None, "", "prose", "code"]),
            created_at=None
            if rng.random() < 0.2
            else (t0 + timedelta(seconds=rng.randrange(300))).astimezone(rng.choice(zones)),
        )
        for i in range(3_000)
    ]
    now = t0 + timedelta(seconds=42)
    expected: dict[tuple[datetime, str, int, str], RollupDelta] = {}
    for rec in records:  # one record at a time, as plainly as possible
        when = rec.created_at or now
        sums = expected.setdefault(
            (when.replace(second=0, microsecond=0), rec.arm, rec.drafter_version or 0, rec.category or ""),
            RollupDelta(),
        )
        sums.requests += 1
        sums.drafted_tokens += rec.drafted_tokens
        sums.accepted_tokens += rec.accepted_tokens
        sums.verify_steps += rec.verify_steps
        sums.generated_tokens += rec.generated_tokens
        sums.prompt_tokens += rec.prompt_tokens or 0
        if rec.total_ms is not None:
            sums.total_ms_sum += rec.total_ms
            sums.timed_requests += 1
        for i, count in enumerate(rec.accepted_per_position):
            if i == len(sums.accepted_per_position):
                sums.accepted_per_position.append(0)
            sums.accepted_per_position[i] += count
        for hist, value in (
            (sums.inter_token_hist, rec.inter_token_ms),
            (sums.total_ms_hist, rec.total_ms),
            (sums.ttft_hist, rec.ttft_ms),
        ):
            if value is not None:
                hist[hist_index(value)] = hist.get(hist_index(value), 0) + 1
    deltas = aggregate(records, when_default=now)
    assert deltas.keys() == expected.keys()
    for key, delta in deltas.items():
        # Exact equality throughout, total_ms_sum included: the same additions in the same order.
        assert delta == expected[key], key


def test_large_groups_bucket_exactly_like_hist_index_even_on_bucket_edges() -> None:
    """A group big enough for the vectorised path, full of values on and next to bucket edges,
    at and below the first edge, and ordinary ones."""
    rng = random.Random(5)
    edges = [HIST_MIN_MS * HIST_RATIO**k for k in range(400)]
    values = [*edges, *(math.nextafter(e, 0.0) for e in edges), *(math.nextafter(e, math.inf) for e in edges)]
    values += [0.0, HIST_MIN_MS / 2, HIST_MIN_MS] + [rng.lognormvariate(2.0, 2.0) for _ in range(2_000)]
    t0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    records = [
        AcceptanceRecord(
            request_id=f"r{i}",
            drafted_tokens=4,
            accepted_tokens=2,
            verify_steps=1,
            generated_tokens=3,
            inter_token_ms=value,
            total_ms=None if i % 3 == 0 else value * 7,
            created_at=t0,
        )
        for i, value in enumerate(values)
    ]
    (delta,) = aggregate(records, when_default=t0).values()
    expected = Counter(hist_index(value) for value in values)
    assert dict(delta.inter_token_hist) == dict(expected)
    assert dict(delta.total_ms_hist) == dict(Counter(hist_index(r.total_ms) for r in records if r.total_ms))
    assert sum(delta.inter_token_hist.values()) == len(values)


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


def _sparse_percentile(counts: dict[int, int], q: float) -> float | None:
    """The reference walk over a sparse histogram: first bucket whose running count reaches q * total."""
    total = sum(counts.values())
    if not total:
        return None
    seen = 0
    for index in sorted(counts):
        seen += counts[index]
        if seen >= q * total:
            return hist_value(index)
    return hist_value(max(counts))


def test_dense_histograms_merge_and_read_like_sparse_counts() -> None:
    rng = random.Random(11)
    for _ in range(200):
        parts = [
            {
                hist_index(rng.lognormvariate(rng.uniform(0, 5), 0.5)): rng.randint(1, 9)
                for _ in range(rng.randint(0, 30))
            }
            for _ in range(rng.randint(1, 5))
        ]
        summed: dict[int, int] = {}
        for part in parts:
            for index, count in part.items():
                summed[index] = summed.get(index, 0) + count
        merged = hist_merge(hist_from_counts(part) for part in parts)
        assert merged == hist_from_counts(summed)
        qs = (0.0, 0.01, 0.5, 0.95, 1.0)
        assert hist_quantiles(merged, qs) == [_sparse_percentile(summed, q) for q in qs]
    assert hist_merge([[], []]) == []
    assert hist_quantiles([], (0.5, 0.95)) == [None, None]


def test_floor_to_uses_the_utc_epoch_grid() -> None:
    when = datetime(2026, 11, 1, 13, 47, 12, tzinfo=UTC)
    assert floor_to(when, 300) == datetime(2026, 11, 1, 13, 45, tzinfo=UTC)
    assert floor_to(when, 86400) == datetime(2026, 11, 1, tzinfo=UTC)
    assert floor_to(when.replace(tzinfo=None), 3600) == datetime(2026, 11, 1, 13)
    # An offset time zone floors to the UTC day, not the local one.
    local = when.astimezone(timezone(timedelta(hours=5, minutes=30)))
    assert floor_to(local, 86400) == datetime(2026, 11, 1, tzinfo=UTC)


def test_tier_deltas_sum_the_minutes_of_each_coarser_bucket() -> None:
    t0 = datetime(2026, 1, 1, 23, 50, tzinfo=UTC)
    records = [_record(i, t0 + timedelta(seconds=37 * i), arm="ab"[i % 2]) for i in range(60)]
    minutes = aggregate(records, when_default=t0)
    tiers = tier_deltas(minutes)
    for resolution in (300, 3600, 86400):
        keys = [key for key in tiers if key[0] == resolution]
        assert sum(tiers[key].requests for key in keys) == 60
        for _, start, arm, version, _category in keys:
            inside = [
                d
                for (minute, a, v, _c), d in minutes.items()
                if (a, v) == (arm, version) and start <= minute < start + timedelta(seconds=resolution)
            ]
            tier = tiers[(resolution, start, arm, version, "")]
            assert tier.requests == sum(d.requests for d in inside)
            assert tier.total_ms_sum == pytest.approx(sum(d.total_ms_sum for d in inside))
            assert hist_from_counts(tier.total_ms_hist) == hist_merge(
                hist_from_counts(d.total_ms_hist) for d in inside
            )
    # The day boundary splits the day tier.
    assert {key[1].day for key in tiers if key[0] == 86400} == {1, 2}


def _rows_of(blocks: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    return sorted((first, r) for r, lo, hi in blocks for first in range(lo, hi, r))


def test_cover_tiles_a_range_with_the_fewest_aligned_rows() -> None:
    day = 20_000 * 86400
    assert cover(day, day + 86400) == [(86400, day, day + 86400)]
    blocks = cover(day - 120, day + 86400 + 3900)
    assert blocks == [
        (60, day - 120, day),
        (86400, day, day + 86400),
        (3600, day + 86400, day + 86400 + 3600),
        (300, day + 86400 + 3600, day + 86400 + 3900),
    ]
    rng = random.Random(3)
    for _ in range(500):
        lo = day + 60 * rng.randint(-3000, 3000)
        hi = lo + 60 * rng.randint(1, 5000)
        rows = _rows_of(cover(lo, hi))
        assert all(first % r == 0 for first, r in rows)
        assert rows[0][0] == lo and all(a + r == b for (a, r), (b, _) in zip(rows, rows[1:], strict=False))
        assert rows[-1][0] + rows[-1][1] == hi


def test_bucket_plans_tile_every_bucket_without_straddling_an_edge() -> None:
    day = 20_000 * 86400
    assert plan_buckets(day, day + 86400, 300) == ([(300, day, day + 86400)], False)
    assert plan_buckets(day, day + 86400, 3600) == ([(3600, day, day + 86400)], False)
    assert plan_buckets(day, day + 86400, 600) == ([(300, day, day + 86400)], True)
    rng = random.Random(5)
    for _ in range(400):
        bucket = 60 * rng.choice((1, 2, 5, 7, 10, 60, 90, 120, 1440, 2880))
        lo = day + 60 * rng.choice((0, 5, 60, 61, 300, 1441, rng.randint(-2000, 2000)))
        hi = lo + 60 * rng.randint(1, 4000)
        if (hi - lo) / bucket > 500:
            continue
        blocks, several = plan_buckets(lo, hi, bucket)
        rows = _rows_of(blocks)
        assert rows[0][0] == lo and rows[-1][0] + rows[-1][1] == hi
        assert all(a + r == b for (a, r), (b, _) in zip(rows, rows[1:], strict=False))
        per_bucket: dict[int, int] = {}
        for first, r in rows:
            index = (first - lo) // bucket
            assert (first + r - 1 - lo) // bucket == index, "a row straddles a bucket edge"
            per_bucket[index] = per_bucket.get(index, 0) + 1
        assert several or max(per_bucket.values()) == 1


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({}, None),
        ({"total_ms": 1e308}, "total_ms"),  # its log bucket overflows an int
        ({"ttft_ms": math.nan}, "ttft_ms"),  # NaN would poison every sum after it
        ({"inter_token_ms": -1.0}, "inter_token_ms"),
        ({"accepted_per_position": [1] * 65}, "accepted_per_position"),
        ({"accepted_per_position": [1.5]}, "accepted_per_position"),
        ({"drafted_tokens": 2**40}, "drafted_tokens"),
    ],
)
def test_rows_the_fold_cannot_sum_are_named(change: dict[str, object], fragment: str | None) -> None:
    row = AcceptanceRecord("r", 4, 2, 2, 4, [1, 1], total_ms=10.0, ttft_ms=1.0, inter_token_ms=2.0)
    for name, value in change.items():
        setattr(row, name, value)
    reason = unfoldable_reason(row)
    assert (reason is None) if fragment is None else (reason is not None and fragment in reason)
    if fragment is None:  # and what it lets through the aggregation takes
        aggregate([row], when_default=datetime(2026, 1, 1, tzinfo=UTC))


def _reference_dense(counts: dict[int, int]) -> list[int]:
    """hist_from_counts as first written: a loop over the counts."""
    present = [index for index, count in counts.items() if count]
    if not present:
        return []
    lo, hi = min(present), max(present)
    dense = [0] * (hi - lo + 1)
    for index, count in counts.items():
        if count:
            dense[index - lo] += count
    return [lo, *dense]


def test_the_fast_histogram_paths_give_what_the_plain_ones_do() -> None:
    rng = random.Random(17)

    def dense() -> list[int]:
        shape = rng.random()
        if shape < 0.1:
            return []
        if shape < 0.15:
            return [rng.randint(0, 300)]  # a first index and no counts: empty
        return [
            rng.randint(0, 80),
            *(rng.choice([0, rng.randint(1, 10**9)]) for _ in range(rng.randint(1, 40))),
        ]

    for _ in range(20_000):
        counts = {rng.randint(0, 200): rng.choice([0, 1, 7, 10**12]) for _ in range(rng.randint(0, 30))}
        assert hist_from_counts(counts) == _reference_dense(counts)
        a, b = dense(), dense()
        copies = (list(a), list(b))
        merged = hist_add(a, b)
        assert merged == hist_merge((a, b)) and (a, b) == copies and merged is not a and merged is not b
        assert row_percentiles([a, b, merged]) == [
            *hist_quantiles(a, QUANTILES),
            *hist_quantiles(b, QUANTILES),
            *hist_quantiles(merged, QUANTILES),
        ]
    assert row_percentiles([[5, 0, 0]]) == [None, None]
