"""Rollups of acceptance records: pure aggregation, log histograms, and the database upsert.

Records are summed per (minute, arm, drafter version, category) and, in the same transaction,
per coarser tier (5 min, 1 h, 6 h, 1 day): ``acceptance_rollups`` holds one row per (resolution,
bucket, arm, drafter version, category), so a stats query reads at most a few hundred rows
whatever the range. Every tier's buckets start at multiples of its resolution since the Unix
epoch, and each resolution divides the next.

Categories are free text from clients, so the rollups keep at most MAX_ROLLUP_CATEGORIES of them
per deployment: once that many are stored, records of any further category are summed under
OVERFLOW_CATEGORY (the raw record keeps its own). A client cannot grow the table without bound.

Latency percentiles come from log-spaced histograms (bucket edges grow by 5%), so a percentile
read from a rollup is within about 2.5% of the exact value whatever the range. Histograms are
stored dense, ``[first bucket index, count, count, ...]`` (``[]`` when empty): latencies of
one deployment span a narrow band of buckets, and adding aligned lists is several times cheaper
than merging dicts. Each row also stores the p50/p95 of its own histograms, refreshed on every
update, so a query bucket that is exactly one row needs no histogram work.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import reduce
from itertools import accumulate, islice, repeat, zip_longest
from operator import add, attrgetter
from typing import Any, cast

import numpy as np
import orjson
from psycopg.rows import tuple_row
from sqlalchemy import Table, bindparam, select, tuple_, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from controlplane.db.models import AcceptanceRollupRow
from controlplane.db.session import driver_cursor, json_dumps, json_loads
from controlplane.ingest.record import AcceptanceRecord

HIST_RATIO = 1.05
HIST_MIN_MS = 0.01
_LOG_RATIO = math.log(HIST_RATIO)

# Rollup resolutions in seconds, finest first. Each divides the next (and a UTC day), so a row
# of one tier is the exact sum of the rows of any finer tier inside it. The 6-hour tier lets a
# 30-day chart (120 six-hour buckets) read one row per bucket instead of merging six hourly
# rows' histograms for each.
MINUTE = 60
SIX_HOURS = 6 * 3600
RESOLUTIONS = (MINUTE, 300, 3600, SIX_HOURS, 86400)
TIER_RESOLUTIONS = RESOLUTIONS[1:]

# The latency figures every rollup row precomputes, as (histogram column, percentile columns).
HISTOGRAMS = ("inter_token_hist", "total_ms_hist", "ttft_hist")
QUANTILES = (0.5, 0.95)
PERCENTILE_COLUMNS = (
    "inter_token_ms_p50",
    "inter_token_ms_p95",
    "total_ms_p50",
    "total_ms_p95",
    "ttft_ms_p50",
    "ttft_ms_p95",
)


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


def hist_from_counts(counts: Mapping[int, int]) -> list[int]:
    """The dense form ``[first index, counts...]`` of a sparse {bucket index: count} mapping."""
    if not counts:
        return []
    lo, hi = min(counts), max(counts)
    if not (counts[lo] and counts[hi]):  # the dense form spans the buckets that count only
        present = [index for index, count in counts.items() if count]
        if not present:
            return []
        lo, hi = min(present), max(present)
    # One lookup per bucket, in C: several times faster than filling a list in Python.
    return [lo, *map(counts.get, range(lo, hi + 1), repeat(0))]


def hist_merge(hists: Iterable[Sequence[int]]) -> list[int]:
    """The sum of dense histograms, as a new dense histogram."""
    present = [h for h in hists if len(h) > 1]
    if len(present) < 2:
        return list(present[0]) if present else []
    lo = min([h[0] for h in present])
    # Left-pad each to the common first index; zip_longest + sum then adds column-wise in C.
    columns = [
        list(islice(h, 1, None)) if h[0] == lo else [0] * (h[0] - lo) + list(islice(h, 1, None))
        for h in present
    ]
    return [lo, *map(sum, zip_longest(*columns, fillvalue=0))]


def hist_add(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """``hist_merge((a, b))``, about three times faster: the merge of every rollup row updated.
    Mostly one's buckets lie within the other's (a minute's within its hour's): a copy of the
    wider one with the other added in."""
    if len(a) < 2 or len(b) < 2:
        return list(a) if len(a) > 1 else list(b) if len(b) > 1 else []
    if b[0] < a[0] or b[0] + len(b) > a[0] + len(a):
        a, b = b, a
    if a[0] <= b[0] and b[0] + len(b) <= a[0] + len(a):
        out = list(a)
    else:
        out = [0] * (max(a[0] + len(a), b[0] + len(b)) - min(a[0], b[0]))
        out[0] = min(a[0], b[0])
        start = a[0] - out[0] + 1
        out[start : start + len(a) - 1] = a[1:]
    start = b[0] - out[0] + 1
    end = start + len(b) - 1
    out[start:end] = map(add, out[start:end], b[1:])
    return out


def hist_quantiles(hist: Sequence[int], qs: Sequence[float]) -> list[float | None]:
    """The q-quantiles (0..1) of a dense histogram in one pass; None each when it is empty.

    The q-quantile is the first bucket whose cumulative count reaches q * total.
    """
    if len(hist) < 2:
        return [None] * len(qs)
    cumulative = list(accumulate(islice(hist, 1, None)))
    total = cumulative[-1]
    if total <= 0:
        return [None] * len(qs)
    last = len(cumulative) - 1
    return [hist_value(hist[0] + min(bisect_left(cumulative, q * total), last)) for q in qs]


def hist_percentile(hist: Sequence[int], q: float) -> float | None:
    """The q-quantile (0..1) of a dense histogram, or None when it is empty."""
    return hist_quantiles(hist, (q,))[0]


def row_percentiles(hists: Sequence[Sequence[int]]) -> list[float | None]:
    """p50 and p95 of each of the three latency histograms, in PERCENTILE_COLUMNS order: what
    hist_quantiles gives, inlined (every rollup row written computes these)."""
    values: list[float | None] = []
    for hist in hists:
        cumulative = list(accumulate(islice(hist, 1, None)))
        total = cumulative[-1] if cumulative else 0
        if total <= 0:
            values.extend([None] * len(QUANTILES))
            continue
        last, lo = len(cumulative) - 1, hist[0]
        values.extend([hist_value(lo + min(bisect_left(cumulative, q * total), last)) for q in QUANTILES])
    return values


def merge_positions(into: list[int], other: Sequence[int]) -> None:
    if len(other) > len(into):
        into.extend([0] * (len(other) - len(into)))
    for i, count in enumerate(other):
        into[i] += int(count)


# (minute, arm, drafter version or 0, category or NO_CATEGORY)
RollupKey = tuple[datetime, str, int, str]
# (resolution, bucket start, arm, drafter version or 0, category)
TierKey = tuple[int, datetime, str, int, str]

# The category of records that gave none: part of the unique key, so never NULL.
NO_CATEGORY = ""
# Where the records of categories past the cap are summed.
OVERFLOW_CATEGORY = "other"
# Distinct categories the rollups keep per deployment (NO_CATEGORY and OVERFLOW_CATEGORY aside).
# Two writers admitting new categories at the same moment may each take the last free place, so
# the bound holds up to the number of concurrent writers; it exists to stop unbounded growth.
MAX_ROLLUP_CATEGORIES = 32


@dataclass(slots=True)
class RollupDelta:
    """Sums to add to one rollup row (histograms sparse, {bucket index: count}, while summing)."""

    requests: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    total_ms_sum: float = 0.0
    timed_requests: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    inter_token_hist: dict[int, int] = field(default_factory=dict)
    total_ms_hist: dict[int, int] = field(default_factory=dict)
    ttft_hist: dict[int, int] = field(default_factory=dict)

    def add(self, other: RollupDelta) -> None:
        for name in _SUM_COLUMNS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        merge_positions(self.accepted_per_position, other.accepted_per_position)
        for name in HISTOGRAMS:
            mine: dict[int, int] = getattr(self, name)
            for index, count in getattr(other, name).items():
                mine[index] = mine.get(index, 0) + count


def aggregate(records: Iterable[AcceptanceRecord], *, when_default: datetime) -> dict[RollupKey, RollupDelta]:
    """Group records by (minute, arm, drafter version, category) and sum them.

    Grouped first, then summed a column at a time (``sum(map(...))``, histograms in NumPy for
    large groups), which runs in C: a 10,000-record batch of one deployment's minute sums in
    half the time a record-at-a-time loop took (8.4 against 17.5 ms here).
    """
    groups: dict[RollupKey, list[AcceptanceRecord]] = {}
    minute_cache: dict[datetime, datetime] = {}
    for rec in records:
        when = rec.created_at or when_default
        minute = minute_cache.get(when)
        if minute is None:
            minute = minute_cache[when] = when.replace(second=0, microsecond=0)
        key = (minute, rec.arm, rec.drafter_version or 0, rec.category or NO_CATEGORY)
        group = groups.get(key)
        if group is None:
            groups[key] = [rec]
        else:
            group.append(rec)
    return {key: _summed(group) for key, group in groups.items()}


def _summed(group: list[AcceptanceRecord]) -> RollupDelta:
    totals = [value for value in map(_TOTAL_MS, group) if value is not None]
    positions = [value for value in map(_POSITIONS, group) if value]
    return RollupDelta(
        requests=len(group),
        drafted_tokens=sum(map(_DRAFTED, group)),
        accepted_tokens=sum(map(_ACCEPTED, group)),
        verify_steps=sum(map(_VERIFY_STEPS, group)),
        generated_tokens=sum(map(_GENERATED, group)),
        prompt_tokens=sum(value for value in map(_PROMPT, group) if value),
        # Left to right, as a running total would (sum() compensates on newer Pythons).
        total_ms_sum=reduce(add, totals, 0.0),
        timed_requests=len(totals),
        accepted_per_position=[sum(map(int, column)) for column in zip_longest(*positions, fillvalue=0)],
        inter_token_hist=_histogram(map(_INTER_TOKEN_MS, group)),
        total_ms_hist=_histogram(totals),
        ttft_hist=_histogram(map(_TTFT_MS, group)),
    )


def _histogram(values: Iterable[float | None]) -> dict[int, int]:
    """Sparse {bucket index: count} of the values that are not None: hist_index of each.

    Large groups take their logarithms in NumPy, ~10x faster than one at a time. NumPy's log
    may differ from the C library's in the last bit, which can only matter for a value whose
    bucket position lands within rounding of a bucket edge: those few are recomputed exactly as
    hist_index does, so the result is identical either way.
    """
    present = [value for value in values if value is not None]
    array = np.array(present, dtype=np.float64) if len(present) >= _VECTOR_MIN_VALUES else None
    if array is None or not np.isfinite(array).all():  # small, or fails as hist_index does
        return Counter(map(hist_index, present))
    with np.errstate(divide="ignore", invalid="ignore"):  # values <= HIST_MIN_MS are masked out
        position = np.log(array / HIST_MIN_MS) / _LOG_RATIO
        above = array > HIST_MIN_MS
        index = np.where(above, 1 + np.floor(position), 0).astype(np.int64)
        near_edge = np.flatnonzero(above & (np.abs(position - np.rint(position)) < 1e-9))
    for i in near_edge.tolist():
        index[i] = hist_index(present[i])
    lowest = int(index.min())
    counts = np.bincount(index - lowest)
    present_buckets = np.flatnonzero(counts)
    return dict(zip((present_buckets + lowest).tolist(), counts[present_buckets].tolist(), strict=True))


# Below this many values the per-call cost of NumPy exceeds what it saves.
_VECTOR_MIN_VALUES = 256

_DRAFTED = attrgetter("drafted_tokens")
_ACCEPTED = attrgetter("accepted_tokens")
_VERIFY_STEPS = attrgetter("verify_steps")
_GENERATED = attrgetter("generated_tokens")
_PROMPT = attrgetter("prompt_tokens")
_TOTAL_MS = attrgetter("total_ms")
_POSITIONS = attrgetter("accepted_per_position")
_INTER_TOKEN_MS = attrgetter("inter_token_ms")
_TTFT_MS = attrgetter("ttft_ms")


def floor_to(when: datetime, resolution_s: int) -> datetime:
    """The start of the ``resolution_s`` bucket holding ``when`` (naive values are taken as UTC)."""
    aware = when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)
    seconds = int(aware.timestamp())
    floored = datetime.fromtimestamp(seconds - seconds % resolution_s, tz=UTC)
    return floored if when.tzinfo is not None else floored.replace(tzinfo=None)


def tier_deltas(deltas: Mapping[RollupKey, RollupDelta]) -> dict[TierKey, RollupDelta]:
    """The minute deltas summed into every coarser tier's buckets."""
    tiers: dict[TierKey, RollupDelta] = {}
    for (minute, arm, version, category), delta in deltas.items():
        for resolution in TIER_RESOLUTIONS:
            key = (resolution, floor_to(minute, resolution), arm, version, category)
            into = tiers.get(key)
            if into is None:
                into = tiers[key] = RollupDelta()
            into.add(delta)
    return tiers


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
    """Add per-minute deltas to the minute rows and every coarser tier's rows, in the caller's
    transaction.

    Rows are first created empty (insert-or-ignore), then locked in key order and updated, so
    concurrent batches touching the same buckets serialise instead of losing counts or
    deadlocking. Three statements whatever the number of tiers (two on PostgreSQL, where one
    upsert creates, locks and reads): this runs in every ingest transaction, where round trips
    dominate. Deltas that name a category take one more, to keep the categories within the cap
    (see rollup_categories).
    """
    if not deltas:
        return
    named = {key[3] for key in deltas} - {NO_CATEGORY}
    kept = rollup_categories(session=session, deployment_id=deployment_id, categories=named) if named else {}
    rows = _tier_rows(deltas, kept)
    keys = sorted(rows)
    if session.get_bind().dialect.name == "postgresql":
        _apply_postgres(session, deployment_id, keys, rows)
        return
    like = keys[0][1]
    _insert_empty(session, deployment_id, keys)
    current = _lock_rows(session, deployment_id, keys)
    locked = {
        (row.resolution_s, _aware(row.bucket_start, like), row.arm, row.drafter_version, row.category): row
        for row in current
    }
    # A Core executemany on the table: the ORM's bulk-update path costs several times more CPU
    # per row, and this runs in every ingest transaction.
    session.execute(_UPDATE_BY_ID, [_updated(locked[key], rows[key]) for key in keys])
    session.expire_all()


def _tier_rows(
    deltas: Mapping[RollupKey, RollupDelta], kept: Mapping[str, str]
) -> dict[TierKey, RollupDelta]:
    """The rows of every tier that per-minute ``deltas`` add to, categories mapped by ``kept``."""
    minutes: dict[RollupKey, RollupDelta] = {}
    for (minute, arm, version, category), delta in deltas.items():
        # Tier buckets are UTC-aligned; normalising here also merges keys that named the same
        # minute in different time zones.
        key = (
            minute.astimezone(UTC) if minute.tzinfo is not None else minute,
            arm,
            version,
            kept.get(category, category),
        )
        into = minutes.get(key)
        if into is None:
            minutes[key] = delta
        else:
            merged = RollupDelta()
            merged.add(into)
            merged.add(delta)
            minutes[key] = merged
    rows: dict[TierKey, RollupDelta] = {(MINUTE, *key): delta for key, delta in minutes.items()}
    # tier_deltas' sums, but a tier row that only one minute adds to shares that minute's delta
    # object (a sum of its own is made when a second minute joins it, in the same order): a
    # fold's minutes are mostly alone in their buckets, and _DeltaForms then converts each
    # shared delta once for all its tiers.
    summed: set[TierKey] = set()
    floors: dict[datetime, list[datetime]] = {}
    for (minute, arm, version, category), delta in minutes.items():
        starts = floors.get(minute)
        if starts is None:
            starts = floors[minute] = [floor_to(minute, resolution) for resolution in TIER_RESOLUTIONS]
        for resolution, start in zip(TIER_RESOLUTIONS, starts, strict=True):
            tier_key = (resolution, start, arm, version, category)
            into = rows.get(tier_key)
            if into is None:
                rows[tier_key] = delta
                continue
            if tier_key not in summed:
                into = rows[tier_key] = _copy(into)
                summed.add(tier_key)
            into.add(delta)
    return rows


def _copy(delta: RollupDelta) -> RollupDelta:
    copied = RollupDelta()
    copied.add(delta)
    return copied


# Rollup rows created, locked and read per statement when many deployments are updated at once.
MANY_CHUNK_ROWS = 20_000


def apply_deltas_by_deployment(
    *, session: Session, deltas: Mapping[int, Mapping[RollupKey, RollupDelta]]
) -> None:
    """:func:`apply_deltas` for many deployments at once (``deltas[deployment_id]``), in the
    caller's transaction.

    On PostgreSQL the round trips do not grow with the number of deployments: one read for the
    stored categories of those not yet remembered, then a read, an insert that locks and an
    update over all their rows (see _apply_postgres_many), locking in (deployment, key) order,
    the order a one-deployment writer locks in too. Elsewhere, one deployment after another, in
    id order.
    """
    if session.get_bind().dialect.name != "postgresql":
        for deployment_id in sorted(deltas):
            apply_deltas(session=session, deployment_id=deployment_id, deltas=deltas[deployment_id])
        return
    named = {deployment_id: {key[3] for key in per} - {NO_CATEGORY} for deployment_id, per in deltas.items()}
    kept = _categories_by_deployment(session, named)
    rows: dict[tuple[int, TierKey], RollupDelta] = {}
    for deployment_id, per in deltas.items():
        for key, delta in _tier_rows(per, kept.get(deployment_id, {})).items():
            rows[(deployment_id, key)] = delta
    keys = sorted(rows)
    for start in range(0, len(keys), MANY_CHUNK_ROWS):
        _apply_postgres_many(session, keys[start : start + MANY_CHUNK_ROWS], rows)


def _categories_by_deployment(session: Session, named: Mapping[int, set[str]]) -> dict[int, dict[str, str]]:
    """rollup_categories for many deployments: the stored categories of every deployment naming
    one not remembered are read in one query (per LOCK_CHUNK deployments), not one each."""
    url = session.get_bind().engine.url.render_as_string(hide_password=True)
    stale = sorted(
        deployment_id
        for deployment_id, wanted in named.items()
        if wanted and not wanted <= _STORED_CATEGORIES.get((url, deployment_id), frozenset())
    )
    if stale:
        r = AcceptanceRollupRow
        stored: dict[int, set[str]] = {deployment_id: set() for deployment_id in stale}
        for start in range(0, len(stale), LOCK_CHUNK):
            query = (
                select(r.deployment_id, r.category)
                .where(
                    r.deployment_id.in_(stale[start : start + LOCK_CHUNK]), r.resolution_s == RESOLUTIONS[-1]
                )
                .distinct()
            )
            for deployment_id, category in session.execute(query):
                stored[int(deployment_id)].add(category)
        if len(_STORED_CATEGORIES) + len(stored) > _MAX_REMEMBERED_DEPLOYMENTS:
            _STORED_CATEGORIES.clear()
        for deployment_id, categories in stored.items():
            _STORED_CATEGORIES[(url, deployment_id)] = frozenset(categories)
    return {
        deployment_id: _admitted(_STORED_CATEGORIES.get((url, deployment_id), frozenset()), wanted)
        for deployment_id, wanted in named.items()
        if wanted
    }


def _apply_postgres_many(
    session: Session, keys: Sequence[tuple[int, TierKey]], rows: Mapping[tuple[int, TierKey], RollupDelta]
) -> None:
    """PostgreSQL: add ``rows`` (``keys`` sorted by (deployment, tier key)), one write per row, in
    three statements whatever their number (two more where another writer got in between):

    1. Read the rows that exist already, without locking them, with their versions (xmin).
    2. Insert the others with their delta as their whole value, and lock the existing ones
       (``DO UPDATE ... WHERE false`` locks without writing), all in key order, the order every
       writer locks in. RETURNING names the rows created: a minute row is new each minute, and
       a fold of new buckets writes each row once. Rows read in 1 are sent as keys only.
    3. Add the deltas to the rows read in 1, unless changed since (their version no longer the
       one read): counts in SQL, positions and histograms merged here and their percentiles
       refreshed. A row changed since 1, or created by another writer between 1 and 2, is now
       locked: read again, and added to in one more update.

    Each column travels as one text parameter (see _column_params): per-row statements, array
    parameters or a JSON document of rows cost several times more CPU, here or in the server.
    """
    forms = _DeltaForms()
    with driver_cursor(session) as cursor:
        cursor.row_factory = tuple_row  # plain tuples: tens of thousands of rows come back
        stored = _read_rows(cursor, keys)
        inserted = [
            (*key_row, *(_LOCK_ONLY if key in stored else forms.inserted(rows[key])))
            for key, key_row in zip(keys, _key_rows(keys), strict=True)
        ]
        cursor.execute(_INSERT_LOCKING_MANY_SQL, _column_params(_INSERTED_COLUMNS, inserted), prepare=True)
        created = {(row[0], row[1:]) for row in cursor.fetchall()}  # RETURNING the key columns
        # Created by another writer between 1 and 2: locked now, read below. (One read in 1 but
        # deleted before 2 was created empty by 2: its id is not the one read, so it joins too.)
        later = [key for key in keys if key not in stored and key not in created]
        if stored:
            cursor.execute(
                _ADD_BY_ID_SQL,
                _column_params(_ADDED_COLUMNS, [forms.added(row, rows[key]) for key, row in stored.items()]),
                prepare=True,
            )
            done = {row[0] for row in cursor.fetchall()}
            later += [key for key, row in stored.items() if row[0] not in done]
        if later:
            later.sort()  # locked already; sorted only to keep the writes in key order
            current = _read_rows(cursor, later)
            added = [forms.added((*current[key][:1], None, *current[key][2:]), rows[key]) for key in later]
            cursor.execute(_ADD_BY_ID_SQL, _column_params(_ADDED_COLUMNS, added), prepare=True)


# The values step 2 of _apply_postgres_many sends for a row read in step 1: none (its key alone).
_LOCK_ONLY = (None,) * (len(_SUM_COLUMNS) + 1 + len(HISTOGRAMS) + len(PERCENTILE_COLUMNS))


def _key_rows(keys: Sequence[tuple[int, TierKey]]) -> list[tuple[Any, ...]]:
    return [(deployment_id, *key) for deployment_id, key in keys]


def _read_rows(
    cursor: Any, keys: Sequence[tuple[int, TierKey]]
) -> dict[tuple[int, TierKey], tuple[Any, ...]]:
    """The stored rows of ``keys`` that exist: (id, version, positions, histograms...) by key.
    The JSON columns come as text and are decoded a column at a time (one call, not one each)."""
    cursor.execute(_READ_MANY_SQL, _column_params(_KEY_COLUMNS, _key_rows(keys)), prepare=True)
    found = cursor.fetchall()
    if not found:
        return {}
    json_at = len(_READ_KEY_COLUMNS)
    decoded = [_json_values([row[i] for row in found]) for i in range(json_at, len(_READ_COLUMNS))]
    # Rows are (id, version, deployment id, tier key..., JSON texts...): see _READ_MANY_SQL.
    return {
        (row[2], row[3:json_at]): (row[0], row[1], *values)
        for row, *values in zip(found, *decoded, strict=True)
    }


class _DeltaForms:
    """A delta's column values as the statements take them (see _column_params), computed once per
    delta object: the coarser tiers of a fold share their minute's delta (see _tier_rows), so
    each aggregate's histograms are made dense and their percentiles found once."""

    def __init__(self) -> None:
        # id(delta) -> (delta, its _VALUE_COLUMNS, its sums, positions and dense histograms).
        # The delta is held so that its id is not reused while this cache lives.
        self._forms: dict[
            int, tuple[RollupDelta, tuple[Any, ...], tuple[Any, ...], list[int], list[list[int]]]
        ] = {}

    def _form(
        self, delta: RollupDelta
    ) -> tuple[RollupDelta, tuple[Any, ...], tuple[Any, ...], list[int], list[list[int]]]:
        known = self._forms.get(id(delta))
        if known is None:
            sums = tuple(getattr(delta, name) for name in _SUM_COLUMNS)
            positions = [int(count) for count in delta.accepted_per_position]
            hists = [hist_from_counts(getattr(delta, name)) for name in HISTOGRAMS]
            values = (*sums, positions, *hists, *row_percentiles(hists))
            known = self._forms[id(delta)] = (delta, values, sums, positions, hists)
        return known

    def inserted(self, delta: RollupDelta) -> tuple[Any, ...]:
        """The _VALUE_COLUMNS of a new row holding just ``delta``."""
        return self._form(delta)[1]

    def added(self, row: Sequence[Any], delta: RollupDelta) -> tuple[Any, ...]:
        """The _ADDED_COLUMNS that add ``delta`` to a stored row (id, version or None for any,
        positions, histograms): the delta's counts (added in SQL), the merged positions and
        histograms, and their percentiles."""
        _, _, sums, added_positions, added_hists = self._form(delta)
        row_id, version, positions, *stored = row
        positions = list(positions or [])
        merge_positions(positions, added_positions)
        hists = [hist_add(old or [], new) for old, new in zip(stored, added_hists, strict=True)]
        return (row_id, version, *sums, positions, *hists, *row_percentiles(hists))


def _json_values(texts: Sequence[str]) -> list[Any]:
    """JSON texts decoded with one call."""
    return json_loads("[" + ",".join(texts) + "]")  # type: ignore[no-any-return]


def _column_params(columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[Any]]) -> dict[str, str]:
    """``rows`` (values in ``columns`` order) as one text parameter per column, each parsed in C
    by the server (see _unnested) and each encoded with one orjson call: numbers and times as an
    array literal (``{1,2,3}``; an array literal reads orjson's ``null`` as NULL), free text as a
    JSON array, and JSON values (lists of integers) as their JSON texts joined by ``;`` (which
    none holds; ``],[`` only lies between two of them), NULL as an empty one."""
    out = {}
    for (name, kind), values in zip(
        columns, zip(*rows, strict=True) if rows else [()] * len(columns), strict=True
    ):
        if kind == "json":
            if None in values:  # NULL: an empty field
                out[name] = ";".join(
                    "" if value is None else orjson.dumps(value).decode() for value in values
                )
            else:
                out[name] = orjson.dumps(values).decode()[1:-1].replace("],[", "];[")
            continue
        encoded = orjson.dumps(values).decode()
        if kind == "text":
            out[name] = encoded
        elif kind == "double precision" and "null" in encoded and not all(map(_finite_or_none, values)):
            # orjson writes infinities and NaN as null: spelled out instead, as float8 reads them.
            out[name] = "{" + ",".join(_FLOAT_LITERALS.get(str(value), str(value)) for value in values) + "}"
        else:
            out[name] = "{" + encoded[1:-1] + "}"
    return out


def _finite_or_none(value: float | None) -> bool:
    return value is None or math.isfinite(value)


_FLOAT_LITERALS = {"None": "NULL", "inf": "Infinity", "-inf": "-Infinity", "nan": "NaN"}


def _unnested(columns: Sequence[tuple[str, str]]) -> str:
    """The SQL rows of _column_params' parameters: ``ROWS FROM (...)`` (pairs them by position), to be
    followed by ``[WITH ORDINALITY] AS alias(names)``; a column is read ``CAST(alias.name AS
    kind)`` where its kind is json, plain elsewhere."""
    functions = []
    for name, kind in columns:
        if kind == "json":
            functions.append(f"unnest(string_to_array(%({name})s, ';', ''))")
        elif kind == "text":
            functions.append(f"json_array_elements_text(CAST(%({name})s AS json))")
        else:
            functions.append(f"unnest(CAST(%({name})s AS {kind}[]))")
    return "ROWS FROM (" + ", ".join(functions) + ")"


def _read(alias: str, column: tuple[str, str]) -> str:
    name, kind = column
    return f"CAST({alias}.{name} AS json)" if kind == "json" else f"{alias}.{name}"


# Categories found stored in a deployment's rollups, by (database URL, deployment id): only ever
# grows while the rows exist (a deployment is soft-deleted, its id never reused).
_STORED_CATEGORIES: dict[tuple[str, int], frozenset[str]] = {}
_MAX_REMEMBERED_DEPLOYMENTS = 10_000


def rollup_categories(*, session: Session, deployment_id: int, categories: Iterable[str]) -> dict[str, str]:
    """The category each of ``categories`` is rolled up under: itself while the deployment's
    rollups hold fewer than MAX_ROLLUP_CATEGORIES categories (or already hold this one), else
    OVERFLOW_CATEGORY. New categories take the free places in name order.

    Read from the daily tier, which holds every record once in the fewest rows. A category once
    stored stays stored, so the categories each read found are remembered per database and
    deployment, and a batch naming only those skips the read: this runs in every ingest flush
    whose records carry a category.
    """
    wanted = set(categories)
    known_key = (session.get_bind().engine.url.render_as_string(hide_password=True), deployment_id)
    known = _STORED_CATEGORIES.get(known_key)
    if known is not None and wanted <= known:
        return {category: category for category in wanted}
    r = AcceptanceRollupRow
    daily = (r.deployment_id == deployment_id, r.resolution_s == RESOLUTIONS[-1])
    stored = set(session.scalars(select(r.category).where(*daily).distinct()))
    if len(_STORED_CATEGORIES) >= _MAX_REMEMBERED_DEPLOYMENTS:
        _STORED_CATEGORIES.clear()
    _STORED_CATEGORIES[known_key] = frozenset(stored)
    return _admitted(stored, wanted)


def _admitted(stored: Iterable[str], wanted: Iterable[str]) -> dict[str, str]:
    """Each of ``wanted`` mapped to the category it is rolled up under, given those ``stored``."""
    counted = set(stored) - {NO_CATEGORY, OVERFLOW_CATEGORY}
    out: dict[str, str] = {}
    for category in sorted(wanted):
        if category in (NO_CATEGORY, OVERFLOW_CATEGORY) or category in counted:
            out[category] = category
        elif len(counted) < MAX_ROLLUP_CATEGORIES:
            counted.add(category)
            out[category] = category
        else:
            out[category] = OVERFLOW_CATEGORY
    return out


def _insert_empty(session: Session, deployment_id: int, keys: Sequence[TierKey]) -> None:
    """SQLite: create the missing rows of ``keys`` (PostgreSQL uses _upsert_locking)."""
    empty = _empty_row(deployment_id)
    session.execute(
        sqlite_insert(AcceptanceRollupRow).on_conflict_do_nothing(),
        [
            {**empty, "resolution_s": r, "bucket_start": b, "arm": a, "drafter_version": v, "category": c}
            for r, b, a, v, c in keys
        ],
    )


def _empty_row(deployment_id: int) -> dict[str, Any]:
    return {
        "deployment_id": deployment_id,
        **dict.fromkeys(_SUM_COLUMNS, 0),
        "accepted_per_position": [],
        **{name: [] for name in HISTOGRAMS},
    }


def _apply_postgres(
    session: Session, deployment_id: int, keys: Sequence[TierKey], rows: Mapping[TierKey, RollupDelta]
) -> None:
    """PostgreSQL: create the missing rows of sorted ``keys``, lock and read all of them in one
    statement, then write each one's new values, in the caller's transaction.

    The no-op DO UPDATE locks an existing row and RETURNING hands back its current values.
    Rows are processed, and so locked, in key order (WITH ORDINALITY), the same sorted order in
    every writer, so concurrent batches cannot deadlock. The keys travel as four arrays, so the
    statement's text is the same whatever their number and the server prepares it once.

    Both statements go straight to the driver's cursor on the session's connection (same
    transaction): a single-record ingest flush runs this, and SQLAlchemy's per-statement
    execution machinery cost about as much CPU as the database's work here.
    """
    with driver_cursor(session) as cursor:
        cursor.execute(
            _UPSERT_LOCKING_SQL,
            {
                "deployment_id": deployment_id,
                "resolutions": [key[0] for key in keys],
                "starts": [key[1] for key in keys],
                "arms": [key[2] for key in keys],
                "versions": [key[3] for key in keys],
                "categories": [key[4] for key in keys],
            },
            prepare=True,
        )
        locked = {
            (row.resolution_s, row.bucket_start, row.arm, row.drafter_version, row.category): row
            for row in cursor.fetchall()
        }
        updates = []
        for key in keys:
            values = _updated(locked[key], rows[key])
            for name in _JSON_COLUMNS:
                values[name] = json_dumps(values[name])
            updates.append(values)
        cursor.executemany(_UPDATE_BY_ID_SQL, updates)


# Keys locked per SELECT, to keep the bound parameters well under SQLite's limit.
LOCK_CHUNK = 1000


def _lock_rows(session: Session, deployment_id: int, keys: Sequence[TierKey]) -> list[Any]:
    """Lock and read the rows of sorted ``keys`` (resolution, bucket start, arm, version, category).

    Locks are taken in the database's order of the key columns. Chunks split only between
    (resolution, bucket start) pairs, whose order is the same in Python and SQL, so the order is
    global across chunks (arm names may collate differently in the database than in Python).
    """
    r = AcceptanceRollupRow
    key_columns = (r.resolution_s, r.bucket_start, r.arm, r.drafter_version, r.category)
    columns = [r.id, *key_columns]
    columns += [getattr(r, name) for name in (*_SUM_COLUMNS, "accepted_per_position", *HISTOGRAMS)]
    rows: list[Any] = []
    chunk: list[TierKey] = []
    for position, key in enumerate(keys):
        chunk.append(key)
        following = keys[position + 1] if position + 1 < len(keys) else None
        if following is not None and (len(chunk) < LOCK_CHUNK or following[:2] == key[:2]):
            continue
        query = (
            select(*columns)
            .where(r.deployment_id == deployment_id, tuple_(*key_columns).in_(chunk))
            .order_by(*key_columns)
            .with_for_update()
        )
        rows.extend(session.execute(query))
        chunk = []
    return rows


def _updated(row: Any, delta: RollupDelta) -> dict[str, Any]:
    positions = list(row.accepted_per_position or [])
    merge_positions(positions, delta.accepted_per_position)
    hists = [
        hist_merge((getattr(row, name) or [], hist_from_counts(getattr(delta, name)))) for name in HISTOGRAMS
    ]
    return {
        "row_id": row.id,
        **{col: getattr(row, col) + getattr(delta, col) for col in _SUM_COLUMNS},
        "accepted_per_position": positions,
        **dict(zip(HISTOGRAMS, hists, strict=True)),
        **dict(zip(PERCENTILE_COLUMNS, row_percentiles(hists), strict=True)),
    }


_ROLLUP_TABLE = cast(Table, AcceptanceRollupRow.__table__)
_UPDATE_BY_ID = (
    update(_ROLLUP_TABLE)
    .where(_ROLLUP_TABLE.c.id == bindparam("row_id"))
    .values(
        {
            name: bindparam(name)
            for name in (*_SUM_COLUMNS, "accepted_per_position", *HISTOGRAMS, *PERCENTILE_COLUMNS)
        }
    )
)


def _aware(value: datetime, like: datetime) -> datetime:
    # SQLite returns naive datetimes; compare in the same form as the keys we computed.
    if value.tzinfo is None and like.tzinfo is not None:
        return value.replace(tzinfo=like.tzinfo)
    return value


_LOCKED_COLUMNS = (
    "id",
    "resolution_s",
    "bucket_start",
    "arm",
    "drafter_version",
    "category",
    *_SUM_COLUMNS,
    "accepted_per_position",
    *HISTOGRAMS,
)
_UPSERT_LOCKING_SQL = f"""
    INSERT INTO acceptance_rollups (deployment_id, resolution_s, bucket_start, arm, drafter_version,
        category, {", ".join(_SUM_COLUMNS)}, accepted_per_position, {", ".join(HISTOGRAMS)})
    SELECT %(deployment_id)s, k.resolution_s, k.bucket_start, k.arm, k.drafter_version, k.category,
        {", ".join("0" for _ in _SUM_COLUMNS)}, '[]', {", ".join("'[]'" for _ in HISTOGRAMS)}
    FROM unnest(CAST(%(resolutions)s AS integer[]), CAST(%(starts)s AS timestamptz[]),
                CAST(%(arms)s AS varchar[]), CAST(%(versions)s AS integer[]),
                CAST(%(categories)s AS varchar[]))
         WITH ORDINALITY AS k(resolution_s, bucket_start, arm, drafter_version, category, position)
    ORDER BY k.position
    ON CONFLICT ON CONSTRAINT uq_acceptance_rollups_key DO UPDATE SET requests = acceptance_rollups.requests
    RETURNING {", ".join(_LOCKED_COLUMNS)}
"""
# (name, SQL type) of the columns _apply_postgres_many sends (see _column_params).
_KEY_COLUMNS = (
    ("deployment_id", "integer"),
    ("resolution_s", "integer"),
    ("bucket_start", "timestamptz"),
    ("arm", "text"),
    ("drafter_version", "integer"),
    ("category", "text"),
)
_VALUE_COLUMNS = (
    *((name, "double precision" if name == "total_ms_sum" else "bigint") for name in _SUM_COLUMNS),
    *((name, "json") for name in ("accepted_per_position", *HISTOGRAMS)),
    *((name, "double precision") for name in PERCENTILE_COLUMNS),
)
_INSERTED_COLUMNS = (*_KEY_COLUMNS, *_VALUE_COLUMNS)
_ADDED_COLUMNS = (("row_id", "bigint"), ("version", "xid"), *_VALUE_COLUMNS)
# Rows of many deployments (see _apply_postgres_many), processed and so locked in the order sent.
# A row read before comes as its key alone (values NULL): if it is created after all, it starts
# empty (_EMPTY; percentiles NULL). The DO UPDATE's false WHERE still locks the conflicting row
# (as PostgreSQL documents) but writes and returns nothing: RETURNING lists exactly the rows
# created.
_EMPTY = {"bigint": "0", "double precision": "0.0", "json": "CAST('[]' AS json)"}
_INSERT_LOCKING_MANY_SQL = f"""
    INSERT INTO acceptance_rollups ({", ".join(name for name, _ in _INSERTED_COLUMNS)})
    SELECT {", ".join(f"k.{name}" for name, _ in _KEY_COLUMNS)}, {
    ", ".join(
        f"k.{name}" if name in PERCENTILE_COLUMNS else f"COALESCE({_read('k', (name, kind))}, {_EMPTY[kind]})"
        for name, kind in _VALUE_COLUMNS
    )
}
    FROM {_unnested(_INSERTED_COLUMNS)}
         WITH ORDINALITY AS k({", ".join(name for name, _ in _INSERTED_COLUMNS)}, position)
    ORDER BY k.position
    ON CONFLICT ON CONSTRAINT uq_acceptance_rollups_key DO UPDATE SET requests = acceptance_rollups.requests
        WHERE false
    RETURNING {", ".join(name for name, _ in _KEY_COLUMNS)}
"""
# The JSON columns are read as text (see _read_rows); the version is the row's xmin, which any
# change to the row (or its freezing by VACUUM) changes.
_READ_KEY_COLUMNS = ("id", "version", *(name for name, _ in _KEY_COLUMNS))
_READ_COLUMNS = (*_READ_KEY_COLUMNS, "accepted_per_position", *HISTOGRAMS)
_READ_MANY_SQL = f"""
    SELECT r.id, CAST(CAST(r.xmin AS text) AS bigint) AS version,
        {", ".join(f"r.{name}" for name, _ in _KEY_COLUMNS)},
        {", ".join(f"CAST(r.{name} AS text)" for name in _READ_COLUMNS[len(_READ_KEY_COLUMNS) :])}
    FROM {_unnested(_KEY_COLUMNS)} AS k({", ".join(name for name, _ in _KEY_COLUMNS)})
    JOIN acceptance_rollups AS r ON {" AND ".join(f"r.{name} = k.{name}" for name, _ in _KEY_COLUMNS)}
"""
# Rows whose version is given are updated only if still at it; RETURNING lists those updated.
_SET_ADDED = ", ".join(
    f"{name} = r.{name} + u.{name}" if name in _SUM_COLUMNS else f"{name} = {_read('u', (name, kind))}"
    for name, kind in _VALUE_COLUMNS
)
_ADD_BY_ID_SQL = f"""
    UPDATE acceptance_rollups AS r SET {_SET_ADDED}
    FROM {_unnested(_ADDED_COLUMNS)} AS u({", ".join(name for name, _ in _ADDED_COLUMNS)})
    WHERE r.id = u.row_id AND (u.version IS NULL OR r.xmin = u.version)
    RETURNING r.id
"""
_JSON_COLUMNS = ("accepted_per_position", *HISTOGRAMS)
_UPDATE_BY_ID_SQL = f"""
    UPDATE acceptance_rollups SET
        {", ".join(f"{name} = %({name})s" for name in (*_SUM_COLUMNS, *PERCENTILE_COLUMNS))},
        {", ".join(f"{name} = CAST(%({name})s AS json)" for name in _JSON_COLUMNS)}
    WHERE id = %(row_id)s
"""
