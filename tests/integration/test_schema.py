"""The schema itself: migrations up and down on both databases, and invariants enforced by the
database even when Python is bypassed."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import MetaData, Table, func, inspect, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.db.migrate import (
    alembic_config,
    current_revision,
    downgrade_to_base,
    head_revision,
    upgrade_to_head,
)
from controlplane.db.models import (
    AcceptanceRecordRow,
    AcceptanceRollupPendingRow,
    Base,
    Deployment,
    DrafterState,
    DrafterVersion,
    Job,
    JobKind,
    JobState,
)
from controlplane.db.session import get_engine, get_sessionmaker
from controlplane.ingest import service as ingest_service
from controlplane.ingest.partitions import is_partition
from controlplane.ingest.record import AcceptanceRecord
from controlplane.ingest.rollups import SIX_HOURS
from controlplane.ingest.service import fold_pending_rollups, store_batches, store_records
from tests.conftest import Database, add_deployment, recreate_pg_database


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_upgrade_downgrade_upgrade_matches_the_models(dialect: str, tmp_path: Path) -> None:
    url = (
        f"sqlite:///{tmp_path / 'm.db'}"
        if dialect == "sqlite"
        else recreate_pg_database("controlplane_migrations")
    )
    upgrade_to_head(url)
    assert current_revision(url) == head_revision(url)
    downgrade_to_base(url)
    tables = set(inspect(get_engine(url)).get_table_names()) - {"alembic_version"}
    assert tables == set()
    upgrade_to_head(url)
    with get_engine(url).connect() as connection:
        # The models declare a partitioned table's parent only; its daily partitions are the
        # maintenance task's (controlplane.ingest.partitions).
        context = MigrationContext.configure(connection, opts={"include_name": _declared_by_the_models})
        diff = compare_metadata(context, Base.metadata)
    assert diff == [], f"models and migrations disagree: {diff}"
    get_engine(url).dispose()


def _declared_by_the_models(name: str | None, type_: str, _parents: object) -> bool:
    return not (type_ == "table" and name is not None and is_partition(name))


def _deployment(session: Session) -> Deployment:
    return add_deployment(session, f"acct-{datetime.now(UTC).timestamp():.0f}")


def _violates(session: Session, action: Callable[[Session], None]) -> bool:
    nested = session.begin_nested()
    try:
        action(session)
        session.flush()
    except IntegrityError:
        nested.rollback()
        return True
    nested.rollback()
    return False


def test_database_enforces_invariants(db: Database) -> None:
    session = db.new_session()
    deployment = _deployment(session)

    def version(n: int, state: DrafterState) -> DrafterVersion:
        return DrafterVersion(
            deployment_id=deployment.id, version=n, artifact_path="x", artifact_sha256="0" * 64, state=state
        )

    session.add(version(1, DrafterState.active))
    session.flush()
    assert _violates(session, lambda s: s.add(version(2, DrafterState.active))), "two active drafter versions"
    assert not _violates(session, lambda s: s.add(version(3, DrafterState.candidate)))
    assert _violates(session, lambda s: s.add(version(1, DrafterState.retired))), "duplicate version number"

    def record(request_id: str) -> AcceptanceRecordRow:
        return AcceptanceRecordRow(
            deployment_id=deployment.id,
            request_id=request_id,
            created_at=datetime.now(UTC),
            arm="live",
            drafted_tokens=4,
            accepted_tokens=2,
            verify_steps=1,
            generated_tokens=3,
            accepted_per_position=[1, 1],
        )

    session.add(record("a"))
    session.flush()
    assert _violates(session, lambda s: s.add(record("a"))), "request id unique per deployment"
    bad = record("b")
    bad.accepted_tokens = 9
    assert _violates(session, lambda s: s.add(bad)), "accepted <= drafted"

    def job(state: JobState) -> Job:
        return Job(deployment_id=deployment.id, kind=JobKind.realign, state=state)

    session.add(job(JobState.queued))
    session.flush()
    assert _violates(session, lambda s: s.add(job(JobState.running))), "one active realignment per deployment"
    assert not _violates(session, lambda s: s.add(job(JobState.succeeded)))
    orphan = record("c")
    orphan.deployment_id = 999_999
    assert _violates(session, lambda s: s.add(orphan)), "foreign keys"
    session.rollback()
    session.close()


def _six_hour_rows(url: str) -> list[dict[str, Any]]:
    return _rollup_rows(url, "resolution_s", SIX_HOURS)


def _rollup_rows(url: str, column: str, value: int) -> list[dict[str, Any]]:
    """Rollup rows whose ``column`` equals ``value``, as the database holds them at its current revision (read
    through the reflected table, not the models: older revisions lack newer columns)."""
    engine = get_engine(url)
    table = Table("acceptance_rollups", MetaData(), autoload_with=engine)
    with engine.connect() as connection:
        rows = connection.execute(
            select(table)
            .where(table.c[column] == value)
            .order_by(table.c.resolution_s, table.c.arm, table.c.drafter_version, table.c.bucket_start)
        ).all()
    return [
        {name: value for name, value in row._mapping.items() if name not in ("id", "deployment_id")}
        for row in rows
    ]


def _random_records(rng: random.Random, batch: int, start: datetime, size: int) -> list[AcceptanceRecord]:
    return [
        AcceptanceRecord(
            request_id=f"r{batch}-{i}",
            drafted_tokens=12,
            accepted_tokens=(accepted := rng.randint(0, 12)),
            verify_steps=4,
            generated_tokens=accepted + 4,
            accepted_per_position=[min(accepted, 4), max(0, min(accepted - 4, 4))],
            inter_token_ms=rng.lognormvariate(2.5, 0.4),
            total_ms=rng.lognormvariate(6.0, 0.5),
            ttft_ms=rng.lognormvariate(3.5, 0.3) if i % 3 else None,
            arm=rng.choice(["live", "baseline"]),
            drafter_version=rng.choice([None, 2]),
            created_at=start + timedelta(minutes=rng.randrange(0, 40 * 60)),
        )
        for i in range(size)
    ]


def test_deferred_rollups_fold_into_exactly_what_inline_ingestion_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same records, ingested with rollups summed in place into one deployment and deferred
    (in batches of 1 to 8, folded now and then) into another, give identical rollup rows; a
    downgrade past the pending table folds what it still holds first."""
    # Folds take pending rows in chunks of 7 here, so every fold sums several chunks.
    monkeypatch.setattr(ingest_service, "FOLD_CHUNK_RECORDS", 7)
    url = recreate_pg_database("controlplane_deferred")
    upgrade_to_head(url)
    rng = random.Random(8)
    start = datetime(2026, 11, 1, 3, 17, tzinfo=UTC)
    batches = [_random_records(rng, batch, start, rng.randint(1, 8)) for batch in range(120)]
    with get_sessionmaker(url)() as session:
        inline, deferred = _deployment(session).id, add_deployment(session, "deferred").id
        for number, records in enumerate(batches):
            store_records(session=session, deployment_id=inline, records=records)
            store_batches(session=session, batches=[(deferred, records)], defer_rollups=True)
            session.commit()
            if number % 25 == 24:
                assert fold_pending_rollups(session=session, deployment_ids=[deferred]) > 0
                session.commit()
        left = sum(len(records) for records in batches[100:])
        assert session.scalar(select(func.count()).select_from(AcceptanceRollupPendingRow)) == left

    command.downgrade(alembic_config(url), "0004")
    written = _rollup_rows(url, "deployment_id", inline)
    folded = _rollup_rows(url, "deployment_id", deferred)
    assert len(written) > 100  # every tier, several arms and versions
    assert [{**row, "total_ms_sum": None} for row in folded] == [
        {**row, "total_ms_sum": None} for row in written
    ]
    # Summed in another order: equal up to floating-point rounding.
    assert [row["total_ms_sum"] for row in folded] == pytest.approx([row["total_ms_sum"] for row in written])
    get_engine(url).dispose()


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_six_hour_backfill_rebuilds_exactly_what_ingestion_writes(dialect: str, tmp_path: Path) -> None:
    url = (
        f"sqlite:///{tmp_path / 'b.db'}"
        if dialect == "sqlite"
        else recreate_pg_database("controlplane_backfill")
    )
    upgrade_to_head(url)
    rng = random.Random(4)
    start = datetime(2026, 11, 1, 3, 17, tzinfo=UTC)
    with get_sessionmaker(url)() as session:
        deployment_id = _deployment(session).id
        for batch in range(40):
            records = _random_records(rng, batch, start, 25)
            store_records(session=session, deployment_id=deployment_id, records=records)
            session.commit()
    written = _six_hour_rows(url)
    assert len(written) > 8  # several 6-hour buckets, arms and versions

    command.downgrade(alembic_config(url), "0003")
    assert _six_hour_rows(url) == []
    upgrade_to_head(url)
    rebuilt = _six_hour_rows(url)

    assert [{**row, "total_ms_sum": None} for row in rebuilt] == [
        {**row, "total_ms_sum": None} for row in written
    ]
    # Summed in another order: equal up to floating-point rounding.
    assert [row["total_ms_sum"] for row in rebuilt] == pytest.approx([row["total_ms_sum"] for row in written])
    get_engine(url).dispose()


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_downgrade_past_categories_sums_them_into_one_row_per_old_key(dialect: str, tmp_path: Path) -> None:
    """The same records, ingested with categories into one deployment and without into another,
    give identical rollup rows once 0010 is downgraded: the per-category rows of each old key are
    summed into one (on PostgreSQL some of them still pending, folded by the downgrade first)."""
    url = (
        f"sqlite:///{tmp_path / 'c.db'}"
        if dialect == "sqlite"
        else recreate_pg_database("controlplane_categories")
    )
    upgrade_to_head(url)
    rng = random.Random(10)
    start = datetime(2026, 11, 1, 3, 17, tzinfo=UTC)
    with get_sessionmaker(url)() as session:
        split, whole = _deployment(session).id, add_deployment(session, "whole").id
        for batch in range(30):
            records = _random_records(rng, batch, start, rng.randint(1, 30))
            named = [
                replace(record, category=rng.choice([None, "", "prose", "structured", "code"]))
                for record in records
            ]
            store_records(session=session, deployment_id=whole, records=records)
            store_batches(session=session, batches=[(split, named)], defer_rollups=batch % 2 == 1)
            session.commit()
    by_category = _rollup_rows(url, "deployment_id", split)
    assert {row["category"] for row in by_category} == {"", "prose", "structured", "code"}

    command.downgrade(alembic_config(url), "0009")
    merged = _rollup_rows(url, "deployment_id", split)
    written = _rollup_rows(url, "deployment_id", whole)
    assert len(written) > 100  # every tier, several arms and versions
    assert "category" not in written[0]
    assert [{**row, "total_ms_sum": None} for row in merged] == [
        {**row, "total_ms_sum": None} for row in written
    ]
    assert [row["total_ms_sum"] for row in merged] == pytest.approx([row["total_ms_sum"] for row in written])
    get_engine(url).dispose()
