"""The draft-stop threshold through a live canary, on real PostgreSQL and SQLite: the candidate arm
serves without a threshold and reports what each threshold would have drafted; at promotion the
tuner's threshold becomes the deployment's, shows in its API answer, the canary's arms and the
serving config; a shortfall after promotion reverts it before the drafter is rolled back, and a
rollback brings back the threshold of the drafter that returns."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select

from controlplane.canary.evaluate import evaluate_deployment, record_shadow_result
from controlplane.canary.service import start_canary
from controlplane.config import Settings
from controlplane.db.models import Deployment, DrafterState, DrafterVersion, Role
from tests.conftest import Database, Tenant
from tests.fleet.canary_setup import arm_records, passing_shadow

BASE = "/v1/accounts/acme/deployments"
GRID = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
# Per record of 20 rounds at k = 4: what each threshold would have drafted, and the accepted
# drafts it would have lost. Doubtful drafts are mostly rejected: stopping at 0.5 saves 36 of 80
# drafts and loses about one accepted token; higher thresholds start cutting accepted ones.
DRAFTED = [80, 80, 80, 60, 44, 36, 30, 25, 21]
LOST = [0, 0, 0, 0, 1, 6, 10, 14, 18]


def with_counts(record: dict[str, Any]) -> dict[str, Any]:
    accepted = record["accepted_tokens"]
    counts = {
        "thresholds": GRID,
        "rounds": record["verify_steps"],
        "drafted": DRAFTED,
        "accepted": [
            max(0, min(accepted - lost, drafted)) for drafted, lost in zip(DRAFTED, LOST, strict=True)
        ],
    }
    return {**record, "draft_stop_counts": counts}


def _setup(
    client: TestClient, db: Database, tenant: Tenant, settings: Settings, policy: dict[str, Any]
) -> int:
    """A deployment at k = 4 with candidate version 1 in a live canary; returns the deployment id."""
    admin = tenant.headers(Role.admin)
    reply = client.post(
        BASE,
        json={
            "target_model": "reference-target",
            "deployment_id": "svc",
            "draft_model": "reference-drafter",
            "draft_token_count": 4,
        },
        headers=admin,
    )
    assert reply.status_code == 201, reply.text
    policy = {"candidate_weight": 0.3, "baseline_weight": 0.3, **policy}
    assert client.patch(f"{BASE}/svc/canary-policy", json=policy, headers=admin).status_code == 200
    with db.new_session() as session:
        deployment = session.scalars(select(Deployment).where(Deployment.name == "svc")).one()
        # A threshold tuned for the drafter serving now: a rollback must bring it back.
        deployment.draft_confidence_threshold = 0.8
        version = DrafterVersion(
            deployment_id=deployment.id,
            version=1,
            artifact_path="/artifacts/v1",
            artifact_sha256=f"{1:064d}",
            state=DrafterState.candidate,
            training_metrics={},
            eval_metrics={},
        )
        session.add(version)
        session.flush()
        canary, _job = start_canary(session=session, version=version)
        session.commit()
        canary_id, deployment_id = canary.id, deployment.id
    with db.new_session() as session:
        phase = record_shadow_result(
            session=session, canary_id=canary_id, result=passing_shadow(), settings=settings
        )
        session.commit()
    assert phase == "live"
    return deployment_id


def _send(client: TestClient, tenant: Tenant, records: list[dict[str, Any]]) -> None:
    reply = client.post(
        f"{BASE}/svc/acceptance", json={"records": records}, headers=tenant.headers(Role.serving)
    )
    assert reply.status_code == 200, reply.text


def _evaluate(db: Database, deployment_id: int, settings: Settings) -> dict[str, Any]:
    with db.new_session() as session:
        outcome = evaluate_deployment(session=session, deployment_id=deployment_id, settings=settings)
        session.commit()
    assert outcome is not None
    return outcome


def _arms(client: TestClient, tenant: Tenant) -> dict[str, dict[str, Any]]:
    config = client.get(f"{BASE}/svc/serving-config", headers=tenant.headers(Role.serving)).json()
    return {arm["arm"]: arm for arm in config["arms"]}


def _winning_canary(client: TestClient, tenant: Tenant) -> None:
    _send(client, tenant, arm_records("live", 120, tps=1.3, ms=5.2, hit=0.1, version=None, start=100))
    candidate = arm_records("canary:1", 120, tps=3.0, ms=2.2, hit=0.5, version=1, start=1000)
    _send(client, tenant, [with_counts(r) for r in candidate])
    _send(client, tenant, arm_records("baseline", 90, tps=1.0, ms=5.0, hit=0.0, version=None, start=2000))


def test_the_canary_threshold_is_applied_at_promotion_served_and_reverted_by_the_watch(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    viewer = acme.headers(Role.viewer)
    deployment_id = _setup(client, db, acme, settings, {})
    arms = _arms(client, acme)
    # The candidate drafts without a threshold, so its records count every one of the grid.
    assert arms["canary:1"]["draft_confidence_threshold"] is None
    assert arms["live"]["draft_confidence_threshold"] == 0.8
    assert arms["baseline"]["draft_confidence_threshold"] is None
    _winning_canary(client, acme)
    assert _evaluate(db, deployment_id, settings)["decision"] == "promote"

    deployment = client.get(f"{BASE}/svc", headers=viewer).json()
    assert deployment["draft_confidence_threshold"] == 0.5
    assert deployment["draft_token_count"] == 4  # k is not tuned by this policy
    assert _arms(client, acme)["live"]["draft_confidence_threshold"] == 0.5
    canary = client.get(f"{BASE}/svc/canaries", headers=viewer).json()["canaries"][0]
    assert canary["arms"]["draft_stop"] == {"candidate_threshold": None, "chosen_threshold": 0.5}
    plan = canary["arms"]["decision_figures"]["draft_stop"]
    assert plan["choice"] == 0.5 and plan["changed"] and plan["rounds"] == 120 * 20
    # The watch expects the hit rate of the drafts the threshold keeps.
    row = next(r for r in plan["rows"] if r["threshold"] == 0.5)
    assert canary["arms"]["watch"]["expected_hit_rate"] == row["hit_rate"] > 0.8
    audit = client.get("/v1/accounts/acme/audit", headers=acme.headers(Role.admin)).json()["entries"]
    assert any(e["action"] == "deployment.draft_stop_tuned" for e in audit)
    # The deployment's tuning view shows the serving threshold beside the k table.
    view = client.get(f"{BASE}/svc/draft-length", headers=viewer).json()
    assert view["draft_stop"]["current_threshold"] == 0.5

    # Live, the promoted drafter hits far below that: the threshold goes first...
    _send(client, acme, arm_records("live", 60, tps=1.4, ms=4.0, hit=0.15, version=1, start=5000))
    assert _evaluate(db, deployment_id, settings)["watch"] == "draft length reverted"
    deployment = client.get(f"{BASE}/svc", headers=viewer).json()
    assert deployment["draft_confidence_threshold"] is None and deployment["active_drafter_version"] == 1
    assert _arms(client, acme)["live"]["draft_confidence_threshold"] is None
    # ...then, short at the canary's own settings too, the drafter, with the old threshold back.
    _send(client, acme, arm_records("live", 60, tps=1.4, ms=4.0, hit=0.15, version=1, start=6000))
    assert _evaluate(db, deployment_id, settings)["watch"] == "rolled back"
    deployment = client.get(f"{BASE}/svc", headers=viewer).json()
    assert deployment["active_drafter_version"] is None and deployment["draft_confidence_threshold"] == 0.8


def test_without_tune_draft_stop_the_threshold_is_left_as_set(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    deployment_id = _setup(client, db, acme, settings, {"tune_draft_stop": False})
    _winning_canary(client, acme)
    assert _evaluate(db, deployment_id, settings)["decision"] == "promote"
    deployment = client.get(f"{BASE}/svc", headers=acme.headers(Role.viewer)).json()
    assert deployment["active_drafter_version"] == 1 and deployment["draft_confidence_threshold"] == 0.8
    assert _arms(client, acme)["live"]["draft_confidence_threshold"] == 0.8


def test_with_k_tuned_too_the_threshold_wins_when_it_gains_more_and_k_stays(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    """The thresholds were counted at the canary's k: a promotion changes k or the threshold,
    whichever the tuners expect to gain more, never both."""
    acme = tenants[0]
    deployment_id = _setup(client, db, acme, settings, {"tune_draft_length": True})
    _winning_canary(client, acme)
    assert _evaluate(db, deployment_id, settings)["decision"] == "promote"
    deployment = client.get(f"{BASE}/svc", headers=acme.headers(Role.viewer)).json()
    canary = client.get(f"{BASE}/svc/canaries", headers=acme.headers(Role.viewer)).json()["canaries"][0]
    plan = canary["arms"]["decision_figures"]["draft_stop"]
    # The k tuner wanted a longer draft, but stopping at doubtful drafts gains more here.
    assert canary["arms"]["decision_figures"]["draft_length"]["best_k"] != 4
    assert "k_kept" in plan and plan["gain"] > 1.02
    assert deployment["draft_token_count"] == 4 and deployment["draft_confidence_threshold"] == 0.5
