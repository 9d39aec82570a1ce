"""Acceptance storage at fleet scale, on real PostgreSQL and SQLite: the daily partitions of edge
aggregates (made ahead, idempotently, by two processes at once; rows land in their day's partition
and stranded ones are moved in) and per-account retention (whole days dropped past the longest
retention, rows of shorter-retention accounts deleted, raw records and the ledger aged out,
rollups kept), through the services and the hourly Celery task."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, time, timedelta
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import Connection, func, select, text
from sqlalchemy.orm import Session

from controlplane.config import get_settings
from controlplane.db.migrate import alembic_config, upgrade_to_head
from controlplane.db.models import (
    AcceptanceAggregateRow,
    AcceptanceRecordRow,
    AcceptanceRollupPendingRow,
    AcceptanceRollupRow,
    Account,
    Base,
    EdgeWindowRow,
)
from controlplane.db.session import get_engine, get_sessionmaker
from controlplane.ingest.partitions import (
    DEFAULT_PARTITION,
    apply_acceptance_retention,
    ensure_partitions,
    partition_name,
    partition_report,
)
from tests.conftest import add_deployment, add_deployment_to, recreate_pg_database
from workers.storage_tasks import maintain_acceptance_storage

# Today (the migration makes today's partitions and the next days'), at a fixed time of day.
TODAY = datetime.now(UTC).date()
NOW = datetime.combine(TODAY, time(9, 30), UTC)


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A freshly migrated PostgreSQL database of this test's own (partitions are DDL: no shared
    transaction to roll back)."""
    url = recreate_pg_database("controlplane_partitions")
    upgrade_to_head(url)
    yield url
    get_engine(url).dispose()


def _partitions(url: str) -> dict[str, str]:
    """Partition name -> its bound, as the catalog has them."""
    with get_engine(url).connect() as connection:
        rows = connection.execute(
            text(
                "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i"
                " JOIN pg_class c ON c.oid = i.inhrelid"
                " WHERE i.inhparent = 'acceptance_aggregates'::regclass"
            )
        ).all()
    return {str(name): str(bound) for name, bound in rows}


def _aggregate(deployment_id: int, window_start: datetime, edge_window_id: int = 1) -> AcceptanceAggregateRow:
    return AcceptanceAggregateRow(
        deployment_id=deployment_id,
        window_start=window_start,
        edge_window_id=edge_window_id,
        arm="live",
        drafter_version=0,
        category="",
        window_s=60,
        requests=10,
        speculated_requests=10,
        timed_requests=10,
        drafted_tokens=40,
        accepted_tokens=30,
        verify_steps=10,
        generated_tokens=40,
        prompt_tokens=100,
        sums={"accepted_per_position": [10, 10, 10]},
        latency={},
    )


def _record(deployment_id: int, created_at: datetime, request_id: str) -> AcceptanceRecordRow:
    return AcceptanceRecordRow(
        deployment_id=deployment_id,
        request_id=request_id,
        created_at=created_at,
        arm="live",
        drafted_tokens=4,
        accepted_tokens=2,
        verify_steps=1,
        generated_tokens=3,
        accepted_per_position=[1, 1],
    )


def _rollup(deployment_id: int, bucket_start: datetime) -> AcceptanceRollupRow:
    return AcceptanceRollupRow(
        deployment_id=deployment_id, resolution_s=60, bucket_start=bucket_start, arm="live", requests=1
    )


def _where_rows_live(url: str) -> list[tuple[str, datetime]]:
    with get_engine(url).connect() as connection:
        rows = connection.execute(
            text("SELECT tableoid::regclass::text, window_start FROM acceptance_aggregates ORDER BY 2")
        ).all()
    return [(str(table), moment) for table, moment in rows]


# --- partitions -------------------------------------------------------------------------------------


def test_the_migration_partitions_aggregates_by_day_and_downgrades(pg_url: str) -> None:
    today = datetime.now(UTC).date()
    partitions = _partitions(pg_url)
    assert partitions[DEFAULT_PARTITION] == "DEFAULT"
    for ahead in range(4):
        assert partition_name(today + timedelta(days=ahead)) in partitions
    with get_engine(pg_url).connect() as connection:
        kind = connection.scalar(text("SELECT relkind FROM pg_class WHERE relname = 'acceptance_aggregates'"))
        key = connection.scalar(
            text(
                "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
                " WHERE conname = 'pk_acceptance_aggregates'"
            )
        )
        # The edge-window index exists on every partition (the monitor reads by edge window).
        indexed = connection.scalars(
            text(
                "SELECT c.relname FROM pg_index x JOIN pg_class c ON c.oid = x.indrelid"
                " JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = x.indkey[0]"
                " WHERE a.attname = 'edge_window_id' AND x.indnatts = 1"
            )
        ).all()
    assert kind == "p"
    assert key == (
        "PRIMARY KEY (deployment_id, window_start, edge_window_id, arm, drafter_version, category)"
    )
    assert set(partitions) <= set(indexed)

    command.downgrade(alembic_config(pg_url), "0010")
    with get_engine(pg_url).connect() as connection:
        left = connection.scalars(
            text("SELECT relname FROM pg_class WHERE relname LIKE 'acceptance_aggregates%'")
        ).all()
    assert left == []
    upgrade_to_head(pg_url)
    assert partition_name(today) in _partitions(pg_url)


def test_partitions_are_made_ahead_once_even_by_two_processes_at_once(pg_url: str) -> None:
    engine = get_engine(pg_url)
    with engine.begin() as connection:
        assert ensure_partitions(bind=connection, now=NOW, days_ahead=3) == []  # the migration's
        soon = NOW + timedelta(days=30)
        first = ensure_partitions(bind=connection, now=soon, days_ahead=3)
    assert first == [partition_name(soon.date() + timedelta(days=n)) for n in range(4)]
    with engine.begin() as connection:
        assert ensure_partitions(bind=connection, now=soon, days_ahead=3) == []

    later = NOW + timedelta(days=60)
    barrier = threading.Barrier(2)
    created: list[list[str]] = []
    errors: list[BaseException] = []

    def maintain() -> None:
        try:
            with engine.connect() as connection:
                barrier.wait()
                with connection.begin():
                    created.append(ensure_partitions(bind=connection, now=later, days_ahead=5))
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=maintain) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    wanted = [partition_name(later.date() + timedelta(days=n)) for n in range(6)]
    assert sorted(created, key=len) == [[], wanted]
    partitions = _partitions(pg_url)
    assert set(wanted) <= set(partitions)
    start = later.date()
    assert partitions[partition_name(start)] == (
        f"FOR VALUES FROM ('{start} 00:00:00+00') TO ('{start + timedelta(days=1)} 00:00:00+00')"
    )


def test_rows_land_in_their_days_partition_and_stranded_rows_are_moved_in(pg_url: str) -> None:
    engine = get_engine(pg_url)
    with engine.begin() as connection:
        ensure_partitions(bind=connection, now=NOW, days_ahead=1)
    late_day = NOW + timedelta(days=10)
    with get_sessionmaker(pg_url)() as session:
        deployment_id = add_deployment(session, "acme").id
        session.add_all(
            [
                _aggregate(deployment_id, NOW),
                _aggregate(deployment_id, NOW.replace(hour=23, minute=59, second=59)),
                _aggregate(deployment_id, NOW + timedelta(days=1), edge_window_id=2),
                # No partition yet for this day: the DEFAULT partition takes it.
                _aggregate(deployment_id, late_day, edge_window_id=3),
                _aggregate(deployment_id, late_day + timedelta(minutes=5), edge_window_id=4),
            ]
        )
        session.commit()
    today, tomorrow, late = (partition_name(d.date()) for d in (NOW, NOW + timedelta(days=1), late_day))
    assert [table for table, _ in _where_rows_live(pg_url)] == [
        today,
        today,
        tomorrow,
        DEFAULT_PARTITION,
        DEFAULT_PARTITION,
    ]

    with engine.begin() as connection:
        created = ensure_partitions(bind=connection, now=NOW, days_ahead=1)
    assert created == [late]
    assert [table for table, _ in _where_rows_live(pg_url)] == [today, today, tomorrow, late, late]
    with get_sessionmaker(pg_url)() as session:
        moved = session.scalars(
            select(AcceptanceAggregateRow).where(AcceptanceAggregateRow.edge_window_id == 3)
        ).one()
        assert (moved.requests, moved.accepted_tokens, moved.sums) == (
            10,
            30,
            {"accepted_per_position": [10, 10, 10]},
        )
        report = {p.name: p for p in partition_report(session=session)}
    assert report[late].day == late_day.date() and report[late].total_bytes > 0
    assert list(report)[-1] == DEFAULT_PARTITION


# --- retention --------------------------------------------------------------------------------------


AGES_DAYS = (35, 20, 2)


def _fill(session: Session, *, long_days: int, short_days: int) -> tuple[int, int]:
    """Two accounts (long and short retention), one deployment each, with aggregates, records,
    rollups and ledger rows 35, 20 and 2 days old; returns the two deployment ids."""
    long_account, short_account = Account(name="keeps-long"), Account(name="keeps-short")
    long_account.acceptance_retention_days = long_days
    short_account.acceptance_retention_days = short_days
    session.add_all([long_account, short_account])
    session.flush()
    deployments = (
        add_deployment_to(session, long_account.id).id,
        add_deployment_to(session, short_account.id).id,
    )
    edge_window = 0
    for account in (long_account, short_account):
        for age in AGES_DAYS:
            edge_window += 1
            session.add(
                EdgeWindowRow(
                    id=edge_window,
                    account_id=account.id,
                    edge_id="edge-1",
                    window_start=NOW - timedelta(days=age),
                    window_s=60,
                    digest="0" * 64,
                    aggregates=1,
                    received_at=NOW - timedelta(days=age),
                    rolled_up_at=NOW - timedelta(days=age),
                )
            )
    for deployment_id in deployments:
        for age in AGES_DAYS:
            moment = NOW - timedelta(days=age)
            session.add(_aggregate(deployment_id, moment))
            session.add(_record(deployment_id, moment, f"r{age}"))
            session.add(_rollup(deployment_id, moment.replace(second=0, microsecond=0)))
    session.commit()
    return deployments


def _ages(session: Session, deployment_id: int) -> dict[str, list[int]]:
    def ages(moments: list[datetime]) -> list[int]:
        return sorted(((NOW - m.replace(tzinfo=UTC)).days for m in moments), reverse=True)

    return {
        "aggregates": ages(
            list(
                session.scalars(
                    select(AcceptanceAggregateRow.window_start).where(
                        AcceptanceAggregateRow.deployment_id == deployment_id
                    )
                )
            )
        ),
        "records": ages(
            list(
                session.scalars(
                    select(AcceptanceRecordRow.created_at).where(
                        AcceptanceRecordRow.deployment_id == deployment_id
                    )
                )
            )
        ),
    }


def _rollups(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(AcceptanceRollupRow)) or 0)


def _ledger_ages(session: Session) -> list[int]:
    moments = session.scalars(select(EdgeWindowRow.received_at)).all()
    return sorted((NOW - m.replace(tzinfo=UTC)).days for m in moments)


def test_retention_drops_whole_days_and_deletes_only_a_shorter_retention_accounts_rows(pg_url: str) -> None:
    engine = get_engine(pg_url)
    days = [TODAY - timedelta(days=age) for age in AGES_DAYS]
    with engine.begin() as connection:
        for day in days:
            ensure_partitions(
                bind=connection, now=datetime.combine(day, datetime.min.time(), UTC), days_ahead=0
            )
    with get_sessionmaker(pg_url)() as session:
        kept_long, kept_short = _fill(session, long_days=30, short_days=5)
        # A window 33 days late whose day has no partition: in the DEFAULT one, past every retention.
        session.add(_aggregate(kept_long, NOW - timedelta(days=33), edge_window_id=99))
        # An old record whose rollup sums are still pending is kept until they are folded.
        pending = _record(kept_short, NOW - timedelta(days=20), "pending")
        session.add(pending)
        session.flush()
        session.add(AcceptanceRollupPendingRow(record_id=pending.id, deployment_id=kept_short))
        session.commit()
        rollups = _rollups(session)

        outcome = apply_acceptance_retention(session=session, now=NOW, batch_rows=1)

        assert outcome.partitions_dropped == [partition_name(TODAY - timedelta(days=35))]
        # One from the DEFAULT partition, one of the short account's (20 days old).
        assert outcome.aggregates_deleted == 2
        assert outcome.records_deleted == 3  # 35 days old (both accounts), 20 days old (short)
        assert outcome.edge_windows_deleted == 2  # 35 days old, past the longest retention
        assert _ages(session, kept_long) == {"aggregates": [20, 2], "records": [20, 2]}
        # The short account's 20-day-old record left is the one whose sums are pending.
        assert _ages(session, kept_short) == {"aggregates": [2], "records": [20, 2]}
        assert session.get(AcceptanceRecordRow, pending.id) is not None
        assert _rollups(session) == rollups
        assert _ledger_ages(session) == [2, 2, 20, 20]
        assert outcome.as_dict() == {
            "partitions_dropped": 1,
            "rows_deleted": {"acceptance_aggregates": 2, "edge_windows": 2, "acceptance_records": 3},
        }
        again = apply_acceptance_retention(session=session, now=NOW)
        assert again.as_dict()["partitions_dropped"] == 0
        assert set(again.as_dict()["rows_deleted"].values()) == {0}
    partitions = _partitions(pg_url)
    assert partition_name(TODAY - timedelta(days=35)) not in partitions
    assert {partition_name(TODAY - timedelta(days=20)), partition_name(TODAY), DEFAULT_PARTITION} <= set(
        partitions
    )
    with engine.connect() as connection:
        assert connection.scalar(text(f"SELECT count(*) FROM {DEFAULT_PARTITION}")) == 0
        leftover = connection.scalar(text("SELECT to_regclass(:name)"), {"name": partition_name(days[0])})
    assert leftover is None, "a dropped partition is gone, not only detached"


def test_retention_on_sqlite_deletes_what_each_account_no_longer_keeps(
    sqlite_template: Path, tmp_path: Path
) -> None:
    path = tmp_path / "retention.db"
    shutil.copy(sqlite_template, path)
    url = f"sqlite:///{path}"
    with get_sessionmaker(url)() as session:
        assert ensure_partitions(bind=session, now=NOW) == []
        kept_long, kept_short = _fill(session, long_days=30, short_days=5)
        rollups = _rollups(session)
        outcome = apply_acceptance_retention(session=session, now=NOW, batch_rows=1)
        assert outcome.partitions_dropped == []
        assert outcome.aggregates_deleted == 3  # 35 days old (both), 20 days old (short)
        assert outcome.records_deleted == 3
        assert outcome.edge_windows_deleted == 2
        assert _ages(session, kept_long) == {"aggregates": [20, 2], "records": [20, 2]}
        assert _ages(session, kept_short) == {"aggregates": [2], "records": [2]}
        assert _rollups(session) == rollups
        assert partition_report(session=session) == []
    get_engine(url).dispose()


def test_the_ledger_outlives_the_time_a_window_may_still_be_resent(pg_url: str) -> None:
    """With a one-day retention everywhere, ledger rows stay until no edge may resend their window
    (seven days), or a late retry would be stored a second time; and a window whose sums are not
    in the rollups yet keeps its row until the fold adds them."""
    with get_sessionmaker(pg_url)() as session:
        _fill(session, long_days=1, short_days=1)
        not_rolled_up = session.scalars(select(EdgeWindowRow).order_by(EdgeWindowRow.id)).first()
        assert not_rolled_up is not None
        not_rolled_up.rolled_up_at = None
        session.commit()
        outcome = apply_acceptance_retention(session=session, now=NOW)
        assert outcome.edge_windows_deleted == 3  # 35 and 20 days old, but for the one not rolled up
        assert _ledger_ages(session) == [2, 2, 35]


def test_a_table_made_by_create_all_works_without_partitions() -> None:
    url = recreate_pg_database("controlplane_create_all")
    Base.metadata.create_all(get_engine(url))
    with get_sessionmaker(url)() as session:
        assert ensure_partitions(bind=session, now=NOW) == []
        kept_long, kept_short = _fill(session, long_days=30, short_days=5)
        outcome = apply_acceptance_retention(session=session, now=NOW)
        assert outcome.partitions_dropped == []
        assert _ages(session, kept_long)["aggregates"] == [20, 2]
        assert _ages(session, kept_short)["aggregates"] == [2]
        assert partition_report(session=session) == []
    get_engine(url).dispose()


def test_the_hourly_task_makes_partitions_and_applies_retention(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with get_sessionmaker(pg_url)() as session:
        deployment_id = add_deployment(session, "acme").id
        session.add(_record(deployment_id, datetime.now(UTC) - timedelta(days=15), "old"))
        session.add(_record(deployment_id, datetime.now(UTC), "new"))
        session.commit()
    monkeypatch.setenv("CONTROLPLANE_DATABASE_URL", pg_url)
    get_settings.cache_clear()
    try:
        summary = maintain_acceptance_storage()
    finally:
        get_settings.cache_clear()
    assert summary["partitions_created"] == []  # the migration made today's and the next days'
    assert summary["rows_deleted"]["acceptance_records"] == 1  # default retention: 14 days
    with get_engine(pg_url).connect() as connection:
        assert _request_ids(connection) == ["new"]


def _request_ids(connection: Connection) -> list[str]:
    return [str(r) for r in connection.scalars(text("SELECT request_id FROM acceptance_records")).all()]
