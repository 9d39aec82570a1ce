"""Writing acceptance records: idempotent by request id, all or nothing per batch, fast.

PostgreSQL takes new rows through binary COPY (an order of magnitude faster than INSERTs);
SQLite through one executemany. Either way the per-minute rollups are updated in the same
transaction, from exactly the rows that were new, so a retried batch changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from sqlalchemy import insert, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.db.models import AcceptanceRecordRow, utcnow
from controlplane.errors import ValidationProblem
from controlplane.ingest.record import AcceptanceRecord
from controlplane.ingest.rollups import aggregate, apply_deltas

# Duplicate ids echoed back to the caller are capped so a huge retried batch stays a small reply.
MAX_ECHOED_DUPLICATES = 100
_LOOKUP_CHUNK = 5_000

COPY_COLUMNS = (
    "deployment_id",
    "request_id",
    "created_at",
    "arm",
    "drafter_version",
    "k",
    "drafted_tokens",
    "accepted_tokens",
    "verify_steps",
    "generated_tokens",
    "prompt_tokens",
    "accepted_per_position",
    "ttft_ms",
    "inter_token_ms",
    "total_ms",
    "category",
)
COPY_TYPES = (
    "int4",
    "text",
    "timestamptz",
    "text",
    "int4",
    "int2",
    "int4",
    "int4",
    "int4",
    "int4",
    "int4",
    "json",
    "float8",
    "float8",
    "float8",
    "text",
)
COPY_SQL = f"COPY acceptance_records ({', '.join(COPY_COLUMNS)}) FROM STDIN (FORMAT BINARY)"


@dataclass(slots=True)
class IngestResult:
    """What a batch did: rows stored, rows already present (a retry), and some of their ids."""

    received: int
    inserted: int
    duplicates: int
    duplicate_request_ids: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "received": self.received,
            "inserted": self.inserted,
            "duplicates": self.duplicates,
            "duplicate_request_ids": self.duplicate_request_ids,
        }


def _as_utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _check_unique_within_batch(records: Sequence[AcceptanceRecord]) -> None:
    seen: dict[str, int] = {}
    problems = []
    for index, rec in enumerate(records):
        first = seen.setdefault(rec.request_id, index)
        if first != index:
            problems.append(
                {"index": index, "field": "request_id", "message": f"duplicates record {first} in this batch"}
            )
    if problems:
        raise ValidationProblem("batch repeats request ids", details=problems)


def _existing_ids(session: Session, deployment_id: int, ids: list[str]) -> set[str]:
    if session.get_bind().dialect.name == "postgresql":
        # One array parameter instead of thousands of bound values.
        rows = session.execute(
            text(
                "SELECT request_id FROM acceptance_records"
                " WHERE deployment_id = :d AND request_id = ANY(:ids)"
            ),
            {"d": deployment_id, "ids": ids},
        )
        return {row[0] for row in rows}
    found: set[str] = set()
    for start in range(0, len(ids), _LOOKUP_CHUNK):
        chunk = ids[start : start + _LOOKUP_CHUNK]
        found.update(
            session.scalars(
                select(AcceptanceRecordRow.request_id).where(
                    AcceptanceRecordRow.deployment_id == deployment_id,
                    AcceptanceRecordRow.request_id.in_(chunk),
                )
            )
        )
    return found


def _copy_rows(
    session: Session, deployment_id: int, records: Sequence[AcceptanceRecord], now: datetime
) -> None:
    driver_conn: Any = session.connection().connection.driver_connection
    try:
        _copy_with(driver_conn, deployment_id, records, now)
    except psycopg.errors.IntegrityError as exc:
        # The raw COPY bypasses SQLAlchemy; give callers the same exception as the ORM path.
        raise IntegrityError(COPY_SQL, None, exc) from exc


def _copy_with(
    driver_conn: Any, deployment_id: int, records: Sequence[AcceptanceRecord], now: datetime
) -> None:
    with driver_conn.cursor() as cursor, cursor.copy(COPY_SQL) as copy:
        copy.set_types(COPY_TYPES)
        write = copy.write_row
        for rec in records:
            write(
                (
                    deployment_id,
                    rec.request_id,
                    rec.created_at or now,
                    rec.arm,
                    rec.drafter_version,
                    rec.k,
                    rec.drafted_tokens,
                    rec.accepted_tokens,
                    rec.verify_steps,
                    rec.generated_tokens,
                    rec.prompt_tokens,
                    rec.accepted_per_position,
                    rec.ttft_ms,
                    rec.inter_token_ms,
                    rec.total_ms,
                    rec.category,
                )
            )


def _insert_rows(
    session: Session, deployment_id: int, records: Sequence[AcceptanceRecord], now: datetime
) -> None:
    session.execute(
        insert(AcceptanceRecordRow),
        [
            {
                "deployment_id": deployment_id,
                "request_id": rec.request_id,
                "created_at": rec.created_at or now,
                "arm": rec.arm,
                "drafter_version": rec.drafter_version,
                "k": rec.k,
                "drafted_tokens": rec.drafted_tokens,
                "accepted_tokens": rec.accepted_tokens,
                "verify_steps": rec.verify_steps,
                "generated_tokens": rec.generated_tokens,
                "prompt_tokens": rec.prompt_tokens,
                "accepted_per_position": rec.accepted_per_position,
                "ttft_ms": rec.ttft_ms,
                "inter_token_ms": rec.inter_token_ms,
                "total_ms": rec.total_ms,
                "category": rec.category,
            }
            for rec in records
        ],
    )


def store_records(
    *, session: Session, deployment_id: int, records: Sequence[AcceptanceRecord]
) -> IngestResult:
    """Store one batch's new records and update rollups, inside the caller's transaction."""
    return store_batches(session=session, batches=[(deployment_id, records)])[0]


def store_batches(
    *, session: Session, batches: Sequence[tuple[int, Sequence[AcceptanceRecord]]]
) -> list[IngestResult]:
    """Store several batches (possibly of several deployments) in the caller's transaction.

    A request id already stored for the deployment, or already taken by an earlier batch of the
    same call, is skipped and reported as a duplicate of that batch, which makes retries
    idempotent. The common case (no stored ids) goes straight to COPY inside a savepoint; only
    when the unique constraint fires are stored ids looked up and skipped. A concurrent writer
    storing the same ids between lookup and write makes the constraint fail again; the caller
    then retries once.
    """
    for _, records in batches:
        _check_unique_within_batch(records)
    now = utcnow()
    # Per deployment: the records to write, in batch order, with in-call repeats set aside.
    planned: dict[int, list[AcceptanceRecord]] = {}
    repeated: list[set[str]] = []
    claimed: dict[int, set[str]] = {}
    for deployment_id, records in batches:
        taken = claimed.setdefault(deployment_id, set())
        repeats = set()
        for rec in records:
            if rec.created_at is not None:
                rec.created_at = _as_utc(rec.created_at)
            if rec.request_id in taken:
                repeats.add(rec.request_id)
            else:
                taken.add(rec.request_id)
                planned.setdefault(deployment_id, []).append(rec)
        repeated.append(repeats)
    stored_before: dict[int, set[str]] = {}
    for deployment_id, candidates in planned.items():
        existing: set[str] = set()
        fresh = candidates
        try:
            with session.begin_nested():
                _write_rows(session, deployment_id, fresh, now)
        except IntegrityError as exc:
            if not is_unique_violation(exc):
                raise
            existing = _existing_ids(session, deployment_id, [r.request_id for r in candidates])
            fresh = [r for r in candidates if r.request_id not in existing]
            if fresh:
                _write_rows(session, deployment_id, fresh, now)
        if fresh:
            apply_deltas(
                session=session, deployment_id=deployment_id, deltas=aggregate(fresh, when_default=now)
            )
        stored_before[deployment_id] = existing
    results = []
    for (deployment_id, records), repeats in zip(batches, repeated, strict=True):
        existing = stored_before.get(deployment_id, set())
        duplicates = [r.request_id for r in records if r.request_id in existing or r.request_id in repeats]
        results.append(
            IngestResult(
                received=len(records),
                inserted=len(records) - len(duplicates),
                duplicates=len(duplicates),
                duplicate_request_ids=duplicates[:MAX_ECHOED_DUPLICATES],
            )
        )
    return results


def _write_rows(
    session: Session, deployment_id: int, records: Sequence[AcceptanceRecord], now: datetime
) -> None:
    if session.get_bind().dialect.name == "postgresql":
        _copy_rows(session, deployment_id, records, now)
    else:
        _insert_rows(session, deployment_id, records, now)
        session.flush()


def is_unique_violation(exc: IntegrityError) -> bool:
    """True when a concurrent writer stored one of our request ids first."""
    text = str(exc.orig).lower()
    return "uq_acceptance_records_deployment_request" in text or (
        "unique" in text and "acceptance_records" in text
    )
