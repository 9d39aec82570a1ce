"""Canary, promotion and rollback through the API and the services, on real PostgreSQL and SQLite:
exactly one active version under concurrent promotions, rollback restores the previous version
and its k, a broken candidate never promotes, and the serving config follows every move."""

from __future__ import annotations

import random
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, func, select

from controlplane.canary.evaluate import evaluate_deployment, record_shadow_result
from controlplane.canary.service import promote, start_canary
from controlplane.config import Settings
from controlplane.db.models import (
    AcceptanceRecordRow,
    Account,
    AuditEntry,
    Canary,
    Deployment,
    DrafterState,
    DrafterVersion,
    Role,
    SpeculationMode,
)
from controlplane.db.session import get_engine, get_sessionmaker
from controlplane.errors import ConflictError
from controlplane.timestamps import utcnow
from tests.conftest import Database, RecordingWorkQueue, Tenant, make_tenant
from tests.fleet.canary_setup import candidate_version

BASE = "/v1/accounts/acme/deployments"


def _deployment(client: TestClient, tenant: Tenant, k: int = 4) -> None:
    response = client.post(
        BASE,
        json={
            "target_model": "reference-target",
            "deployment_id": "svc",
            "draft_model": "reference-drafter",
            "draft_token_count": k,
        },
        headers=tenant.headers(Role.admin),
    )
    assert response.status_code == 201, response.text


def _add_version(db: Database, number: int, parent_id: int | None = None) -> int:
    with db.new_session() as session:
        deployment = session.scalars(select(Deployment).where(Deployment.name == "svc")).one()
        version = candidate_version(session, deployment.id, number, parent_version_id=parent_id)
        session.commit()
        return version.id


def test_promote_then_rollback_restores_the_previous_version_and_its_k(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant]
) -> None:
    acme, globex = tenants
    admin, viewer = acme.headers(Role.admin), acme.headers(Role.viewer)
    _deployment(client, acme, k=4)
    _add_version(db, 1)
    _add_version(db, 2)

    config = client.get(f"{BASE}/svc/serving-config", headers=acme.headers(Role.serving)).json()
    assert [a["arm"] for a in config["arms"]] == ["live", "baseline"]  # the standing no-speculation share
    assert config["arms"][0]["drafter_version"] is None
    drafter = config["arms"][0]["drafter"]  # the registered drafter, by folder and per-file sha256
    assert drafter["name"] == "reference-drafter" and drafter["uri"].endswith("generic-drafter")
    assert "model.safetensors" in drafter["files"] and config["target"]["name"] == "reference-target"

    # Viewers read but never change; another account does not see the deployment at all.
    assert client.post(f"{BASE}/svc/drafter-versions/1:promote", headers=viewer).status_code == 403
    assert (
        client.post(
            "/v1/accounts/globex/deployments/svc/drafter-versions/1:promote",
            headers=globex.headers(Role.admin),
        ).status_code
        == 404
    )

    first = client.post(f"{BASE}/svc/drafter-versions/1:promote", headers=admin, json={"reason": "test"})
    assert first.status_code == 200 and first.json()["state"] == "active"
    # Change k while v1 serves, then promote v2: rollback must bring back v1 with k = 6.
    assert client.patch(f"{BASE}/svc", json={"draft_token_count": 6}, headers=admin).status_code == 200
    assert client.post(f"{BASE}/svc/drafter-versions/2:promote", headers=admin).status_code == 200
    states = {
        v["version"]: v["state"]
        for v in client.get(f"{BASE}/svc/drafter-versions", headers=viewer).json()["drafter_versions"]
    }
    assert states == {1: "retired", 2: "active"}
    config = client.get(f"{BASE}/svc/serving-config", headers=acme.headers(Role.serving)).json()
    assert (
        config["arms"][0]["drafter_version"] == 2
        and config["arms"][0]["drafter"]["uri"] == "file:///artifacts/v2"
    )

    assert client.post(f"{BASE}/svc:rollback", headers=viewer).status_code == 403
    back = client.post(f"{BASE}/svc:rollback", headers=admin, json={"reason": "bad"})
    assert back.status_code == 200, back.text
    assert back.json() == {"active_version": 1, "draft_token_count": 6, "speculation_mode": "draft_model"}
    states = {
        v["version"]: v["state"]
        for v in client.get(f"{BASE}/svc/drafter-versions", headers=viewer).json()["drafter_versions"]
    }
    assert states == {1: "active", 2: "rejected"}
    config = client.get(f"{BASE}/svc/serving-config", headers=acme.headers(Role.serving)).json()
    assert config["arms"][0]["drafter_version"] == 1
    actions = [
        e["action"]
        for e in client.get("/v1/accounts/acme/audit?deployment=svc", headers=viewer).json()["entries"]
    ]
    assert actions[:3] == ["drafter.rollback", "drafter.promote", "deployment.update"]


def test_rollback_after_a_canary_promotion_restores_version_and_k(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], queue: RecordingWorkQueue
) -> None:
    acme = tenants[0]
    admin = acme.headers(Role.admin)
    _deployment(client, acme, k=4)
    _add_version(db, 1)
    v2_id = _add_version(db, 2)
    assert client.post(f"{BASE}/svc/drafter-versions/1:promote", headers=admin).status_code == 200
    started = client.post(f"{BASE}/svc/drafter-versions/2:canary", headers=admin)
    assert started.status_code == 202, started.text
    canary = started.json()
    assert canary["phase"] == "shadow" and canary["incumbent_version"] == 1 and len(queue.sent) == 1
    # The canary's decision promotes v2 and sets k = 7 (the tuner's choice).
    with db.new_session() as session:
        row = session.get_one(Canary, canary["canary_id"])
        deployment = session.get_one(Deployment, row.deployment_id)
        promote(
            session=session,
            deployment_id=deployment.id,
            version_number=2,
            actor="system",
            reason="canary won",
            canary=row,
            draft_token_count=7,
        )
        session.commit()
    got = client.get(f"{BASE}/svc/canaries/{canary['canary_id']}", headers=admin).json()
    assert got["decision"] == "promote" and got["phase"] == "watching"
    assert client.get(f"{BASE}/svc", headers=admin).json()["draft_token_count"] == 7
    back = client.post(f"{BASE}/svc:rollback", headers=admin, json={"reason": "live hit rate fell"})
    assert back.status_code == 200, back.text
    assert back.json() == {"active_version": 1, "draft_token_count": 4, "speculation_mode": "draft_model"}
    with db.new_session() as session:
        assert session.get_one(DrafterVersion, v2_id).state == DrafterState.rejected
        assert session.get_one(Canary, canary["canary_id"]).phase == "rolled_back"
    # Nothing left to roll back to a version: the configured drafter serves; a second rollback is 409.
    assert client.post(f"{BASE}/svc:rollback", headers=admin).status_code == 200
    assert client.post(f"{BASE}/svc:rollback", headers=admin).status_code == 409


def test_a_broken_candidate_is_rejected_and_cannot_be_promoted(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    _deployment(client, acme)
    v1 = _add_version(db, 1)
    with db.new_session() as session:
        canary, _job = start_canary(session=session, version=session.get_one(DrafterVersion, v1))
        session.commit()
        canary_id = canary.id
    shadow: dict[str, Any] = {
        "arms": {
            "baseline": {"hit_rate": None, "broken": None},
            "incumbent": {"hit_rate": 0.3, "broken": None},
            "candidate": {"hit_rate": 0.9, "broken": "prompt 3: token 17 differs from no speculation"},
        },
        "paired": {},
    }
    with db.new_session() as session:
        phase = record_shadow_result(session=session, canary_id=canary_id, result=shadow, settings=settings)
        session.commit()
    assert phase == "decided"
    got = client.get(f"{BASE}/svc/canaries/{canary_id}", headers=acme.headers(Role.viewer)).json()
    assert got["decision"] == "reject" and "broken" in got["reason"]
    refused = client.post(f"{BASE}/svc/drafter-versions/1:promote", headers=acme.headers(Role.admin))
    assert refused.status_code == 409
    with db.new_session() as session:
        with pytest.raises(ConflictError):
            promote(
                session=session,
                deployment_id=session.get_one(Canary, canary_id).deployment_id,
                version_number=1,
                actor="x",
                reason="x",
            )


def test_canary_policy_validation_names_every_bad_field(
    client: TestClient, tenants: tuple[Tenant, Tenant]
) -> None:
    acme = tenants[0]
    _deployment(client, acme)
    admin = acme.headers(Role.admin)
    bad = client.patch(
        f"{BASE}/svc/canary-policy", json={"alpha": 2, "bogus": 1, "min_samples_per_arm": "x"}, headers=admin
    )
    assert bad.status_code == 422
    message = bad.json()["error"]["message"]
    assert "alpha" in message and "bogus" in message and "min_samples_per_arm" in message
    assert client.get(f"{BASE}/svc/canary-policy", headers=admin).json()["alpha"] == 0.05  # nothing stored
    good = client.patch(
        f"{BASE}/svc/canary-policy", json={"candidate_weight": 0.3, "baseline_weight": 0.3}, headers=admin
    )
    assert good.status_code == 200 and good.json()["candidate_weight"] == 0.3


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_concurrent_promotions_of_two_candidates_leave_exactly_one_active(
    dialect: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    if dialect == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        shutil.copy(template, tmp_path / "race.db")
        url = f"sqlite:///{tmp_path / 'race.db'}"
    else:
        url = request.getfixturevalue("migrated_pg_url")
    sessions = get_sessionmaker(url)
    with sessions() as session:
        tenant = make_tenant(session, f"promo{dialect}")
        deployment = Deployment(
            account_id=tenant.account_id,
            name="svc",
            target_model="reference-target",
            speculation_mode=SpeculationMode.draft_model,
            draft_model="reference-drafter",
            draft_token_count=4,
            drift_policy={},
            canary_policy={},
        )
        session.add(deployment)
        session.flush()
        for n in (1, 2):
            session.add(
                DrafterVersion(
                    deployment_id=deployment.id,
                    version=n,
                    artifact_path=f"/a/{n}",
                    artifact_sha256="0" * 64,
                    state=DrafterState.candidate,
                    training_metrics={},
                    eval_metrics={},
                )
            )
        session.commit()
        deployment_id = deployment.id
    try:
        barrier = threading.Barrier(2)
        outcomes: list[str] = []

        def promote_one(number: int) -> None:
            with sessions() as session:
                barrier.wait(10)
                try:
                    promote(
                        session=session,
                        deployment_id=deployment_id,
                        version_number=number,
                        actor=f"t{number}",
                        reason="race",
                    )
                    session.commit()
                    outcomes.append(f"promoted {number}")
                except Exception as exc:  # a refused promotion is fine; two actives are not
                    session.rollback()
                    outcomes.append(f"refused {number}: {type(exc).__name__}")

        threads = [threading.Thread(target=promote_one, args=(n,)) for n in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(outcomes) == 2, outcomes
        with sessions() as session:
            active = session.scalar(
                select(func.count())
                .select_from(DrafterVersion)
                .where(
                    DrafterVersion.deployment_id == deployment_id, DrafterVersion.state == DrafterState.active
                )
            )
            promotions = session.scalar(
                select(func.count())
                .select_from(AuditEntry)
                .where(AuditEntry.action == "drafter.promote", AuditEntry.account_id == tenant.account_id)
            )
        assert active == 1
        assert promotions == sum(o.startswith("promoted") for o in outcomes)
    finally:
        with sessions() as session:
            session.execute(delete(Account).where(Account.id == tenant.account_id))
            session.commit()
        if dialect == "sqlite":
            get_engine(url).dispose()


def _shadow(candidate_tps: float, incumbent_tps: float, n: int = 30) -> dict[str, Any]:
    """A shadow replay that neither breaks nor harms: per-prompt figures for the three arms."""
    rng = random.Random(1)

    def arm(tps: float, ms: float) -> dict[str, list[float]]:
        return {
            "tokens_per_step": [tps * rng.uniform(0.9, 1.1) for _ in range(n)],
            "ms_per_token": [ms * rng.uniform(0.9, 1.1) for _ in range(n)],
        }

    return {
        "arms": {"baseline": {}, "incumbent": {}, "candidate": {}},
        "per_prompt": {
            "baseline": arm(1.0, 5.0),
            "incumbent": arm(incumbent_tps, 5.0 / incumbent_tps * 1.3),
            "candidate": arm(candidate_tps, 5.0 / candidate_tps * 1.3),
        },
        "costs": {"cost_ratio": 0.07},
    }


def _records(
    db: Database,
    deployment_id: int,
    arm: str,
    n: int,
    *,
    tps: float,
    ms: float,
    hit: float,
    version: int | None,
    start: int,
    from_serving_key: bool = True,
) -> None:
    rng = random.Random(start)
    with db.new_session() as session:
        for i in range(n):
            steps = 20
            accepted_per_step = max(0.0, tps - 1.0)
            generated = int(round(steps * tps * rng.uniform(0.92, 1.08)))
            drafted = 0 if arm == "baseline" else steps * 4
            accepted = 0 if arm == "baseline" else min(drafted, int(round(drafted * hit)))
            session.add(
                AcceptanceRecordRow(
                    deployment_id=deployment_id,
                    request_id=f"{arm}-{start + i}",
                    created_at=utcnow(),
                    arm=arm,
                    drafter_version=version,
                    k=0 if arm == "baseline" else 4,
                    drafted_tokens=drafted,
                    accepted_tokens=accepted,
                    verify_steps=generated if arm == "baseline" else steps,
                    generated_tokens=generated,
                    accepted_per_position=[]
                    if arm == "baseline"
                    else [int(steps * accepted_per_step / 4)] * 4,
                    inter_token_ms=ms * rng.uniform(0.9, 1.1),
                    total_ms=None,
                    ttft_ms=None,
                    from_serving_key=from_serving_key,
                )
            )
        session.commit()


def _live_canary(db: Database, settings: Settings, shadow: dict[str, Any]) -> tuple[int, int]:
    v1 = _add_version(db, 1)
    with db.new_session() as session:
        canary, _job = start_canary(session=session, version=session.get_one(DrafterVersion, v1))
        session.commit()
        canary_id, deployment_id = canary.id, canary.deployment_id
    with db.new_session() as session:
        phase = record_shadow_result(session=session, canary_id=canary_id, result=shadow, settings=settings)
        session.commit()
    assert phase == "live"
    return canary_id, deployment_id


def test_a_live_canary_that_wins_is_promoted_and_serving_follows(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    viewer = acme.headers(Role.viewer)
    _deployment(client, acme)
    assert (
        client.patch(
            f"{BASE}/svc/canary-policy",
            json={"candidate_weight": 0.3, "baseline_weight": 0.3, "tune_draft_length": True},
            headers=acme.headers(Role.admin),
        ).status_code
        == 200
    )
    canary_id, deployment_id = _live_canary(db, settings, _shadow(3.0, 1.3))
    serving = acme.headers(Role.serving)
    arms = {
        a["arm"]: a["weight"]
        for a in client.get(f"{BASE}/svc/serving-config", headers=serving).json()["arms"]
    }
    assert arms == {"live": 0.4, "canary:1": 0.3, "baseline": 0.3}
    # Too few requests: the rule waits.
    _records(db, deployment_id, "live", 10, tps=1.3, ms=5.2, hit=0.1, version=None, start=0)
    with db.new_session() as session:
        outcome = evaluate_deployment(session=session, deployment_id=deployment_id, settings=settings)
        session.commit()
    assert outcome is not None and outcome["decision"] == "continue"
    # The candidate accepts far more per step and is faster than both the incumbent and no speculation.
    _records(db, deployment_id, "live", 120, tps=1.3, ms=5.2, hit=0.1, version=None, start=100)
    _records(db, deployment_id, "canary:1", 90, tps=3.0, ms=2.2, hit=0.6, version=1, start=1000)
    _records(db, deployment_id, "baseline", 90, tps=1.0, ms=5.0, hit=0.0, version=None, start=2000)
    with db.new_session() as session:
        outcome = evaluate_deployment(session=session, deployment_id=deployment_id, settings=settings)
        session.commit()
    assert outcome is not None and outcome["decision"] == "promote", outcome
    got = client.get(f"{BASE}/svc/canaries/{canary_id}", headers=viewer).json()
    assert got["decision"] == "promote" and got["phase"] == "watching"
    figures = got["arms"]["decision_figures"]
    assert figures["arms"]["candidate"]["n"] if "n" in figures["arms"]["candidate"] else figures["arm_counts"]
    assert figures["draft_length"]["best_k"] >= 1
    if figures["draft_length"]["best_k"] != 4:
        # The watch compares the live hit rate with what the new k should give, not the canary's k.
        assert got["arms"]["watch"]["expected_hit_rate"] == figures["expected_hit_rate_at_new_k"]
    live = client.get(f"{BASE}/svc/serving-config", headers=acme.headers(Role.serving)).json()["arms"]
    assert [a["arm"] for a in live] == ["live", "baseline"] and live[0]["drafter_version"] == 1
    assert (
        client.get(f"{BASE}/svc", headers=viewer).json()["draft_token_count"]
        == figures["draft_length"]["best_k"]
    )


def test_a_tuned_k_that_falls_short_goes_back_to_the_canary_k_before_any_rollback(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    admin, viewer = acme.headers(Role.admin), acme.headers(Role.viewer)
    _deployment(client, acme)
    policy = {"candidate_weight": 0.3, "baseline_weight": 0.3, "tune_draft_length": True}
    assert client.patch(f"{BASE}/svc/canary-policy", json=policy, headers=admin).status_code == 200
    canary_id, deployment_id = _live_canary(db, settings, _shadow(3.0, 1.3))
    _records(db, deployment_id, "live", 120, tps=1.3, ms=5.2, hit=0.1, version=None, start=100)
    _records(db, deployment_id, "canary:1", 90, tps=3.0, ms=2.2, hit=0.6, version=1, start=1000)
    _records(db, deployment_id, "baseline", 90, tps=1.0, ms=5.0, hit=0.0, version=None, start=2000)

    def evaluate() -> dict[str, Any]:
        with db.new_session() as session:
            outcome = evaluate_deployment(session=session, deployment_id=deployment_id, settings=settings)
            session.commit()
        assert outcome is not None
        return outcome

    assert evaluate()["decision"] == "promote"
    tuned_k = client.get(f"{BASE}/svc", headers=viewer).json()["draft_token_count"]
    assert tuned_k != 4  # the tuner extrapolated past the canary's k = 4
    # Live at the tuned k, the new drafter hits far below what the tuner expected...
    _records(db, deployment_id, "live", 60, tps=1.4, ms=4.0, hit=0.15, version=1, start=5000)
    outcome = evaluate()
    assert outcome["watch"] == "draft length reverted", outcome
    # ...so k goes back to the canary's, and the new drafter keeps serving.
    deployment = client.get(f"{BASE}/svc", headers=viewer).json()
    assert deployment["draft_token_count"] == 4 and deployment["active_drafter_version"] == 1
    watch = client.get(f"{BASE}/svc/canaries/{canary_id}", headers=viewer).json()["arms"]["watch"]
    assert watch["draft_length_reverted"]["from"] == tuned_k and watch["expected_hit_rate"] == 0.6
    audit = client.get("/v1/accounts/acme/audit", headers=admin).json()["entries"]
    assert any(e["action"] == "drafter.draft_length_reverted" for e in audit)
    # At the canary's own k it still falls short: now the drafter is rolled back.
    _records(db, deployment_id, "live", 60, tps=1.4, ms=4.0, hit=0.15, version=1, start=6000)
    assert evaluate()["watch"] == "rolled back"
    assert client.get(f"{BASE}/svc", headers=viewer).json()["active_drafter_version"] is None


def test_a_slower_than_no_speculation_incumbent_is_switched_to_ngram_when_the_candidate_fails(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    _deployment(client, acme)
    canary_id, deployment_id = _live_canary(db, settings, _shadow(1.2, 1.2))
    # Both drafters are slow (the seed's 29% case): latency per token well above no speculation's.
    # Arm counts follow the default routing weights (80/10/10), so the split is not flagged.
    _records(db, deployment_id, "live", 480, tps=1.2, ms=8.0, hit=0.05, version=None, start=0)
    _records(db, deployment_id, "canary:1", 60, tps=1.0, ms=9.5, hit=0.01, version=1, start=1000)
    _records(db, deployment_id, "baseline", 60, tps=1.0, ms=5.0, hit=0.0, version=None, start=2000)
    with db.new_session() as session:
        outcome = evaluate_deployment(session=session, deployment_id=deployment_id, settings=settings)
        session.commit()
    assert outcome is not None and outcome["decision"] == "reject", outcome
    got = client.get(f"{BASE}/svc", headers=acme.headers(Role.viewer)).json()
    assert got["speculation_mode"] == "ngram"
    actions = [
        e["action"]
        for e in client.get(
            "/v1/accounts/acme/audit?deployment=svc", headers=acme.headers(Role.viewer)
        ).json()["entries"]
    ]
    assert "guardrail.speculation_slower" in actions and "drafter.reject" in actions
    canary = client.get(f"{BASE}/svc/canaries/{canary_id}", headers=acme.headers(Role.viewer)).json()
    assert canary["arms"]["guardrails"][0]["kind"] == "speculation_slower"
