"""Automatic realignments besides drift: a first drafter for a deployment without one (cut from the
target, trained, canaried against no speculation, promoted), and continuous realignment that
canaries candidate after candidate, keeps a better one, rejects a worse one, and is skipped with
a recorded reason once the deployment's GPU budget for the day is spent."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from controlplane.adaptation.service import adapt_deployment
from controlplane.app import create_app
from controlplane.canary.evaluate import record_shadow_result
from controlplane.canary.service import start_canary
from controlplane.canary.shadow import claim_replay
from controlplane.config import Settings
from controlplane.db.models import (
    AuditEntry,
    Canary,
    Deployment,
    DrafterState,
    DrafterVersion,
    Job,
    JobKind,
    JobState,
    Role,
    Trace,
    TraceSource,
)
from controlplane.db.session import get_engine, get_sessionmaker
from controlplane.jobs.service import finish_job, start_job
from controlplane.timestamps import utcnow
from tests.conftest import Database, Tenant, make_tenant
from tests.fleet.canary_setup import arm_records, candidate_version, passing_shadow
from tests.in_process import evaluate_canary, in_process_settings, post_native
from tests.integration.test_recovery import _register_tiny, _tiny_models

BASE = "/v1/accounts/acme/deployments/svc"


def _add_traces(sessions: Any, pk: int, n: int, start: int = 0) -> None:
    with sessions() as session:
        for i in range(start, start + n):
            session.add(
                Trace(
                    deployment_id=pk,
                    source=TraceSource.sampled,
                    category="structured",
                    prompt=f'call {{"name": "lookup", "id": {i}}}\n',
                    completion=f'{{"tool": "lookup", "args": {{"id": {i}, "limit": {i % 7}}}}}\n',
                )
            )
        session.commit()


def _no_speculation(arm: str, n: int, *, ms: float, start: int) -> list[dict[str, Any]]:
    """Records of an arm that serves without a drafter (the live arm of a drafter-less deployment)."""
    return [
        {**r, "arm": arm, "request_id": f"{arm}-{start + i}"}
        for i, r in enumerate(arm_records("baseline", n, tps=1.0, ms=ms, hit=0.0, version=None, start=start))
    ]


def _adapt(sessions: Any, settings: Settings, pk: int) -> Any:
    with sessions() as session:
        outcome = adapt_deployment(session=session, deployment_id=pk, settings=settings)
        session.commit()
    return outcome


# ------------------------------------------------ day 0: a first drafter, trained in process (SQLite)


def test_a_deployment_without_a_drafter_gets_a_first_drafter_canaried_against_no_speculation(
    sqlite_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import controlplane.canary.service
    import workers.tasks

    settings = in_process_settings(
        sqlite_template,
        tmp_path,
        "day0.db",
        model_roots=[_tiny_models(tmp_path / "models")],
        realign_time_budget_s=2,
        realign_min_traces=30,
        drift_enqueue_on_ingest=False,
        api_gc_freeze=False,
    )
    url = settings.database_url
    monkeypatch.setattr(workers.tasks, "get_settings", lambda: settings)
    monkeypatch.setattr(controlplane.canary.service, "get_settings", lambda: settings)
    sent: list[Any] = []
    monkeypatch.setattr(workers.tasks.messaging, "send_all", lambda _app, messages: sent.extend(messages))
    sessions = get_sessionmaker(url)
    with sessions() as session:
        tenant = make_tenant(session, "acme")
        _register_tiny(session, tenant.account_id, settings)
        session.commit()
    with TestClient(create_app(settings)) as client:
        admin, viewer, serving = (tenant.headers(r) for r in (Role.admin, Role.viewer, Role.serving))
        created = client.post(
            "/v1/accounts/acme/deployments",
            json={
                "target_model": "tiny-target",
                "deployment_id": "svc",
                "disable_speculative_decoding": True,
            },
            headers=admin,
        )
        assert created.status_code == 201, created.text
        with sessions() as session:
            pk = int(session.scalars(select(Deployment.id).where(Deployment.name == "svc")).one())

        status = client.get(f"{BASE}/adaptation-policy", headers=viewer).json()
        assert status["first_drafter"] is True and status["status"]["has_drafter"] is False
        assert status["status"]["next_trigger"] is None and "0/30" in status["status"]["reason"]

        # Too little traffic yet: the monitor pass requests nothing.
        _add_traces(sessions, pk, 29)
        assert workers.tasks.monitor_deployment(pk)["adaptation"]["job_id"] is None
        _add_traces(sessions, pk, 31, start=29)
        outcome = workers.tasks.monitor_deployment(pk)["adaptation"]
        assert outcome["trigger"] == "first_drafter" and outcome["job_id"] is not None
        job_id = int(outcome["job_id"])
        assert [(m.task, m.args) for m in sent] == [("realign.run", (job_id,))]
        job = client.get(f"{BASE}/jobs/{job_id}", headers=viewer).json()
        assert job["trigger"] == "first_drafter" and job["requested_by"] == "adaptation:first_drafter"
        # A first drafter starts from far less than a realignment does: twice the budget.
        assert job["params"] == {"time_budget_s": 4.0}
        # A second pass while it is queued asks for nothing more.
        assert workers.tasks.monitor_deployment(pk)["adaptation"]["job_id"] is None

        trained = workers.tasks.run_realign(job_id)
        assert trained.get("drafter_version") == 1, trained
        with sessions() as session:
            assert session.get_one(Job, job_id).state == JobState.succeeded
            version = session.get_one(DrafterVersion, int(trained["drafter_version_id"]))
            assert version.parent_version_id is None
            # Started narrow from the target's embeddings: two layers, not a cut of the target.
            assert version.training_metrics["incumbent"].startswith("first-drafter:narrow-2x")
            assert version.training_metrics["incumbent"].endswith("-of-tiny-target")
            canary = session.scalars(select(Canary).where(Canary.candidate_version_id == version.id)).one()
            # Judged against what serves: the live arm without speculation.
            assert canary.incumbent_version_id is None and canary.arms["incumbent_mode"] == "disabled"
            replay_job = session.get_one(Job, canary.job_id)
            assert replay_job.kind == JobKind.canary and replay_job.trigger == "first_drafter"
            claim = claim_replay(session=session, job_id=replay_job.id, delivery_id=None)
            assert claim.plan is not None
            assert claim.plan.incumbent is None and claim.plan.incumbent_speculation == "disabled"
            session.commit()
            canary_id = canary.id
        with sessions() as session:
            phase = record_shadow_result(
                session=session, canary_id=canary_id, result=passing_shadow(), settings=settings
            )
            session.commit()
        assert phase == "live"
        config = client.get(f"{BASE}/serving-config", headers=serving).json()
        arms = {a["arm"]: a for a in config["arms"]}
        assert arms["live"]["speculation"] == "disabled" and arms["canary:1"]["drafter_version"] == 1

        post_native(
            client,
            serving,
            _no_speculation("live", 480, ms=5.0, start=0)
            + arm_records("canary:1", 60, tps=3.0, ms=2.2, hit=0.6, version=1, start=1000)
            + _no_speculation("baseline", 60, ms=5.0, start=2000),
        )
        decided = evaluate_canary(sessions, settings, pk)
        assert decided["decision"] == "promote", decided
        deployment = client.get(BASE, headers=viewer).json()
        assert deployment["speculation_mode"] == "draft_model" and deployment["active_drafter_version"] == 1
        live = {a["arm"]: a for a in client.get(f"{BASE}/serving-config", headers=serving).json()["arms"]}
        assert live["live"]["speculation"] == "draft_model" and live["live"]["drafter_version"] == 1
        assert client.get(f"{BASE}/adaptation-policy", headers=viewer).json()["status"]["has_drafter"] is True

        # A person rolls it back: the deployment serves without speculation again.
        rolled = client.post(f"{BASE}:rollback", json={"reason": "by hand"}, headers=admin)
        assert rolled.status_code == 200, rolled.text
        deployment = client.get(BASE, headers=viewer).json()
        assert deployment["speculation_mode"] == "disabled" and deployment["active_drafter_version"] is None
    get_engine(url).dispose()


# ------------------------------------------------ continuous realignment, both dialects, no training


def _deployment(client: TestClient, db: Database, tenant: Tenant) -> int:
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
    patched = client.patch(f"{BASE}/canary-policy", json={"watch_requests": 20}, headers=admin)
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
    """The worker's side of a realignment without training: the job succeeds with a version, whose
    canary opens and passes its shadow replay (as ``register_trained`` and the replay would)."""
    with db.new_session() as session:
        start_job(session=session, job_id=job_id)
        finish_job(session=session, job_id=job_id, result={"drafter_version": number})
        version = candidate_version(session, pk, number, training_job_id=job_id)
        canary, replay = start_canary(session=session, version=version, actor=f"job:{job_id}")
        assert replay.trigger == "continuous"
        session.commit()
        canary_id = canary.id
    with db.new_session() as session:
        phase = record_shadow_result(
            session=session,
            canary_id=canary_id,
            result=passing_shadow(),
            settings=Settings(database_url=db.url),
        )
        session.commit()
    assert phase == "live"
    return canary_id


def _split(version: int, start: int, *, wins: bool, live_version: int | None) -> list[dict[str, Any]]:
    candidate = (
        arm_records(f"canary:{version}", 60, tps=3.0, ms=2.2, hit=0.6, version=version, start=start + 1000)
        if wins
        else arm_records(
            f"canary:{version}", 60, tps=1.1, ms=6.5, hit=0.05, version=version, start=start + 1000
        )
    )
    return (
        arm_records("live", 480, tps=2.0, ms=3.2, hit=0.35, version=live_version, start=start)
        + candidate
        + arm_records("baseline", 60, tps=1.0, ms=5.0, hit=0.0, version=None, start=start + 2000)
    )


def test_continuous_canaries_candidate_after_candidate_and_rejects_a_worse_one_then_stops_at_the_budget(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    admin, viewer, serving = (acme.headers(r) for r in (Role.admin, Role.viewer, Role.serving))
    pk = _deployment(client, db, acme)
    sessions = db.new_session

    # Off by default: traffic alone starts nothing on a deployment that has a drafter.
    _add_traces(sessions, pk, 12)
    assert _adapt(sessions, settings, pk).job_id is None
    stored = client.put(
        f"{BASE}/adaptation-policy", json={"continuous": True, "continuous_every_traces": 10}, headers=admin
    )
    assert stored.status_code == 200, stored.text
    assert stored.json()["continuous"] is True and stored.json()["gpu_seconds_per_day"] == 3600
    assert stored.json()["status"]["next_trigger"] == "continuous"

    # 1. The first continuous candidate wins its canary and is promoted.
    first = _adapt(sessions, settings, pk)
    assert first.decision.trigger == "continuous" and first.job_id is not None
    again = _adapt(sessions, settings, pk)
    assert again.job_id is None and f"realign job {first.job_id} is queued" in again.decision.reason
    _pretend_trained(db, first.job_id, pk, 1)
    _add_traces(sessions, pk, 15, start=100)
    busy = _adapt(sessions, settings, pk)
    assert busy.job_id is None and "is live" in busy.decision.reason
    post_native(client, serving, _split(1, 0, wins=True, live_version=None))
    assert evaluate_canary(sessions, settings, pk)["decision"] == "promote"
    assert client.get(BASE, headers=viewer).json()["active_drafter_version"] == 1
    assert "is watching" in _adapt(sessions, settings, pk).decision.reason
    # The promotion's watch sees the hit rate the canary measured, and closes.
    post_native(client, serving, arm_records("live", 30, tps=3.0, ms=2.2, hit=0.6, version=1, start=5000))
    evaluate_canary(sessions, settings, pk)
    with sessions() as session:
        assert session.scalars(select(Canary.phase).order_by(Canary.id.desc())).first() == "closed"

    # 2. Traffic since the first job makes the second due; that candidate is worse: rejected.
    second = _adapt(sessions, settings, pk)
    assert second.decision.trigger == "continuous" and second.job_id is not None
    _pretend_trained(db, second.job_id, pk, 2)
    post_native(client, serving, _split(2, 10_000, wins=False, live_version=1))
    assert evaluate_canary(sessions, settings, pk)["decision"] == "reject"
    deployment = client.get(BASE, headers=viewer).json()
    assert deployment["active_drafter_version"] == 1 and deployment["speculation_mode"] == "draft_model"
    jobs = client.get(f"{BASE}/jobs", headers=viewer).json()["jobs"]
    realigns = [j for j in jobs if j["kind"] == "realign"]
    assert [j["trigger"] for j in realigns] == ["continuous", "continuous"]
    with sessions() as session:
        assert session.get_one(DrafterVersion, _version_id(session, pk, 2)).state == DrafterState.rejected

    # 3. The day's GPU budget is spent: the next due realignment is skipped, with its reason.
    patched = client.patch(f"{BASE}/adaptation-policy", json={"gpu_seconds_per_day": 60}, headers=admin)
    assert patched.status_code == 200 and patched.json()["continuous_every_traces"] == 10
    with sessions() as session:
        job = session.get_one(Job, first.job_id)
        job.started_at, job.finished_at = utcnow() - timedelta(minutes=5), utcnow() - timedelta(minutes=3)
        session.commit()
    _add_traces(sessions, pk, 12, start=200)
    skipped = _adapt(sessions, settings, pk)
    assert skipped.job_id is None and skipped.decision.skipped
    assert "at or over gpu_seconds_per_day (60 s)" in skipped.decision.reason
    _adapt(sessions, settings, pk)  # the same skip again is not recorded twice
    with sessions() as session:
        entries = session.scalar(
            select(func.count()).select_from(AuditEntry).where(AuditEntry.action == "adaptation.skip")
        )
        assert entries == 1
        assert (
            session.scalar(
                select(func.count())
                .select_from(Job)
                .where(Job.deployment_id == pk, Job.kind == JobKind.realign)
            )
            == 2
        )
    status = client.get(f"{BASE}/adaptation-policy", headers=viewer).json()["status"]
    assert status["gpu_seconds_last_24h"] >= 120 and status["next_trigger"] is None
    assert status["last_skip"]["trigger"] == "continuous" and "skipped" in status["last_skip"]["reason"]
    # A bigger budget lets it through again.
    client.patch(f"{BASE}/adaptation-policy", json={"gpu_seconds_per_day": 3600}, headers=admin)
    assert _adapt(sessions, settings, pk).job_id is not None


def _version_id(session: Any, pk: int, number: int) -> int:
    return int(
        session.scalars(
            select(DrafterVersion.id).where(
                DrafterVersion.deployment_id == pk, DrafterVersion.version == number
            )
        ).one()
    )


def test_a_bad_policy_is_refused_whole_and_the_change_is_audited(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant]
) -> None:
    acme = tenants[0]
    admin = acme.headers(Role.admin)
    _deployment(client, db, acme)
    bad = client.patch(
        f"{BASE}/adaptation-policy",
        json={"continuous": True, "standing_baseline_share": 0.9, "gpu_seconds_per_day": "lots", "x": 1},
        headers=admin,
    )
    assert bad.status_code == 422, bad.text
    fields = {d["field"] for d in bad.json()["error"]["details"]}
    assert fields == {"standing_baseline_share", "gpu_seconds_per_day", "x"}
    assert client.get(f"{BASE}/adaptation-policy", headers=admin).json()["continuous"] is False
    good = client.patch(f"{BASE}/adaptation-policy", json={"standing_baseline_share": 0}, headers=admin)
    assert good.status_code == 200 and good.json()["standing_baseline_share"] == 0
    # PUT replaces: a field left out returns to its default.
    put = client.put(f"{BASE}/adaptation-policy", json={"first_drafter": False}, headers=admin)
    assert put.json()["standing_baseline_share"] == 0.05 and put.json()["first_drafter"] is False
    audit = client.get("/v1/accounts/acme/audit", headers=admin).json()
    entries = [e for e in audit["entries"] if e["action"] == "adaptation_policy.update"]
    assert len(entries) == 2
    assert entries[0]["after"] == {"first_drafter": False}


def test_first_drafter_trigger_on_both_dialects(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    """Speculation off, n-gram lookup and the default mode with no drafter all count as "no
    drafter"; the default mode with the target's default drafter does not."""
    acme = tenants[0]
    admin = acme.headers(Role.admin)
    few = settings.model_copy(update={"realign_min_traces": 5})
    for name, body, due in (
        ("off", {"disable_speculative_decoding": True}, True),
        ("lookup", {"ngram_speculation_length": 3, "draft_token_count": 4}, True),
        ("inherits", {}, False),  # reference-target's default drafter serves
    ):
        created = client.post(
            "/v1/accounts/acme/deployments",
            json={"target_model": "reference-target", "deployment_id": name, **body},
            headers=admin,
        )
        assert created.status_code == 201, created.text
        with db.new_session() as session:
            pk = int(session.scalars(select(Deployment.id).where(Deployment.name == name)).one())
        _add_traces(db.new_session, pk, 5)
        outcome = _adapt(db.new_session, few, pk)
        assert (outcome.decision.trigger == "first_drafter") is due, (name, outcome)
        assert (outcome.job_id is not None) is due, (name, outcome)
