"""The schema itself: migrations up and down on both databases, and invariants enforced by the
database even when Python is bypassed."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.db.migrate import current_revision, downgrade_to_base, head_revision, upgrade_to_head
from controlplane.db.models import (
    AcceptanceRecordRow,
    Account,
    Base,
    Deployment,
    DrafterState,
    DrafterVersion,
    Job,
    JobKind,
    JobState,
    SpeculationMode,
)
from controlplane.db.session import get_engine
from tests.conftest import Database, recreate_pg_database


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
        diff = compare_metadata(MigrationContext.configure(connection), Base.metadata)
    assert diff == [], f"models and migrations disagree: {diff}"
    get_engine(url).dispose()


def _deployment(session: Session) -> Deployment:
    account = Account(name=f"acct-{datetime.now(UTC).timestamp():.0f}")
    session.add(account)
    session.flush()
    deployment = Deployment(
        account_id=account.id,
        name="d",
        target_model="m",
        speculation_mode=SpeculationMode.default,
        drift_policy={},
        canary_policy={},
    )
    session.add(deployment)
    session.flush()
    return deployment


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
