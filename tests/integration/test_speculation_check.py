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
    Canary,
    Deployment,
    DrafterState,
    DrafterVersion,
    DriftMonitorState,
    Job,
    Role,
    SpeculationCheck,
    SpeculationMode,
)
from controlplane.loop.drift import advance_monitor
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


def _create(client: TestClient, db: Database, tenant: Tenant, name: str = "svc", **extra: Any) -> int:
    response = client.post(
        f"/v1/accounts/{tenant.name}/deployments",
        json={
            "target_model": "reference-target",
            "deployment_id": name,
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
                    Deployment.account_id == tenant.account_id, Deployment.name == name
                )
            ).one()
        )


# Verify cost of k + 1 tokens over one, by k, as a shadow replay stores it (JSON keys): a target for
# which a wider verify pass is almost free, and the 12M reference target on a CPU.
NEAR_FLAT_VERIFY = {str(k): 1.0 + 0.02 * k for k in range(1, 9)}
CPU_VERIFY = {"1": 1.44, "2": 1.50, "3": 1.55, "4": 1.60, "5": 1.66, "6": 1.72, "7": 1.78, "8": 1.84}


def _store_replay_costs(db: Database, deployment_id: int, verify_cost: dict[str, float]) -> int:
    """A decided canary of the deployment whose shadow replay measured ``verify_cost``."""
    with db.new_session() as session:
        version = DrafterVersion(
            deployment_id=deployment_id,
            version=99,
            artifact_path="/artifacts/v99",
            artifact_sha256="9" * 64,
            state=DrafterState.rejected,
            training_metrics={},
            eval_metrics={},
        )
        session.add(version)
        session.flush()
        canary = Canary(
            deployment_id=deployment_id,
            candidate_version_id=version.id,
            phase="decided",
            decision="reject",
            arms={"shadow": {"costs": {"cost_ratio": 0.07, "verify_cost": verify_cost}}},
        )
        session.add(canary)
        session.commit()
        return canary.id


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
    canary_id = _store_replay_costs(db, deployment_id, NEAR_FLAT_VERIFY)
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

    # k = 4 with a weak drafter at 1.25x the latency per token of no speculation; a replay measured
    # an almost free wider verify pass for this target, so the drafting is what costs: shorten k.
    _ingest(client, acme, _records(rng, prefix="k4", live=400, baseline=60, k=4, p=0.3, live_ms=10.0))
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
        assert f"from canary {canary_id} shadow replay" in (check.reason or "")
        [audit] = session.scalars(
            select(AuditEntry.after).where(AuditEntry.action == "speculation_check.draft_length")
        )
        assert audit["cost_model"] == "measured_verify_cost" and audit["expected_speedup"] >= 1.05
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


@pytest.mark.parametrize("measured", ["nothing", "another account's flat curve", "a sibling's CPU curve"])
def test_k_stays_unless_a_measured_verify_cost_says_the_new_k_pays(
    client: TestClient,
    db: Database,
    tenants: tuple[Tenant, Tenant],
    settings: Settings,
    measured: str,
) -> None:
    """The records that made k 4 -> 1 with a near-flat measured verify cost, without one (the
    flat-verify plan is shown, not acted on; another account's measurement is never read) or
    with a CPU's (a 2-token verify at 1.44 steps: k = 1 does not pay): n-gram lookup takes over."""
    acme, globex = tenants
    deployment_id = _create(client, db, acme, auto_realign=False)
    if measured == "another account's flat curve":
        _store_replay_costs(db, _create(client, db, globex), NEAR_FLAT_VERIFY)
    elif measured == "a sibling's CPU curve":
        sibling = _create(client, db, acme, name="svc-sibling")
        _store_replay_costs(db, sibling, CPU_VERIFY)
    _check(db, deployment_id, settings)
    # Deterministic: the k 4 -> 1 case's records (the generator moved past its forged ones first).
    rng = random.Random(11)
    _records(rng, prefix="forged", live=300, baseline=60, k=4, p=0.3, live_ms=30)
    _ingest(client, acme, _records(rng, prefix="k4", live=400, baseline=60, k=4, p=0.3, live_ms=10.0))
    outcome = _settle(db, deployment_id, settings)
    assert outcome.verdict == "not_paying" and outcome.action == ACTION_NGRAM
    with db.new_session() as session:
        assert session.get_one(Deployment, deployment_id).draft_token_count == 4
        [audit] = session.scalars(
            select(AuditEntry.after).where(AuditEntry.action == "speculation_check.fallback_ngram")
        )
    plan = audit["draft_length_plan"]
    assert not plan["actionable"] and "k unchanged" in audit["why_not_earlier"]
    body = client.get(f"{BASE}/svc/speculation-check", headers=acme.headers(Role.viewer)).json()
    assert body["ladder"] == [ACTION_NGRAM] and "k unchanged" in body["reason"]
    if measured == "a sibling's CPU curve":
        assert plan["cost_model"] == "measured_verify_cost" and plan["best_k"] != 1
        assert plan["verify_cost_source"].endswith(f"of deployment {sibling} shadow replay")
        assert plan["verify_cost_at_live_k"] == pytest.approx(1.60)
    else:
        # The flat model alone would have shortened k, as it did before verify costs were measured.
        assert plan["cost_model"] == "flat_verify_unmeasured" and plan["verify_cost_source"] is None
        assert plan["best_k"] == 1 and plan["best_speedup"] > 1.05
        assert plan["worst_case_speedup"] < 1.0


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
