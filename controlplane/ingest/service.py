"""Writing acceptance records: idempotent by request id, all or nothing per batch, fast.

Idempotency compares content: a request id already stored with the same values is a duplicate
(skipped and reported), the same id with different values is a conflict (409 naming the ids)
and nothing of that batch is stored. The rollup fold never stops on one record: a stored row
whose sums it cannot take (a value from before the ingest limits) is moved aside to
``quarantined_rollup_records`` with the reason, and counted in the stats and ``/metrics``.

PostgreSQL takes large batches through binary COPY (an order of magnitude faster than INSERTs)
and small ones through one INSERT ... ON CONFLICT DO NOTHING RETURNING, a single round trip
that also names the rows it stored; SQLite takes every batch through one executemany. The
rollups are updated from exactly the rows that were new, so a retried batch changes nothing:
in the same transaction, or, for a small batch on PostgreSQL when the caller asks
(``defer_rollups``), by a later fold that sums many such batches' records at once
(fold_pending_rollups; the API's batcher runs it within a fraction of a second, and every
reader of rollups runs it first). Every path sums through controlplane.ingest.rollups, which keys
the rollups by the records' category too (capped per deployment; the raw record keeps its own).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Engine, func, insert, select
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.orm import Session

from controlplane.db.models import AcceptanceRecordRow, QuarantinedRollupRecord
from controlplane.db.session import driver_cursor, json_dumps
from controlplane.errors import ConflictError, ValidationProblem
from controlplane.ingest.formats import MAX_COUNT, MAX_K, MAX_LATENCY_MS, NATIVE_FIELDS
from controlplane.ingest.record import AcceptanceRecord
from controlplane.ingest.rollups import RollupDelta, RollupKey, aggregate, apply_deltas
from controlplane.timestamps import as_utc, utcnow

log = logging.getLogger(__name__)

# Duplicate ids echoed back to the caller are capped so a huge retried batch stays a small reply.
MAX_ECHOED_DUPLICATES = 100
_LOOKUP_CHUNK = 5_000
# Batches up to this size skip COPY on PostgreSQL: COPY needs a savepoint around it (and, when a
# stored id makes it fail, a lookup and a second write), three or more round trips where the
# INSERT below takes one. Past it, COPY's speed per row wins.
SMALL_BATCH_RECORDS = 64

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
    "from_serving_key",
    "draft_stop_counts",
    "counted_in_aggregate",
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
    "bool",
    "json",
    "bool",
)
COPY_SQL = f"COPY acceptance_records ({', '.join(COPY_COLUMNS)}) FROM STDIN (FORMAT BINARY)"

# Small batches go in as one INSERT ... ON CONFLICT DO NOTHING RETURNING that takes each column
# as one array: the statement's text is the same whatever the number of rows, so the server
# prepares it once, where a multi-row VALUES list is a new statement for every batch size (and
# past 50 parameters psycopg parses it again on every call). Rows go in in array order
# (request-id order, see _store_postgres).
_ARRAY_COLUMNS = COPY_COLUMNS[1:]
_ARRAYS = ", ".join(
    f"CAST(%({name})s AS {kind}[])" for name, kind in zip(_ARRAY_COLUMNS, COPY_TYPES[1:], strict=True)
)
_INSERT_NEW_FROM_ARRAYS_SQL = f"""
    INSERT INTO acceptance_records ({", ".join(COPY_COLUMNS)})
    SELECT %(deployment_id)s, {", ".join(f"r.{name}" for name in _ARRAY_COLUMNS)}
    FROM unnest({_ARRAYS})
         WITH ORDINALITY AS r({", ".join(_ARRAY_COLUMNS)}, position)
    ORDER BY r.position
    ON CONFLICT ON CONSTRAINT uq_acceptance_records_deployment_request DO NOTHING
    RETURNING request_id
"""
# The same insert, also queueing each stored row for the rollup fold (see fold_pending_rollups).
_RETURNING_IDS = _INSERT_NEW_FROM_ARRAYS_SQL.replace(
    "RETURNING request_id", "RETURNING id, request_id, counted_in_aggregate"
)
_INSERT_NEW_DEFERRING_ROLLUPS_SQL = f"""
    WITH stored AS ({_RETURNING_IDS}),
    queued AS (
        INSERT INTO acceptance_rollup_pending (record_id, deployment_id)
        SELECT id, %(deployment_id)s FROM stored WHERE NOT counted_in_aggregate
    )
    SELECT request_id FROM stored
"""
# Records taken per fold statement: a fold of a busy API's last fraction of a second is a few
# dozen; a backlog (folds failing while the database was away) is taken in chunks, each summed
# into the fold's deltas at once, so memory holds one chunk of rows whatever the backlog.
FOLD_CHUNK_RECORDS = 5_000
# A fold reads the columns every write path stores (aggregate() reads most of them by name),
# except who wrote the record, which no rollup splits by: earlier revisions' migrations fold
# with this code on a table that has no such column yet.
# The draft-stop counts are left out for the same reason (and no rollup sums them).
_UNFOLDED_COLUMNS = ("from_serving_key", "draft_stop_counts", "counted_in_aggregate")
_FOLDED_COLUMNS = ", ".join(
    ["r.id", *(f"r.{name}" for name in COPY_COLUMNS if name not in _UNFOLDED_COLUMNS)]
)
# Pending rows are taken, and so locked, in record order by every fold, whatever its filter,
# and each fold runs in a transaction of its own that locks rollup rows only after it holds
# every pending row it takes: a transaction waiting for pending rows then never holds a rollup
# row, so folds, and the flushes that lock rollup rows, cannot wait on each other in a cycle.
_FOLD_SQL_TEMPLATE = """
    WITH taken AS (
        DELETE FROM acceptance_rollup_pending
        WHERE record_id IN (
            SELECT record_id FROM acceptance_rollup_pending {where}
            ORDER BY record_id LIMIT %(limit)s FOR UPDATE
        )
        RETURNING record_id
    )
    SELECT {columns} FROM acceptance_records r JOIN taken ON r.id = taken.record_id
"""
_FOLD_ALL_SQL = _FOLD_SQL_TEMPLATE.format(where="", columns=_FOLDED_COLUMNS)
_FOLD_DEPLOYMENTS_SQL = _FOLD_SQL_TEMPLATE.format(
    where="WHERE deployment_id = ANY(%(deployment_ids)s)", columns=_FOLDED_COLUMNS
)


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
    with driver_cursor(session) as cursor, cursor.copy(COPY_SQL) as copy:
        copy.set_types(COPY_TYPES)
        write = copy.write_row
        for rec in records:
            write(_row(deployment_id, rec, now))


def _row(deployment_id: int, rec: AcceptanceRecord, now: datetime) -> tuple[Any, ...]:
    """One record's column values in COPY_COLUMNS order: the one mapping every write path uses."""
    return (
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
        rec.from_serving_key,
        rec.draft_stop_counts,
        rec.counted_in_aggregate,
    )


def _row_values(
    deployment_id: int, records: Sequence[AcceptanceRecord], now: datetime
) -> list[dict[str, Any]]:
    return [dict(zip(COPY_COLUMNS, _row(deployment_id, rec, now), strict=True)) for rec in records]


def _column_arrays(deployment_id: int, records: Sequence[AcceptanceRecord], now: datetime) -> dict[str, Any]:
    """The parameters of _INSERT_NEW_FROM_ARRAYS: each column but deployment_id as one list."""
    # Lists, not tuples: psycopg sends a list as an array and a tuple as a record.
    columns = [
        list(column) for column in zip(*(_row(deployment_id, rec, now) for rec in records), strict=True)
    ]
    params: dict[str, Any] = dict(zip(COPY_COLUMNS, columns, strict=True))
    params["deployment_id"] = deployment_id
    params["accepted_per_position"] = [json_dumps(p) for p in params["accepted_per_position"]]
    params["draft_stop_counts"] = [None if c is None else json_dumps(c) for c in params["draft_stop_counts"]]
    return params


def _insert_rows(
    session: Session, deployment_id: int, records: Sequence[AcceptanceRecord], now: datetime
) -> None:
    session.execute(insert(AcceptanceRecordRow), _row_values(deployment_id, records, now))


def _insert_new_rows(
    session: Session,
    deployment_id: int,
    records: Sequence[AcceptanceRecord],
    now: datetime,
    *,
    defer_rollups: bool = False,
) -> set[str]:
    """PostgreSQL: store the records whose id is not yet stored (queueing them for the rollup
    fold when ``defer_rollups``); returns the ids stored.

    ON CONFLICT DO NOTHING waits for a concurrent writer of the same id and then skips it, so
    this never fails on a duplicate and needs no savepoint. It runs in every single-record
    ingest flush, so it goes straight to the driver (see driver_cursor).
    """
    sql = _INSERT_NEW_DEFERRING_ROLLUPS_SQL if defer_rollups else _INSERT_NEW_FROM_ARRAYS_SQL
    with driver_cursor(session) as cursor:
        cursor.execute(sql, _column_arrays(deployment_id, records, now), prepare=True)
        return {row.request_id for row in cursor.fetchall()}


def rollups_deferrable(record_count: int) -> bool:
    """Whether a deployment's records of one store_batches call may defer their rollup sums:
    those that go in by one INSERT (a COPY's batch is large enough to sum in place cheaply)."""
    return record_count <= SMALL_BATCH_RECORDS


def fold_pending_rollups(*, session: Session, deployment_ids: Sequence[int] | None = None) -> int:
    """Add the rollup sums of records stored with deferred rollups (of the given deployments,
    or all) in the caller's transaction, which must hold no rollup row yet (a fresh one: see
    _FOLD_SQL_TEMPLATE); returns how many records were folded (quarantined ones included). A
    no-op on SQLite, which never defers.

    Each pending row is deleted in the statement that reads its record, so a record is summed
    once whichever of several concurrent folds takes it: a fold waits for rows another one
    holds and then skips them (gone once that one commits), and a fold that fails leaves them
    for the next. Every pending row is taken before any rollup row is locked.

    A record whose sums cannot be stored (see unfoldable_reason) is quarantined instead of
    summed. Should the fold fail for a reason no check foresaw (the database still reachable),
    it is undone and run again deployment by deployment, each in a savepoint, and only a
    deployment whose sums fail goes record by record, the records that fail alone quarantined:
    no row can stop the folds after it, nor slow another deployment's fold to one record at a
    time (record by record, a fold of every deployment's backlog fell behind the ingest of a
    poisoning account's neighbours: 2,855 of their records still unfolded 30 s after it stopped).
    """
    if session.get_bind().dialect.name != "postgresql":
        return 0
    try:
        with session.begin_nested():
            return _fold(session, deployment_ids, one_by_one=False)
    except Exception as exc:
        if database_unreachable(exc):
            raise
        log.warning("rollup fold failed (%s: %s); folding deployment by deployment", type(exc).__name__, exc)
    return _fold(session, deployment_ids, one_by_one=True)


def _fold(session: Session, deployment_ids: Sequence[int] | None, *, one_by_one: bool) -> int:
    params: dict[str, Any] = {"limit": FOLD_CHUNK_RECORDS}
    if deployment_ids is None:
        sql = _FOLD_ALL_SQL
    else:
        sql = _FOLD_DEPLOYMENTS_SQL
        params["deployment_ids"] = list(deployment_ids)
    deltas: dict[int, dict[RollupKey, RollupDelta]] = {}
    folded = 0
    now = utcnow()
    while True:
        with driver_cursor(session) as cursor:
            cursor.execute(sql, params, prepare=True)
            rows = cursor.fetchall()
        by_deployment: dict[int, list[Any]] = {}
        quarantine: list[tuple[Any, str]] = []
        for row in rows:
            reason = unfoldable_reason(row)
            if reason is None:
                by_deployment.setdefault(row.deployment_id, []).append(row)
            else:
                quarantine.append((row, reason))
        # Deployments in id order, the order every writer locks rollup rows in.
        for deployment_id, records in sorted(by_deployment.items()):
            if one_by_one:
                quarantine += _apply_isolating(session, deployment_id, records, now)
                continue
            # The rows carry every attribute aggregate() reads, under the record's names.
            into = deltas.setdefault(deployment_id, {})
            for key, delta in aggregate(cast(list[AcceptanceRecord], records), when_default=now).items():
                if key in into:
                    into[key].add(delta)
                else:
                    into[key] = delta
        _quarantine(session, quarantine)
        folded += len(rows)
        if len(rows) < FOLD_CHUNK_RECORDS:
            break
    for deployment_id, summed in sorted(deltas.items()):
        apply_deltas(session=session, deployment_id=deployment_id, deltas=summed)
    return folded


def _apply_isolating(
    session: Session, deployment_id: int, records: Sequence[Any], now: datetime
) -> list[tuple[Any, str]]:
    """Add one deployment's records to the rollups in a savepoint; should that fail (the database
    reachable), add them one by one, each in a savepoint of its own. Returns the records that
    failed alone, with the reason."""
    try:
        with session.begin_nested():
            apply_deltas(
                session=session,
                deployment_id=deployment_id,
                deltas=aggregate(cast(list[AcceptanceRecord], records), when_default=now),
            )
        return []
    except Exception as exc:
        if database_unreachable(exc):
            raise
    failed: list[tuple[Any, str]] = []
    for record in records:
        try:
            with session.begin_nested():
                apply_deltas(
                    session=session, deployment_id=deployment_id, deltas=aggregate([record], when_default=now)
                )
        except Exception as exc:
            if database_unreachable(exc):
                raise
            failed.append((record, f"{type(exc).__name__}: {exc}"))
    return failed


def unfoldable_reason(record: Any) -> str | None:
    """Why a stored record's values cannot be added to the rollups, or None when they can.

    The ingest limits (controlplane.ingest.formats.storage_problems) keep such values out; a
    row stored before them (or written around the API) may still hold one, e.g. a latency whose
    log-histogram bucket or running sum is not a finite number.
    """
    for name in ("ttft_ms", "inter_token_ms", "total_ms"):
        value = getattr(record, name)
        if value is not None and not (math.isfinite(value) and 0.0 <= value <= MAX_LATENCY_MS):
            return f"{name} is {value!r}: outside 0..{MAX_LATENCY_MS:.0f} ms"
    for name in ("drafted_tokens", "accepted_tokens", "verify_steps", "generated_tokens"):
        value = getattr(record, name)
        if not 0 <= value <= MAX_COUNT:
            return f"{name} is {value}: outside 0..{MAX_COUNT}"
    positions = record.accepted_per_position
    if positions is None:
        return None
    if not isinstance(positions, list) or len(positions) > MAX_K:
        return f"accepted_per_position is not a list of at most {MAX_K} counts"
    if not all(type(count) is int and 0 <= count <= MAX_COUNT for count in positions):
        return f"accepted_per_position holds a value that is not a count in 0..{MAX_COUNT}"
    return None


# Reasons are stored for people to read; the column holds 500 characters.
_MAX_REASON_CHARS = 500


def _quarantine(session: Session, rows: Sequence[tuple[Any, str]]) -> None:
    if not rows:
        return
    now = utcnow()
    for row, reason in rows:
        log.warning(
            "rollup fold quarantined record %s of deployment %s: %s", row.id, row.deployment_id, reason
        )
    session.execute(
        insert(QuarantinedRollupRecord),
        [
            {
                "deployment_id": row.deployment_id,
                "record_id": row.id,
                "reason": reason[:_MAX_REASON_CHARS],
                "quarantined_at": now,
            }
            for row, reason in rows
        ],
    )


def quarantined_counts(*, session: Session, deployment_ids: Sequence[int]) -> dict[int, int]:
    """How many records the rollup fold set aside, per deployment (absent: none)."""
    if not deployment_ids:
        return {}
    q = QuarantinedRollupRecord
    rows = session.execute(
        select(q.deployment_id, func.count())
        .where(q.deployment_id.in_(list(deployment_ids)))
        .group_by(q.deployment_id)
    )
    return {int(deployment_id): int(count) for deployment_id, count in rows}


def database_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database (or the connection to it) is away, rather than that it
    refused what one statement asked: then retrying piece by piece cannot help."""
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def fold_before_reading(*, session: Session, deployment_ids: Sequence[int]) -> None:
    """Fold the deployments' deferred rollup sums before ``session`` reads their rollups, so
    that the read counts every acknowledged record.

    The fold commits in a transaction of its own (on a connection of the session's engine),
    as every fold must, whatever the reader's transaction holds or does next. A session bound
    to one connection (tests binding everything to a transaction they roll back) folds in
    its own transaction instead: nothing there defers (the batcher defers only on an engine).
    """
    bind = session.get_bind()
    if bind.dialect.name != "postgresql" or not deployment_ids:
        return
    if isinstance(bind, Engine):
        with Session(bind=bind) as own:
            fold_pending_rollups(session=own, deployment_ids=deployment_ids)
            own.commit()
    else:
        fold_pending_rollups(session=session, deployment_ids=deployment_ids)


def store_records(
    *, session: Session, deployment_id: int, records: Sequence[AcceptanceRecord]
) -> IngestResult:
    """Store one batch's new records and update rollups, inside the caller's transaction."""
    return store_batches(session=session, batches=[(deployment_id, records)])[0]


def store_batches(
    *,
    session: Session,
    batches: Sequence[tuple[int, Sequence[AcceptanceRecord]]],
    defer_rollups: bool = False,
) -> list[IngestResult]:
    """Store several batches (possibly of several deployments) in the caller's transaction.

    A request id already stored for the deployment, or already taken by an earlier batch of the
    same call, is skipped and reported as a duplicate of that batch, which makes retries
    idempotent. On PostgreSQL no duplicate, even one a concurrent writer is storing, makes this
    fail (see _store_postgres); on SQLite a lookup after a conflict finds the stored ids.

    With ``defer_rollups``, a deployment's records that go in by one INSERT (at most
    SMALL_BATCH_RECORDS, on PostgreSQL) are queued for fold_pending_rollups instead of summed
    here; the caller must see that a fold follows.
    """
    for _, records in batches:
        _check_unique_within_batch(records)
    now = utcnow()
    # Per deployment: the records to write, in batch order, with in-call repeats set aside.
    planned: dict[int, list[AcceptanceRecord]] = {}
    repeated: list[set[str]] = []
    claimed: dict[int, dict[str, AcceptanceRecord]] = {}
    conflicts: list[tuple[str, str]] = []
    for deployment_id, records in batches:
        taken = claimed.setdefault(deployment_id, {})
        repeats = set()
        for rec in records:
            if rec.created_at is not None:
                rec.created_at = as_utc(rec.created_at)
            first = taken.get(rec.request_id)
            if first is not None:
                repeats.add(rec.request_id)
                difference = content_difference(first, rec)
                if difference is not None:
                    conflicts.append((rec.request_id, difference))
            else:
                taken[rec.request_id] = rec
                planned.setdefault(deployment_id, []).append(rec)
        repeated.append(repeats)
    if conflicts:
        raise ConflictingRecordsError(conflicts)
    stored_before: dict[int, set[str]] = {}
    postgres = session.get_bind().dialect.name == "postgresql"
    # Deployments in id order, like the rows inside each: concurrent writers lock in one order.
    for deployment_id, candidates in sorted(planned.items()):
        deferred = postgres and defer_rollups and rollups_deferrable(len(candidates))
        if postgres:
            fresh, existing = _store_postgres(session, deployment_id, candidates, now, defer_rollups=deferred)
        else:
            fresh, existing = _store_sqlite(session, deployment_id, candidates, now)
        if existing:
            conflicts += _stored_differently(session, deployment_id, claimed[deployment_id], existing)
        if conflicts:
            break  # the transaction is undone: nothing more to write
        # A sampled record also counted in an edge aggregate is in the rollups through it.
        to_roll_up = [rec for rec in fresh if not rec.counted_in_aggregate]
        if to_roll_up and not deferred:
            apply_deltas(
                session=session, deployment_id=deployment_id, deltas=aggregate(to_roll_up, when_default=now)
            )
        stored_before[deployment_id] = existing
    if conflicts:
        raise ConflictingRecordsError(conflicts)
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


# Conflicting ids named in a 409, like the duplicates echoed in a 200: a small reply whatever
# the batch.
MAX_ECHOED_CONFLICTS = 100


class ConflictingRecordsError(ConflictError):
    """Request ids already stored (or repeated by a batch of the same flush) with different
    values: a 409 naming them; the caller's transaction must be rolled back (nothing stored)."""

    def __init__(self, conflicts: Sequence[tuple[str, str]]) -> None:
        shown = [{"field": "request_id", "request_id": rid, "message": why} for rid, why in conflicts]
        more = len(conflicts) - MAX_ECHOED_CONFLICTS
        super().__init__(
            f"{len(conflicts)} request id(s) already stored with different content; nothing of this "
            "batch was stored (a retry must resend the same values; new data needs new request ids)",
            details=shown[:MAX_ECHOED_CONFLICTS]
            + ([{"field": "request_id", "message": f"and {more} more"}] if more > 0 else []),
        )
        self.request_ids = [rid for rid, _ in conflicts]


# The record's values a retry must repeat exactly: every field a client sends but its id, and
# created_at, compared apart (a retry without one matches any stored time).
_CONTENT_FIELDS = tuple(name for name in NATIVE_FIELDS if name not in ("request_id", "created_at"))


def content_difference(stored: Any, sent: AcceptanceRecord) -> str | None:
    """The first value in which ``sent`` differs from ``stored`` (a record or a stored row), as a
    message; None when ``sent`` repeats it. A ``sent`` record without ``created_at`` (stamped by
    the server) matches any stored time."""
    for name in _CONTENT_FIELDS:
        before, now = getattr(stored, name), getattr(sent, name)
        if name == "accepted_per_position":
            before, now = list(before or []), list(now or [])
        if before != now:
            return f"{name} is {before!r} in the stored record but {now!r} in this one"
    if sent.created_at is not None and stored.created_at is not None:
        if as_utc(stored.created_at) != as_utc(sent.created_at):
            return (
                f"created_at is {as_utc(stored.created_at).isoformat()} in the stored record but "
                f"{as_utc(sent.created_at).isoformat()} in this one"
            )
    return None


def _stored_differently(
    session: Session, deployment_id: int, sent: dict[str, AcceptanceRecord], ids: set[str]
) -> list[tuple[str, str]]:
    """(request id, difference) for each of ``ids`` stored with other values than ``sent``."""
    r = AcceptanceRecordRow
    columns = [r.request_id, r.created_at, *(getattr(r, name) for name in _CONTENT_FIELDS)]
    ordered = sorted(ids)
    conflicts: list[tuple[str, str]] = []
    for start in range(0, len(ordered), _LOOKUP_CHUNK):
        chunk = ordered[start : start + _LOOKUP_CHUNK]
        rows = session.execute(
            select(*columns).where(r.deployment_id == deployment_id, r.request_id.in_(chunk))
        )
        for row in rows:
            difference = content_difference(row, sent[row.request_id])
            if difference is not None:
                conflicts.append((row.request_id, difference))
    return conflicts


def _request_id(record: AcceptanceRecord) -> str:
    return record.request_id


def _store_postgres(
    session: Session,
    deployment_id: int,
    candidates: list[AcceptanceRecord],
    now: datetime,
    *,
    defer_rollups: bool = False,
) -> tuple[list[AcceptanceRecord], set[str]]:
    """Write the candidates not stored yet; returns (written, ids already stored).

    A large batch goes by COPY inside a savepoint. Should an id already be stored (a retry), or
    be written by a concurrent writer meanwhile, the savepoint is undone and the batch goes
    through INSERT ... ON CONFLICT DO NOTHING instead, which skips such ids, waiting for a
    concurrent writer to finish first, and so never fails on a duplicate however many writers
    race on the same ids. Rows go in request-id order: a writer waits on another's uncommitted
    id only, and every writer takes its ids in the same order, so two batches sharing ids
    cannot deadlock.
    """
    candidates = sorted(candidates, key=_request_id)
    if len(candidates) > SMALL_BATCH_RECORDS:
        try:
            with session.begin_nested():
                _copy_rows(session, deployment_id, candidates, now)
            return candidates, set()
        except IntegrityError as exc:
            if not is_unique_violation(exc):
                raise
    stored = _insert_new_rows(session, deployment_id, candidates, now, defer_rollups=defer_rollups)
    if len(stored) == len(candidates):
        return candidates, set()
    return [r for r in candidates if r.request_id in stored], {r.request_id for r in candidates} - stored


def _store_sqlite(
    session: Session, deployment_id: int, candidates: list[AcceptanceRecord], now: datetime
) -> tuple[list[AcceptanceRecord], set[str]]:
    """Write the candidates not stored yet; returns (written, ids already stored).

    SQLite has one writer at a time, so ids looked up after a conflict cannot change before
    the second write.
    """
    try:
        with session.begin_nested():
            _insert_rows(session, deployment_id, candidates, now)
            session.flush()
        return candidates, set()
    except IntegrityError as exc:
        if not is_unique_violation(exc):
            raise
    existing = _existing_ids(session, deployment_id, [r.request_id for r in candidates])
    fresh = [r for r in candidates if r.request_id not in existing]
    if fresh:
        _insert_rows(session, deployment_id, fresh, now)
        session.flush()
    return fresh, existing


def is_unique_violation(exc: IntegrityError) -> bool:
    """True when a concurrent writer stored one of our request ids first."""
    text = str(exc.orig).lower()
    return "uq_acceptance_records_deployment_request" in text or (
        "unique" in text and "acceptance_records" in text
    )
