"""Time series of hit rate, accepted length, per-position acceptance, latency and throughput.

Every figure is derived from summed raw counts in the per-minute rollups, never from averaged
ratios, so buckets of any size (a multiple of one minute) combine exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.db.models import AcceptanceRollup
from controlplane.errors import ValidationProblem
from controlplane.ingest.rollups import hist_percentile, merge_hist, merge_positions

MAX_BUCKETS = 10_000


@dataclass(slots=True)
class BucketSums:
    requests: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    generated_tokens: int = 0
    total_ms_sum: float = 0.0
    timed_requests: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    inter_token_hist: dict[str, int] = field(default_factory=dict)
    total_ms_hist: dict[str, int] = field(default_factory=dict)
    ttft_hist: dict[str, int] = field(default_factory=dict)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def summarise(sums: BucketSums, *, bucket_seconds: int) -> dict[str, Any]:
    """The derived figures of one bucket.

    Per-position conditional acceptance at position i is accepted(i) / accepted(i-1), with
    accepted(-1) = verify steps: the chance position i is accepted given i-1 was, assuming
    every step drafted all k positions (true for draft models; n-gram steps may draft fewer).
    """
    positions = sums.accepted_per_position
    conditional: list[float | None] = []
    previous = sums.verify_steps
    for count in positions:
        conditional.append(_ratio(count, previous))
        previous = count
    return {
        "requests": sums.requests,
        "drafted_tokens": sums.drafted_tokens,
        "accepted_tokens": sums.accepted_tokens,
        "verify_steps": sums.verify_steps,
        "generated_tokens": sums.generated_tokens,
        "hit_rate": _ratio(sums.accepted_tokens, sums.drafted_tokens),
        "mean_accepted_length": (1 + sums.accepted_tokens / sums.verify_steps) if sums.verify_steps else None,
        "per_position_acceptance": [_ratio(c, sums.verify_steps) for c in positions],
        "per_position_conditional_acceptance": conditional,
        "inter_token_latency_ms_p50": hist_percentile(sums.inter_token_hist, 0.5),
        "inter_token_latency_ms_p95": hist_percentile(sums.inter_token_hist, 0.95),
        "total_latency_ms_p50": hist_percentile(sums.total_ms_hist, 0.5),
        "total_latency_ms_p95": hist_percentile(sums.total_ms_hist, 0.95),
        "ttft_ms_p50": hist_percentile(sums.ttft_hist, 0.5),
        "ttft_ms_p95": hist_percentile(sums.ttft_hist, 0.95),
        "throughput_tokens_per_s": sums.generated_tokens / bucket_seconds,
        "decode_tokens_per_s": _ratio(sums.generated_tokens * 1000.0, sums.total_ms_sum),
    }


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def acceptance_series(
    *,
    session: Session,
    deployment_id: int,
    start: datetime,
    end: datetime,
    bucket_seconds: int,
    arm: str | None = None,
    drafter_version: int | None = None,
) -> dict[str, Any]:
    """Buckets of ``bucket_seconds`` between start (inclusive) and end (exclusive), plus a total."""
    if bucket_seconds < 60 or bucket_seconds % 60:
        raise ValidationProblem("bucket_seconds must be a positive multiple of 60 (rollups are per minute)")
    start, end = _utc(start), _utc(end)
    if end <= start:
        raise ValidationProblem("end must be after start")
    if (end - start).total_seconds() / bucket_seconds > MAX_BUCKETS:
        raise ValidationProblem(f"at most {MAX_BUCKETS} buckets per query; widen bucket_seconds")
    r = AcceptanceRollup
    query = select(
        r.bucket_start,
        r.requests,
        r.drafted_tokens,
        r.accepted_tokens,
        r.verify_steps,
        r.generated_tokens,
        r.total_ms_sum,
        r.timed_requests,
        r.accepted_per_position,
        r.inter_token_hist,
        r.total_ms_hist,
        r.ttft_hist,
    ).where(r.deployment_id == deployment_id, r.bucket_start >= start, r.bucket_start < end)
    if arm is not None:
        query = query.where(r.arm == arm)
    if drafter_version is not None:
        query = query.where(r.drafter_version == drafter_version)
    origin = start.timestamp()
    buckets: dict[int, BucketSums] = {}
    total = BucketSums()
    for row in session.execute(query):
        index = int((_utc(row[0]).timestamp() - origin) // bucket_seconds)
        sums = buckets.get(index)
        if sums is None:
            sums = buckets[index] = BucketSums()
        for target in (sums, total):
            target.requests += row[1]
            target.drafted_tokens += row[2]
            target.accepted_tokens += row[3]
            target.verify_steps += row[4]
            target.generated_tokens += row[5]
            target.total_ms_sum += row[6]
            target.timed_requests += row[7]
            merge_positions(target.accepted_per_position, row[8] or [])
            merge_hist(target.inter_token_hist, row[9] or {})
            merge_hist(target.total_ms_hist, row[10] or {})
            merge_hist(target.ttft_hist, row[11] or {})
    series = [
        {
            "start": datetime.fromtimestamp(origin + index * bucket_seconds, tz=UTC).isoformat(),
            **summarise(buckets[index], bucket_seconds=bucket_seconds),
        }
        for index in sorted(buckets)
    ]
    span = int((end - start).total_seconds())
    return {
        "start": start.isoformat(),
        "end": end.isoformat(),
        "bucket_seconds": bucket_seconds,
        "arm": arm,
        "drafter_version": drafter_version,
        "buckets": series,
        "total": summarise(total, bucket_seconds=max(span, 1)),
    }
