"""Edge aggregates into the acceptance rollups, so that aggregated traffic shows in the stats API
and the dashboards as per-request records do.

One fold (:func:`fold_aggregate_rollups`, run by beat every few seconds) claims the edge windows
not rolled up yet, reads all their aggregate rows in one query, sums them per deployment into
:class:`controlplane.ingest.rollups.RollupDelta` values and adds those for all the deployments at
once (:func:`controlplane.ingest.rollups.apply_deltas_by_deployment`, which also fills the coarser
tiers and keeps the category cap, in a few statements whatever the number of deployments).

Each window is marked (``edge_windows.rolled_up_at``) in the same transaction that adds its sums,
so a window counts exactly once: a fold that fails adds nothing and marks nothing, and a window
committed late (its id taken before a newer one's) is simply still unmarked. The claim locks the
windows it takes and skips those another fold holds, so folds may run side by side.

What a window carries and what a rollup row needs differ in three places:

* **The minute.** A window of more than a minute is summed into the minute it starts in. Its
  own tier and every coarser one are exact (windows start on multiples of their length, and each
  length divides a day); minute rows of a longer window hold it all in the first minute.
* **Latency histograms.** Rollups count latencies in log buckets 5% wide; a window carries a
  DDSketch per latency figure (1% relative accuracy). Each sketch bin's representative value goes
  into the rollup bucket that holds it, with the bin's count. A request whose latency lies within
  1% of a bucket edge may land in the neighbouring bucket, so percentiles read from these rows
  are within about 3.5% (against 2.5% for records).
* **Total latency.** The rollups keep the sum of total latencies (decode throughput's
  denominator); a sketch does not. It is estimated as the sum of each bin's count times its
  representative value, within 1% of the true sum. Its request count (``timed_requests``) is exact.

Request and token counts and per-position acceptance are sums, and exact. A record the edge sent
as a sample of aggregated traffic is not rolled up again (the ingest path skips it).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ddsketch.mapping import LogarithmicMapping
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from controlplane.db.models import AcceptanceAggregateRow, EdgeWindowRow
from controlplane.ingest.aggregates import SKETCH_RELATIVE_ACCURACY
from controlplane.ingest.rollups import (
    NO_CATEGORY,
    RollupDelta,
    RollupKey,
    apply_deltas_by_deployment,
    hist_index,
)
from controlplane.timestamps import as_utc, utcnow

# Aggregates claimed per transaction (whole windows, at least one): a fleet far behind catches up
# over several transactions, each short enough not to hold rollup rows locked against ingest for
# long (about ten seconds at the cost measured on PostgreSQL), and at most this many windows.
FOLD_AGGREGATE_LIMIT = 10_000
FOLD_WINDOW_LIMIT = 2_000
_IN_CHUNK = 5_000

_SKETCH_MAPPING = LogarithmicMapping(SKETCH_RELATIVE_ACCURACY)


# Sketch bin key -> (rollup histogram bucket, representative latency in ms). Bins repeat from
# window to window (and keys are bounded by ingest validation), so each is computed once.
_SKETCH_BINS: dict[int, tuple[int, float]] = {}


def sketch_bin(key: int) -> tuple[int, float]:
    """The rollup histogram bucket a sketch bin's requests are counted in, and the bin's
    representative latency (ms)."""
    known = _SKETCH_BINS.get(key)
    if known is None:
        value = float(_SKETCH_MAPPING.value(key))
        known = _SKETCH_BINS[key] = (hist_index(value), value)
    return known


@dataclass(frozen=True, slots=True)
class SketchCounts:
    """A latency sketch as rollup histogram counts, with its request count and estimated sum."""

    histogram: dict[int, int]
    requests: int
    estimated_sum_ms: float


def sketch_counts(sketch: Mapping[str, Any] | None) -> SketchCounts:
    """A stored sketch (``{"bins": [[key, count], ...], "zeros": count}``) in rollup terms."""
    histogram: dict[int, int] = {}
    requests = 0
    estimated = 0.0
    if not sketch:
        return SketchCounts(histogram, requests, estimated)
    for key, count in sketch.get("bins", ()):
        n = round(count)
        if n <= 0:
            continue
        bucket, value = sketch_bin(key)
        histogram[bucket] = histogram.get(bucket, 0) + n
        requests += n
        estimated += n * value
    zeros = int(round(float(sketch.get("zeros", 0.0))))
    if zeros > 0:
        histogram[0] = histogram.get(0, 0) + zeros  # bucket 0 holds everything up to HIST_MIN_MS
        requests += zeros
    return SketchCounts(histogram, requests, estimated)


def rollup_delta_of(row: Any) -> RollupDelta:
    """One aggregate (any object with the stored row's counts, ``accepted_per_position`` and
    ``latency``) as the sums it adds to its rollup rows."""
    sketches = row.latency or {}
    total = sketch_counts(sketches.get("total_ms"))
    return RollupDelta(
        requests=int(row.requests),
        drafted_tokens=int(row.drafted_tokens),
        accepted_tokens=int(row.accepted_tokens),
        verify_steps=int(row.verify_steps),
        generated_tokens=int(row.generated_tokens),
        prompt_tokens=int(row.prompt_tokens),
        total_ms_sum=total.estimated_sum_ms,
        timed_requests=total.requests,
        # A window whose requests carried no per-position counts holds zeros: records add nothing.
        accepted_per_position=[int(c) for c in (row.accepted_per_position or [])]
        if int(row.speculated_requests)
        else [],
        inter_token_hist=sketch_counts(sketches.get("inter_token_ms")).histogram,
        total_ms_hist=total.histogram,
        ttft_hist=sketch_counts(sketches.get("ttft_ms")).histogram,
    )


def minute_of(window_start: datetime) -> datetime:
    """The rollup minute a window is summed into: the one it starts in (UTC)."""
    return as_utc(window_start).replace(second=0, microsecond=0)


def deltas_by_deployment(rows: Iterable[Any]) -> dict[int, dict[RollupKey, RollupDelta]]:
    """Aggregate rows summed per deployment and rollup key (minute, arm, drafter version, category)."""
    out: dict[int, dict[RollupKey, RollupDelta]] = {}
    for row in rows:
        key = (
            minute_of(row.window_start),
            row.arm,
            int(row.drafter_version or 0),
            row.category or NO_CATEGORY,
        )
        per_deployment = out.setdefault(int(row.deployment_id), {})
        delta = rollup_delta_of(row)
        into = per_deployment.get(key)
        if into is None:
            per_deployment[key] = delta
        else:
            into.add(delta)
    return out


@dataclass
class AggregateRollupFold:
    """What one fold added."""

    windows: int = 0
    aggregates: int = 0
    deployments: int = 0
    requests: int = 0
    seconds: float = 0.0

    def add(self, other: AggregateRollupFold) -> None:
        """Count another fold's work in this one (a task's several transactions)."""
        self.windows += other.windows
        self.aggregates += other.aggregates
        self.deployments += other.deployments
        self.requests += other.requests
        self.seconds += other.seconds

    def as_dict(self) -> dict[str, Any]:
        return {
            "windows": self.windows,
            "aggregates": self.aggregates,
            "deployments": self.deployments,
            "requests": self.requests,
            "seconds": round(self.seconds, 4),
        }


def _claim_windows(session: Session, *, window_limit: int, aggregate_limit: int) -> list[Any]:
    """Mark the oldest windows not rolled up yet, as many as fit in ``aggregate_limit`` aggregates
    (at least one, at most ``window_limit``), and return them, in one statement. Windows another
    fold holds are skipped (PostgreSQL; SQLite has one writer)."""
    w = EdgeWindowRow
    pending = (
        select(w.id, w.aggregates)
        .where(w.rolled_up_at.is_(None))
        .order_by(w.id)
        .limit(window_limit)
        .with_for_update(skip_locked=True)
        .subquery()
    )
    before = func.sum(pending.c.aggregates).over(order_by=pending.c.id) - pending.c.aggregates
    ranked = select(pending.c.id, before.label("before")).subquery()
    claim = (
        update(w)
        .where(w.id.in_(select(ranked.c.id).where(ranked.c.before < aggregate_limit).scalar_subquery()))
        .values(rolled_up_at=utcnow())
        .returning(w.id, w.window_start)
        .execution_options(synchronize_session=False)
    )
    return list(session.execute(claim).all())


def _aggregate_rows(session: Session, windows: Sequence[Any]) -> list[Any]:
    """Every aggregate row of ``windows``, in one query per chunk of window ids."""
    agg = AcceptanceAggregateRow
    columns = (
        agg.deployment_id,
        agg.window_start,
        agg.arm,
        agg.drafter_version,
        agg.category,
        agg.requests,
        agg.speculated_requests,
        agg.drafted_tokens,
        agg.accepted_tokens,
        agg.verify_steps,
        agg.generated_tokens,
        agg.prompt_tokens,
        # Only the one vector of ``sums`` a rollup keeps: the detector's moments stay unread.
        agg.sums["accepted_per_position"].label("accepted_per_position"),
        agg.latency,
    )
    rows: list[Any] = []
    for start in range(0, len(windows), _IN_CHUNK):
        chunk = windows[start : start + _IN_CHUNK]
        starts = [as_utc(window.window_start) for window in chunk]
        rows.extend(
            session.execute(
                select(*columns).where(
                    agg.edge_window_id.in_([int(window.id) for window in chunk]),
                    # The table is partitioned by window start: this bound spares the other days.
                    agg.window_start.between(min(starts), max(starts)),
                )
            ).all()
        )
    return rows


def fold_aggregate_rollups(
    *,
    session: Session,
    aggregate_limit: int = FOLD_AGGREGATE_LIMIT,
    window_limit: int = FOLD_WINDOW_LIMIT,
) -> AggregateRollupFold:
    """Roll the oldest pending edge windows (about ``aggregate_limit`` aggregates, whole windows)
    into the rollups, in the caller's transaction (see the module docstring); commit it to make
    the fold count."""
    started = time.perf_counter()
    fold = AggregateRollupFold()
    windows = _claim_windows(session, window_limit=window_limit, aggregate_limit=aggregate_limit)
    if windows:
        rows = _aggregate_rows(session, windows)
        per_deployment = deltas_by_deployment(rows)
        apply_deltas_by_deployment(session=session, deltas=per_deployment)
        fold.windows, fold.aggregates, fold.deployments = len(windows), len(rows), len(per_deployment)
        fold.requests = sum(int(row.requests) for row in rows)
    fold.seconds = time.perf_counter() - started
    return fold
