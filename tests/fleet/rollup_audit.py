"""The rollups against the raw rows they were summed from: the measure behind the fault tests' and
the reliability bench's rollup_double_counted_records / rollup_missing_records.

Every record not set aside (quarantined by the fold, or a sample the edge also counted in an
aggregate) and every edge aggregate already rolled up must be summed exactly once into
``acceptance_rollups`` at each of its resolutions. The expected sums are computed here apart from
controlplane.ingest.rollups, so a fault in that code cannot hide itself: PostgreSQL sums the raw
rows per minute, and plain integer arithmetic carries the minutes into each coarser bucket. A
bucket whose rollup counts more requests than its raw rows hold counts the excess as double
counted; fewer, as missing. Any other summed column that differs (tokens, per-position counts,
latency counts) makes the bucket a mismatch even where the request counts agree.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

# The tiers acceptance_rollups keeps (seconds); a row of any other resolution is itself a finding.
RESOLUTIONS = (60, 300, 3600, 6 * 3600, 86400)
# Where the rollups sum categories past their per-deployment cap.
OVERFLOW_CATEGORY = "other"
# Integer columns compared exactly, in the order the queries below return them.
COUNT_COLUMNS = (
    "requests",
    "drafted_tokens",
    "accepted_tokens",
    "verify_steps",
    "generated_tokens",
    "prompt_tokens",
)
# Compared only where no edge aggregate contributes (an aggregate's latencies are a sketch, summed
# into the rollups as estimates).
LATENCY_COLUMNS = ("timed_requests", "total_ms_sum", "inter_token_count", "total_ms_count", "ttft_count")

# Records of the deployments that the rollups must hold: neither quarantined nor still pending
# (pending ones are counted apart: the audit is meant to run after a fold).
_RECORDS_WHERE = """
    r.deployment_id = ANY(%(ids)s) AND NOT r.counted_in_aggregate
    AND NOT EXISTS (SELECT 1 FROM quarantined_rollup_records q WHERE q.record_id = r.id)
    AND NOT EXISTS (SELECT 1 FROM acceptance_rollup_pending p WHERE p.record_id = r.id)
"""
_MINUTE = "floor(extract(epoch FROM {column}) / 60)::bigint * 60"
_RECORD_KEY = (
    f"r.deployment_id, {_MINUTE.format(column='r.created_at')}, r.arm,"
    " coalesce(r.drafter_version, 0), coalesce(r.category, '')"
)
_RECORD_MINUTES_SQL = f"""
    SELECT {_RECORD_KEY}, count(*), sum(r.drafted_tokens), sum(r.accepted_tokens),
        sum(r.verify_steps), sum(r.generated_tokens), coalesce(sum(r.prompt_tokens), 0),
        count(r.total_ms), coalesce(sum(r.total_ms), 0), count(r.inter_token_ms), count(r.total_ms),
        count(r.ttft_ms)
    FROM acceptance_records r WHERE {_RECORDS_WHERE}
    GROUP BY 1, 2, 3, 4, 5
"""
_RECORD_POSITIONS_SQL = f"""
    SELECT {_RECORD_KEY}, p.position - 1, sum(p.value::bigint)
    FROM acceptance_records r
    CROSS JOIN LATERAL json_array_elements_text(
        CASE WHEN json_typeof(r.accepted_per_position) = 'array' THEN r.accepted_per_position
        ELSE '[]'::json END
    ) WITH ORDINALITY AS p(value, position)
    WHERE {_RECORDS_WHERE}
    GROUP BY 1, 2, 3, 4, 5, 6
"""
_AGGREGATES_WHERE = "a.deployment_id = ANY(%(ids)s) AND w.rolled_up_at IS NOT NULL"
_AGGREGATE_KEY = (
    f"a.deployment_id, {_MINUTE.format(column='a.window_start')}, a.arm, a.drafter_version, a.category"
)
_AGGREGATE_MINUTES_SQL = f"""
    SELECT {_AGGREGATE_KEY}, sum(a.requests), sum(a.drafted_tokens), sum(a.accepted_tokens),
        sum(a.verify_steps), sum(a.generated_tokens), sum(a.prompt_tokens)
    FROM acceptance_aggregates a JOIN edge_windows w ON w.id = a.edge_window_id
    WHERE {_AGGREGATES_WHERE}
    GROUP BY 1, 2, 3, 4, 5
"""
_AGGREGATE_POSITIONS_SQL = f"""
    SELECT {_AGGREGATE_KEY}, p.position - 1, sum(p.value::bigint)
    FROM acceptance_aggregates a JOIN edge_windows w ON w.id = a.edge_window_id
    CROSS JOIN LATERAL json_array_elements_text(
        CASE WHEN a.speculated_requests > 0 AND json_typeof(a.sums -> 'accepted_per_position') = 'array'
        THEN a.sums -> 'accepted_per_position' ELSE '[]'::json END
    ) WITH ORDINALITY AS p(value, position)
    WHERE {_AGGREGATES_WHERE}
    GROUP BY 1, 2, 3, 4, 5, 6
"""
_ROLLUPS_SQL = """
    SELECT deployment_id, resolution_s, extract(epoch FROM bucket_start)::bigint, arm, drafter_version,
        category, requests, drafted_tokens, accepted_tokens, verify_steps, generated_tokens,
        prompt_tokens, timed_requests, total_ms_sum, CAST(accepted_per_position AS text),
        CAST(inter_token_hist AS text), CAST(total_ms_hist AS text), CAST(ttft_hist AS text)
    FROM acceptance_rollups WHERE deployment_id = ANY(%(ids)s)
"""
_SET_ASIDE_SQL = """
    SELECT
        (SELECT count(*) FROM acceptance_records WHERE deployment_id = ANY(%(ids)s)),
        (SELECT count(*) FROM quarantined_rollup_records WHERE deployment_id = ANY(%(ids)s)),
        (SELECT count(*) FROM acceptance_rollup_pending WHERE deployment_id = ANY(%(ids)s))
"""

# (deployment, resolution, bucket start in Unix seconds, arm, drafter version, category)
BucketKey = tuple[int, int, int, str, int, str]


@dataclass
class _Sums:
    counts: list[int] = field(default_factory=lambda: [0] * len(COUNT_COLUMNS))
    latency: list[float] = field(default_factory=lambda: [0.0] * len(LATENCY_COLUMNS))
    positions: dict[int, int] = field(default_factory=dict)
    from_aggregates: bool = False

    def add(self, other: _Sums) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.latency = [a + b for a, b in zip(self.latency, other.latency, strict=True)]
        for position, count in other.positions.items():
            self.positions[position] = self.positions.get(position, 0) + count
        self.from_aggregates |= other.from_aggregates


@dataclass(frozen=True)
class RollupAudit:
    """What the rollups of some deployments hold against their raw rows."""

    # Per resolution, the requests the rollups count beyond their raw rows, summed over buckets;
    # the headline is the worst resolution (each record is summed once into every resolution).
    double_counted_by_resolution: dict[int, int]
    missing_by_resolution: dict[int, int]
    # Buckets (any resolution) where any summed column differs, request counts equal or not.
    mismatched_buckets: int
    # Rows at a resolution the product does not keep.
    unknown_resolution_rows: int
    raw_records: int
    # Requests of edge aggregates already rolled up, summed with the records.
    aggregated_requests: int
    quarantined_records: int
    pending_records: int
    samples: list[str]

    @property
    def double_counted_records(self) -> int:
        return max(self.double_counted_by_resolution.values(), default=0)

    @property
    def missing_records(self) -> int:
        return max(self.missing_by_resolution.values(), default=0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "rollup_double_counted_records": self.double_counted_records,
            "rollup_missing_records": self.missing_records,
            "double_counted_by_resolution": {str(k): v for k, v in self.double_counted_by_resolution.items()},
            "missing_by_resolution": {str(k): v for k, v in self.missing_by_resolution.items()},
            "mismatched_buckets": self.mismatched_buckets,
            "unknown_resolution_rows": self.unknown_resolution_rows,
            "raw_records": self.raw_records,
            "aggregated_requests": self.aggregated_requests,
            "quarantined_records": self.quarantined_records,
            "pending_records": self.pending_records,
            "mismatch_samples": self.samples,
        }


def audit_rollups(dsn: str, deployment_ids: Sequence[int]) -> RollupAudit:
    """Compare the rollups of ``deployment_ids`` with their raw rows (psycopg ``dsn``)."""
    ids = {"ids": list(deployment_ids)}
    with psycopg.connect(dsn) as conn, conn.transaction():
        # One snapshot for every query, so rows committed meanwhile cannot skew one side.
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        minutes: dict[tuple[int, int, str, int, str], _Sums] = {}
        for row in conn.execute(_RECORD_MINUTES_SQL, ids):
            sums = _Sums(counts=[int(v) for v in row[5:11]], latency=[float(v) for v in row[11:16]])
            _merge(minutes, _key(row), sums)
        aggregated = 0
        for row in conn.execute(_AGGREGATE_MINUTES_SQL, ids):
            _merge(minutes, _key(row), _Sums(counts=[int(v) for v in row[5:11]], from_aggregates=True))
            aggregated += int(row[5])
        for sql in (_RECORD_POSITIONS_SQL, _AGGREGATE_POSITIONS_SQL):
            for row in conn.execute(sql, ids):
                _merge(minutes, _key(row), _Sums(positions={int(row[5]): int(row[6])}))
        rollup_rows = conn.execute(_ROLLUPS_SQL, ids).fetchall()
        set_aside = conn.execute(_SET_ASIDE_SQL, ids).fetchone()
    assert set_aside is not None
    stored: dict[BucketKey, _Sums] = {}
    kept_categories: dict[int, set[str]] = {}
    unknown = 0
    for row in rollup_rows:
        key: BucketKey = (int(row[0]), int(row[1]), int(row[2]), row[3], int(row[4]), row[5])
        if key[1] not in RESOLUTIONS:
            unknown += 1
            continue
        kept_categories.setdefault(key[0], set()).add(key[5])
        hists = [json.loads(text) or [] for text in row[15:18]]
        stored[key] = _Sums(
            counts=[int(v) for v in row[6:12]],
            latency=[float(row[12]), float(row[13]), *(float(sum(h[1:])) for h in hists)],
            positions={i: int(c) for i, c in enumerate(json.loads(row[14]) or []) if c},
        )
    expected: dict[BucketKey, _Sums] = {}
    for (deployment, minute, arm, version, category), sums in minutes.items():
        kept = kept_categories.get(deployment, set())
        if category not in kept and category not in ("", OVERFLOW_CATEGORY):
            category = OVERFLOW_CATEGORY  # past the cap (or a category nothing rolled up: missing)
        for resolution in RESOLUTIONS:
            bucket = (deployment, resolution, minute - minute % resolution, arm, version, category)
            into = expected.setdefault(bucket, _Sums())
            into.add(sums)
    double = dict.fromkeys(RESOLUTIONS, 0)
    missing = dict.fromkeys(RESOLUTIONS, 0)
    mismatched = 0
    samples: list[str] = []
    for bucket in sorted(expected.keys() | stored.keys()):
        want, have = expected.get(bucket, _Sums()), stored.get(bucket, _Sums())
        excess = have.counts[0] - want.counts[0]
        if excess > 0:
            double[bucket[1]] += excess
        elif excess < 0:
            missing[bucket[1]] -= excess
        difference = _difference(want, have)
        if difference is not None:
            mismatched += 1
            if len(samples) < 20:
                samples.append(f"{bucket}: {difference}")
    return RollupAudit(
        double_counted_by_resolution=double,
        missing_by_resolution=missing,
        mismatched_buckets=mismatched,
        unknown_resolution_rows=unknown,
        raw_records=int(set_aside[0]),
        aggregated_requests=aggregated,
        quarantined_records=int(set_aside[1]),
        pending_records=int(set_aside[2]),
        samples=samples,
    )


def _key(row: Sequence[Any]) -> tuple[int, int, str, int, str]:
    return int(row[0]), int(row[1]), str(row[2]), int(row[3]), str(row[4])


def _merge(into: dict[Any, _Sums], key: Any, sums: _Sums) -> None:
    present = into.get(key)
    if present is None:
        into[key] = sums
    else:
        present.add(sums)


def _difference(want: _Sums, have: _Sums) -> str | None:
    """The first summed column in which the stored bucket differs from the raw rows' sums."""
    for name, a, b in zip(COUNT_COLUMNS, want.counts, have.counts, strict=True):
        if a != b:
            return f"{name} {b} stored, {a} in the raw rows"
    wanted_positions = {i: c for i, c in want.positions.items() if c}
    if wanted_positions != {i: c for i, c in have.positions.items() if c}:
        return f"accepted_per_position {have.positions} stored, {wanted_positions} in the raw rows"
    if want.from_aggregates or have.from_aggregates:
        return None
    for name, a, b in zip(LATENCY_COLUMNS, want.latency, have.latency, strict=True):
        # Sums of latencies differ in the last bits with the order of addition; counts are exact.
        if not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6):
            return f"{name} {b} stored, {a} in the raw rows"
    return None
