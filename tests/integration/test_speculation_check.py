"""The speculation check on real databases: records stored through the ingest API, the check
finds speculation slower than the standing no-speculation arm, acts (another k, then a
realignment or the n-gram fallback), stores and audits what it did, and the API says why. Also
the standing baseline arm in serving-config outside a canary."""

from __future__ import annotations

import random
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from controlplane.config import Settings
from controlplane.db.models import (
    AuditEntry,
    Deployment,
    DriftMonitorState,
    Job,
    Role,
    SpeculationCheck,
    SpeculationMode,
)
from controlplane.drift.service import advance_monitor
from controlplane.speculation_check.sequential import PaysTest
from controlplane.speculation_check.service import (
    ACTION_DRAFT_LENGTH,
    ACTION_NGRAM,
    ACTION_REALIGN,
    CheckOutcome,
    run_check,
)
from tests.conftest import Database, Tenant

BASE = "/v1/accounts/acme/deployments"


def _create(client: TestClient, db: Database, tenant: Tenant, **extra: Any) -> int:
    response = client.post(
        BASE,
        json={
            "target_model": "reference-target",
            "deployment_id": "svc",
            "draft_model": "reference-drafter",
            "draft_token_count": 4,
            **extra,
        },
        headers=tenant.headers(Role.admin),
    )
    assert response.status_code == 201, response.text
    with db.new_session() as session:
        return int(
            session.scalars(
                select(Deployment.id).where(
                    Deployment.account_id == tenant.account_id, Deployment.name == "svc"
                )
            ).one()
        )


def _records(
    rng: random.Random, *, prefix: str, live: int, baseline: int, k: int, p: float, live_ms: float
) -> list[dict[str, Any]]:
    """Live requests drafting ``k`` with per-position acceptance ``p`` at ``live_ms`` per token,
    and no-speculation requests at 8 ms per token, interleaved."""
    out: list[dict[str, Any]] = []
    arms = ["live"] * live + ["baseline"] * baseline
    rng.shuffle(arms)
    for i, arm in enumerate(arms):
        steps = rng.randint(10, 20)
        if arm == "baseline":
            out.append(
                {
                    "request_id": f"{prefix}-{i}",
                    "arm": "baseline",
                    "k": 0,
                    "drafted_tokens": 0,
                    "accepted_tokens": 0,
                    "verify_steps": steps,
                    "generated_tokens": steps,
                    "accepted_per_position": [],
                    "inter_token_ms": 8.0 * rng.uniform(0.9, 1.1),
                }
            )
            continue
        per_step = []
        for _ in range(steps):
            accepted = 0
            while accepted < k and rng.random() < p:
                accepted += 1
            per_step.append(accepted)
        out.append(
            {
                "request_id": f"{prefix}-{i}",
                "arm": "live",
                "k": k,
                "drafted_tokens": steps * k,
                "accepted_tokens": sum(per_step),
                "verify_steps": steps,
                "generated_tokens": sum(per_step) + steps,
                "accepted_per_position": [sum(1 for a in per_step if a > j) for j in range(k)],
                "inter_token_ms": live_ms * rng.uniform(0.9, 1.1),
            }
        )
    return out


def _ingest(
    client: TestClient, tenant: Tenant, records: list[dict[str, Any]], role: Role = Role.serving
) -> None:
    response = client.post(f"{BASE}/svc/acceptance", json={"records": records}, headers=tenant.headers(role))
    assert response.status_code == 200, response.text


def _check(db: Database, deployment_id: int, settings: Settings) -> CheckOutcome:
    with db.new_session() as session:
        outcome = run_check(session=session, deployment_id=deployment_id, settings=settings)
        session.commit()
        return outcome


def _settle(db: Database, deployment_id: int, settings: Settings) -> CheckOutcome:
    """Two runs: the first sees the newest id (its horizon), the second consumes up to it."""
    _check(db, deployment_id, settings)
    return _check(db, deployment_id, settings)


def _audit_actions(db: Database) -> list[str]:
    with db.new_session() as session:
        return list(
            session.scalars(
                select(AuditEntry.action)
                .where(AuditEntry.action.like("speculation_check.%"))
                .order_by(AuditEntry.id)
            )
        )


def test_serving_config_routes_a_standing_baseline_share_outside_a_canary(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant]
) -> None:
    acme, _ = tenants
    _create(client, db, acme)
    serving = acme.headers(Role.serving)
    arms = client.get(f"{BASE}/svc/serving-config", headers=serving).json()["arms"]
    assert [(a["arm"], a["weight"], a["speculation"]) for a in arms] == [
        ("live", 0.95, "draft_model"),
        ("baseline", 0.05, "disabled"),
    ]
    assert arms[1]["drafter"] is None and arms[1]["k"] == 0
    put = client.put(
        f"{BASE}/svc/adaptation-policy", json={"standing_baseline_share": 0}, headers=acme.headers(Role.admin)
    )
    assert put.status_code == 200, put.text
    arms = client.get(f"{BASE}/svc/serving-config", headers=serving).json()["arms"]
    assert [(a["arm"], a["weight"]) for a in arms] == [("live", 1.0)]
    # A deployment that does not speculate has no second no-speculation arm, whatever the share.
    client.put(
        f"{BASE}/svc/adaptation-policy",
        json={"standing_baseline_share": 0.2},
        headers=acme.headers(Role.admin),
    )
    assert [a["arm"] for a in client.get(f"{BASE}/svc/serving-config", headers=serving).json()["arms"]] == [
        "live",
        "baseline",
    ]
    off = client.patch(
        f"{BASE}/svc", json={"disable_speculative_decoding": True}, headers=acme.headers(Role.admin)
    )
    assert off.status_code == 200, off.text
    arms = client.get(f"{BASE}/svc/serving-config", headers=serving).json()["arms"]
    assert [(a["arm"], a["weight"], a["speculation"]) for a in arms] == [("live", 1.0, "disabled")]


def test_slower_speculation_is_found_then_k_changes_then_n_gram_takes_over(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme, globex = tenants
    viewer = acme.headers(Role.viewer)
    deployment_id = _create(client, db, acme, auto_realign=False)
    rng = random.Random(11)
    first = _check(db, deployment_id, settings)
    assert first.verdict == "unknown" and first.action is None

    # An ingest key cannot forge arm labels into switching speculation off: its records are not read.
    _ingest(
        client,
        acme,
        _records(rng, prefix="forged", live=300, baseline=60, k=4, p=0.3, live_ms=30),
        Role.ingest,
    )
    assert _settle(db, deployment_id, settings).records_consumed == 0

    # k = 4 with a weak drafter at 1.4x the latency per token of no speculation.
    _ingest(client, acme, _records(rng, prefix="k4", live=400, baseline=60, k=4, p=0.3, live_ms=11.0))
    outcome = _settle(db, deployment_id, settings)
    # Deterministic: every request here comes from random.Random(11) or (5); the verdicts fail only
    # if the code changes.
    assert outcome.verdict == "not_paying" and outcome.action == ACTION_DRAFT_LENGTH
    with db.new_session() as session:
        deployment = session.get_one(Deployment, deployment_id)
        new_k = deployment.draft_token_count
        assert new_k is not None and 1 <= new_k < 4
        check = session.get_one(SpeculationCheck, deployment_id)
        assert check.action == ACTION_DRAFT_LENGTH and check.acted_at is not None
        assert f"k 4 -> {new_k}" in (check.reason or "")
    body = client.get(f"{BASE}/svc/speculation-check", headers=viewer).json()
    assert body["action"] == ACTION_DRAFT_LENGTH and body["acted_at"] is not None
    assert body["ladder"] == [ACTION_DRAFT_LENGTH] and body["history"][0]["action"] == ACTION_DRAFT_LENGTH
    # The answer shows the evidence acted on; the test itself started over at the new k, so
    # that evidence never counts again.
    assert body["serving"]["k"] == new_k and body["arms"]["live"]["requests"] >= 300
    with db.new_session() as session:
        restarted = PaysTest.from_state(session.get_one(SpeculationCheck, deployment_id).state["test"])
        assert restarted.requests("live") == restarted.requests("baseline") == 0
    assert body["verdict"] == "not_paying" and "slower than no speculation" in body["reason"]

    # Records still in flight at the old k are ignored; at the new k it is still slower: no
    # traces to realign on, so n-gram lookup takes over.
    _ingest(client, acme, _records(rng, prefix="late", live=200, baseline=0, k=4, p=0.3, live_ms=11.0))
    _ingest(client, acme, _records(rng, prefix="newk", live=400, baseline=60, k=new_k, p=0.3, live_ms=10.0))
    outcome = _settle(db, deployment_id, settings)
    assert outcome.verdict == "not_paying" and outcome.action == ACTION_NGRAM
    with db.new_session() as session:
        deployment = session.get_one(Deployment, deployment_id)
        assert deployment.speculation_mode == SpeculationMode.ngram and deployment.draft_model is None
        assert deployment.drift_policy["guardrail_fallback"]["mode"] == "ngram"
    body = client.get(f"{BASE}/svc/speculation-check", headers=viewer).json()
    assert body["action"] == ACTION_NGRAM and body["ladder"] == [ACTION_DRAFT_LENGTH, ACTION_NGRAM]
    assert "the deployment does not realign automatically" in body["reason"]
    assert _audit_actions(db) == ["speculation_check.draft_length", "speculation_check.fallback_ngram"]
    config = client.get(f"{BASE}/svc/serving-config", headers=acme.headers(Role.serving)).json()
    assert [(a["arm"], a["speculation"]) for a in config["arms"]] == [
        ("live", "ngram"),
        ("baseline", "disabled"),
    ]

    # Another account's keys learn nothing; the check does not act again on the same evidence.
    assert (
        client.get(
            "/v1/accounts/globex/deployments/svc/speculation-check", headers=globex.headers(Role.admin)
        ).status_code
        == 404
    )
    again = _settle(db, deployment_id, settings)
    assert again.action is None and again.verdict == "unknown"

    metrics = client.get("/metrics", headers=viewer).text
    assert 'specctl_speculation_pays{account="acme",deployment="svc"} 0.0' in metrics
    assert (
        'specctl_speculation_check_actions_total{account="acme",deployment="svc",kind="draft_length"} 1.0'
        in metrics
    )
    assert (
        'specctl_speculation_check_actions_total{account="acme",deployment="svc",kind="fallback_ngram"} 1.0'
        in metrics
    )


def test_when_no_k_pays_the_check_requests_a_realignment_once(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme, _ = tenants
    deployment_id = _create(client, db, acme)
    traces = client.post(
        f"{BASE}/svc/traces",
        json={"traces": [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(5)]},
        headers=acme.headers(Role.ingest),
    )
    assert traces.status_code == 200, traces.text
    rng = random.Random(5)
    _check(db, deployment_id, settings)
    # Almost nothing accepted: no k pays, so the drafter itself must get better.
    _ingest(client, acme, _records(rng, prefix="weak", live=400, baseline=60, k=4, p=0.02, live_ms=14.0))
    outcome = _settle(db, deployment_id, settings)
    assert outcome.verdict == "not_paying" and outcome.action == ACTION_REALIGN
    assert len(outcome.realign_jobs) == 1
    with db.new_session() as session:
        job = session.get_one(Job, outcome.realign_jobs[0])
        assert job.trigger == "unprofitable" and job.requested_by == "speculation-check"
        assert session.get_one(Deployment, deployment_id).draft_token_count == 4  # k untouched
    # While the realignment is queued, more slow evidence acts on nothing.
    _ingest(client, acme, _records(rng, prefix="more", live=400, baseline=60, k=4, p=0.02, live_ms=14.0))
    waiting = _settle(db, deployment_id, settings)
    assert waiting.action is None and waiting.verdict == "not_paying"
    body = client.get(f"{BASE}/svc/speculation-check", headers=acme.headers(Role.viewer)).json()
    assert f"realignment job {job.id} is queued" in body["reason"] and body["action"] == ACTION_REALIGN
    assert body["ratio"] > 1.0 and body["ratio_low"] > 1.0 and body["arms"]["baseline"]["requests"] >= 30
    assert _audit_actions(db) == ["speculation_check.realign"]


@pytest.mark.parametrize("share", [0.0])
def test_with_no_standing_share_the_check_is_off(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings, share: float
) -> None:
    acme, _ = tenants
    deployment_id = _create(client, db, acme)
    client.put(
        f"{BASE}/svc/adaptation-policy",
        json={"standing_baseline_share": share},
        headers=acme.headers(Role.admin),
    )
    _check(db, deployment_id, settings)
    _ingest(
        client, acme, _records(random.Random(2), prefix="x", live=200, baseline=60, k=4, p=0.3, live_ms=20)
    )
    outcome = _settle(db, deployment_id, settings)
    assert outcome.verdict == "unknown" and outcome.action is None and outcome.skipped is not None
    body = client.get(f"{BASE}/svc/speculation-check", headers=acme.headers(Role.viewer)).json()
    assert "share is 0" in body["reason"] and body["standing_baseline_share"] == 0.0


def test_the_drift_detector_reads_only_the_live_arm_of_a_standing_split(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme, _ = tenants
    deployment_id = _create(client, db, acme)
    _ingest(
        client, acme, _records(random.Random(4), prefix="mix", live=150, baseline=40, k=4, p=0.5, live_ms=6)
    )
    for _ in range(3):  # the first run records the horizon; the next consume up to it
        with db.new_session() as session:
            advance_monitor(session=session, deployment_id=deployment_id, settings=settings)
            session.commit()
    with db.new_session() as session:
        state = session.get_one(DriftMonitorState, deployment_id)
        assert state.records_examined == 150  # every live record, no baseline one
