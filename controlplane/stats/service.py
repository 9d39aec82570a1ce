"""Time series of hit rate, accepted length, per-position acceptance, latency and throughput.

Every figure is derived from summed raw counts in the rollups, never from averaged ratios, so
buckets of any size (a multiple of one minute) combine exactly. Each bucket is read as the
fewest rollup rows that tile it exactly (see controlplane.ingest.rollups for the tiers): for a
start on a tier's grid and a bucket that is a multiple of that tier, that is one row per bucket
(per arm and drafter version). A bucket that is one row takes its latency percentiles from the
row; only buckets made of several rows decode and merge histograms.

Rollup rows are also keyed by the records' category (see controlplane.ingest.rollups), so a
series can be narrowed to one category, and the figures of every category over the range, with
the speed-up of speculation against the no-speculation arm of the same category, come from one
more grouped read of the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Select, and_, func, or_, select
from sqlalchemy.orm import Session

from controlplane.db.models import AcceptanceRollupRow
from controlplane.errors import ValidationProblem
from controlplane.ingest.formats import MAX_CATEGORY_CHARS
from controlplane.ingest.record import ARM_BASELINE
from controlplane.ingest.rollups import (
    HISTOGRAMS,
    MINUTE,
    PERCENTILE_COLUMNS,
    RESOLUTIONS,
    hist_merge,
    merge_positions,
    row_percentiles,
)
from controlplane.ingest.service import fold_before_reading, quarantined_counts
from controlplane.speculation_math import hit_rate, mean_accepted_length, ms_per_token, speedup
from controlplane.timestamps import as_utc

MAX_BUCKETS = 10_000

_COARSEST_FIRST = tuple(sorted(RESOLUTIONS, reverse=True))
_SCALARS = (
    "requests",
    "drafted_tokens",
    "accepted_tokens",
    "verify_steps",
    "generated_tokens",
    "total_ms_sum",
    "timed_requests",
)
# Positions of the selected columns in a result row (see _select).
_POSITIONS = 1 + len(_SCALARS)
_PERCENTILES = slice(_POSITIONS + 1, _POSITIONS + 1 + len(PERCENTILE_COLUMNS))
_HISTS = slice(_PERCENTILES.stop, _PERCENTILES.stop + len(HISTOGRAMS))

# A run of rollup rows of one resolution: (resolution, first bucket start, end), epoch seconds.
Block = tuple[int, int, int]


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
    # p50/p95 of inter-token, total and TTFT latency, in PERCENTILE_COLUMNS order.
    percentiles: Sequence[float | None] = (None,) * len(PERCENTILE_COLUMNS)


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
    it50, it95, total50, total95, ttft50, ttft95 = sums.percentiles
    return {
        "requests": sums.requests,
        "drafted_tokens": sums.drafted_tokens,
        "accepted_tokens": sums.accepted_tokens,
        "verify_steps": sums.verify_steps,
        "generated_tokens": sums.generated_tokens,
        "hit_rate": hit_rate(sums.accepted_tokens, sums.drafted_tokens),
        "mean_accepted_length": mean_accepted_length(sums.accepted_tokens, sums.verify_steps),
        "per_position_acceptance": [_ratio(c, sums.verify_steps) for c in positions],
        "per_position_conditional_acceptance": conditional,
        "inter_token_latency_ms_p50": it50,
        "inter_token_latency_ms_p95": it95,
        "total_latency_ms_p50": total50,
        "total_latency_ms_p95": total95,
        "ttft_ms_p50": ttft50,
        "ttft_ms_p95": ttft95,
        "throughput_tokens_per_s": sums.generated_tokens / bucket_seconds,
        "decode_tokens_per_s": _ratio(sums.generated_tokens * 1000.0, sums.total_ms_sum),
    }


def _minute_ceil(value: datetime) -> int:
    """Epoch seconds of the first minute starting at or after ``value``."""
    seconds = math.ceil(value.timestamp())
    return -(-seconds // MINUTE) * MINUTE


def cover(lo: int, hi: int) -> list[Block]:
    """[lo, hi) (minute-aligned epoch seconds) as the fewest whole rollup rows, in time order.

    The coarsest tier takes the whole buckets it has inside the range; what is left at either
    edge goes to the next finer tier, down to minutes.
    """
    out: list[Block] = []
    _cover_into(lo, hi, 0, out)
    return out


def _cover_into(lo: int, hi: int, level: int, out: list[Block]) -> None:
    while level < len(_COARSEST_FIRST) and lo < hi:
        resolution = _COARSEST_FIRST[level]
        first = -(-lo // resolution) * resolution
        last = hi // resolution * resolution
        level += 1
        if first < last:
            _cover_into(lo, first, level, out)
            out.append((resolution, first, last))
            lo = last


# Past this many runs of rows the per-bucket tiling falls back to the grid tier's rows: the
# statement would grow with the bucket count (and SQLite caps expression depth at 1000).
MAX_RUNS = 64


def plan_buckets(lo: int, hi: int, bucket_seconds: int) -> tuple[list[Block], bool]:
    """The rollup rows tiling each bucket of [lo, hi), merged into runs per resolution.

    Also says whether some bucket is made of several rows (then percentiles need histograms).
    """
    # The grid tier: the coarsest whose rows never straddle a bucket edge.
    grid = max(r for r in RESOLUTIONS if bucket_seconds % r == 0 and lo % r == 0)
    end = max(lo, hi // grid * grid)
    tail = cover(end, hi)  # inside the last bucket, which is partial
    grid_plan = ([(grid, lo, end)] if end > lo else []) + tail
    grid_several = bucket_seconds > grid or _rows(tail) > 1
    if bucket_seconds < min((r for r in RESOLUTIONS if r > grid), default=bucket_seconds + 1):
        # No bucket can hold a whole row of a coarser tier: the grid plan is the fewest rows.
        return grid_plan, grid_several
    # A bucket (e.g. one day from 06:00) may hold whole rows of a coarser tier: tile each bucket.
    runs: dict[int, list[list[int]]] = {}
    count = 0
    several = False
    for a in range(lo, hi, bucket_seconds):
        pieces = cover(a, min(a + bucket_seconds, hi))
        several = several or _rows(pieces) > 1
        for resolution, first, last in pieces:
            spans = runs.setdefault(resolution, [])
            if spans and spans[-1][1] == first:
                spans[-1][1] = last
            else:
                spans.append([first, last])
                count += 1
        if count > MAX_RUNS:
            return grid_plan, grid_several
    return [(r, first, last) for r, spans in runs.items() for first, last in spans], several


def _rows(blocks: Sequence[Block]) -> int:
    return sum((last - first) // resolution for resolution, first, last in blocks)


def _at(seconds: int) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def _select(
    blocks: Sequence[Block],
    *,
    deployment_id: int,
    arm: str | None,
    drafter_version: int | None,
    category: str | None,
    hists: bool,
) -> Select[Any]:
    """One statement reading every rollup row of ``blocks``."""
    r = AcceptanceRollupRow
    columns = [
        r.bucket_start,
        *(getattr(r, name) for name in _SCALARS),
        r.accepted_per_position,
        *(getattr(r, name) for name in PERCENTILE_COLUMNS),
    ]
    if hists:
        columns += [getattr(r, name) for name in HISTOGRAMS]
    columns.append(r.id)  # last: lets a bucket's histograms be fetched later, by row
    runs = [
        and_(r.resolution_s == resolution, r.bucket_start >= _at(first), r.bucket_start < _at(last))
        for resolution, first, last in blocks
    ]
    query = select(*columns).where(r.deployment_id == deployment_id, or_(*runs))
    if arm is not None:
        query = query.where(r.arm == arm)
    if drafter_version is not None:
        query = query.where(r.drafter_version == drafter_version)
    if category is not None:
        query = query.where(r.category == category)
    return query


def _fetch(session: Session, blocks: Sequence[Block], hists: bool, **filters: Any) -> list[Any]:
    if not blocks:
        return []
    return list(session.execute(_select(blocks, hists=hists, **filters)))


# Rows per statement when histograms are fetched by row id (well under SQLite's bound parameters).
_IDS_PER_STATEMENT = 500


def _histograms_of(session: Session, ids: Sequence[int]) -> dict[int, tuple[Any, ...]]:
    """The latency histograms of the given rollup rows, by row id."""
    r = AcceptanceRollupRow
    out: dict[int, tuple[Any, ...]] = {}
    for i in range(0, len(ids), _IDS_PER_STATEMENT):
        chunk = ids[i : i + _IDS_PER_STATEMENT]
        query = select(r.id, *(getattr(r, name) for name in HISTOGRAMS)).where(r.id.in_(chunk))
        for row in session.execute(query):
            out[row[0]] = tuple(row[1:])
    return out


def _group(rows: Sequence[Any], lo: int, bucket_seconds: int) -> dict[int, list[Any]]:
    """Rows by bucket index (datetime arithmetic: several times cheaper than .timestamp())."""
    groups: dict[int, list[Any]] = {}
    if not rows:
        return groups
    origin = _at(lo)
    if rows[0][0].tzinfo is None:  # SQLite hands back naive datetimes; the rollups store UTC
        origin = origin.replace(tzinfo=None)
    step = timedelta(seconds=bucket_seconds)
    for row in rows:
        index = (row[0] - origin) // step
        group = groups.get(index)
        if group is None:
            groups[index] = [row]
        else:
            group.append(row)
    return groups


def _sum_counts(rows: Sequence[Any]) -> BucketSums:
    """The summed counts of rows, without percentiles."""
    first = rows[0]
    sums = BucketSums(
        requests=first[1],
        drafted_tokens=first[2],
        accepted_tokens=first[3],
        verify_steps=first[4],
        generated_tokens=first[5],
        total_ms_sum=first[6],
        timed_requests=first[7],
        accepted_per_position=list(first[_POSITIONS] or []),
    )
    for row in rows[1:]:
        sums.requests += row[1]
        sums.drafted_tokens += row[2]
        sums.accepted_tokens += row[3]
        sums.verify_steps += row[4]
        sums.generated_tokens += row[5]
        sums.total_ms_sum += row[6]
        sums.timed_requests += row[7]
        merge_positions(sums.accepted_per_position, row[_POSITIONS] or [])
    return sums


def _sum_rows(rows: Sequence[Any], histograms: dict[int, tuple[Any, ...]] | None = None) -> BucketSums:
    """The sums of rows with their percentiles: exactly one row takes its own; several merge their
    histograms, read from the rows themselves or, when given, from ``histograms`` by row id."""
    sums = _sum_counts(rows)
    if len(rows) == 1:
        sums.percentiles = rows[0][_PERCENTILES]
        return sums
    per_row = (
        [histograms[row[-1]] for row in rows] if histograms is not None else [row[_HISTS] for row in rows]
    )
    sums.percentiles = row_percentiles([hist_merge([h[i] for h in per_row]) for i in range(len(HISTOGRAMS))])
    return sums


def _percentiles(session: Session, blocks: Sequence[Block], **filters: Any) -> Sequence[float | None]:
    """Latency percentiles over every row of ``blocks``: read from the row when there is one."""
    if not blocks:
        return BucketSums().percentiles
    several = len(blocks) > 1 or _rows(blocks) > 1
    rows = _fetch(session, blocks, several, **filters)
    if not rows:
        return BucketSums().percentiles
    if len(rows) > 1 and not several:  # several arms or drafter versions in the one row's span
        return _sum_rows(rows, _histograms_of(session, [row[-1] for row in rows])).percentiles
    return _sum_rows(rows).percentiles


def acceptance_series(
    *,
    session: Session,
    deployment_id: int,
    start: datetime,
    end: datetime,
    bucket_seconds: int,
    arm: str | None = None,
    drafter_version: int | None = None,
    category: str | None = None,
    percentiles: bool = True,
    fold_pending: bool = True,
    per_category: bool = False,
) -> dict[str, Any]:
    """Buckets of ``bucket_seconds`` between start (inclusive) and end (exclusive), plus a total.

    A record belongs to the range when its minute starts in [start, end); buckets start at
    ``start``, and the last one may be partial. ``category`` keeps the records of that category
    only (exact match; None or "" keeps all). ``percentiles=False`` leaves the latency
    percentiles out (None) and reads no histogram: for callers that want only the counts.
    ``fold_pending=False`` skips folding the deployment's deferred rollup sums first, for a
    caller that has just folded them (controlplane.ingest.service.fold_before_reading).
    ``per_category`` adds each category's figures over the whole range (see category_figures).
    """
    if bucket_seconds < 60 or bucket_seconds % 60:
        raise ValidationProblem("bucket_seconds must be a positive multiple of 60 (rollups are per minute)")
    start, end = as_utc(start), as_utc(end)
    if end <= start:
        raise ValidationProblem("end must be after start")
    if (end - start).total_seconds() / bucket_seconds > MAX_BUCKETS:
        raise ValidationProblem(f"at most {MAX_BUCKETS} buckets per query; widen bucket_seconds")
    if category is not None and len(category) > MAX_CATEGORY_CHARS:
        raise ValidationProblem(f"category must be at most {MAX_CATEGORY_CHARS} characters")
    category = category or None
    # Sums small ingest flushes deferred are added first: the series counts every acknowledged
    # record.
    if fold_pending:
        fold_before_reading(session=session, deployment_ids=[deployment_id])
    filters = {
        "deployment_id": deployment_id,
        "arm": arm,
        "drafter_version": drafter_version,
        "category": category,
    }
    # The minutes counted are those starting in [start, end), i.e. in [lo, hi). Bucket edges at
    # start + j * bucket_seconds group minutes exactly as edges at lo + j * bucket_seconds do
    # (lo - start < 60 and every edge distance is a multiple of 60), so the grid starts at lo.
    lo, hi = _minute_ceil(start), _minute_ceil(end)
    buckets: dict[int, BucketSums] = {}
    total = BucketSums()
    if lo < hi:
        blocks, several = plan_buckets(lo, hi, bucket_seconds)
        rows = _fetch(session, blocks, several and percentiles, **filters)
        groups = _group(rows, lo, bucket_seconds)
        histograms: dict[int, tuple[Any, ...]] | None = None
        if percentiles and not several:
            # Several arms or drafter versions may share a bucket: only those buckets' rows need
            # their histograms, fetched by row id.
            shared = [row[-1] for group in groups.values() if len(group) > 1 for row in group]
            histograms = _histograms_of(session, shared) if shared else None
        for index, group in groups.items():
            sums = _sum_rows(group, histograms) if percentiles else _sum_counts(group)
            buckets[index] = sums
            total.requests += sums.requests
            total.drafted_tokens += sums.drafted_tokens
            total.accepted_tokens += sums.accepted_tokens
            total.verify_steps += sums.verify_steps
            total.generated_tokens += sums.generated_tokens
            total.total_ms_sum += sums.total_ms_sum
            total.timed_requests += sums.timed_requests
            merge_positions(total.accepted_per_position, sums.accepted_per_position)
        if not percentiles:
            pass  # the total's percentiles stay None, like every bucket's
        elif len(buckets) == 1:
            # One bucket holds every row of the range: its percentiles are the total's.
            total.percentiles = next(iter(buckets.values())).percentiles
        elif several and rows:
            # The rows tile the range and came with their histograms: merge them all.
            merged = [hist_merge([row[_HISTS][i] for row in rows]) for i in range(len(HISTOGRAMS))]
            total.percentiles = row_percentiles(merged)
        elif buckets:
            total.percentiles = _percentiles(session, cover(lo, hi), **filters)
    origin = start.timestamp()
    series = [
        {
            "start": datetime.fromtimestamp(origin + index * bucket_seconds, tz=UTC).isoformat(),
            **summarise(buckets[index], bucket_seconds=bucket_seconds),
        }
        for index in sorted(buckets)
    ]
    span = int((end - start).total_seconds())
    out: dict[str, Any] = {
        "start": start.isoformat(),
        "end": end.isoformat(),
        "bucket_seconds": bucket_seconds,
        "arm": arm,
        "drafter_version": drafter_version,
        "category": category,
        "buckets": series,
        "total": summarise(total, bucket_seconds=max(span, 1)),
        # Records the rollup fold set aside (values it could not sum), whatever the range: they
        # are in no bucket, and a non-zero count says the figures above miss them.
        "quarantined_records": quarantined_counts(session=session, deployment_ids=[deployment_id]).get(
            deployment_id, 0
        ),
    }
    if per_category:
        out["per_category"] = category_figures(
            session,
            cover(lo, hi) if lo < hi else [],
            deployment_id=deployment_id,
            arm=arm,
            drafter_version=drafter_version,
            category=category,
        )
    return out


_CATEGORY_SUMS = (
    "requests",
    "drafted_tokens",
    "accepted_tokens",
    "verify_steps",
    "generated_tokens",
    "total_ms_sum",
)


@dataclass(slots=True)
class _CategorySums:
    requests: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    generated_tokens: int = 0
    total_ms_sum: float = 0.0

    def add(self, row: Any) -> None:
        # PostgreSQL sums BIGINT columns as NUMERIC: convert back to the field's type.
        for name in _CATEGORY_SUMS:
            value = getattr(row, name) or 0
            added = float(value) if name == "total_ms_sum" else int(value)
            setattr(self, name, getattr(self, name) + added)

    def wall_ms_per_token(self) -> float | None:
        # The rollups keep no TTFT sum, so this is wall time per token, TTFT included.
        return ms_per_token(None, self.total_ms_sum, None, self.generated_tokens, include_ttft=True)


def category_figures(
    session: Session,
    blocks: Sequence[Block],
    *,
    deployment_id: int,
    arm: str | None,
    drafter_version: int | None,
    category: str | None,
) -> list[dict[str, Any]]:
    """Each category's figures over the rows of ``blocks``, most requests first.

    The counts and ratios are those of the records the arm and drafter-version filters keep.
    ``speedup_vs_no_speculation`` compares their speculating arms' wall milliseconds per generated
    token (TTFT included: the rollups sum no TTFT) with the no-speculation arm's (``baseline``,
    whatever the filters) in the same category and range: the standing no-speculation share makes
    it a like-for-like figure; None where either side has no timed tokens. Records without a
    category are listed under "".
    """
    if not blocks:
        return []
    r = AcceptanceRollupRow
    runs = [
        and_(r.resolution_s == resolution, r.bucket_start >= _at(first), r.bucket_start < _at(last))
        for resolution, first, last in blocks
    ]
    query = (
        select(
            r.category,
            r.arm,
            r.drafter_version,
            *(func.sum(getattr(r, name)).label(name) for name in _CATEGORY_SUMS),
        )
        .where(r.deployment_id == deployment_id, or_(*runs))
        .group_by(r.category, r.arm, r.drafter_version)
    )
    if category is not None:
        query = query.where(r.category == category)
    kept: dict[str, _CategorySums] = {}
    speculating: dict[str, _CategorySums] = {}
    baseline: dict[str, _CategorySums] = {}
    for row in session.execute(query):
        if row.arm == ARM_BASELINE:
            baseline.setdefault(row.category, _CategorySums()).add(row)
        if arm in (None, row.arm) and drafter_version in (None, row.drafter_version):
            kept.setdefault(row.category, _CategorySums()).add(row)
            if row.arm != ARM_BASELINE:
                speculating.setdefault(row.category, _CategorySums()).add(row)
    figures: list[dict[str, Any]] = []
    for name, sums in kept.items():
        spec = speculating.get(name)
        plain = baseline.get(name)
        spec_ms = spec.wall_ms_per_token() if spec else None
        plain_ms = plain.wall_ms_per_token() if plain else None
        figures.append(
            {
                "category": name,
                "requests": sums.requests,
                "drafted_tokens": sums.drafted_tokens,
                "accepted_tokens": sums.accepted_tokens,
                "generated_tokens": sums.generated_tokens,
                "hit_rate": hit_rate(sums.accepted_tokens, sums.drafted_tokens),
                "mean_accepted_length": mean_accepted_length(sums.accepted_tokens, sums.verify_steps),
                "decode_tokens_per_s": _ratio(sums.generated_tokens * 1000.0, sums.total_ms_sum),
                "no_speculation_requests": plain.requests if plain else 0,
                "speedup_vs_no_speculation": speedup(plain_ms, spec_ms),
            }
        )
    figures.sort(key=lambda f: (-f["requests"], f["category"]))
    return figures
