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

import gc
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import reduce
from itertools import chain
from operator import add
from typing import Any, cast

import numpy as np
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
# long (a few seconds at the cost measured on PostgreSQL), and at most this many windows.
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


def sketches_counts(sketches: Sequence[Mapping[str, Any] | None], *, sums: bool = True) -> list[SketchCounts]:
    """:func:`sketch_counts` of each of ``sketches``, the same values, for all of them at once:
    their bins go through NumPy together, where a fold's millions of bins one at a time in Python
    were most of its CPU. Each estimated sum is still added bin by bin in order, as sketch_counts
    adds it, so the two agree to the last bit; ``sums=False`` leaves them 0.0 (the rollups keep
    only the total latency's). Bins NumPy could not hold exactly (counts past 2**53, keys not
    integers, a bin not a pair) send every sketch to sketch_counts itself."""
    # A histogram of its own each, even where empty: deltas made of them are summed in place.
    out: list[SketchCounts | None] = [None if sketch else SketchCounts({}, 0, 0.0) for sketch in sketches]
    owners = [i for i, sketch in enumerate(sketches) if sketch]
    bins = [sketch.get("bins", ()) for sketch in sketches if sketch]
    flat = list(chain.from_iterable(bins))
    if flat and set(map(len, flat)) != {2}:
        return [sketch_counts(sketch) for sketch in sketches]
    numbers = np.fromiter(chain.from_iterable(flat), dtype=np.float64, count=2 * len(flat))
    keys, counts = numbers[0::2], np.rint(numbers[1::2])  # rint rounds half to even, as round() does
    int_keys = keys.astype(np.int64)
    if not (np.isfinite(numbers).all() and (np.abs(counts) < 2.0**53).all() and (int_keys == keys).all()):
        return [sketch_counts(sketch) for sketch in sketches]
    sketch_of = np.repeat(np.arange(len(bins)), [len(b) for b in bins])
    kept = counts > 0
    int_keys, counts, sketch_of = int_keys[kept], counts[kept], sketch_of[kept]
    buckets = np.zeros(0, dtype=np.int64)
    values = np.zeros(0)
    if len(int_keys):
        low = int(int_keys.min())
        # Keys span a few hundred values in practice (at most 200,001: ingest bounds them).
        table = [sketch_bin(key) for key in range(low, int(int_keys.max()) + 1)]
        buckets = np.array([bucket for bucket, _ in table], dtype=np.int64)[int_keys - low]
        if sums:
            values = np.array([value for _, value in table])[int_keys - low]
    # The kept bins summed per (sketch, bucket): runs of equal cells, in order already where each
    # sketch's keys ascend (sketch_to_dict writes them so), else sorted first.
    first_bucket = int(buckets.min()) if len(buckets) else 0
    span = int(buckets.max()) - first_bucket + 1 if len(buckets) else 1
    cells = sketch_of * span + (buckets - first_bucket)
    cell_counts = counts
    if not (np.diff(cells) >= 0).all():
        order = np.argsort(cells, kind="stable")
        cells, cell_counts = cells[order], counts[order]
    starts = np.flatnonzero(np.r_[True, cells[1:] != cells[:-1]]) if len(cells) else np.zeros(0, np.int64)
    summed = np.add.reduceat(cell_counts, starts).astype(np.int64).tolist() if len(starts) else []
    run_buckets = (cells[starts] % span + first_bucket).tolist()
    run_bounds = np.searchsorted(cells[starts] // span, np.arange(len(bins) + 1)).tolist()
    bin_bounds = np.searchsorted(sketch_of, np.arange(len(bins) + 1)).tolist()
    products = (counts * values).tolist() if sums else []
    for j, i in enumerate(owners):
        lo, hi = run_bounds[j], run_bounds[j + 1]
        histogram = dict(zip(run_buckets[lo:hi], summed[lo:hi], strict=True))
        requests = sum(summed[lo:hi])
        # From 0.0 left to right, as sketch_counts adds (sum() compensates on newer Pythons).
        estimated = reduce(add, products[bin_bounds[j] : bin_bounds[j + 1]], 0.0) if sums else 0.0
        zeros = int(round(float(cast(Mapping[str, Any], sketches[i]).get("zeros", 0.0))))
        if zeros > 0:
            histogram[0] = histogram.get(0, 0) + zeros
            requests += zeros
        out[i] = SketchCounts(histogram, requests, estimated)
    return cast(list[SketchCounts], out)


def rollup_delta_of(row: Any) -> RollupDelta:
    """One aggregate (any object with the stored row's counts, ``accepted_per_position`` and
    ``latency``) as the sums it adds to its rollup rows."""
    sketches = row.latency or {}
    return _delta(
        row, *(sketch_counts(sketches.get(name)) for name in ("total_ms", "inter_token_ms", "ttft_ms"))
    )


def _delta(row: Any, total: SketchCounts, inter_token: SketchCounts, ttft: SketchCounts) -> RollupDelta:
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
        inter_token_hist=inter_token.histogram,
        total_ms_hist=total.histogram,
        ttft_hist=ttft.histogram,
    )


def minute_of(window_start: datetime) -> datetime:
    """The rollup minute a window is summed into: the one it starts in (UTC)."""
    return as_utc(window_start).replace(second=0, microsecond=0)


def deltas_by_deployment(rows: Iterable[Any]) -> dict[int, dict[RollupKey, RollupDelta]]:
    """Aggregate rows summed per deployment and rollup key (minute, arm, drafter version, category)."""
    rows = list(rows)
    latencies = [row.latency or {} for row in rows]
    # Only the total latency's estimated sum is kept (total_ms_sum).
    totals = sketches_counts([latency.get("total_ms") for latency in latencies])
    inter_token = sketches_counts([latency.get("inter_token_ms") for latency in latencies], sums=False)
    ttft = sketches_counts([latency.get("ttft_ms") for latency in latencies], sums=False)
    out: dict[int, dict[RollupKey, RollupDelta]] = {}
    for at, row in enumerate(rows):
        key = (
            minute_of(row.window_start),
            row.arm,
            int(row.drafter_version or 0),
            row.category or NO_CATEGORY,
        )
        per_deployment = out.setdefault(int(row.deployment_id), {})
        delta = _delta(row, totals[at], inter_token[at], ttft[at])
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
        with _collector_paused():
            _fold_windows(session, windows, fold)
        fold.windows = len(windows)
    fold.seconds = time.perf_counter() - started
    return fold


def _fold_windows(session: Session, windows: Sequence[Any], fold: AggregateRollupFold) -> None:
    """Add the claimed windows' aggregates to the rollups; count them in ``fold``. What it reads
    is freed when it returns, before the collector runs again (see _collector_paused)."""
    rows = _aggregate_rows(session, windows)
    per_deployment = deltas_by_deployment(rows)
    apply_deltas_by_deployment(session=session, deltas=per_deployment)
    fold.aggregates, fold.deployments = len(rows), len(per_deployment)
    fold.requests = sum(int(row.requests) for row in rows)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (if it was on). A fold decodes
    millions of small lists (sketch bins, histograms) that all live until it ends: the collector,
    run every few hundred allocations, traversed them again and again and took about half the
    fold's CPU. What the fold reads holds no reference cycles, and is freed before the collector
    is back on (else its first run would walk it all once more); cycles others make meanwhile
    wait for the next collection."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
