"""After a guardrail switched a deployment to its fallback, the loop keeps realigning:

- in process, SQLite, with the realign task run for real on tiny models: a live arm measured
  slower than no speculation (serving records) switches the deployment to n-gram and resolves its
  event ``guardrail_action``; a realignment of the drafter that served is queued, due after the
  drift policy's cooldown, on the traffic since the switch; it trains a candidate, which is
  canaried against n-gram and, beating it, promoted: the deployment speculates with it again;
- both dialects: a candidate that loses to the fallback queues the next try after a longer wait;
  a person choosing n-gram by hand queues nothing, and a person changing the mode (or dismissing
  an alarm) cancels the guardrail's pending realignment; the drift detector re-bases on the
  fallback, and a drift of the fallback makes the waiting realignment due at once.
"""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from controlplane.app import create_app
from controlplane.canary.evaluate import record_shadow_result
from controlplane.canary.service import start_canary
from controlplane.config import Settings
from controlplane.db.models import (
    AuditEntry,
    Canary,
    Deployment,
    DrafterVersion,
    DriftEvent,
    DriftMonitorState,
    DriftResolution,
    DriftState,
    Job,
    JobState,
    Role,
    Trace,
    TraceSource,
)
from controlplane.db.session import get_engine, get_sessionmaker
from controlplane.jobs.recovery import MIN_GUARDRAIL_REALIGN_DELAY_S
from controlplane.jobs.service import (
    GUARDRAIL_ACTOR,
    active_realign_job,
    claim_stale_queued_realigns,
    finish_job,
    start_job,
)
from controlplane.loop.drift import advance_monitor
from controlplane.timestamps import as_utc, utcnow
from tests.conftest import Database, Tenant, make_tenant
from tests.fleet.canary_setup import arm_records, candidate_version, passing_shadow
from tests.in_process import evaluate_canary, in_process_settings, post_native
from tests.integration.test_drift_monitor import request_record
from tests.integration.test_recovery import _register_tiny, _tiny_models

BASE = "/v1/accounts/acme/deployments/svc"
COOLDOWN_S = 900


def _slow_split(start: int, version: int = 1) -> list[dict[str, Any]]:
    """The drafter serving (and its candidate) slower than no speculation, at the 80/10/10 split."""
    return (
        arm_records("live", 480, tps=1.2, ms=8.0, hit=0.05, version=None, start=start)
        + arm_records(f"canary:{version}", 60, tps=1.0, ms=9.5, hit=0.01, version=version, start=start + 1000)
        + arm_records("baseline", 60, tps=1.0, ms=5.0, hit=0.0, version=None, start=start + 2000)
    )


def _candidate_split(version: int, start: int, *, wins: bool) -> list[dict[str, Any]]:
    """n-gram serving faster than no speculation; the candidate clearly beats it, or clearly loses."""
    candidate = (
        arm_records(f"canary:{version}", 60, tps=3.0, ms=2.2, hit=0.6, version=version, start=start + 1000)
        if wins
        else arm_records(
            f"canary:{version}", 60, tps=1.0, ms=9.0, hit=0.02, version=version, start=start + 1000
        )
    )
    return (
        arm_records("live", 480, tps=1.3, ms=4.2, hit=0.1, version=None, start=start)
        + candidate
        + arm_records("baseline", 60, tps=1.0, ms=5.0, hit=0.0, version=None, start=start + 2000)
    )


def _go_live(sessions: Any, settings: Settings, version_id: int) -> int:
    with sessions() as session:
        canary, _job = start_canary(session=session, version=session.get_one(DrafterVersion, version_id))
        session.commit()
        canary_id = canary.id
    with sessions() as session:
        phase = record_shadow_result(
            session=session, canary_id=canary_id, result=passing_shadow(), settings=settings
        )
        session.commit()
    assert phase == "live"
    return canary_id


def _trip_guardrail(client: TestClient, sessions: Any, settings: Settings, tenant: Tenant, pk: int) -> int:
    """A drift event answered by candidate 1's canary, whose live arm (the drafter serving) is
    measured slower than no speculation by the fleet's serving key: the guardrail switches to
    n-gram. Returns the event's id."""
    with sessions() as session:
        event = DriftEvent(deployment_id=pk, state=DriftState.open, detector="test", evidence={})
        session.add(event)
        version = candidate_version(session, pk, 1)
        session.commit()
        event_id, version_id = event.id, version.id
    _go_live(sessions, settings, version_id)
    post_native(client, tenant.headers(Role.serving), _slow_split(0))
    assert evaluate_canary(sessions, settings, pk)["decision"] == "reject"
    return event_id


def _guardrail_job(session: Any, pk: int) -> Job:
    job = active_realign_job(session=session, deployment_id=pk)
    assert job is not None and job.requested_by == GUARDRAIL_ACTOR
    return job


# ------------------------------------------------------------- the whole loop, in process (SQLite)


def test_after_a_guardrail_switch_a_realignment_wins_the_deployment_back_from_ngram(
    sqlite_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import controlplane.canary.service
    import workers.tasks

    settings = in_process_settings(
        sqlite_template,
        tmp_path,
        "guardrail.db",
        model_roots=[_tiny_models(tmp_path / "models")],
        realign_time_budget_s=2,
        drift_enqueue_on_ingest=False,
        api_gc_freeze=False,
    )
    url = settings.database_url
    monkeypatch.setattr(workers.tasks, "get_settings", lambda: settings)
    monkeypatch.setattr(controlplane.canary.service, "get_settings", lambda: settings)
    sessions = get_sessionmaker(url)
    with sessions() as session:
        tenant = make_tenant(session, "acme")
        _register_tiny(session, tenant.account_id, settings)
        session.commit()
    with TestClient(create_app(settings)) as client:
        admin, viewer = tenant.headers(Role.admin), tenant.headers(Role.viewer)
        created = client.post(
            "/v1/accounts/acme/deployments",
            json={
                "target_model": "tiny-target",
                "deployment_id": "svc",
                "draft_model": "tiny-drafter",
                "draft_token_count": 4,
            },
            headers=admin,
        )
        assert created.status_code == 201, created.text
        patched = client.patch(f"{BASE}/drift-policy", json={"cooldown_s": COOLDOWN_S}, headers=admin)
        assert patched.status_code == 200, patched.text
        with sessions() as session:
            pk = int(session.scalars(select(Deployment.id).where(Deployment.name == "svc")).one())
            # Traffic from before the switch: the realignment must not train on it.
            session.add(Trace(deployment_id=pk, source=TraceSource.sampled, prompt="old", completion="old"))
            session.commit()

        switch_from = utcnow()
        event_id = _trip_guardrail(client, sessions, settings, tenant, pk)
        switch_to = utcnow()
        assert client.get(BASE, headers=viewer).json()["speculation_mode"] == "ngram"
        with sessions() as session:
            event = session.get_one(DriftEvent, event_id)
            assert event.resolution == DriftResolution.guardrail_action
            job = _guardrail_job(session, pk)
            job_id = job.id
            due = as_utc(job.next_attempt_at)
            # Due one cooldown after the switch (the first try: no candidate has lost yet).
            # Deterministic: the switch happened between `switch_from` and `switch_to`, however
            # long a loaded machine took over it.
            cooldown = timedelta(seconds=COOLDOWN_S)
            assert switch_from + cooldown <= due <= switch_to + cooldown
            assert job.state == JobState.queued and job.drift_event_id is None
            assert "after guardrail switch to ngram" in job.progress_message
            audit = session.scalars(
                select(AuditEntry).where(
                    AuditEntry.action == "job.create", AuditEntry.actor == GUARDRAIL_ACTOR
                )
            ).one()
            assert audit.after["reason"] == "after guardrail switch to ngram"
            # The sweep leaves it until it is due, then sends it.
            assert claim_stale_queued_realigns(session=session, older_than=utcnow()) == []
            assert claim_stale_queued_realigns(
                session=session, older_than=due, now=due + timedelta(seconds=1)
            ) == [job_id]
            session.rollback()
        status = client.get(f"{BASE}/drift-status", headers=viewer).json()["guardrail_recovery"]
        assert status["reason"] == "after guardrail switch to ngram" and status["realign_job_id"] == job_id
        assert status["draft_model"] == "tiny-drafter" and status["losses"] == 0

        # Fresh traffic since the switch; the cooldown passes.
        with sessions() as session:
            for i in range(40):
                session.add(
                    Trace(
                        deployment_id=pk,
                        source=TraceSource.sampled,
                        prompt=f"def f{i}(x):\n",
                        completion=f"    return x + {i}\n\nprint(f{i}(2))\n",
                    )
                )
            session.get_one(Job, job_id).next_attempt_at = utcnow() - timedelta(seconds=1)
            session.commit()
        outcome = workers.tasks.run_realign(job_id)
        assert outcome.get("drafter_version") == 2, outcome
        with sessions() as session:
            job = session.get_one(Job, job_id)
            assert job.state == JobState.succeeded
            version = session.get_one(DrafterVersion, int(outcome["drafter_version_id"]))
            assert version.parent_version_id is None  # the registered tiny-drafter, realigned
            assert version.training_metrics["incumbent"] == "tiny-drafter"
            assert as_utc(version.traffic_window_start) >= switch_from
            canary = session.scalars(select(Canary).where(Canary.candidate_version_id == version.id)).one()
            # Judged against the fallback actually serving.
            assert canary.incumbent_version_id is None and canary.arms["incumbent_mode"] == "ngram"
            canary_id = canary.id
        with sessions() as session:
            phase = record_shadow_result(
                session=session, canary_id=canary_id, result=passing_shadow(), settings=settings
            )
            session.commit()
        assert phase == "live"
        post_native(client, tenant.headers(Role.serving), _candidate_split(2, 50_000, wins=True))
        assert evaluate_canary(sessions, settings, pk)["decision"] == "promote"
        deployment = client.get(BASE, headers=viewer).json()
        assert deployment["speculation_mode"] == "draft_model" and deployment["active_drafter_version"] == 2
        assert "guardrail_fallback" not in deployment["drift_policy"]
        assert client.get(f"{BASE}/drift-status", headers=viewer).json()["guardrail_recovery"] is None
        with sessions() as session:
            assert active_realign_job(session=session, deployment_id=pk) is None
    get_engine(url).dispose()


# ------------------------------------------------------------------------ both dialects, no training


def _deployment(client: TestClient, db: Database, tenant: Tenant, cooldown_s: int = COOLDOWN_S) -> int:
    admin = tenant.headers(Role.admin)
    created = client.post(
        "/v1/accounts/acme/deployments",
        json={
            "target_model": "reference-target",
            "deployment_id": "svc",
            "draft_model": "reference-drafter",
            "draft_token_count": 4,
        },
        headers=admin,
    )
    assert created.status_code == 201, created.text
    patched = client.patch(
        f"{BASE}/drift-policy", json={"cooldown_s": cooldown_s, "reference_requests": 200}, headers=admin
    )
    assert patched.status_code == 200, patched.text
    with db.new_session() as session:
        return int(
            session.scalars(
                select(Deployment.id).where(
                    Deployment.name == "svc", Deployment.account_id == tenant.account_id
                )
            ).one()
        )


def _pretend_trained(db: Database, job_id: int, pk: int, number: int) -> int:
    """The worker's side of a realignment, without training: the job succeeds with a version."""
    with db.new_session() as session:
        start_job(session=session, job_id=job_id)
        finish_job(session=session, job_id=job_id, result={"drafter_version": number})
        version = candidate_version(session, pk, number)
        session.commit()
        return version.id


def test_a_candidate_that_loses_to_the_fallback_is_tried_again_after_a_longer_wait(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    pk = _deployment(client, db, acme)
    _trip_guardrail(client, db.new_session, settings, acme, pk)
    with db.new_session() as session:
        first = _guardrail_job(session, pk)
        first_id, first_delay = first.id, first.result["delay_s"]
    assert first_delay == COOLDOWN_S

    version_id = _pretend_trained(db, first_id, pk, 2)
    _go_live(db.new_session, settings, version_id)
    post_native(client, acme.headers(Role.serving), _candidate_split(2, 60_000, wins=False))
    lost_from = utcnow()
    assert evaluate_canary(db.new_session, settings, pk)["decision"] == "reject"
    lost_to = utcnow()
    viewer = acme.headers(Role.viewer)
    assert client.get(BASE, headers=viewer).json()["speculation_mode"] == "ngram"
    with db.new_session() as session:
        second = _guardrail_job(session, pk)
        assert second.id != first_id and second.result["losses_since_switch"] == 1
        # Twice the wait of the first try: it never spins, and it never stops.
        assert second.result["delay_s"] == 2 * COOLDOWN_S
        # Deterministic: bracketed by the clock around the decision, as above.
        twice = timedelta(seconds=2 * COOLDOWN_S)
        assert lost_from + twice <= as_utc(second.next_attempt_at) <= lost_to + twice
        second_id = second.id

    # A person chooses the speculation mode: the guardrail's pending realignment is cancelled.
    patched = client.patch(BASE, json={"ngram_speculation_length": 3}, headers=acme.headers(Role.admin))
    assert patched.status_code == 200, patched.text
    assert "guardrail_fallback" not in patched.json()["drift_policy"]
    with db.new_session() as session:
        cancelled = session.get_one(Job, second_id)
        assert cancelled.state == JobState.cancelled and "speculation settings chosen" in (
            cancelled.progress_message or ""
        )
        assert active_realign_job(session=session, deployment_id=pk) is None
    assert client.get(f"{BASE}/drift-status", headers=viewer).json()["guardrail_recovery"] is None


def test_a_person_choosing_ngram_queues_no_realignment(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    pk = _deployment(client, db, acme)
    patched = client.patch(BASE, json={"ngram_speculation_length": 3}, headers=acme.headers(Role.admin))
    assert patched.status_code == 200 and patched.json()["speculation_mode"] == "ngram", patched.text
    with db.new_session() as session:
        version_id = candidate_version(session, pk, 1).id
        session.commit()
    _go_live(db.new_session, settings, version_id)
    # The candidate loses to the n-gram a person chose: nothing is queued to try again.
    post_native(client, acme.headers(Role.serving), _candidate_split(1, 70_000, wins=False))
    assert evaluate_canary(db.new_session, settings, pk)["decision"] == "reject"
    with db.new_session() as session:
        assert active_realign_job(session=session, deployment_id=pk) is None
        assert session.scalars(select(Job).where(Job.requested_by == GUARDRAIL_ACTOR)).first() is None


def _monitor(db: Database, pk: int, settings: Settings) -> list[int]:
    raised: list[int] = []
    for _ in range(3):  # the first run only records the horizon; later runs consume settled ids
        with db.new_session() as session:
            raised += advance_monitor(session=session, deployment_id=pk, settings=settings).events_raised
            session.commit()
    return raised


def _ingest(client: TestClient, tenant: Tenant, records: list[dict[str, Any]]) -> None:
    response = client.post(
        f"{BASE}/acceptance", json={"records": records}, headers=tenant.headers(Role.serving)
    )
    assert response.status_code == 200, response.text


def test_the_detector_rebases_on_the_fallback_and_its_drift_makes_the_realignment_due_at_once(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    # No quiet period after the guardrail's event: the fallback's drift may alarm at once.
    pk = _deployment(client, db, acme, cooldown_s=0)
    rng = random.Random(5)
    _ingest(client, acme, [request_record(i, rng, 0.8) for i in range(300)])
    assert _monitor(db, pk, settings) == []
    _trip_guardrail(client, db.new_session, settings, acme, pk)
    with db.new_session() as session:
        job_id = _guardrail_job(session, pk).id
        # Even with no cooldown, the next try waits a minimum: the loop never spins.
        assert as_utc(session.get_one(Job, job_id).next_attempt_at) > utcnow() + timedelta(
            seconds=MIN_GUARDRAIL_REALIGN_DELAY_S - 10
        )
    # The fallback's own hit rate becomes the new baseline (a fresh reference window)...
    _ingest(client, acme, [request_record(1000 + i, rng, 0.5, prefix="ng") for i in range(300)])
    assert _monitor(db, pk, settings) == []
    with db.new_session() as session:
        state = session.get_one(DriftMonitorState, pk)
        assert state.detector_state["speculation_mode"] == "ngram"
        assert state.records_examined < 1000  # restarted on the switch, not counting from the start
    # ...so a later drop of the fallback is detected, and makes the waiting realignment due now.
    _ingest(client, acme, [request_record(2000 + i, rng, 0.2, prefix="ng") for i in range(600)])
    [event_id] = _monitor(db, pk, settings)
    with db.new_session() as session:
        event = session.get_one(DriftEvent, event_id)
        assert event.state == DriftState.realigning and event.evidence["realign_job_id"] == job_id
        job = session.get_one(Job, job_id)
        assert job.state == JobState.queued and as_utc(job.next_attempt_at) <= utcnow()
        assert claim_stale_queued_realigns(session=session, older_than=utcnow()) == [job_id]
        session.commit()
    # A person dismisses that alarm: they have taken over, and the guardrail's loop stops.
    dismissed = client.post(f"{BASE}/drift-events/{event_id}:dismiss", headers=acme.headers(Role.admin))
    assert dismissed.status_code == 200, dismissed.text
    with db.new_session() as session:
        assert session.get_one(Job, job_id).state == JobState.cancelled
        deployment = session.get_one(Deployment, pk)
        assert "guardrail_fallback" not in deployment.drift_policy


def test_a_promotion_the_watch_rolls_back_to_the_fallback_resumes_the_loop_with_a_longer_wait(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    viewer, serving = acme.headers(Role.viewer), acme.headers(Role.serving)
    pk = _deployment(client, db, acme)
    _trip_guardrail(client, db.new_session, settings, acme, pk)
    with db.new_session() as session:
        first_id = _guardrail_job(session, pk).id
    version_id = _pretend_trained(db, first_id, pk, 2)
    _go_live(db.new_session, settings, version_id)
    post_native(client, serving, _candidate_split(2, 80_000, wins=True))
    assert evaluate_canary(db.new_session, settings, pk)["decision"] == "promote"
    assert client.get(BASE, headers=viewer).json()["speculation_mode"] == "draft_model"
    with db.new_session() as session:
        assert active_realign_job(session=session, deployment_id=pk) is None

    # Served for real, the promoted drafter falls far short of its canary: the watch rolls back
    # to n-gram, and the loop resumes, one loss further on.
    post_native(client, serving, arm_records("live", 400, tps=1.2, ms=4.0, hit=0.1, version=2, start=90_000))
    assert evaluate_canary(db.new_session, settings, pk)["watch"] == "rolled back"
    assert client.get(BASE, headers=viewer).json()["speculation_mode"] == "ngram"
    with db.new_session() as session:
        resumed = _guardrail_job(session, pk)
        assert resumed.id != first_id and resumed.state == JobState.queued
        assert resumed.result["losses_since_switch"] == 1 and resumed.result["delay_s"] == 2 * COOLDOWN_S
    status = client.get(f"{BASE}/drift-status", headers=viewer).json()["guardrail_recovery"]
    assert status["realign_job_id"] == resumed.id and status["losses"] == 1
