"""Edge aggregates on real databases: the ingest route (idempotent per edge window, all or nothing,
per account) and the drift monitor's set-based pass over them (sharded, exactly once, mixed with
per-request records of the same deployment)."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import func, select

from controlplane.config import Settings
from controlplane.db.models import (
    AcceptanceAggregateRow,
    Deployment,
    DriftEvent,
    DriftMonitorState,
    EdgeWindowRow,
    Role,
)
from controlplane.drift.aggregate_monitor import DetectorCache
from controlplane.ingest.aggregates import EdgeWindow, WindowAccumulator
from controlplane.ingest.record import AcceptanceRecord
from controlplane.loop.drift import monitor_aggregates
from tests.conftest import Database, Tenant

K = 4


def served(rng: random.Random, p: float, category: str | None = None) -> AcceptanceRecord:
    steps = rng.randint(8, 16)
    per_step = []
    for _ in range(steps):
        accepted = 0
        while accepted < K and rng.random() < p:
            accepted += 1
        per_step.append(accepted)
    return AcceptanceRecord(
        request_id="-",
        drafted_tokens=steps * K,
        accepted_tokens=sum(per_step),
        verify_steps=steps,
        generated_tokens=sum(per_step) + steps,
        accepted_per_position=[sum(1 for a in per_step if a > j) for j in range(K)],
        k=K,
        inter_token_ms=rng.uniform(5, 15),
        total_ms=rng.uniform(100, 300),
        ttft_ms=rng.uniform(10, 30),
        prompt_tokens=rng.randint(20, 200),
        category=category,
    )


def window_body(
    edge: str, start: datetime, per_deployment: dict[str, list[AcceptanceRecord]]
) -> dict[str, Any]:
    acc = WindowAccumulator(k=K)
    for name, records in per_deployment.items():
        for record in records:
            acc.add(name, record)
    return EdgeWindow(edge, start, 60, acc.aggregates()).to_dict()


def _deploy(client: TestClient, tenant: Tenant, name: str, db: Database | None = None) -> int:
    response = client.post(
        f"/v1/accounts/{tenant.name}/deployments",
        json={
            "target_model": "reference-target",
            "deployment_id": name,
            "draft_model": "reference-drafter",
            "draft_token_count": K,
        },
        headers=tenant.headers(Role.admin),
    )
    assert response.status_code == 201, response.text
    if db is None:
        return 0
    session = db.new_session()
    deployment_id = session.scalar(
        select(Deployment.id).where(Deployment.account_id == tenant.account_id, Deployment.name == name)
    )
    session.close()
    assert deployment_id is not None
    return int(deployment_id)


def _first_window() -> datetime:
    now = datetime.now(UTC)
    return now.replace(second=0, microsecond=0) - timedelta(hours=5)


def test_a_window_is_stored_once_and_a_different_body_is_a_conflict(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, globex = tenants
    _deploy(client, acme, "svc")
    rng = random.Random(1)
    start = _first_window()
    body = window_body("edge-a", start, {"svc": [served(rng, 0.7, "prose") for _ in range(40)]})
    url = f"/v1/accounts/{acme.name}/aggregates"
    first = client.post(url, json=body, headers=acme.headers(Role.serving))
    assert first.status_code == 200, first.text
    assert first.json()["stored"] is True and first.json()["aggregates"] == 1
    retry = client.post(url, json=body, headers=acme.headers(Role.ingest))
    assert retry.status_code == 200 and retry.json()["duplicate"] is True
    assert retry.json()["edge_window_id"] == first.json()["edge_window_id"]
    changed = dict(
        body, aggregates=[dict(body["aggregates"][0], requests=body["aggregates"][0]["requests"] + 1)]
    )
    conflict = client.post(url, json=changed, headers=acme.headers(Role.ingest))
    assert conflict.status_code == 409, conflict.text
    # Another edge's window of the same minute is its own.
    other = client.post(url, json=dict(body, edge_id="edge-b"), headers=acme.headers(Role.ingest))
    assert other.status_code == 200 and other.json()["stored"] is True
    session = db.new_session()
    assert session.scalar(select(func.count()).select_from(EdgeWindowRow)) == 2
    rows = session.scalars(select(AcceptanceAggregateRow)).all()
    assert [r.requests for r in rows] == [40, 40]
    assert all(r.from_serving_key for r in rows if r.edge_window_id == first.json()["edge_window_id"])
    session.close()
    # The same body under another account names a deployment that account does not have.
    foreign = client.post(
        f"/v1/accounts/{globex.name}/aggregates", json=body, headers=globex.headers(Role.ingest)
    )
    assert foreign.status_code == 422 and "svc" in foreign.text
    # And a key of one account cannot post into another's.
    crossed = client.post(url, json=dict(body, edge_id="edge-c"), headers=globex.headers(Role.ingest))
    assert crossed.status_code in (403, 404)
    viewer = client.post(url, json=dict(body, edge_id="edge-d"), headers=acme.headers(Role.viewer))
    assert viewer.status_code == 403


def test_an_invalid_window_is_refused_whole_with_every_problem_listed(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, _ = tenants
    _deploy(client, acme, "svc")
    rng = random.Random(2)
    start = _first_window()
    body = window_body("edge-a", start, {"svc": [served(rng, 0.7) for _ in range(5)]})
    good = body["aggregates"][0]
    bad_rows = [
        dict(good, accepted_tokens=good["drafted_tokens"] + 1),
        dict(good, deployment="svc", arm="canary:2", position_moments=[1.0]),
        dict(good, deployment="nope", arm="baseline"),
    ]
    url = f"/v1/accounts/{acme.name}/aggregates"
    response = client.post(
        url, json=dict(body, aggregates=[good, *bad_rows]), headers=acme.headers(Role.ingest)
    )
    assert response.status_code == 422
    fields = [d["field"] for d in response.json()["error"]["details"]]
    assert "aggregates[1].accepted_tokens" in fields and "aggregates[2].position_moments" in fields
    for shape in (
        dict(body, window_start=(start + timedelta(seconds=7)).isoformat()),
        dict(body, window_s=7),
        dict(body, window_start=(datetime.now(UTC) + timedelta(hours=1)).isoformat()),
        dict(body, aggregates=[good, good]),
        dict(body, edge_id=""),
        [body],
    ):
        refused = client.post(url, json=shape, headers=acme.headers(Role.ingest))
        assert refused.status_code == 422, (
            shape if isinstance(shape, list) else shape.get("window_s"),
            refused.text,
        )
    unknown = client.post(url, json=dict(body, aggregates=[bad_rows[2]]), headers=acme.headers(Role.ingest))
    assert unknown.status_code == 422 and "nope" in unknown.text
    session = db.new_session()
    assert session.scalar(select(func.count()).select_from(EdgeWindowRow)) == 0
    assert session.scalar(select(func.count()).select_from(AcceptanceAggregateRow)) == 0
    session.close()


def _pass(db: Database, settings: Settings, cache: DetectorCache, shard: int = 0, shards: int = 1) -> Any:
    session = db.new_session()
    outcome = monitor_aggregates(
        session=session, settings=settings, shard=shard, shards=shards, cache=cache, settle_s=0.0
    )
    session.commit()
    outcome.commit(cache)
    session.close()
    return outcome


def test_the_monitor_detects_drift_from_aggregates_sharded_and_exactly_once(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database, settings: Settings
) -> None:
    acme, _ = tenants
    names = [f"svc-{i}" for i in range(4)]
    ids = {name: _deploy(client, acme, name, db) for name in names}
    session = db.new_session()
    for deployment in session.scalars(select(Deployment).where(Deployment.id.in_(ids.values()))):
        deployment.drift_policy = {"arl0_requests": 10_000, "reference_requests": 400, "min_drop": 0.05}
    session.commit()
    session.close()
    rng = random.Random(3)
    start = _first_window()
    url = f"/v1/accounts/{acme.name}/aggregates"
    caches = [DetectorCache(), DetectorCache()]
    drifted = names[0]
    for minute in range(12):
        traffic = {
            name: [
                served(rng, 0.55 if (name == drifted and minute >= 6) else 0.8, "prose") for _ in range(100)
            ]
            for name in names
        }
        body = window_body("edge-a", start + timedelta(minutes=minute), traffic)
        assert client.post(url, json=body, headers=acme.headers(Role.serving)).status_code == 200
    for shard in (0, 1):  # ids are consumed up to the horizon a previous pass saw
        assert _pass(db, settings, caches[shard], shard, 2).windows == 0
    passes = [_pass(db, settings, caches[shard], shard, 2) for shard in (0, 1)]
    # Each shard consumed its own deployments' twelve windows, and only those.
    assert sum(p.deployments for p in passes) == 4
    assert sum(p.windows for p in passes) == 48
    assert sum(p.requests for p in passes) == 4 * 12 * 100
    for p in passes:
        assert p.deployments == sum(1 for name in names if ids[name] % 2 == p.shard)
    again = [_pass(db, settings, caches[shard], shard, 2) for shard in (0, 1)]
    assert sum(p.windows for p in again) == 0  # exactly once
    session = db.new_session()
    events = session.scalars(select(DriftEvent)).all()
    # Deterministic: the windows come from random.Random(3).
    assert [e.deployment_id for e in events] == [ids[drifted]]
    assert events[0].drop is not None and events[0].drop > 0.05
    states = {s.deployment_id: s for s in session.scalars(select(DriftMonitorState))}
    assert {states[ids[n]].records_examined for n in names} == {1_200}
    session.close()
    # Another writer (the per-request monitor, say) advanced a deployment's state: the cached
    # detector is stale and must not be used; the next window is consumed once, from the state.
    more = window_body(
        "edge-a", start + timedelta(minutes=12), {name: [served(rng, 0.8, "prose")] * 50 for name in names}
    )
    assert client.post(url, json=more, headers=acme.headers(Role.serving)).status_code == 200
    shard_of = ids[names[1]] % 2
    _pass(db, settings, caches[shard_of], shard_of, 2)  # sees the new horizon
    session = db.new_session()
    state = session.get_one(DriftMonitorState, ids[names[1]])
    state.version += 1
    state.records_examined = 7
    session.commit()
    session.close()
    retried = _pass(db, settings, caches[shard_of], shard_of, 2)
    assert retried.windows == 2 and retried.requests == 100
    session = db.new_session()
    assert session.get_one(DriftMonitorState, ids[names[1]]).records_examined == 57
    session.close()


def test_the_raw_record_sample_rate_is_set_per_deployment_and_served_to_edges(
    client: TestClient, tenants: tuple[Tenant, Tenant]
) -> None:
    acme, _ = tenants
    _deploy(client, acme, "svc")
    base = f"/v1/accounts/{acme.name}/deployments/svc"
    changed = client.patch(base, json={"raw_record_sample_rate": 0.05}, headers=acme.headers(Role.admin))
    assert changed.status_code == 200 and changed.json()["raw_record_sample_rate"] == 0.05
    refused = client.patch(base, json={"raw_record_sample_rate": 1.5}, headers=acme.headers(Role.admin))
    assert refused.status_code == 422
    served_config = client.get(f"{base}/serving-config", headers=acme.headers(Role.serving))
    assert served_config.status_code == 200 and served_config.json()["raw_record_sample_rate"] == 0.05
