"""The live judge per request category, through ingest, the stored tally and the API: a candidate
that wins the overall mix but loses one category is rejected and the canary shows each
category's figures; the incremental tally, split by category, equals a full recount."""

from __future__ import annotations

import random
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from controlplane.canary.evaluate import (
    advance_judge,
    evaluate_deployment,
    record_shadow_result,
    recount_judge,
)
from controlplane.canary.service import start_canary
from controlplane.config import Settings
from controlplane.db.models import Canary, Deployment, DrafterState, DrafterVersion, Role
from tests.conftest import Database, Tenant
from tests.fleet.canary_setup import arm_records, passing_shadow

BASE = "/v1/accounts/acme/deployments"
POLICY = {"candidate_weight": 0.3, "baseline_weight": 0.3}


def _live_canary(client: TestClient, db: Database, tenant: Tenant, policy: dict[str, Any]) -> tuple[int, int]:
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
    assert client.patch(f"{BASE}/svc/canary-policy", json=policy, headers=admin).status_code == 200
    with db.new_session() as session:
        deployment = session.scalars(select(Deployment).where(Deployment.name == "svc")).one()
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
        settings = Settings(database_url=db.url)
        phase = record_shadow_result(
            session=session, canary_id=canary_id, result=passing_shadow(), settings=settings
        )
        session.commit()
    assert phase == "live"
    return canary_id, deployment_id


def _categorised(
    category: str, arm: str, n: int, *, tps: float, ms: float, hit: float, start: int
) -> list[dict[str, Any]]:
    version = 1 if arm.startswith("canary:") else None
    return [
        {**r, "category": category}
        for r in arm_records(arm, n, tps=tps, ms=ms, hit=hit, version=version, start=start)
    ]


def _mixed_traffic() -> list[dict[str, Any]]:
    """Two thirds prose, where the candidate is twice as fast; a third code, where it is far slower.
    Arm shares fit the routing weights (0.4 / 0.3 / 0.3) in each category."""
    records = (
        _categorised("prose", "live", 160, tps=1.5, ms=4.0, hit=0.15, start=0)
        + _categorised("prose", "canary:1", 120, tps=3.0, ms=2.0, hit=0.6, start=1000)
        + _categorised("prose", "baseline", 120, tps=1.0, ms=5.0, hit=0.0, start=2000)
        + _categorised("code", "live", 80, tps=3.0, ms=2.0, hit=0.6, start=3000)
        + _categorised("code", "canary:1", 60, tps=1.6, ms=3.6, hit=0.2, start=4000)
        + _categorised("code", "baseline", 60, tps=1.0, ms=5.0, hit=0.0, start=5000)
    )
    random.Random(7).shuffle(records)
    return records


def _post(client: TestClient, tenant: Tenant, records: list[dict[str, Any]]) -> None:
    for start in range(0, len(records), 100):
        reply = client.post(
            f"{BASE}/svc/acceptance",
            json={"format": "native", "records": records[start : start + 100]},
            headers=tenant.headers(Role.serving),
        )
        assert reply.status_code == 200, reply.text


def _evaluate(db: Database, deployment_id: int) -> dict[str, Any]:
    with db.new_session() as session:
        outcome = evaluate_deployment(
            session=session, deployment_id=deployment_id, settings=Settings(database_url=db.url)
        )
        session.commit()
    assert outcome is not None
    return outcome


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_a_candidate_that_wins_the_mix_but_loses_a_category_is_rejected(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant]
) -> None:
    acme = tenants[0]
    canary_id, deployment_id = _live_canary(client, db, acme, POLICY)
    traffic = _mixed_traffic()
    _post(client, acme, traffic)

    # The stored tally, advanced a few records a tick, equals a recount, category split included.
    with db.new_session() as session:
        canary = session.get_one(Canary, canary_id)
        ticks = 0
        while True:
            view = advance_judge(session=session, canary=canary, max_requests=20_000, batch_limit=150)
            full = recount_judge(session=session, canary=canary, max_requests=view.records)
            assert view.to_state() == full.to_state()
            ticks += 1
            if view.records == len(traffic) and canary.judge_state["tally"]["records"] == len(traffic):
                break
            assert ticks < 20
        assert set(view.categories) == {"prose", "code"} and view.category_records == len(traffic)
        assert canary.judge_state["tally"]["categories"]["code"]["candidate"]["timed"] == 60
        session.commit()
    assert ticks > 2

    outcome = _evaluate(db, deployment_id)
    # Deterministic: the traffic is fixed and shuffled by random.Random(7).
    assert outcome["decision"] == "reject", outcome
    assert "'code'" in outcome["reason"] and "even though it wins overall" in outcome["reason"]

    got = client.get(f"{BASE}/svc/canaries/{canary_id}", headers=acme.headers(Role.viewer)).json()
    assert got["decision"] == "reject" and got["phase"] == "decided"
    per_category = got["arms"]["per_category"]
    assert list(per_category) == ["prose", "code"]  # most requests first
    code, prose = per_category["code"], per_category["prose"]
    assert code["verdict"] == "worse" and prose["verdict"] == "no harm shown"
    assert code["comparisons"]["slower_than_incumbent"]["shown"]
    assert code["candidate"]["requests"] == 60 and code["incumbent"]["requests"] == 80
    assert code["candidate"]["latency_per_token_ms"] == pytest.approx(3.6, rel=0.05)
    assert prose["candidate"]["latency_per_token_ms"] == pytest.approx(2.0, rel=0.05)
    assert 0.1 < code["candidate"]["hit_rate"] < 0.3 and code["baseline"]["hit_rate"] is None
    assert got["arms"]["per_category_judge"]["family_size"] == 2
    # Overall, the candidate wins: more tokens per step and lower latency than both other arms.
    figures = got["arms"]["decision_figures"]
    counts = figures["arm_counts"]
    assert (
        counts["candidate"]["ms_per_token"]
        < counts["incumbent"]["ms_per_token"]
        < counts["baseline"]["ms_per_token"]
    )
    assert figures["comparisons"]["latency_vs_incumbent"]["verdict"] == "better"
    assert figures["categories"]["verdicts"]["code"]["verdict"] == "worse"


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_with_per_category_judging_off_the_same_traffic_is_promoted(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant]
) -> None:
    acme = tenants[0]
    canary_id, deployment_id = _live_canary(client, db, acme, {**POLICY, "judge_per_category": False})
    assert (
        client.get(f"{BASE}/svc/canary-policy", headers=acme.headers(Role.viewer)).json()[
            "judge_per_category"
        ]
        is False
    )
    _post(client, acme, _mixed_traffic())
    outcome = _evaluate(db, deployment_id)
    assert outcome["decision"] == "promote", outcome
    got = client.get(f"{BASE}/svc/canaries/{canary_id}", headers=acme.headers(Role.viewer)).json()
    assert got["arms"]["per_category"]["code"]["verdict"] == "not judged"
