"""The canary's recovery and trust, on real databases: a lost or failed shadow replay is sent again
or ends its canary with a reason (and its drift event with it); only records written under a
serving key move a canary; the judge's incremental tally equals a full recount; one deployment's
failing evaluation does not stop the others; after a guardrail switched a deployment to n-gram, a
new candidate is judged against n-gram and promoted when it wins."""

from __future__ import annotations

import random
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import delete, select

from controlplane.canary import policy as decision_policy
from controlplane.canary.evaluate import (
    advance_judge,
    evaluate_deployment,
    live_accumulators,
    record_shadow_result,
    recount_judge,
)
from controlplane.canary.service import start_canary
from controlplane.canary.shadow import claim_replay, fail_replay, sweep_overdue_replays
from controlplane.config import Settings
from controlplane.db.models import (
    AcceptanceRecordRow,
    Account,
    Canary,
    Deployment,
    DriftEvent,
    DriftResolution,
    DriftState,
    Job,
    JobState,
    Role,
    SpeculationMode,
)
from controlplane.db.session import get_engine, get_sessionmaker
from controlplane.timestamps import utcnow
from tests.conftest import TEST_SECRET, Database, Tenant, make_tenant
from tests.fleet.canary_setup import arm_records, candidate_version, passing_shadow

BASE = "/v1/accounts/acme/deployments"


def _deployment(
    client: TestClient, db: Database, tenant: Tenant, policy: dict[str, Any] | None = None
) -> int:
    admin = tenant.headers(Role.admin)
    created = client.post(
        BASE,
        json={
            "target_model": "reference-target",
            "deployment_id": "svc",
            "draft_model": "reference-drafter",
            "draft_token_count": 4,
        },
        headers=admin,
    )
    assert created.status_code == 201, created.text
    if policy:
        assert client.patch(f"{BASE}/svc/canary-policy", json=policy, headers=admin).status_code == 200
    with db.new_session() as session:
        return int(
            session.scalars(
                select(Deployment.id).where(
                    Deployment.name == "svc", Deployment.account_id == tenant.account_id
                )
            ).one()
        )


def _open_event(session: Any, deployment_id: int) -> int:
    event = DriftEvent(deployment_id=deployment_id, state=DriftState.open, detector="test", evidence={})
    session.add(event)
    session.flush()
    return event.id


def _live_canary(db: Database, settings: Settings, deployment_id: int, number: int = 1) -> int:
    with db.new_session() as session:
        version = candidate_version(session, deployment_id, number)
        canary, _job = start_canary(session=session, version=version)
        session.commit()
        canary_id = canary.id
    with db.new_session() as session:
        phase = record_shadow_result(
            session=session, canary_id=canary_id, result=passing_shadow(), settings=settings
        )
        session.commit()
    assert phase == "live"
    return canary_id


def _post(client: TestClient, headers: dict[str, str], records: list[dict[str, Any]]) -> None:
    reply = client.post(
        f"{BASE}/svc/acceptance", json={"format": "native", "records": records}, headers=headers
    )
    assert reply.status_code == 200, reply.text


def _evaluate(db: Database, settings: Settings, deployment_id: int) -> dict[str, Any]:
    with db.new_session() as session:
        outcome = evaluate_deployment(session=session, deployment_id=deployment_id, settings=settings)
        session.commit()
    assert outcome is not None
    return outcome


def _winning_split(start: int) -> list[dict[str, Any]]:
    return (
        arm_records("live", 120, tps=1.3, ms=5.2, hit=0.1, version=None, start=start)
        + arm_records("canary:1", 90, tps=3.0, ms=2.2, hit=0.6, version=1, start=start + 1000)
        + arm_records("baseline", 90, tps=1.0, ms=5.0, hit=0.0, version=None, start=start + 2000)
    )


def test_only_records_written_under_a_serving_key_promote_or_roll_back(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    viewer = acme.headers(Role.viewer)
    deployment_id = _deployment(client, db, acme, {"candidate_weight": 0.3, "baseline_weight": 0.3})
    canary_id = _live_canary(db, settings, deployment_id)

    # An ingest key posts a split in which the candidate clearly wins: the canary does not move.
    _post(client, acme.headers(Role.ingest), _winning_split(0))
    outcome = _evaluate(db, settings, deployment_id)
    assert outcome["decision"] == "continue", outcome
    canary = client.get(f"{BASE}/svc/canaries/{canary_id}", headers=viewer).json()
    assert canary["phase"] == "live"
    assert canary["arms"]["live"]["arm_counts"]["candidate"]["requests"] == 0

    # The same split from the fleet's serving key promotes.
    _post(client, acme.headers(Role.serving), _winning_split(10_000))
    assert _evaluate(db, settings, deployment_id)["decision"] == "promote"
    assert client.get(f"{BASE}/svc", headers=viewer).json()["active_drafter_version"] == 1

    # Live records far below the canary's hit rate, from an ingest key, roll nothing back...
    shortfall = arm_records("live", 400, tps=1.2, ms=4.0, hit=0.1, version=1, start=20_000)
    _post(client, acme.headers(Role.ingest), shortfall)
    assert _evaluate(db, settings, deployment_id)["watch"] == "watching"
    assert client.get(f"{BASE}/svc", headers=viewer).json()["active_drafter_version"] == 1
    # ...from the serving key they do.
    shortfall = arm_records("live", 400, tps=1.2, ms=4.0, hit=0.1, version=1, start=30_000)
    _post(client, acme.headers(Role.serving), shortfall)
    assert _evaluate(db, settings, deployment_id)["watch"] == "rolled back"
    assert client.get(f"{BASE}/svc", headers=viewer).json()["active_drafter_version"] is None


def _slow_split(start: int) -> list[dict[str, Any]]:
    """Both drafters slower than no speculation (the seed's 29 % case), at the 80/10/10 split."""
    return (
        arm_records("live", 480, tps=1.2, ms=8.0, hit=0.05, version=None, start=start)
        + arm_records("canary:1", 60, tps=1.0, ms=9.5, hit=0.01, version=1, start=start + 1000)
        + arm_records("baseline", 60, tps=1.0, ms=5.0, hit=0.0, version=None, start=start + 2000)
    )


def test_a_guardrail_trips_only_on_serving_records_and_then_a_candidate_beats_ngram(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    viewer = acme.headers(Role.viewer)
    deployment_id = _deployment(client, db, acme)
    with db.new_session() as session:
        event_id = _open_event(session, deployment_id)
        session.commit()
    canary_id = _live_canary(db, settings, deployment_id)

    _post(client, acme.headers(Role.ingest), _slow_split(0))
    assert _evaluate(db, settings, deployment_id)["decision"] == "continue"
    assert client.get(f"{BASE}/svc", headers=viewer).json()["speculation_mode"] == "draft_model"
    assert "guardrails" not in client.get(f"{BASE}/svc/canaries/{canary_id}", headers=viewer).json()["arms"]

    _post(client, acme.headers(Role.serving), _slow_split(10_000))
    assert _evaluate(db, settings, deployment_id)["decision"] == "reject"
    assert client.get(f"{BASE}/svc", headers=viewer).json()["speculation_mode"] == "ngram"
    with db.new_session() as session:
        event = session.get_one(DriftEvent, event_id)
        assert event.state != DriftState.open and event.resolution == DriftResolution.guardrail_action
        assert event.resolution_reason and "slower than no speculation" in event.resolution_reason

    # The loop goes on: a new candidate is canaried against the n-gram fallback now serving.
    with db.new_session() as session:
        version = candidate_version(session, deployment_id, 2)
        canary, job = start_canary(session=session, version=version)
        session.commit()
        second_id, job_id = canary.id, job.id
    with db.new_session() as session:
        second = session.get_one(Canary, second_id)
        assert second.incumbent_version_id is None and second.arms["incumbent_mode"] == "ngram"
        plan = claim_replay(session=session, job_id=job_id, delivery_id=None).plan
        session.commit()
    assert plan is not None and plan.incumbent is None
    assert (plan.incumbent_speculation, plan.ngram_length) == ("ngram", 3)
    with db.new_session() as session:
        phase = record_shadow_result(
            session=session, canary_id=second_id, result=passing_shadow(), settings=settings
        )
        session.commit()
    assert phase == "live"
    serving = acme.headers(Role.serving)
    _post(client, serving, arm_records("live", 480, tps=1.3, ms=5.2, hit=0.1, version=None, start=40_000))
    _post(client, serving, arm_records("canary:2", 60, tps=3.0, ms=2.2, hit=0.6, version=2, start=41_000))
    _post(client, serving, arm_records("baseline", 60, tps=1.0, ms=5.0, hit=0.0, version=None, start=42_000))
    assert _evaluate(db, settings, deployment_id)["decision"] == "promote"
    deployment = client.get(f"{BASE}/svc", headers=viewer).json()
    assert deployment["speculation_mode"] == "draft_model" and deployment["active_drafter_version"] == 2
    # A rollback would bring back what served before it: n-gram.
    back = client.post(f"{BASE}/svc:rollback", headers=acme.headers(Role.admin), json={"reason": "test"})
    assert back.status_code == 200 and back.json()["speculation_mode"] == "ngram", back.text


def _insert(session: Any, deployment_id: int, rows: list[dict[str, Any]], *, trusted: bool = True) -> None:
    for row in rows:
        session.add(
            AcceptanceRecordRow(
                deployment_id=deployment_id,
                created_at=utcnow(),
                accepted_per_position=row.pop("accepted_per_position"),
                from_serving_key=trusted,
                total_ms=None,
                ttft_ms=None,
                **row,
            )
        )
    session.flush()


def test_the_incremental_judge_equals_a_full_recount_tick_by_tick(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    deployment_id = _deployment(client, db, acme, {"candidate_weight": 0.3, "baseline_weight": 0.3})
    canary_id = _live_canary(db, settings, deployment_id)
    policy = decision_policy.CanaryPolicy(candidate_weight=0.3, baseline_weight=0.3)
    split = _winning_split(0)
    random.Random(5).shuffle(split)

    def compare(session: Any, canary: Canary, view: Any) -> None:
        # A tick that reads at most ``batch_limit`` records judges the oldest ones (an id prefix).
        full = recount_judge(session=session, canary=canary, max_requests=view.records)
        assert view.to_state() == full.to_state()  # the same floats, not merely close ones
        ticked = decision_policy.decide(live_accumulators(view.arms), policy)
        whole = decision_policy.decide(live_accumulators(full.arms), policy)
        assert ticked.as_dict() == whole.as_dict()

    ticks = 0
    with db.new_session() as session:
        canary = session.get_one(Canary, canary_id)
        for start in range(0, len(split), 17):
            _insert(session, deployment_id, split[start : start + 17])
            # Records from an ingest key, interleaved, never count.
            _insert(session, deployment_id, arm_records("canary:1", 2, tps=9, ms=0.1, hit=1, version=1,
                                                     start=90_000 + start), trusted=False)  # fmt: skip
            view = advance_judge(
                session=session, canary=canary, max_requests=policy.max_requests, batch_limit=7
            )
            compare(session, canary, view)
            ticks += 1
        for _ in range(len(split) // 7 + 3):  # the tally catches up
            view = advance_judge(
                session=session, canary=canary, max_requests=policy.max_requests, batch_limit=7
            )
            compare(session, canary, view)
        assert view.records == len(split)
        # A transaction takes an id, then commits only after a tick saw a newer one: still counted.
        late = arm_records("canary:1", 4, tps=3.0, ms=2.2, hit=0.6, version=1, start=99_000)
        _insert(session, deployment_id, [dict(r) for r in late])
        taken = session.scalar(
            select(AcceptanceRecordRow.id).where(AcceptanceRecordRow.request_id == late[0]["request_id"])
        )
        session.execute(delete(AcceptanceRecordRow).where(AcceptanceRecordRow.id == taken))
        view = advance_judge(session=session, canary=canary, max_requests=policy.max_requests)
        compare(session, canary, view)
        assert view.records == len(split) + 3 and int(canary.judge_state["horizon"]) > taken
        _insert(session, deployment_id, [{**late[0], "id": taken}])
        for _ in range(2):
            view = advance_judge(session=session, canary=canary, max_requests=policy.max_requests)
            compare(session, canary, view)
        assert view.records == len(split) + 4
        assert canary.judge_state["tally"]["records"] == len(split) + 4
        assert canary.judge_watermark_record_id == canary.judge_state["horizon"]
        session.commit()
    assert ticks > 10
    # One big read decides as the ticks did.
    assert _evaluate(db, settings, deployment_id)["decision"] == "promote"


def test_a_lost_replay_is_sent_again_then_ends_its_canary_and_drift_event_with_the_reason(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    deployment_id = _deployment(client, db, acme)
    with db.new_session() as session:
        event_id = _open_event(session, deployment_id)
        canary, job = start_canary(session=session, version=candidate_version(session, deployment_id, 1))
        session.commit()
        canary_id, job_id = canary.id, job.id
        sent_at = canary.shadow_sent_at
    assert sent_at is not None and canary.shadow_attempts == 1

    def sweep(after_s: float) -> tuple[list[int], list[int]]:
        with db.new_session() as session:
            done = sweep_overdue_replays(
                session=session, resend_after_s=60, max_sends=3, now=sent_at + timedelta(seconds=after_s)
            )
            session.commit()
        return done.resend_jobs, done.ended_canaries

    assert sweep(30) == ([], [])  # not overdue yet
    assert sweep(61) == ([job_id], [])
    assert sweep(100) == ([], [])  # the resend restarted the clock
    # A running replay whose worker keeps beating is left alone.
    with db.new_session() as session:
        running = session.get_one(Job, job_id)
        running.state, running.heartbeat_at = JobState.running, sent_at + timedelta(seconds=150)
        session.commit()
    assert sweep(160) == ([], [])
    assert sweep(250) == ([job_id], [])  # its heartbeat stopped: the worker is presumed lost
    assert sweep(400) == ([], [canary_id])
    with db.new_session() as session:
        ended = session.get_one(Canary, canary_id)
        assert (ended.phase, ended.decision, ended.shadow_attempts) == ("decided", "inconclusive", 3)
        assert "sent 3 times" in (ended.reason or "")
        assert session.get_one(Job, job_id).state == JobState.failed
        event = session.get_one(DriftEvent, event_id)
        assert event.resolution == DriftResolution.canary_inconclusive
        assert event.resolution_reason == ended.reason
    assert sweep(10_000) == ([], [])


def test_a_failed_replay_ends_its_canary_and_drift_event_with_the_error(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    deployment_id = _deployment(client, db, acme)
    with db.new_session() as session:
        event_id = _open_event(session, deployment_id)
        canary, job = start_canary(session=session, version=candidate_version(session, deployment_id, 1))
        session.commit()
        canary_id, job_id = canary.id, job.id
    with db.new_session() as session:
        fail_replay(session=session, job_id=job_id, error="artifact sha256 mismatch", candidate_refused=True)
        session.commit()
    with db.new_session() as session:
        ended = session.get_one(Canary, canary_id)
        assert ended.decision == "reject" and "sha256 mismatch" in (ended.reason or "")
        event = session.get_one(DriftEvent, event_id)
        assert event.resolution == DriftResolution.candidate_rejected
        assert "sha256 mismatch" in (event.resolution_reason or "")
        # A canary that answered is no replay's to sweep.
        assert (
            sweep_overdue_replays(
                session=session, resend_after_s=1, max_sends=1, now=utcnow() + timedelta(hours=1)
            ).ended_canaries
            == []
        )


def test_one_failing_evaluation_does_not_stop_the_other_deployments(
    tmp_path: Path, sqlite_template: Path
) -> None:
    from workers.canary_tasks import judge_tick

    shutil.copy(sqlite_template, tmp_path / "judge.db")
    url = f"sqlite:///{tmp_path / 'judge.db'}"
    settings = Settings(database_url=url, environment="test", secret_key=TEST_SECRET, api_gc_freeze=False)
    sessions = get_sessionmaker(url)
    try:
        with sessions() as session:
            tenant = make_tenant(session, "acme")
            ids = []
            for name in ("broken", "svc"):
                deployment = Deployment(
                    account_id=tenant.account_id,
                    name=name,
                    target_model="reference-target",
                    speculation_mode=SpeculationMode.draft_model,
                    draft_model="reference-drafter",
                    draft_token_count=4,
                    drift_policy={},
                    canary_policy={"candidate_weight": 0.3, "baseline_weight": 0.3},
                )
                session.add(deployment)
                session.flush()
                ids.append(deployment.id)
            session.commit()
        canaries = [_live_canary(Database(url, "sqlite", sessions), settings, d) for d in ids]
        with sessions() as session:
            # The first deployment's stored policy got corrupted: its evaluation raises every tick.
            broken = session.get_one(Deployment, ids[0])
            broken.canary_policy = {**broken.canary_policy, "alpha": 7}
            for deployment_id in ids:
                rows = _winning_split(deployment_id * 100_000)
                _insert(session, deployment_id, rows)
            session.commit()
        outcome = judge_tick(settings)
        assert "error" in outcome[str(ids[0])] and "alpha" in outcome[str(ids[0])]["error"]
        assert outcome[str(ids[1])]["decision"] == "promote"
        judge_tick(settings)
        with sessions() as session:
            failing = session.get_one(Canary, canaries[0])
            assert failing.phase == "live" and failing.arms["evaluation_errors"]["count"] == 2
            assert session.get_one(Canary, canaries[1]).phase == "watching"

        from controlplane.app import create_app

        with TestClient(create_app(settings)) as api:
            text = api.get("/metrics", headers=tenant.headers(Role.viewer)).text
        assert 'specctl_canary_evaluation_errors_total{account="acme",deployment="broken"} 2.0' in text
        assert 'specctl_canary_evaluation_errors_total{account="acme",deployment="svc"} 0.0' in text
    finally:
        with sessions() as session:
            session.execute(delete(Account))
            session.commit()
        get_engine(url).dispose()
