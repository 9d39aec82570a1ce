"""Daily time partitions of ``acceptance_aggregates`` and the retention of acceptance data.

On PostgreSQL ``acceptance_aggregates`` is declared ``PARTITION BY RANGE (window_start)`` with one
partition per UTC day (``acceptance_aggregates_pYYYYMMDD``) and a DEFAULT partition. Edges may send
a window up to seven days late, and a partition may be missing (a fresh install, a maintenance
task that did not run for days): the DEFAULT partition takes such rows so that an insert never
fails, and :func:`ensure_partitions` moves them into their day's partition when it creates it, so
the DEFAULT partition is empty in steady state (creating a partition scans it).

Retention (:func:`apply_acceptance_retention`) is per account (``accounts.acceptance_retention_days``):

* a daily partition whose whole day is older than the *longest* retention among accounts is
  detached and dropped: O(1), nothing to vacuum. Rows of accounts with that longest retention
  therefore live up to a day past it; rows of accounts with a shorter retention are deleted from
  the remaining older partitions in bounded batches;
* ``edge_windows`` (the ledger of aggregate ingest) is kept for the longest retention, and never
  less than the time an edge may still resend a window, or a late retry would be stored twice; a
  window whose sums are not in the rollups yet keeps its row until the rollup fold adds them;
* raw ``acceptance_records`` are deleted past their account's retention, in batches. That table
  stays unpartitioned: its idempotency key ``(deployment_id, request_id)`` cannot include the
  time, and on a partitioned table PostgreSQL only enforces unique constraints that include the
  partition key. A record whose rollup sums are still pending is kept until they are folded;
* rollups (``acceptance_rollups``) are never touched: dashboards and statistics keep their history.

SQLite, and a PostgreSQL table made without partitions (say by ``Base.metadata.create_all``), get
the same retention through DELETEs alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from functools import partial
from typing import Any, cast

from sqlalchemy import CursorResult, Delete, delete, exists, select, text, tuple_
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from controlplane.db.models import (
    AcceptanceAggregateRow,
    AcceptanceRecordRow,
    AcceptanceRollupPendingRow,
    Account,
    Deployment,
    EdgeWindowRow,
)
from controlplane.ingest.aggregates import MAX_WINDOW_AGE
from controlplane.timestamps import as_utc

TABLE = "acceptance_aggregates"
DEFAULT_PARTITION = f"{TABLE}_default"
DAILY_PARTITION = re.compile(rf"^{TABLE}_p(\d{{8}})$")
# Hourly maintenance keeps this many days ready beyond today, so a few missed runs cost nothing.
DAYS_AHEAD = 3
DEFAULT_RETENTION_DAYS = 14
MIN_RETENTION_DAYS = 1
MAX_RETENTION_DAYS = 3_650
# A retried edge window is recognised by its ledger row for as long as it may still be sent.
MIN_LEDGER_KEEP = MAX_WINDOW_AGE + timedelta(days=1)
DELETE_BATCH_ROWS = 10_000
DEPLOYMENT_CHUNK = 1_000
# Partition changes take an ACCESS EXCLUSIVE lock on the parent table; two maintenance runs wait
# for each other on this transaction-scoped advisory lock instead of racing on the catalog.
ADVISORY_LOCK = f"SELECT pg_advisory_xact_lock(hashtext('{TABLE} partitions'))"

Bind = Session | Connection


@dataclass(frozen=True, slots=True)
class PartitionInfo:
    """One partition of ``acceptance_aggregates``: its day (None for the DEFAULT partition), the
    planner's row estimate (None until the table was first analysed) and its size on disk."""

    name: str
    day: date | None
    rows_estimate: int | None
    total_bytes: int


@dataclass(slots=True)
class RetentionOutcome:
    """What one retention pass removed."""

    partitions_dropped: list[str] = field(default_factory=list)
    aggregates_deleted: int = 0
    edge_windows_deleted: int = 0
    records_deleted: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "partitions_dropped": len(self.partitions_dropped),
            "rows_deleted": {
                "acceptance_aggregates": self.aggregates_deleted,
                "edge_windows": self.edge_windows_deleted,
                "acceptance_records": self.records_deleted,
            },
        }


def partition_name(day: date) -> str:
    """The daily partition holding windows that start on ``day`` (UTC).

    >>> partition_name(date(2026, 12, 3))
    'acceptance_aggregates_p20261203'
    """
    return f"{TABLE}_p{day:%Y%m%d}"


def partition_day(name: str) -> date | None:
    """The day of a daily partition's name; None for any other table name.

    >>> partition_day("acceptance_aggregates_p20261203"), partition_day("acceptance_aggregates_default")
    (datetime.date(2026, 12, 3), None)
    """
    match = DAILY_PARTITION.match(name)
    return datetime.strptime(match.group(1), "%Y%m%d").date() if match else None


def is_partition(name: str) -> bool:
    """Whether ``name`` is one of the partitions this module manages (schema comparisons skip them:
    the models declare only the parent table)."""
    return name == DEFAULT_PARTITION or partition_day(name) is not None


def ensure_partitions(
    *, bind: Bind, now: datetime, days_ahead: int = DAYS_AHEAD, lock_timeout_s: float | None = None
) -> list[str]:
    """Create the DEFAULT partition and the daily partitions from today to ``days_ahead`` days
    ahead that are missing, plus one for every day found in the DEFAULT partition (its rows are
    moved in); the names created, in day order.

    Idempotent, and safe with several processes at once: they take turns on an advisory lock
    (``CREATE TABLE IF NOT EXISTS`` alone still races in the catalog), and the later one finds the
    partitions made. Runs in the caller's transaction; once it created a partition, that
    transaction holds the table's exclusive lock until it ends, so commit soon. A table that is
    not partitioned (SQLite, ``create_all``) needs nothing: [].
    """
    connection = _connection(bind)
    if not _is_partitioned(connection):
        return []
    _lock(connection, lock_timeout_s)
    existing = set(_children(connection))
    created: list[str] = []
    if DEFAULT_PARTITION not in existing:
        connection.exec_driver_sql(
            f"CREATE TABLE IF NOT EXISTS {DEFAULT_PARTITION} PARTITION OF {TABLE} DEFAULT"
        )
        created.append(DEFAULT_PARTITION)
    stranded = _days_in_default(connection)
    today = as_utc(now).date()
    wanted = {today + timedelta(days=ahead) for ahead in range(days_ahead + 1)} | stranded
    for day in sorted(wanted):
        name = partition_name(day)
        if name not in existing:
            _create_day_partition(connection, day, move_from_default=day in stranded)
            created.append(name)
    return created


def apply_acceptance_retention(
    *,
    session: Session,
    now: datetime,
    batch_rows: int = DELETE_BATCH_ROWS,
    lock_timeout_s: float | None = None,
) -> RetentionOutcome:
    """Remove acceptance data past each account's retention (see the module docstring).

    Commits as it goes: right after dropping partitions (which lock the whole table until the
    transaction ends) and after every batch of at most ``batch_rows`` deleted rows, so no pass holds
    one long transaction open (that would hold back vacuum across the database). A pass cut short
    keeps what it removed; the next one continues.
    """
    moment = as_utc(now)
    retention = {
        int(account_id): _clamped_days(days)
        for account_id, days in session.execute(select(Account.id, Account.acceptance_retention_days))
    }
    longest = max(retention.values(), default=DEFAULT_RETENTION_DAYS)
    outcome = RetentionOutcome()
    partitioned = _is_partitioned(session.connection())
    if partitioned:
        kept_by_anyone = moment - timedelta(days=longest)
        outcome.partitions_dropped = _drop_partitions_before(session, kept_by_anyone, lock_timeout_s)
        session.commit()
        outcome.aggregates_deleted += _delete_old_default_rows(session, kept_by_anyone, batch_rows)
    accounts_by_days: dict[int, list[int]] = {}
    for account_id, days in retention.items():
        accounts_by_days.setdefault(days, []).append(account_id)
    for days, account_ids in sorted(accounts_by_days.items()):
        cutoff = moment - timedelta(days=days)
        for deployment_ids in _deployment_chunks(session, account_ids):
            # Whole days past the longest retention went with their partitions; what these accounts
            # keep beyond it lasts at most a day longer, not worth deleting row by row.
            if not partitioned or days < longest:
                outcome.aggregates_deleted += _delete_in_batches(
                    session, partial(_aggregates_before, deployment_ids, cutoff), batch_rows
                )
            outcome.records_deleted += _delete_in_batches(
                session, partial(_records_before, deployment_ids, cutoff), batch_rows
            )
    ledger_cutoff = moment - max(timedelta(days=longest), MIN_LEDGER_KEEP)
    outcome.edge_windows_deleted = _delete_in_batches(
        session, partial(_edge_windows_received_before, ledger_cutoff), batch_rows
    )
    return outcome


def partition_report(*, session: Session) -> list[PartitionInfo]:
    """Every partition of ``acceptance_aggregates``, by day, the DEFAULT partition last; [] when
    the table is not partitioned."""
    connection = session.connection()
    if not _is_partitioned(connection):
        return []
    rows = connection.execute(
        text(
            "SELECT c.relname, c.reltuples, pg_total_relation_size(c.oid) AS total_bytes"
            " FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = to_regclass(:parent)"
        ),
        {"parent": TABLE},
    ).all()
    report = [
        PartitionInfo(
            name=str(row.relname),
            day=partition_day(str(row.relname)),
            # reltuples is -1 for a table never vacuumed or analysed (PostgreSQL 14 and later).
            rows_estimate=int(row.reltuples) if row.reltuples >= 0 else None,
            total_bytes=int(row.total_bytes),
        )
        for row in rows
    ]
    return sorted(report, key=lambda p: (p.day is None, p.day or date.min, p.name))


# --- PostgreSQL partitions ------------------------------------------------------------------------


def _connection(bind: Bind) -> Connection:
    return bind.connection() if isinstance(bind, Session) else bind


def _is_partitioned(connection: Connection) -> bool:
    if connection.dialect.name != "postgresql":
        return False
    kind = connection.execute(
        text("SELECT relkind FROM pg_class WHERE oid = to_regclass(:table)"), {"table": TABLE}
    ).scalar()
    return kind == "p"


def _lock(connection: Connection, lock_timeout_s: float | None) -> None:
    if lock_timeout_s is not None:
        # Waiting behind a long query for the table's lock would queue every insert behind us.
        connection.exec_driver_sql(f"SET LOCAL lock_timeout = {max(1, round(lock_timeout_s * 1000))}")
    connection.exec_driver_sql(ADVISORY_LOCK)


def _children(connection: Connection) -> list[str]:
    return [
        str(name)
        for name in connection.execute(
            text(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
                " WHERE i.inhparent = to_regclass(:parent)"
            ),
            {"parent": TABLE},
        ).scalars()
    ]


def _days_in_default(connection: Connection) -> set[date]:
    """The UTC days of the rows in the DEFAULT partition (a scan: it is empty in steady state)."""
    return set(
        connection.execute(
            text(f"SELECT DISTINCT (window_start AT TIME ZONE 'UTC')::date FROM {DEFAULT_PARTITION}")
        ).scalars()
    )


def _day_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime.combine(day, time(), tzinfo=UTC)
    return start, start + timedelta(days=1)


def _create_day_partition(connection: Connection, day: date, *, move_from_default: bool) -> None:
    """Create ``day``'s partition. PostgreSQL refuses to while the DEFAULT partition holds rows of
    that day, so those are first set aside in a temporary table, then inserted through the parent
    into the new partition, all in this transaction (readers see them in one place or the other)."""
    name = partition_name(day)
    start, end = _day_bounds(day)
    parked = f"{name}_moving"
    columns = ", ".join(f'"{c}"' for c in _columns(connection))
    if move_from_default:
        connection.exec_driver_sql(f"CREATE TEMPORARY TABLE {parked} (LIKE {TABLE}) ON COMMIT DROP")
        connection.execute(
            text(
                f"WITH moved AS (DELETE FROM {DEFAULT_PARTITION}"
                " WHERE window_start >= :start AND window_start < :end"
                f" RETURNING {columns}) INSERT INTO {parked} ({columns}) SELECT {columns} FROM moved"
            ),
            {"start": start, "end": end},
        )
    # Bounds are literals (DDL takes no parameters), made from a date: nothing from outside.
    connection.exec_driver_sql(
        f"CREATE TABLE IF NOT EXISTS {name} PARTITION OF {TABLE}"
        f" FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')"
    )
    if move_from_default:
        connection.exec_driver_sql(f"INSERT INTO {TABLE} ({columns}) SELECT {columns} FROM {parked}")
        connection.exec_driver_sql(f"DROP TABLE {parked}")


def _columns(connection: Connection) -> list[str]:
    """The parent table's columns as the database has them (named, so that a partition attached
    with another column order still lines up)."""
    return [
        str(name)
        for name in connection.execute(
            text(
                "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(:table)"
                " AND attnum > 0 AND NOT attisdropped ORDER BY attnum"
            ),
            {"table": TABLE},
        ).scalars()
    ]


def _drop_partitions_before(session: Session, cutoff: datetime, lock_timeout_s: float | None) -> list[str]:
    """Detach and drop every daily partition whose whole day lies before ``cutoff``."""
    connection = session.connection()
    _lock(connection, lock_timeout_s)
    expired = sorted(
        name
        for name in _children(connection)
        if (day := partition_day(name)) is not None and _day_bounds(day)[1] <= cutoff
    )
    for name in expired:
        connection.exec_driver_sql(f"ALTER TABLE {TABLE} DETACH PARTITION {name}")
        connection.exec_driver_sql(f"DROP TABLE {name}")
    return expired


def _delete_old_default_rows(session: Session, cutoff: datetime, batch_rows: int) -> int:
    """Rows in the DEFAULT partition past every retention (late windows for days already dropped)."""
    deleted = 0
    while True:
        result = session.execute(
            text(
                f"DELETE FROM {DEFAULT_PARTITION} WHERE ctid = ANY(ARRAY("
                f"SELECT ctid FROM {DEFAULT_PARTITION} WHERE window_start < :cutoff LIMIT :batch))"
            ),
            {"cutoff": cutoff, "batch": batch_rows},
        )
        count = int(cast(CursorResult[Any], result).rowcount or 0)
        session.commit()
        deleted += count
        if count < batch_rows:
            return deleted


# --- batched deletes (both dialects) ----------------------------------------------------------------


def _clamped_days(days: int | None) -> int:
    """An account's retention in days, clamped so that a value stored past the API's bounds can
    neither overflow a date nor delete everything."""
    if days is None:
        return DEFAULT_RETENTION_DAYS
    return min(max(int(days), MIN_RETENTION_DAYS), MAX_RETENTION_DAYS)


def _deployment_chunks(session: Session, account_ids: Sequence[int]) -> Iterator[list[int]]:
    """The accounts' deployments (soft-deleted ones too: their data ages out like any other), in
    chunks small enough for one ``IN`` list."""
    ids: list[int] = []
    for start in range(0, len(account_ids), DEPLOYMENT_CHUNK):
        ids.extend(
            int(i)
            for i in session.scalars(
                select(Deployment.id).where(
                    Deployment.account_id.in_(account_ids[start : start + DEPLOYMENT_CHUNK])
                )
            )
        )
    for start in range(0, len(ids), DEPLOYMENT_CHUNK):
        yield ids[start : start + DEPLOYMENT_CHUNK]


def _aggregates_before(deployment_ids: list[int], cutoff: datetime, batch_rows: int) -> Delete:
    """A batch of the deployments' aggregates whose window starts before ``cutoff``, by primary key
    (``deployment_id, window_start`` lead it, and the cutoff prunes the newer partitions)."""
    agg = AcceptanceAggregateRow
    key = (
        agg.deployment_id,
        agg.window_start,
        agg.edge_window_id,
        agg.arm,
        agg.drafter_version,
        agg.category,
    )
    batch = select(*key).where(agg.deployment_id.in_(deployment_ids), agg.window_start < cutoff)
    return delete(agg).where(tuple_(*key).in_(batch.limit(batch_rows)))


def _records_before(deployment_ids: list[int], cutoff: datetime, batch_rows: int) -> Delete:
    """A batch of the deployments' raw records created before ``cutoff`` whose rollup sums are not
    pending (deleting one would cascade to its pending row, and its sums would never be added)."""
    record = AcceptanceRecordRow
    pending = exists().where(AcceptanceRollupPendingRow.record_id == record.id)
    batch = select(record.id).where(
        record.deployment_id.in_(deployment_ids), record.created_at < cutoff, ~pending
    )
    return delete(record).where(record.id.in_(batch.limit(batch_rows)))


def _edge_windows_received_before(cutoff: datetime, batch_rows: int) -> Delete:
    """A batch of ledger rows received before ``cutoff`` (``received_at`` is indexed and never
    earlier than the window's start, so such a window can no longer be sent again) whose sums are
    in the rollups: the rollup fold finds the windows it has not added by their ledger row."""
    ledger = EdgeWindowRow
    batch = select(ledger.id).where(ledger.received_at < cutoff, ledger.rolled_up_at.is_not(None))
    return delete(ledger).where(ledger.id.in_(batch.limit(batch_rows)))


def _delete_in_batches(session: Session, batch_of: Callable[[int], Delete], batch_rows: int) -> int:
    """Delete ``batch_of(batch_rows)`` and commit, until a batch finds fewer than ``batch_rows``."""
    deleted = 0
    while True:
        statement = batch_of(batch_rows).execution_options(synchronize_session=False)
        count = int(cast(CursorResult[Any], session.execute(statement)).rowcount or 0)
        session.commit()
        deleted += count
        if count < batch_rows:
            return deleted
