"""Every account-scoped route checks account and role: another account's key sees 404, a too-weak
role gets 403, and the right role gets through. A new route without an entry here fails the test."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select

from controlplane.canary.service import promote, start_canary
from controlplane.config import Settings
from controlplane.db.models import (
    ActuatorDelivery,
    Canary,
    Deployment,
    DrafterState,
    DrafterVersion,
    DriftEvent,
    DriftState,
    Job,
    JobKind,
    Role,
)
from controlplane.models.service import ModelSource, find_model, register_model
from tests.conftest import Database, Tenant

ADMIN = {Role.admin}
READ = {Role.admin, Role.viewer}
WRITE_DATA = {Role.admin, Role.ingest, Role.serving}
# What to serve names the live arms: only the fleet's own serving key (and admin) reads it.
SERVING = {Role.admin, Role.serving}

RECORD = {
    "request_id": "r1",
    "drafted_tokens": 4,
    "accepted_tokens": 2,
    "verify_steps": 1,
    "generated_tokens": 3,
    "accepted_per_position": [1, 1, 0, 0],
    "k": 4,
}
PROM = (
    'vllm:spec_decode_num_drafts_total{model_name="m"} 1\n'
    'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 4\n'
    'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 2\n'
)
_WINDOW_START = datetime.fromtimestamp((int(time.time()) // 60 - 60) * 60, UTC)
EDGE_WINDOW = {
    "edge_id": "edge-1",
    "window_start": _WINDOW_START.isoformat(),
    "window_s": 60,
    "aggregates": [
        {
            "deployment": "svc",
            "requests": 1,
            "drafted_tokens": 4,
            "accepted_tokens": 2,
            "verify_steps": 1,
            "generated_tokens": 3,
        }
    ],
}

# (method, path template, roles allowed, json body or raw text)
MATRIX: list[tuple[str, str, set[Role], Any]] = [
    ("GET", "/v1/accounts/{account}/deployments", READ, None),
    (
        "POST",
        "/v1/accounts/{account}/deployments",
        ADMIN,
        {"target_model": "reference-target", "deployment_id": "new"},
    ),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}", READ, None),
    ("PATCH", "/v1/accounts/{account}/deployments/{deployment}", ADMIN, {"draft_token_count": 5}),
    ("DELETE", "/v1/accounts/{account}/deployments/{deployment}", ADMIN, None),
    ("GET", "/v1/accounts/{account}/audit", READ, None),
    ("POST", "/v1/accounts/{account}/deployments/{deployment}/acceptance", WRITE_DATA, {"records": [RECORD]}),
    ("POST", "/v1/accounts/{account}/deployments/{deployment}/acceptance/prometheus", WRITE_DATA, PROM),
    ("POST", "/v1/accounts/{account}/aggregates", WRITE_DATA, EDGE_WINDOW),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/stats", READ, None),
    (
        "POST",
        "/v1/accounts/{account}/deployments/{deployment}/traces",
        WRITE_DATA,
        {"traces": [{"prompt": "p", "completion": "c"}]},
    ),
    (
        "POST",
        "/v1/accounts/{account}/deployments/{deployment}/datasets",
        WRITE_DATA,
        '{"input": "p", "output": "c"}\n',
    ),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/traces", READ, None),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/drift-events", READ, None),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/drift-events/{event_id}", READ, None),
    ("POST", "/v1/accounts/{account}/deployments/{deployment}/drift-events/{event_id}:dismiss", ADMIN, None),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/drift-status", READ, None),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/speculation-check", READ, None),
    ("PATCH", "/v1/accounts/{account}/deployments/{deployment}/drift-policy", ADMIN, {"min_drop": 0.1}),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/jobs", READ, None),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/jobs/{job_id}", READ, None),
    ("POST", "/v1/accounts/{account}/deployments/{deployment}/jobs/{job_id}:cancel", ADMIN, None),
    ("POST", "/v1/accounts/{account}/deployments/{deployment}:realign", ADMIN, None),
    ("GET", "/v1/accounts/{account}/models", READ, None),
    (
        "POST",
        "/v1/accounts/{account}/models",
        ADMIN,
        {"name": "mine", "path": "reference/generic-drafter", "drafter_for": ["own-target"]},
    ),
    ("GET", "/v1/accounts/{account}/models/{name}", READ, None),
    ("PATCH", "/v1/accounts/{account}/models/{name}", ADMIN, {"default_drafter": "own-drafter"}),
    ("DELETE", "/v1/accounts/{account}/models/{name}", ADMIN, None),
    ("GET", "/v1/accounts/{account}/api-keys", ADMIN, None),
    ("POST", "/v1/accounts/{account}/api-keys", ADMIN, {"name": "k", "role": "viewer"}),
    ("DELETE", "/v1/accounts/{account}/api-keys/{key_id}", ADMIN, None),
    ("GET", "/v1/accounts/{account}/settings", READ, None),
    ("PATCH", "/v1/accounts/{account}/settings", ADMIN, {"acceptance_retention_days": 30}),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/serving-config", SERVING, None),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/serving-config/export", SERVING, None),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/drafter-versions", READ, None),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/drafter-versions/{version}", READ, None),
    (
        "POST",
        "/v1/accounts/{account}/deployments/{deployment}/drafter-versions/{version}:promote",
        ADMIN,
        None,
    ),
    (
        "POST",
        "/v1/accounts/{account}/deployments/{deployment}/drafter-versions/{version}:canary",
        ADMIN,
        None,
    ),
    ("POST", "/v1/accounts/{account}/deployments/{deployment}:rollback", ADMIN, None),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/canaries", READ, None),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/canaries/{canary_id}", READ, None),
    ("POST", "/v1/accounts/{account}/deployments/{deployment}/canaries/{canary_id}:promote", ADMIN, None),
    ("POST", "/v1/accounts/{account}/deployments/{deployment}/canaries/{canary_id}:reject", ADMIN, None),
    ("POST", "/v1/accounts/{account}/deployments/{deployment}/canaries/{canary_id}/ready", ADMIN, None),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/canary-policy", READ, None),
    ("PATCH", "/v1/accounts/{account}/deployments/{deployment}/canary-policy", ADMIN, {"alpha": 0.1}),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/adaptation-policy", READ, None),
    ("PUT", "/v1/accounts/{account}/deployments/{deployment}/adaptation-policy", ADMIN, {"continuous": True}),
    (
        "PATCH",
        "/v1/accounts/{account}/deployments/{deployment}/adaptation-policy",
        ADMIN,
        {"gpu_seconds_per_day": 600},
    ),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/draft-length", READ, None),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/backends", READ, None),
    (
        "POST",
        "/v1/accounts/{account}/deployments/{deployment}/backends",
        ADMIN,
        {"name": "cand-9", "pool": "candidate", "url": "http://10.0.0.9:8000"},
    ),
    ("DELETE", "/v1/accounts/{account}/deployments/{deployment}/backends/{backend}", ADMIN, None),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/actuator", READ, None),
    ("PUT", "/v1/accounts/{account}/deployments/{deployment}/actuator", ADMIN, {"kind": "reference"}),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/deliveries", READ, None),
    ("POST", "/v1/accounts/{account}/deployments/{deployment}/deliveries/{delivery_id}/retry", ADMIN, None),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/scrape-targets", READ, None),
    (
        "POST",
        "/v1/accounts/{account}/deployments/{deployment}/scrape-targets",
        ADMIN,
        {"name": "new-target", "urls": ["http://127.0.0.1:9/metrics"]},
    ),
    ("GET", "/v1/accounts/{account}/deployments/{deployment}/scrape-targets/{name}", READ, None),
    ("DELETE", "/v1/accounts/{account}/deployments/{deployment}/scrape-targets/{name}", ADMIN, None),
    ("POST", "/v1/accounts/{account}/deployments/{deployment}/scrape-targets/{name}/scrape", ADMIN, None),
    ("GET", "/v1/accounts/{account}/dashboard/overview", READ, None),
    ("GET", "/v1/accounts/{account}/dashboard/deployments/{deployment}", READ, None),
    ("GET", "/v1/accounts/{account}/dashboard/deployments/{deployment}/canaries", READ, None),
    ("GET", "/v1/accounts/{account}/dashboard/deployments/{deployment}/promotions", READ, None),
    ("GET", "/v1/accounts/{account}/dashboard/jobs", READ, None),
]


def _call(client: TestClient, method: str, path: str, headers: dict[str, str], body: Any) -> int:
    if isinstance(body, str):
        return client.request(method, path, content=body, headers=headers).status_code
    return client.request(method, path, json=body, headers=headers).status_code


def _open_drift_event(db: Database, tenant: Tenant) -> int:
    session = db.new_session()
    deployment_id = session.scalar(
        select(Deployment.id).where(
            Deployment.account_id == tenant.account_id,
            Deployment.name == "svc",
            Deployment.deleted_at.is_(None),
            Deployment.name == "svc",
            Deployment.deleted_at.is_(None),
        )
    )
    assert deployment_id is not None
    event = DriftEvent(deployment_id=deployment_id, detector="test", state=DriftState.open)
    session.add(event)
    session.commit()
    event_id = event.id
    session.close()
    return event_id


def _queued_job(db: Database, event_id: int) -> int:
    session = db.new_session()
    event = session.get_one(DriftEvent, event_id)
    job = Job(deployment_id=event.deployment_id, kind=JobKind.realign, drift_event_id=event_id)
    session.add(job)
    session.commit()
    job_id = job.id
    session.close()
    return job_id


def _drafter_history(db: Database, tenant: Tenant) -> int:
    """v1 promoted and active, v2 a candidate in an open canary; returns the canary's id."""
    session = db.new_session()
    deployment = session.scalars(
        select(Deployment).where(
            Deployment.account_id == tenant.account_id,
            Deployment.name == "svc",
            Deployment.deleted_at.is_(None),
        )
    ).one()
    for number in (1, 2):
        session.add(
            DrafterVersion(
                deployment_id=deployment.id,
                version=number,
                artifact_path=f"/artifacts/v{number}",
                artifact_sha256="0" * 64,
                state=DrafterState.candidate,
                training_metrics={},
                eval_metrics={},
            )
        )
    session.commit()
    promote(session=session, deployment_id=deployment.id, version_number=1, actor="test", reason="setup")
    session.commit()
    v2 = session.scalars(
        select(DrafterVersion).where(
            DrafterVersion.deployment_id == deployment.id, DrafterVersion.version == 2
        )
    ).one()
    canary, _job = start_canary(session=session, version=v2)
    session.commit()
    canary_id = canary.id
    session.close()
    return canary_id


def _delivery(db: Database, canary_id: int) -> int:
    """An event handed to the deployment's actuator earlier (it may be retried)."""
    session = db.new_session()
    canary = session.get_one(Canary, canary_id)
    delivery = ActuatorDelivery(
        deployment_id=canary.deployment_id,
        canary_id=canary.id,
        event="canary-start",
        actuator="webhook",
        payload={"event": "canary-start"},
        state="failed",
        attempts=8,
    )
    session.add(delivery)
    session.commit()
    delivery_id = delivery.id
    session.close()
    return delivery_id


def _setup(client: TestClient, tenant: Tenant, db: Database) -> dict[str, str]:
    admin = tenant.headers(Role.admin)
    response = client.post(
        f"/v1/accounts/{tenant.name}/deployments",
        json={"target_model": "reference-target", "deployment_id": "svc"},
        headers=admin,
    )
    assert response.status_code == 201
    # A scrape target named like the models ({name}); nothing listens on its URL.
    target = {"name": "own-target", "urls": ["http://127.0.0.1:9/metrics"]}
    scrape_targets = f"/v1/accounts/{tenant.name}/deployments/svc/scrape-targets"
    assert client.post(scrape_targets, json=target, headers=admin).status_code == 201
    key = client.post(
        f"/v1/accounts/{tenant.name}/api-keys", json={"name": "spare", "role": "viewer"}, headers=admin
    ).json()
    _own_models(db, tenant)
    canary_id = _drafter_history(db, tenant)  # before the event: a promotion answers open events
    event_id = _open_drift_event(db, tenant)
    job_id = _queued_job(db, event_id)
    backend = {"name": "inc-1", "pool": "incumbent", "url": "http://10.0.0.1:8000"}
    assert client.post(
        f"/v1/accounts/{tenant.name}/deployments/svc/backends", json=backend, headers=admin
    ).is_success
    delivery_id = _delivery(db, canary_id)
    return {
        "backend": "inc-1",
        "delivery_id": str(delivery_id),
        "version": "2",
        "canary_id": str(canary_id),
        "account": tenant.name,
        "deployment": "svc",
        "key_id": str(key["id"]),
        "event_id": str(event_id),
        "job_id": str(job_id),
        "name": "own-target",
    }


def _own_models(db: Database, tenant: Tenant) -> None:
    """The account's own target and a drafter registered for it (from the bundled folders); an
    earlier round of the same test may have registered (or deleted) either."""
    session = db.new_session()
    settings = Settings(database_url=db.url, environment="test")
    wanted = (
        ("own-target", "reference/target", []),
        ("own-drafter", "reference/generic-drafter", ["own-target"]),
    )
    for name, path, drafter_for in wanted:
        if find_model(session=session, account_id=tenant.account_id, name=name) is None:
            register_model(
                session=session,
                account_id=tenant.account_id,
                name=name,
                source=ModelSource(path=path),
                settings=settings,
                drafter_for=drafter_for,
            )
    session.commit()
    session.close()


def test_matrix_covers_every_account_route(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    routes = {
        (method.upper(), path)
        for path, operations in paths.items()
        if path.startswith("/v1/accounts/")
        for method in operations
    }
    assert routes == {(method, path) for method, path, _, _ in MATRIX}


def test_openapi_tells_clients_how_to_present_a_key(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "Authorization: Bearer <key>",
    }
    assert schema["components"]["securitySchemes"]["apiKeyHeader"]["name"] == "X-API-Key"
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            secured = operation.get("security") == [{"bearer": []}, {"apiKeyHeader": []}]
            assert secured == (path.startswith("/v1/") or path == "/metrics"), path


def test_other_accounts_and_weak_roles_are_refused(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, globex = tenants
    acme_ids = _setup(client, acme, db)
    _setup(client, globex, db)
    for method, template, allowed, body in MATRIX:
        path = template.format(**acme_ids)
        for role in Role:
            # globex's keys, whatever their role, must not even learn that acme's resources exist.
            status = _call(client, method, path, globex.headers(role), body)
            assert status == 404, (method, template, "other account", role, status)
        for role in set(Role) - allowed:
            status = _call(client, method, path, acme.headers(role), body)
            assert status == 403, (method, template, role, status)
        assert _call(client, method, path, {}, body) == 401


def test_allowed_roles_get_through(client: TestClient, tenants: tuple[Tenant, Tenant], db: Database) -> None:
    acme, _ = tenants
    for method, template, allowed, body in MATRIX:
        for role in sorted(allowed):
            ids = _setup(client, acme, db)
            path = template.format(**ids)
            status = _call(client, method, path, acme.headers(role), body)
            assert status < 400, (method, template, role, status)
            client.delete(f"/v1/accounts/{acme.name}/deployments/svc", headers=acme.headers(Role.admin))
            client.delete(f"/v1/accounts/{acme.name}/deployments/new", headers=acme.headers(Role.admin))
