"""The drift monitor on real databases: records in, an event with evidence out, exactly once;
the drift API (events, status, dismiss, policy validation)."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from controlplane.config import Settings
from controlplane.db.models import DriftEvent, DriftMonitorState, Role
from controlplane.db.session import get_engine, get_sessionmaker
from controlplane.errors import ConflictError
from controlplane.loop.drift import advance_monitor
from tests.conftest import TEST_SECRET, Database, Tenant, make_tenant, prepare_database, recreate_pg_database


def request_record(i: int, rng: random.Random, p: float, k: int = 4, prefix: str = "r") -> dict[str, Any]:
    """A request whose draft positions are each accepted with probability p (given the previous)."""
    steps = rng.randint(8, 16)
    per_step = []
    for _ in range(steps):
        accepted = 0
        while accepted < k and rng.random() < p:
            accepted += 1
        per_step.append(accepted)
    return {
        "request_id": f"{prefix}-{i}",
        "drafted_tokens": steps * k,
        "accepted_tokens": sum(per_step),
        "verify_steps": steps,
        "generated_tokens": sum(per_step) + steps,
        "accepted_per_position": [sum(1 for a in per_step if a > j) for j in range(k)],
        "k": k,
    }


def _ingest(client: TestClient, tenant: Tenant, records: list[dict[str, Any]]) -> None:
    url = f"/v1/accounts/{tenant.name}/deployments/svc/acceptance"
    for start in range(0, len(records), 2000):
        response = client.post(
            url, json={"records": records[start : start + 2000]}, headers=tenant.headers(Role.ingest)
        )
        assert response.status_code == 200, response.text


def _run_monitor(db: Database, deployment_id: int, settings: Settings) -> list[int]:
    raised: list[int] = []
    for _ in range(3):  # the first run only records the horizon; later runs consume settled ids
        session = db.new_session()
        outcome = advance_monitor(session=session, deployment_id=deployment_id, settings=settings)
        session.commit()
        session.close()
        raised += outcome.events_raised
    return raised


@pytest.fixture
def svc_deployment(client: TestClient, tenants: tuple[Tenant, Tenant]) -> None:
    acme, _ = tenants
    response = client.post(
        f"/v1/accounts/{acme.name}/deployments",
        json={
            "target_model": "reference-target",
            "deployment_id": "svc",
            "draft_model": "reference-drafter",
            "draft_token_count": 4,
        },
        headers=acme.headers(Role.admin),
    )
    assert response.status_code == 201
    return int(
        client.get(f"/v1/accounts/{acme.name}/deployments/svc", headers=acme.headers(Role.admin)).status_code
    )


def _deployment_pk(db: Database) -> int:
    from controlplane.db.models import Deployment

    session = db.new_session()
    try:
        return int(session.scalar(select(Deployment.id).where(Deployment.name == "svc")) or 0)
    finally:
        session.close()


def test_a_drop_raises_one_event_with_evidence_and_a_stable_stream_none(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database, settings: Settings, svc_deployment: None
) -> None:
    acme, _ = tenants
    rng = random.Random(11)
    # Deterministic: the records come from random.Random(11); no alarm on the stable part and one on
    # the drop fail only if the code changes.
    stable = [request_record(i, rng, 0.8) for i in range(1600)]
    _ingest(client, acme, stable)
    pk = _deployment_pk(db)
    assert _run_monitor(db, pk, settings) == []
    dropped = [request_record(5000 + i, rng, 0.55) for i in range(400)]
    _ingest(client, acme, dropped)
    raised = _run_monitor(db, pk, settings)
    assert len(raised) == 1
    base = f"/v1/accounts/{acme.name}/deployments/svc"
    events = client.get(f"{base}/drift-events", headers=acme.headers(Role.viewer)).json()["drift_events"]
    assert [e["id"] for e in events] == raised
    event = events[0]
    # The deployment realigns automatically: the event is answered by the job it started.
    assert event["state"] == "realigning" and event["detector"] == "mixture_sr"
    assert event["evidence"]["realign_job_id"] > 0 and event["resolution"] is None
    assert event["baseline_rate"] > event["current_rate"] and event["drop"] > 0.1
    assert event["statistic"] >= event["threshold"]
    assert "verdict" in event["evidence"]["mix_attribution"]  # the side monitor's view is recorded
    # Detected within the drop, not on the stable part: the alarm came after the change point.
    session = db.new_session()
    stable_last = session.scalar(select(func.max(DriftMonitorState.watermark_record_id)))
    session.close()
    assert stable_last is not None and event["last_record_id"] > 1600
    # More dropped traffic does not open a second event while one is open (latch).
    _ingest(client, acme, [request_record(9000 + i, rng, 0.55) for i in range(300)])
    assert _run_monitor(db, pk, settings) == []
    status = client.get(f"{base}/drift-status", headers=acme.headers(Role.viewer)).json()
    assert status["open_events"] == 1 and status["detector"]["drift_detected"] is True
    dismissed = client.post(f"{base}/drift-events/{raised[0]}:dismiss", headers=acme.headers(Role.admin))
    assert dismissed.status_code == 200 and dismissed.json()["state"] == "dismissed"
    assert dismissed.json()["resolution"] == "dismissed"
    again = client.post(f"{base}/drift-events/{raised[0]}:dismiss", headers=acme.headers(Role.admin))
    assert again.status_code == 409


def test_a_pure_mix_shift_raises_no_event(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database, settings: Settings, svc_deployment: None
) -> None:
    """Traffic moves from mostly prose to mostly code (the drafter is as good as ever on each):
    the pooled hit rate falls, the risk-adjusted detector stays quiet, the side monitor sees it."""
    acme, _ = tenants
    rng = random.Random(17)

    def mixed(i: int, code_share: float) -> dict[str, Any]:
        code = rng.random() < code_share
        record = request_record(i, rng, 0.55 if code else 0.85)
        record["category"] = "code" if code else "prose"
        return record

    _ingest(client, acme, [mixed(i, 0.3) for i in range(1600)])
    pk = _deployment_pk(db)
    assert _run_monitor(db, pk, settings) == []
    _ingest(client, acme, [mixed(5000 + i, 0.9) for i in range(1200)])
    assert _run_monitor(db, pk, settings) == []
    base = f"/v1/accounts/{acme.name}/deployments/svc"
    status = client.get(f"{base}/drift-status", headers=acme.headers(Role.viewer)).json()
    assert status["open_events"] == 0
    assert status["detector"]["mix_shift_detected"] is True


def test_policy_changes_are_validated_and_audited(
    client: TestClient, tenants: tuple[Tenant, Tenant], svc_deployment: None
) -> None:
    acme, _ = tenants
    url = f"/v1/accounts/{acme.name}/deployments/svc/drift-policy"
    headers = acme.headers(Role.admin)
    for bad in ({"arl0_requests": -5}, {"min_drop": 1.5}, {"cooldown_s": "soon"}, {"typo": 1}):
        response = client.patch(url, json=bad, headers=headers)
        assert response.status_code == 422, (bad, response.text)
        assert response.json()["error"]["details"][0]["field"] == next(iter(bad))
    ok = client.patch(url, json={"arl0_requests": 20000, "min_drop": 0.1}, headers=headers)
    assert ok.status_code == 200 and ok.json()["arl0_requests"] == 20000 and ok.json()["min_drop"] == 0.1
    assert client.patch(url, json={"min_drop": 0.2}, headers=acme.headers(Role.viewer)).status_code == 403
    audit = client.get(f"/v1/accounts/{acme.name}/audit", headers=headers).json()["entries"]
    assert audit[0]["action"] == "deployment.drift_policy" and audit[0]["after"]["arl0_requests"] == 20000


@pytest.fixture
def committed_pg() -> Iterator[str]:
    """A PostgreSQL database with real commits (no test transaction), for concurrency."""
    url = recreate_pg_database("controlplane_drift_concurrency")
    prepare_database(url)
    yield url
    get_engine(url).dispose()


def test_two_monitors_at_once_consume_each_record_once(committed_pg: str) -> None:
    from controlplane.ingest.formats import parse_batch
    from controlplane.ingest.service import store_records

    settings = Settings(database_url=committed_pg, environment="test", secret_key=TEST_SECRET)
    sessions = get_sessionmaker(committed_pg)
    with sessions() as session:
        tenant = make_tenant(session, "acme")
        from controlplane.db.models import Deployment, SpeculationMode

        deployment = Deployment(
            account_id=tenant.account_id,
            name="svc",
            target_model="reference-target",
            speculation_mode=SpeculationMode.default,
            draft_token_count=4,
            drift_policy={},
            canary_policy={},
        )
        session.add(deployment)
        session.commit()
        pk = deployment.id
        rng = random.Random(3)
        store_records(
            session=session,
            deployment_id=pk,
            records=parse_batch({"records": [request_record(i, rng, 0.8) for i in range(1500)]}),
        )
        session.commit()
    with sessions() as session:  # first run: records the horizon
        advance_monitor(session=session, deployment_id=pk, settings=settings)
        session.commit()
    outcomes: list[str] = []
    barrier = threading.Barrier(2)

    def run() -> None:
        with sessions() as session:
            barrier.wait()
            try:
                outcome = advance_monitor(session=session, deployment_id=pk, settings=settings)
                session.commit()
                outcomes.append(f"consumed {outcome.records_consumed}")
            except ConflictError:
                session.rollback()
                outcomes.append("conflict")

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["conflict", "consumed 1500"], outcomes
    with sessions() as session:
        state = session.get(DriftMonitorState, pk)
        assert state is not None and state.records_examined == 1500 and state.version == 1
        assert session.scalar(select(func.count()).select_from(DriftEvent)) == 0


def test_a_failed_realignment_ends_its_event_and_the_detector_alarms_again(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database, settings: Settings, svc_deployment: None
) -> None:
    from controlplane.jobs.service import fail_job

    acme, _ = tenants
    base = f"/v1/accounts/{acme.name}/deployments/svc"
    admin, viewer = acme.headers(Role.admin), acme.headers(Role.viewer)
    assert client.patch(f"{base}/drift-policy", json={"cooldown_s": 0}, headers=admin).status_code == 200
    rng = random.Random(12)
    _ingest(client, acme, [request_record(i, rng, 0.8) for i in range(1600)])
    pk = _deployment_pk(db)
    assert _run_monitor(db, pk, settings) == []
    _ingest(client, acme, [request_record(5000 + i, rng, 0.55) for i in range(400)])
    [first] = _run_monitor(db, pk, settings)
    event = client.get(f"{base}/drift-events/{first}", headers=viewer).json()
    assert event["state"] == "realigning"
    with db.new_session() as session:
        fail_job(
            session=session, job_id=event["evidence"]["realign_job_id"], error="RuntimeError: out of memory"
        )
        session.commit()
    ended = client.get(f"{base}/drift-events/{first}", headers=viewer).json()
    assert ended["state"] == "resolved" and ended["resolution"] == "realignment_failed"
    assert "out of memory" in ended["resolution_reason"]
    # Nothing is left latched: the drop is still there, so the detector re-arms and alarms again,
    # and that event starts a new realignment.
    _ingest(client, acme, [request_record(9000 + i, rng, 0.55) for i in range(400)])
    second = _run_monitor(db, pk, settings)
    assert len(second) == 1 and second[0] != first
    again = client.get(f"{base}/drift-events/{second[0]}", headers=viewer).json()
    assert again["state"] == "realigning"
    assert again["evidence"]["realign_job_id"] != event["evidence"]["realign_job_id"]
