"""One request never fails another: a value the database refuses, or a request id re-sent with
other values, fails only its own request in a shared (group-commit) flush, whichever accounts
share it; and a stored row the rollup fold cannot sum is set aside instead of stopping every
fold (and every stats, dashboard and /metrics read) after it."""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from controlplane.app import create_app
from controlplane.config import Settings
from controlplane.db.models import (
    AcceptanceRecordRow,
    AcceptanceRollup,
    AcceptanceRollupPendingRow,
    QuarantinedRollupRecord,
    Role,
)
from controlplane.db.session import get_engine, get_sessionmaker
from controlplane.ingest import service
from controlplane.ingest.batcher import IngestBatcher, StorageRefusedError
from controlplane.ingest.record import AcceptanceRecord
from controlplane.ingest.service import ConflictingRecordsError, IngestResult, fold_pending_rollups
from tests.conftest import (
    TEST_SECRET,
    add_deployment,
    add_deployment_to,
    make_tenant,
    prepare_database,
    recreate_pg_database,
)
from tests.fleet.rollup_audit import audit_rollups

# Refuses one request id the way a database refuses a value: a check violation, raised by the
# database inside the shared transaction (the value passes every check of the API).
PG_REFUSE = """
CREATE OR REPLACE FUNCTION refuse_poisoned() RETURNS trigger AS $$
BEGIN
    IF NEW.request_id LIKE 'poisoned%' THEN
        RAISE EXCEPTION 'request id % is refused by this database', NEW.request_id
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$ LANGUAGE plpgsql;
DROP TRIGGER IF EXISTS refuse_poisoned ON acceptance_records;
CREATE TRIGGER refuse_poisoned BEFORE INSERT ON acceptance_records
    FOR EACH ROW EXECUTE FUNCTION refuse_poisoned();
"""
SQLITE_REFUSE = """
CREATE TRIGGER IF NOT EXISTS refuse_poisoned BEFORE INSERT ON acceptance_records
WHEN NEW.request_id LIKE 'poisoned%'
BEGIN SELECT RAISE(ABORT, 'request id is refused by this database'); END
"""


def _record(request_id: str, generated: int = 7) -> AcceptanceRecord:
    return AcceptanceRecord(
        request_id=request_id,
        drafted_tokens=8,
        accepted_tokens=5,
        verify_steps=2,
        generated_tokens=generated,
        accepted_per_position=[4, 1],
        k=4,
        total_ms=120.0,
    )


@pytest.fixture(scope="module")
def pg_isolation_url() -> str:
    """One migrated PostgreSQL database for this module's tests: each uses accounts of its own."""
    url = recreate_pg_database("controlplane_isolation")
    prepare_database(url)
    return url


@pytest.fixture(params=["sqlite", "postgres"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A migrated database the batcher commits to on real connections."""
    if request.param == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        shutil.copy(template, tmp_path / "isolation.db")
        url = f"sqlite:///{tmp_path / 'isolation.db'}"
    else:
        url = request.getfixturevalue("pg_isolation_url")
    yield url
    get_engine(url).dispose()


def _name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def _refuse_poisoned(url: str) -> None:
    engine = get_engine(url)
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text(PG_REFUSE))
        else:
            conn.execute(text(SQLITE_REFUSE))


def _two_accounts(url: str) -> tuple[int, int]:
    with get_sessionmaker(url)() as session:
        acme, globex = add_deployment(session, _name("acme")).id, add_deployment(session, _name("globex")).id
        session.commit()
    return acme, globex


def _stored(url: str, deployment_id: int) -> tuple[int, int]:
    """(records stored, requests the minute rollups count) of one deployment, after a fold; on
    PostgreSQL every rollup tier is also audited against the raw records it sums."""
    with get_sessionmaker(url)() as session:
        fold_pending_rollups(session=session)
        session.commit()
        records = session.scalar(
            select(func.count()).where(AcceptanceRecordRow.deployment_id == deployment_id)
        )
        counted = session.scalar(
            select(func.coalesce(func.sum(AcceptanceRollup.requests), 0)).where(
                AcceptanceRollup.deployment_id == deployment_id
            )
        )
    if get_engine(url).dialect.name == "postgresql":
        audit = audit_rollups(url.replace("postgresql+psycopg://", "postgresql://"), [deployment_id])
        assert (audit.double_counted_records, audit.missing_records, audit.mismatched_buckets) == (0, 0, 0), (
            audit.samples
        )
    return int(records or 0), int(counted or 0)


def _submit_together(
    batcher: IngestBatcher, requests: list[tuple[int, list[AcceptanceRecord]]]
) -> list[IngestResult | BaseException]:
    async def run() -> list[IngestResult | BaseException]:
        # Submitted in one tick: they queue before the writer wakes, so they share one flush.
        outcomes = await asyncio.gather(
            *(batcher.submit(deployment_id, records) for deployment_id, records in requests),
            return_exceptions=True,
        )
        await batcher.close()
        return list(outcomes)

    return asyncio.run(run())


def test_a_value_the_database_refuses_fails_only_its_own_request(
    database: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = database
    _refuse_poisoned(url)
    acme, globex = _two_accounts(url)
    batcher = IngestBatcher(get_sessionmaker(url), engine=get_engine(url))
    requests = [(acme, [_record(f"acme-{i}-a"), _record(f"acme-{i}-b")]) for i in range(6)]
    requests.insert(3, (acme, [_record("fine-before"), _record("poisoned-1")]))
    requests += [(globex, [_record(f"globex-{i}")]) for i in range(6)]
    # Large enough that PostgreSQL writes the shared flush by COPY (the trigger fires there too).
    requests.append((acme, [_record(f"acme-bulk-{i}") for i in range(80)]))
    with caplog.at_level(logging.WARNING, logger="controlplane.ingest.batcher"):
        outcomes = _submit_together(batcher, requests)
    # They did share a flush, and it failed as a whole first.
    assert any("flushing its halves apart" in message for message in caplog.messages)
    failed = [i for i, outcome in enumerate(outcomes) if isinstance(outcome, BaseException)]
    assert failed == [3]
    error = outcomes[3]
    assert isinstance(error, StorageRefusedError) and error.status_code == 422
    assert "refused by this database" in error.message and "nothing of this batch" in error.message
    collateral = sum(
        1 for i, outcome in enumerate(outcomes) if i != 3 and not isinstance(outcome, IngestResult)
    )
    assert collateral == 0  # poisoned_requests_collateral
    assert all(outcome.inserted == len(requests[i][1]) for i, outcome in enumerate(outcomes) if i != 3)  # type: ignore[union-attr]
    # Nothing of the refused request (not even its valid record), everything of the others.
    assert _stored(url, acme) == (92, 92)
    assert _stored(url, globex) == (6, 6)


def test_a_conflicting_request_id_fails_only_its_own_request(database: str) -> None:
    url = database
    acme, globex = _two_accounts(url)
    batcher = IngestBatcher(get_sessionmaker(url), engine=get_engine(url))
    first = _submit_together(batcher, [(acme, [_record("kept", generated=7)])])
    assert isinstance(first[0], IngestResult) and first[0].inserted == 1
    batcher = IngestBatcher(get_sessionmaker(url), engine=get_engine(url))
    outcomes = _submit_together(
        batcher,
        [
            (globex, [_record("g-0")]),
            (acme, [_record("new-beside-conflict"), _record("kept", generated=9)]),
            (acme, [_record("kept", generated=7), _record("a-1")]),  # a true retry: a duplicate
            (globex, [_record("kept", generated=9)]),  # another deployment's own id
        ],
    )
    conflict = outcomes[1]
    assert isinstance(conflict, ConflictingRecordsError) and conflict.status_code == 409
    assert conflict.request_ids == ["kept"]
    assert "generated_tokens" in conflict.details[0]["message"]
    retry, other = outcomes[2], outcomes[3]
    assert isinstance(retry, IngestResult) and (retry.inserted, retry.duplicates) == (1, 1)
    assert isinstance(other, IngestResult) and other.inserted == 1
    assert isinstance(outcomes[0], IngestResult) and outcomes[0].inserted == 1
    assert _stored(url, acme) == (2, 2)  # kept and a-1; nothing of the conflicting request
    assert _stored(url, globex) == (2, 2)


def test_the_api_names_the_refusal_and_stores_nothing_of_that_batch(database: str) -> None:
    url = database
    _refuse_poisoned(url)
    settings = Settings(
        database_url=url,
        environment="test",
        secret_key=TEST_SECRET,
        drift_enqueue_on_ingest=False,
        api_gc_freeze=False,
    )
    with get_sessionmaker(url)() as session:
        tenant = make_tenant(session, _name("acme"))
        add_deployment_to(session, tenant.account_id, "svc")
        session.commit()
    base = f"/v1/accounts/{tenant.name}/deployments/svc"
    records = [
        {
            "request_id": rid,
            "drafted_tokens": 4,
            "accepted_tokens": 2,
            "verify_steps": 1,
            "generated_tokens": 3,
        }
        for rid in ("ok-1", "poisoned-2")
    ]
    with TestClient(create_app(settings)) as client:
        refused = client.post(
            f"{base}/acceptance", json={"records": records}, headers=tenant.headers(Role.ingest)
        )
        assert refused.status_code == 422, refused.text
        assert "refused by this database" in refused.json()["error"]["message"]
        fine = client.post(
            f"{base}/acceptance", json={"records": records[:1]}, headers=tenant.headers(Role.ingest)
        )
        assert fine.status_code == 200 and fine.json()["inserted"] == 1


# --- the rollup fold ----------------------------------------------------------------------------

# Stored rows from before the ingest limits: a latency whose histogram bucket is not a number.
_RAW_RECORD = text(
    """
    INSERT INTO acceptance_records (deployment_id, request_id, created_at, arm, drafter_version, k,
        drafted_tokens, accepted_tokens, verify_steps, generated_tokens, accepted_per_position,
        total_ms, from_serving_key)
    VALUES (:deployment_id, :request_id, :created_at, :arm, NULL, 2, 4, 2, 2, 4, '[1, 1]', :total_ms, false)
    RETURNING id
    """
)
# Refuses any rollup row of one arm: a failure no check of the fold foresees.
_PG_REFUSE_ROLLUP = """
CREATE FUNCTION refuse_odd_arm() RETURNS trigger AS $$
BEGIN
    IF NEW.arm = 'canary:666' THEN
        RAISE EXCEPTION 'arm % cannot be summed here', NEW.arm USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER refuse_odd_arm BEFORE INSERT OR UPDATE ON acceptance_rollups
    FOR EACH ROW EXECUTE FUNCTION refuse_odd_arm();
"""


def _pending_raw(
    session: Session, deployment_id: int, request_id: str, *, total_ms: float, arm: str = "live"
) -> None:
    record_id = session.scalar(
        _RAW_RECORD,
        {
            "deployment_id": deployment_id,
            "request_id": request_id,
            "created_at": datetime.now(UTC),
            "arm": arm,
            "total_ms": total_ms,
        },
    )
    session.add(AcceptanceRollupPendingRow(record_id=record_id, deployment_id=deployment_id))
    session.flush()


def test_a_row_the_fold_cannot_sum_is_quarantined_and_reported() -> None:
    url = recreate_pg_database("controlplane_quarantine")
    prepare_database(url)
    with get_engine(url).begin() as conn:
        conn.execute(text(_PG_REFUSE_ROLLUP))
    with get_sessionmaker(url)() as session:
        tenant = make_tenant(session, "acme")
        poisoned = add_deployment_to(session, tenant.account_id, "poisoned").id
        healthy = add_deployment_to(session, tenant.account_id, "healthy").id
        _pending_raw(session, poisoned, "huge", total_ms=1e308)
        _pending_raw(session, poisoned, "odd-arm", total_ms=10.0, arm="canary:666")
        _pending_raw(session, poisoned, "fine", total_ms=10.0)
        _pending_raw(session, healthy, "fine", total_ms=10.0)
        session.commit()
    with get_sessionmaker(url)() as session:
        assert fold_pending_rollups(session=session) == 4
        session.commit()
        reasons = dict(
            session.execute(select(QuarantinedRollupRecord.record_id, QuarantinedRollupRecord.reason)).all()
        )
        assert session.scalar(select(func.count()).select_from(AcceptanceRollupPendingRow)) == 0
    assert len(reasons) == 2
    assert any("total_ms" in reason for reason in reasons.values())
    assert any("cannot be summed here" in reason for reason in reasons.values())
    assert _stored(url, poisoned) == (3, 1)  # the two quarantined rows are in no sum
    assert _stored(url, healthy) == (1, 1)

    settings = Settings(
        database_url=url,
        environment="test",
        secret_key=TEST_SECRET,
        drift_enqueue_on_ingest=False,
        api_gc_freeze=False,
    )
    headers = tenant.headers(Role.admin)
    with TestClient(create_app(settings)) as client:
        base = "/v1/accounts/acme/deployments"
        # The fold keeps going for everyone: new records of both deployments are counted.
        for name in ("poisoned", "healthy"):
            sent = client.post(
                f"{base}/{name}/acceptance",
                json={
                    "records": [
                        {
                            "request_id": "later",
                            "drafted_tokens": 2,
                            "accepted_tokens": 1,
                            "verify_steps": 1,
                            "generated_tokens": 2,
                        }
                    ]
                },
                headers=headers,
            )
            assert sent.status_code == 200, sent.text
        stats = client.get(f"{base}/poisoned/stats", headers=headers)
        assert stats.status_code == 200, stats.text
        assert stats.json()["quarantined_records"] == 2
        assert stats.json()["total"]["requests"] == 2
        healthy_stats = client.get(f"{base}/healthy/stats", headers=headers).json()
        assert (healthy_stats["quarantined_records"], healthy_stats["total"]["requests"]) == (0, 2)
        dashboard = client.get("/v1/accounts/acme/dashboard/deployments/poisoned", headers=headers)
        assert dashboard.status_code == 200, dashboard.text
        metrics = client.get("/metrics", headers=headers)
        assert metrics.status_code == 200, metrics.text
        assert (
            'specctl_rollup_records_quarantined_total{account="acme",deployment="poisoned"} 2.0'
            in metrics.text
        )
        assert (
            'specctl_rollup_records_quarantined_total{account="acme",deployment="healthy"} 0.0'
            in metrics.text
        )


def test_a_record_the_fold_cannot_sum_leaves_other_deployments_folded_in_one_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fold's fallback goes record by record only in the deployment whose sums failed: the
    others are summed at once, as they would be without the poisoned record."""
    url = recreate_pg_database("controlplane_fold_isolation")
    prepare_database(url)
    with get_engine(url).begin() as conn:
        conn.execute(text(_PG_REFUSE_ROLLUP))
    with get_sessionmaker(url)() as session:
        tenant = make_tenant(session, "acme")
        poisoned = add_deployment_to(session, tenant.account_id, "poisoned").id
        healthy = add_deployment_to(session, tenant.account_id, "healthy").id
        _pending_raw(session, poisoned, "odd-arm", total_ms=10.0, arm="canary:666")
        for i in range(30):
            _pending_raw(session, poisoned, f"fine-{i}", total_ms=10.0)
            _pending_raw(session, healthy, f"fine-{i}", total_ms=10.0)
        session.commit()
    applied: list[int] = []
    original = service.apply_deltas

    def counting(**kwargs: Any) -> None:
        applied.append(kwargs["deployment_id"])
        original(**kwargs)

    monkeypatch.setattr(service, "apply_deltas", counting)
    with get_sessionmaker(url)() as session:
        assert fold_pending_rollups(session=session) == 61
        session.commit()
    # At most once in the fold that failed as a whole, once in its fallback: never per record.
    assert applied.count(healthy) <= 2
    assert applied.count(poisoned) == 1 + 1 + 31  # whole fold, its deployment's savepoint, each record
    assert _stored(url, healthy) == (30, 30)
    assert _stored(url, poisoned) == (31, 30)  # the odd arm quarantined
