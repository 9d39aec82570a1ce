"""Per-minute rollups of acceptance records: pure aggregation plus the database upsert.

Latency percentiles come from sparse log-spaced histograms (bucket edges grow by 5%), so a
percentile read from a rollup is within about 2.5% of the exact value whatever the range.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import and_, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from controlplane.db.models import AcceptanceRollup
from controlplane.ingest.record import AcceptanceRecord

HIST_RATIO = 1.05
HIST_MIN_MS = 0.01
_LOG_RATIO = math.log(HIST_RATIO)


def hist_index(value_ms: float) -> int:
    """The log bucket holding ``value_ms`` (bucket 0 holds everything up to HIST_MIN_MS)."""
    if value_ms <= HIST_MIN_MS:
        return 0
    return 1 + int(math.log(value_ms / HIST_MIN_MS) / _LOG_RATIO)


def hist_value(index: int) -> float:
    """A representative value (geometric middle) of a bucket."""
    if index <= 0:
        return HIST_MIN_MS
    return float(HIST_MIN_MS * HIST_RATIO ** (index - 0.5))


def hist_percentile(hist: Mapping[str, int] | Mapping[int, int], q: float) -> float | None:
    """The q-quantile (0..1) of a sparse histogram, or None when it is empty."""
    items = sorted((int(k), int(v)) for k, v in hist.items())
    total = sum(v for _, v in items)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for index, count in items:
        seen += count
        if seen >= rank:
            return hist_value(index)
    return hist_value(items[-1][0])


def merge_hist(into: dict[str, int], other: Mapping[str, int]) -> None:
    for key, count in other.items():
        into[key] = into.get(key, 0) + int(count)


def merge_positions(into: list[int], other: Sequence[int]) -> None:
    if len(other) > len(into):
        into.extend([0] * (len(other) - len(into)))
    for i, count in enumerate(other):
        into[i] += int(count)


RollupKey = tuple[datetime, str, int]


@dataclass(slots=True)
class RollupDelta:
    """Sums to add to one rollup row."""

    requests: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    total_ms_sum: float = 0.0
    timed_requests: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    inter_token_hist: dict[str, int] = field(default_factory=dict)
    total_ms_hist: dict[str, int] = field(default_factory=dict)
    ttft_hist: dict[str, int] = field(default_factory=dict)


def _bump(hist: dict[str, int], value: float | None) -> None:
    if value is not None:
        key = str(hist_index(value))
        hist[key] = hist.get(key, 0) + 1


def aggregate(records: Iterable[AcceptanceRecord], *, when_default: datetime) -> dict[RollupKey, RollupDelta]:
    """Group records by (minute, arm, drafter version) and sum them."""
    deltas: dict[RollupKey, RollupDelta] = {}
    minute_cache: dict[datetime, datetime] = {}
    for rec in records:
        when = rec.created_at or when_default
        minute = minute_cache.get(when)
        if minute is None:
            minute = when.replace(second=0, microsecond=0)
            minute_cache[when] = minute
        key = (minute, rec.arm, rec.drafter_version or 0)
        delta = deltas.get(key)
        if delta is None:
            delta = deltas[key] = RollupDelta()
        delta.requests += 1
        delta.drafted_tokens += rec.drafted_tokens
        delta.accepted_tokens += rec.accepted_tokens
        delta.verify_steps += rec.verify_steps
        delta.generated_tokens += rec.generated_tokens
        delta.prompt_tokens += rec.prompt_tokens or 0
        if rec.total_ms is not None:
            delta.total_ms_sum += rec.total_ms
            delta.timed_requests += 1
        if rec.accepted_per_position:
            merge_positions(delta.accepted_per_position, rec.accepted_per_position)
        _bump(delta.inter_token_hist, rec.inter_token_ms)
        _bump(delta.total_ms_hist, rec.total_ms)
        _bump(delta.ttft_hist, rec.ttft_ms)
    return deltas


_SUM_COLUMNS = (
    "requests",
    "drafted_tokens",
    "accepted_tokens",
    "verify_steps",
    "generated_tokens",
    "prompt_tokens",
    "total_ms_sum",
    "timed_requests",
)


def apply_deltas(*, session: Session, deployment_id: int, deltas: Mapping[RollupKey, RollupDelta]) -> None:
    """Add deltas to the rollup rows in the caller's transaction.

    Rows are first created empty (insert-or-ignore), then locked in key order and updated, so
    concurrent batches for the same minute serialise instead of losing counts or deadlocking.
    """
    if not deltas:
        return
    keys = sorted(deltas)
    dialect = session.get_bind().dialect.name
    empty_rows = [
        {
            "deployment_id": deployment_id,
            "bucket_start": minute,
            "arm": arm,
            "drafter_version": version,
            **dict.fromkeys(_SUM_COLUMNS, 0),
            "accepted_per_position": [],
            "inter_token_hist": {},
            "total_ms_hist": {},
            "ttft_hist": {},
        }
        for minute, arm, version in keys
    ]
    stmt: Any
    if dialect == "postgresql":
        stmt = pg_insert(AcceptanceRollup).on_conflict_do_nothing(constraint="uq_acceptance_rollups_key")
    elif dialect == "sqlite":
        stmt = sqlite_insert(AcceptanceRollup).on_conflict_do_nothing()
    else:  # pragma: no cover - only the two supported dialects reach here
        stmt = insert(AcceptanceRollup)
    session.execute(stmt, empty_rows)
    conditions = [
        and_(
            AcceptanceRollup.bucket_start == minute,
            AcceptanceRollup.arm == arm,
            AcceptanceRollup.drafter_version == version,
        )
        for minute, arm, version in keys
    ]
    query = (
        select(AcceptanceRollup)
        .where(AcceptanceRollup.deployment_id == deployment_id, or_(*conditions))
        .order_by(AcceptanceRollup.bucket_start, AcceptanceRollup.arm, AcceptanceRollup.drafter_version)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    rows = {(_aware(r.bucket_start, keys[0][0]), r.arm, r.drafter_version): r for r in session.scalars(query)}
    updates: list[dict[str, Any]] = []
    for key in keys:
        row = rows[key]
        delta = deltas[key]
        positions = list(row.accepted_per_position or [])
        merge_positions(positions, delta.accepted_per_position)
        hists = {}
        for name in ("inter_token_hist", "total_ms_hist", "ttft_hist"):
            merged = dict(getattr(row, name) or {})
            merge_hist(merged, getattr(delta, name))
            hists[name] = merged
        values = {col: getattr(row, col) + getattr(delta, col) for col in _SUM_COLUMNS}
        updates.append({"id": row.id, **values, "accepted_per_position": positions, **hists})
    session.execute(update(AcceptanceRollup), updates)
    session.expire_all()


def _aware(value: datetime, like: datetime) -> datetime:
    # SQLite returns naive datetimes; compare in the same form as the keys we computed.
    if value.tzinfo is None and like.tzinfo is not None:
        return value.replace(tzinfo=like.tzinfo)
    return value
