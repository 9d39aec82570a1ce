"""Multi-resolution rollups on real databases: every tier sums its minutes exactly, and the stats
series read from whichever tiers a query picks matches a brute-force recount of the records."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.db.models import (
    AcceptanceRollup,
    AcceptanceRollupRow,
)
from controlplane.ingest.record import AcceptanceRecord
from controlplane.ingest.rollups import (
    HISTOGRAMS,
    PERCENTILE_COLUMNS,
    QUANTILES,
    RESOLUTIONS,
    TIER_RESOLUTIONS,
    hist_from_counts,
    hist_index,
    hist_merge,
    hist_quantiles,
    row_percentiles,
)
from controlplane.ingest.service import store_records
from controlplane.stats.service import acceptance_series
from tests.conftest import Database, add_deployment

DAY = datetime(2026, 11, 1, tzinfo=UTC)
# Records from 30 minutes before the day to 2 h after it, so ranges cross the day boundary.
SPAN_START = DAY - timedelta(minutes=30)
SPAN_SECONDS = 26 * 3600 + 1800
ARMS = ("live", "baseline")
VERSIONS = (None, 2)


def _records(count: int, seed: int) -> list[AcceptanceRecord]:
    rng = random.Random(seed)
    records = []
    for i in range(count):
        k = 4
        steps = rng.randint(1, 12)
        per_step = [min(k, int(rng.expovariate(0.6))) for _ in range(steps)]
        # Bursts at a few instants put many records in the same minutes, the rest spread out.
        offset = rng.choice((rng.uniform(0, SPAN_SECONDS), 3600 * rng.randint(0, 26) + rng.uniform(-90, 90)))
        offset = min(max(offset, 0.0), SPAN_SECONDS - 1.0)
        records.append(
            AcceptanceRecord(
                request_id=f"t{seed}-{i}",
                drafted_tokens=steps * k,
                accepted_tokens=sum(per_step),
                verify_steps=steps,
                generated_tokens=sum(per_step) + steps,
                accepted_per_position=[sum(1 for a in per_step if a > p) for p in range(k)],
                k=k,
                prompt_tokens=rng.randint(1, 300),
                ttft_ms=rng.lognormvariate(3, 0.6),
                inter_token_ms=rng.uniform(2, 20) if rng.random() > 0.05 else None,
                total_ms=rng.lognormvariate(5.5, 0.7) if rng.random() > 0.05 else None,
                arm=rng.choice(ARMS),
                drafter_version=rng.choice(VERSIONS),
                created_at=SPAN_START + timedelta(seconds=offset),
            )
        )
    return records


@pytest.fixture
def stored(db: Database) -> Iterator[tuple[Session, int, list[AcceptanceRecord]]]:
    session = db.new_session()
    deployment_id = add_deployment(session, "tiers", name="tiers").id
    records = _records(3000, seed=1)
    # Several batches, so rows are updated (merged) as well as created.
    for offset in range(0, len(records), 700):
        store_records(session=session, deployment_id=deployment_id, records=records[offset : offset + 700])
    session.commit()
    yield session, deployment_id, records
    session.close()


def _key(row: Any) -> tuple[datetime, str, int]:
    start = row.bucket_start if row.bucket_start.tzinfo else row.bucket_start.replace(tzinfo=UTC)
    return start.astimezone(UTC), row.arm, row.drafter_version


def test_every_tier_row_is_the_exact_sum_of_its_minutes(
    stored: tuple[Session, int, list[AcceptanceRecord]],
) -> None:
    session, deployment_id, records = stored
    minutes = session.scalars(
        select(AcceptanceRollup).where(AcceptanceRollup.deployment_id == deployment_id)
    ).all()
    every = session.scalars(
        select(AcceptanceRollupRow).where(AcceptanceRollupRow.deployment_id == deployment_id)
    ).all()
    tiers = [row for row in every if row.resolution_s != 60]
    # The minute mapping sees only minute rows, so summing it counts every record once.
    assert sorted(m.id for m in minutes) == sorted(row.id for row in every if row.resolution_s == 60)
    assert sum(m.requests for m in minutes) == len(records)
    by_cell: dict[tuple[str, int], list[AcceptanceRollup]] = {}
    for minute in minutes:
        by_cell.setdefault(_key(minute)[1:], []).append(minute)
    by_tier: dict[int, list[AcceptanceRollupRow]] = {}
    for row in tiers:
        by_tier.setdefault(row.resolution_s, []).append(row)
    assert sorted(by_tier) == sorted(TIER_RESOLUTIONS)
    for resolution, rows in by_tier.items():
        assert sum(r.requests for r in rows) == len(records)
        for row in rows:
            start, arm, version = _key(row)
            assert start.timestamp() % resolution == 0
            inside = [
                m
                for m in by_cell[(arm, version)]
                if start <= _key(m)[0] < start + timedelta(seconds=resolution)
            ]
            for column in ("requests", "drafted_tokens", "accepted_tokens", "verify_steps", "prompt_tokens"):
                assert getattr(row, column) == sum(getattr(m, column) for m in inside), (resolution, column)
            assert row.total_ms_sum == pytest.approx(sum(m.total_ms_sum for m in inside))
            for name in HISTOGRAMS:
                assert getattr(row, name) == hist_merge(getattr(m, name) for m in inside)
            stored_percentiles = [getattr(row, name) for name in PERCENTILE_COLUMNS]
            assert stored_percentiles == row_percentiles([getattr(row, name) for name in HISTOGRAMS])


def _brute_force(
    records: Sequence[AcceptanceRecord],
    start: datetime,
    end: datetime,
    bucket_seconds: int,
    arm: str | None,
    version: int | None,
) -> dict[int, list[AcceptanceRecord]]:
    """Records by bucket index, a record counted when its minute starts in [start, end)."""
    buckets: dict[int, list[AcceptanceRecord]] = {}
    for rec in records:
        assert rec.created_at is not None
        minute = rec.created_at.replace(second=0, microsecond=0)
        if not start <= minute < end:
            continue
        if arm is not None and rec.arm != arm:
            continue
        if version is not None and (rec.drafter_version or 0) != version:
            continue
        index = int((minute - start).total_seconds() // bucket_seconds)
        buckets.setdefault(index, []).append(rec)
    return buckets


def _exact_quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _check(figures: dict[str, Any], chunk: Sequence[AcceptanceRecord], seconds: int) -> None:
    drafted = sum(r.drafted_tokens for r in chunk)
    accepted = sum(r.accepted_tokens for r in chunk)
    steps = sum(r.verify_steps for r in chunk)
    generated = sum(r.generated_tokens for r in chunk)
    assert figures["requests"] == len(chunk)
    assert (figures["drafted_tokens"], figures["accepted_tokens"]) == (drafted, accepted)
    assert figures["hit_rate"] == pytest.approx(accepted / drafted)
    assert figures["mean_accepted_length"] == pytest.approx(1 + accepted / steps)
    positions = [sum(r.accepted_per_position[p] for r in chunk) for p in range(4)]
    assert figures["per_position_acceptance"] == pytest.approx([p / steps for p in positions])
    assert figures["throughput_tokens_per_s"] == pytest.approx(generated / seconds)
    timed = sum(r.total_ms for r in chunk if r.total_ms is not None)
    assert figures["decode_tokens_per_s"] == (pytest.approx(generated * 1000 / timed) if timed else None)
    for field, prefix in (("inter_token_ms", "inter_token_latency_ms"), ("total_ms", "total_latency_ms")):
        values = [getattr(r, field) for r in chunk if getattr(r, field) is not None]
        counts: dict[int, int] = {}
        for value in values:
            counts[hist_index(value)] = counts.get(hist_index(value), 0) + 1
        # Exactly the histogram of these very records, and so within its resolution of the truth.
        expected = hist_quantiles(hist_from_counts(counts), QUANTILES)
        assert [figures[f"{prefix}_p50"], figures[f"{prefix}_p95"]] == expected
        for q, got in zip(QUANTILES, expected, strict=True):
            if got is None:
                assert not values
                continue
            assert abs(got - _exact_quantile(values, q)) / _exact_quantile(values, q) < 0.026


CASES = [
    # (start, end, bucket seconds): aligned to a day, an hour, 5 minutes, a minute, or not at all;
    # ends that cut the last bucket short.
    (DAY, DAY + timedelta(days=1), 300),
    (DAY, DAY + timedelta(days=1), 3600),
    (DAY, DAY + timedelta(days=1), 600),
    (DAY, DAY + timedelta(days=1), 60),
    (DAY, DAY + timedelta(hours=26), 86400),
    (DAY - timedelta(minutes=25), DAY + timedelta(hours=2, minutes=7), 300),
    (DAY + timedelta(hours=3), DAY + timedelta(hours=9, minutes=3), 3600),
    (DAY + timedelta(minutes=7), DAY + timedelta(hours=25), 3600),
    (DAY + timedelta(minutes=7, seconds=30), DAY + timedelta(hours=5, seconds=10), 600),
    (DAY + timedelta(hours=6), DAY + timedelta(hours=26), 7200),
    (DAY - timedelta(minutes=30), DAY + timedelta(hours=26), 86400),
]


def test_series_match_a_brute_force_recount(stored: tuple[Session, int, list[AcceptanceRecord]]) -> None:
    # One test over every case: the 3000-record fixture costs more than the queries.
    session, deployment_id, records = stored
    for start, end, bucket_seconds in CASES:
        for arm, version in ((None, None), ("live", None), ("baseline", 2)):
            case = (
                f"{start.isoformat()} .. {end.isoformat()} / {bucket_seconds}s, arm {arm}, version {version}"
            )
            query = {
                "session": session,
                "deployment_id": deployment_id,
                "start": start,
                "end": end,
                "bucket_seconds": bucket_seconds,
                "arm": arm,
                "drafter_version": version,
            }
            result = acceptance_series(**query)
            expected = _brute_force(records, start, end, bucket_seconds, arm, version)
            assert [b["start"] for b in result["buckets"]] == [
                (start + timedelta(seconds=i * bucket_seconds)).isoformat() for i in sorted(expected)
            ], case
            for index, bucket in zip(sorted(expected), result["buckets"], strict=True):
                _check(bucket, expected[index], bucket_seconds)
            everything = [rec for chunk in expected.values() for rec in chunk]
            _check(result["total"], everything, int((end - start).total_seconds()))
            # Counts only: the same figures, and no percentile read or guessed.
            counts_only = acceptance_series(**query, percentiles=False)
            for full, lean in zip(
                [*result["buckets"], result["total"]],
                [*counts_only["buckets"], counts_only["total"]],
                strict=True,
            ):
                assert all(v is None for k, v in lean.items() if k.endswith(("_p50", "_p95"))), case
                assert {k: v for k, v in lean.items() if not k.endswith(("_p50", "_p95"))} == {
                    k: v for k, v in full.items() if not k.endswith(("_p50", "_p95"))
                }, case


def test_finer_and_coarser_bucket_sizes_agree(stored: tuple[Session, int, list[AcceptanceRecord]]) -> None:
    """Summing 5-minute buckets gives the 1-hour buckets, which give 6 hours, then the day: tiers agree."""
    session, deployment_id, _ = stored
    series = {
        seconds: acceptance_series(
            session=session,
            deployment_id=deployment_id,
            start=DAY,
            end=DAY + timedelta(days=1),
            bucket_seconds=seconds,
        )
        for seconds in RESOLUTIONS
    }
    for fine, coarse in zip(RESOLUTIONS, RESOLUTIONS[1:], strict=False):
        rolled: dict[str, list[int]] = {}
        for bucket in series[fine]["buckets"]:
            at = datetime.fromisoformat(bucket["start"])
            key = (at - timedelta(seconds=(at - DAY).total_seconds() % coarse)).isoformat()
            sums = rolled.setdefault(key, [0, 0, 0])
            sums[0] += bucket["requests"]
            sums[1] += bucket["accepted_tokens"]
            sums[2] += bucket["verify_steps"]
        assert rolled == {
            b["start"]: [b["requests"], b["accepted_tokens"], b["verify_steps"]]
            for b in series[coarse]["buckets"]
        }
    # The whole-range figures do not depend on the bucket size (up to float summation order).
    totals = [s["total"] for s in series.values()]
    for total in totals[1:]:
        for name, value in totals[0].items():
            if isinstance(value, float):
                assert total[name] == pytest.approx(value, rel=1e-12), name
            else:
                assert total[name] == value, name
