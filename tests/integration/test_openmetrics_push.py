"""OpenMetrics pushes to the Prometheus route: stored acceptance equals the counter deltas."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy import func, select

from controlplane.db.models import AcceptanceRecordRow, Role
from tests.conftest import Database, Tenant
from tests.unit.test_prometheus_ingest import RESTARTED_AT, FakeVllmServer

OPENMETRICS = {"Content-Type": "application/openmetrics-text; version=1.0.0; charset=utf-8"}


def _push_url(client: TestClient, tenant: Tenant) -> str:
    response = client.post(
        f"/v1/accounts/{tenant.name}/deployments",
        json={"target_model": "reference-target", "deployment_id": "svc"},
        headers=tenant.headers(Role.admin),
    )
    assert response.status_code == 201, response.text
    return f"/v1/accounts/{tenant.name}/deployments/svc/acceptance/prometheus"


def _stored(db: Database) -> list[tuple[int, int, int, list[int]]]:
    session = db.new_session()
    try:
        rows = session.scalars(select(AcceptanceRecordRow).order_by(AcceptanceRecordRow.id)).all()
        return [
            (r.verify_steps, r.drafted_tokens, r.accepted_tokens, list(r.accepted_per_position)) for r in rows
        ]
    finally:
        session.close()


def _served_once(client: TestClient, tenant: Tenant) -> tuple[str, dict[str, str], FakeVllmServer]:
    """The push URL, an ingest key's OpenMetrics headers, and a vLLM that served one window."""
    server = FakeVllmServer(k=4)
    server.serve(10, 40, 25, [9, 8, 5, 3])
    return _push_url(client, tenant), {**tenant.headers(Role.ingest), **OPENMETRICS}, server


def test_openmetrics_scrapes_store_their_deltas(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    url, headers, server = _served_once(client, tenants[0])
    first = client.post(url, content=server.scrape(), headers=headers)
    assert first.status_code == 200, first.text
    server.serve(5, 20, 8, [4, 2, 2, 0])
    second = client.post(url, content=server.scrape(), headers=headers)
    assert second.status_code == 200, second.text
    assert second.json()["inserted"] == 1
    assert _stored(db) == [(10, 40, 25, [9, 8, 5, 3]), (5, 20, 8, [4, 2, 2, 0])]


def test_restart_between_scrapes_counts_once(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    url, headers, server = _served_once(client, tenants[0])
    assert client.post(url, content=server.scrape(), headers=headers).status_code == 200
    restarted = FakeVllmServer(k=4, started_at=RESTARTED_AT)
    restarted.serve(14, 56, 30, [12, 9, 6, 3])  # no counter went down
    reply = client.post(url, content=restarted.scrape(), headers=headers)
    assert reply.status_code == 200, reply.text
    # The new process's counts since it started: neither 4 (a delta across the restart) nor 24.
    assert _stored(db) == [(10, 40, 25, [9, 8, 5, 3]), (14, 56, 30, [12, 9, 6, 3])]


def test_openmetrics_body_without_eof_is_refused(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    url, headers, server = _served_once(client, tenants[0])
    truncated = server.scrape().removesuffix("# EOF\n")
    reply = client.post(url, content=truncated, headers=headers)
    assert reply.status_code == 422, reply.text
    assert "# EOF" in reply.text
    session = db.new_session()
    try:
        assert session.scalar(select(func.count()).select_from(AcceptanceRecordRow)) == 0
    finally:
        session.close()
    # The same scrape, complete, is taken; the refused one left no snapshot behind to diff against.
    assert client.post(url, content=server.scrape(), headers=headers).json()["inserted"] == 1
    assert _stored(db) == [(10, 40, 25, [9, 8, 5, 3])]
