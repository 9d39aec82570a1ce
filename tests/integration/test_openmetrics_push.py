"""Pushes to the Prometheus route: stored acceptance equals the counter deltas since the first
push (a baseline), whatever the counters' size, the scrape ids and the label sets that come and go."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy import func, select

from controlplane.db.models import AcceptanceRecordRow, Role
from tests.conftest import Database, Tenant
from tests.unit.test_prometheus_ingest import RESTARTED_AT, FakeVllmServer, exposition

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
    # The first push is the baseline: the engine's history before it is not a window of traffic.
    assert (first.json()["inserted"], first.json()["baseline_label_sets"]) == (0, 1)
    server.serve(5, 20, 8, [4, 2, 2, 0])
    second = client.post(url, content=server.scrape(), headers=headers)
    assert second.status_code == 200, second.text
    assert (second.json()["inserted"], second.json()["baseline_label_sets"]) == (1, 0)
    assert _stored(db) == [(5, 20, 8, [4, 2, 2, 0])]


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
    assert _stored(db) == [(14, 56, 30, [12, 9, 6, 3])]


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
    # The same scrape, complete, is taken as the baseline; the refused one left no snapshot behind.
    assert client.post(url, content=server.scrape(), headers=headers).json()["baseline_label_sets"] == 1
    server.serve(1, 4, 2, [1, 1, 0, 0])
    assert client.post(url, content=server.scrape(), headers=headers).json()["inserted"] == 1
    assert _stored(db) == [(1, 4, 2, [1, 1, 0, 0])]


def _text(drafts: int, per_pos: list[int], engine: str = "0") -> str:
    """Prometheus text of one engine with k = 2 that drafted 2 per step."""
    return exposition(drafts, 2 * drafts, sum(per_pos), per_pos, engine=engine)


def test_counters_past_two_to_the_31_vanishing_label_sets_and_a_fixed_scrape_id(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    url = _push_url(client, tenants[0])
    headers = tenants[0].headers(Role.ingest)
    big = 5 * 2**31  # a long-lived engine's first push

    def push(text: str) -> dict[str, int]:
        reply = client.post(f"{url}?scrape_id=fixed", content=text, headers=headers)
        assert reply.status_code == 200, reply.text
        return reply.json()

    assert push(_text(big, [big // 2, big // 4]) + _text(100, [60, 30], "1"))["baseline_label_sets"] == 2
    # Engine 1 misses a scrape; the reused scrape id does not make engine 0's window a repeat.
    assert push(_text(big + 10, [big // 2 + 8, big // 4 + 4]))["inserted"] == 1
    # Engine 1 is back: its increase since its last values, not its whole count again.
    back = push(_text(big + 20, [big // 2 + 16, big // 4 + 8]) + _text(110, [66, 33], "1"))
    assert (back["inserted"], back["baseline_label_sets"]) == (2, 0)
    assert sorted(_stored(db)) == [(10, 20, 9, [6, 3]), (10, 20, 12, [8, 4]), (10, 20, 12, [8, 4])]


def test_label_sets_per_push_are_capped(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    url = _push_url(client, tenants[0])
    text = "".join(_text(1, [1, 0], engine=str(i)) for i in range(1001))
    reply = client.post(url, content=text, headers=tenants[0].headers(Role.ingest))
    assert reply.status_code == 413, reply.text
    assert "limit of 1000" in reply.json()["error"]["message"]


def test_only_a_push_under_the_serving_key_counts_as_the_fleets(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    url = _push_url(client, tenants[0])
    for i, role in enumerate((Role.serving, Role.ingest, Role.admin)):
        text = _text(100 * (i + 1), [60 * (i + 1), 30 * (i + 1)], engine=role.value)
        later = _text(100 * (i + 1) + 10, [60 * (i + 1) + 8, 30 * (i + 1) + 4], engine=role.value)
        for body in (text, later):
            reply = client.post(url, content=body, headers=tenants[0].headers(role))
            assert reply.status_code == 200, reply.text
    session = db.new_session()
    try:
        flags = session.scalars(select(AcceptanceRecordRow.from_serving_key).order_by(AcceptanceRecordRow.id))
        assert list(flags) == [True, False, False]
    finally:
        session.close()
