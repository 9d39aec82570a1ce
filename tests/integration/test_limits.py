"""The request gate and the bounds on what a request may name: a key before any body is read,
body sizes counted while reading, path ids no row can have, per-key rates; and the serving role."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.api.deps import get_session
from controlplane.app import create_app
from controlplane.config import Settings
from controlplane.db.models import AcceptanceRecordRow, Deployment, Role
from controlplane.ingest.batcher import IngestBatcher
from tests.conftest import Database, Tenant

RECORD = {
    "drafted_tokens": 4,
    "accepted_tokens": 2,
    "verify_steps": 1,
    "generated_tokens": 3,
    "accepted_per_position": [1, 1, 0, 0],
    "k": 4,
}


def _app(db: Database, settings: Settings, **overrides: Any) -> FastAPI:
    """The API on the test's database, with ``overrides`` to its settings (as conftest's client)."""
    app = create_app(settings.model_copy(update=overrides))

    def session_override() -> Iterator[Session]:
        session = db.new_session()
        try:
            yield session
        finally:
            session.rollback()
            session.close()

    app.dependency_overrides[get_session] = session_override
    app.state.session_factory = db.new_session
    app.state.ingest_batcher = IngestBatcher(db.new_session)
    return app


@contextmanager
def _client(db: Database, settings: Settings, **overrides: Any) -> Iterator[TestClient]:
    with TestClient(_app(db, settings, **overrides)) as client:
        yield client


def _deployment(client: TestClient, tenant: Tenant, name: str = "svc") -> str:
    response = client.post(
        f"/v1/accounts/{tenant.name}/deployments",
        json={"target_model": "reference-target", "deployment_id": name},
        headers=tenant.headers(Role.admin),
    )
    assert response.status_code == 201, response.text
    return f"/v1/accounts/{tenant.name}/deployments/{name}"


def _records(db: Database) -> int:
    session = db.new_session()
    try:
        return int(session.scalar(select(func.count()).select_from(AcceptanceRecordRow)) or 0)
    finally:
        session.close()


def _deployments(db: Database) -> int:
    session = db.new_session()
    try:
        return int(session.scalar(select(func.count()).select_from(Deployment)) or 0)
    finally:
        session.close()


def _error(response: Any) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


# --- authentication before the body ------------------------------------------------------------


@contextmanager
def _serve(app: FastAPI) -> Iterator[int]:
    """``app`` behind a real uvicorn on a free port, in a thread."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# A server that waited for the announced body would never answer (no byte of it is sent), so any
# answer at all before this timeout shows the refusal came first; the timeout only has to be far
# above a loaded machine's stalls (an answer takes milliseconds).
HEADERS_ONLY_TIMEOUT_S = 60.0
REFUSAL_BOUND_S = 30.0


def _headers_only(port: int, path: str, headers: dict[str, str], declared: int) -> tuple[int, str, float]:
    """POST headers announcing ``declared`` bytes and send none of them: (status, reply, seconds)."""
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append(f"Content-Length: {declared}")
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=HEADERS_ONLY_TIMEOUT_S) as conn:
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            reply += chunk
    elapsed = time.monotonic() - started
    status = int(reply.split(b" ", 2)[1])
    return status, reply.decode(errors="replace"), elapsed


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_a_huge_body_is_refused_before_it_is_sent(
    db: Database, settings: Settings, tenants: tuple[Tenant, Tenant]
) -> None:
    acme, _ = tenants
    ten_gib = 10 * 2**30
    with _serve(_app(db, settings)) as port:
        url = f"/v1/accounts/{acme.name}/deployments"
        # No key, a wrong key: 401 at once, though the client has sent none of the 10 GiB.
        for headers in ({}, {"Authorization": "Bearer sk_nothing_here"}):
            status, reply, elapsed = _headers_only(port, url, headers, ten_gib)
            assert status == 401, reply
            assert elapsed < REFUSAL_BOUND_S, elapsed
        # The right key on an ingest route: 413 naming the limit, still before any byte is sent.
        ingest = f"{url}/svc/acceptance"
        status, reply, elapsed = _headers_only(port, ingest, acme.headers(Role.ingest), ten_gib)
        assert status == 413, reply
        assert "max_body_bytes" in reply and str(settings.max_body_bytes) in reply
        assert elapsed < REFUSAL_BOUND_S, elapsed
    assert _deployments(db) == 0


def test_the_gate_reads_no_body_without_a_valid_key(db: Database, settings: Settings) -> None:
    """At the ASGI level: the app never asks for the body of a request it refuses."""
    app = _app(db, settings)
    asked_for_body = False
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal asked_for_body
        asked_for_body = True
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def call(headers: list[tuple[bytes, bytes]]) -> None:
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/accounts/acme/deployments",
            "raw_path": b"/v1/accounts/acme/deployments",
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"2"), *headers],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        await app(scope, receive, send)  # type: ignore[arg-type]

    asyncio.run(call([]))
    asyncio.run(call([(b"x-api-key", b"sk_abc_notakey")]))
    statuses = [m["status"] for m in sent if m["type"] == "http.response.start"]
    assert statuses == [401, 401]
    assert not asked_for_body


# --- body sizes ------------------------------------------------------------------------------------


def test_json_routes_take_small_bodies(
    db: Database, settings: Settings, tenants: tuple[Tenant, Tenant]
) -> None:
    acme, _ = tenants
    with _client(db, settings, max_json_body_bytes=2048) as client:
        url = f"/v1/accounts/{acme.name}/deployments"
        body = {"target_model": "reference-target", "deployment_id": "big", "description": "x" * 4096}
        refused = client.post(url, json=body, headers=acme.headers(Role.admin))
        assert refused.status_code == 413
        error = _error(refused)
        assert error["details"] == {"limit": "max_json_body_bytes", "limit_bytes": 2048}
        assert "2048-byte limit" in error["message"]

        # Sent in chunks with no Content-Length: stopped while reading, at the same limit.
        def chunks() -> Iterator[bytes]:
            yield b'{"target_model": "reference-target", "deployment_id": "big", "description": "'
            for _ in range(8):
                yield b"x" * 1024
            yield b'"}'

        headers = {**acme.headers(Role.admin), "Content-Type": "application/json"}
        refused = client.post(url, content=chunks(), headers=headers)
        assert refused.status_code == 413, refused.text
        assert _error(refused)["details"]["limit"] == "max_json_body_bytes"
    assert _deployments(db) == 0


def test_ingest_bodies_are_counted_while_read(
    db: Database, settings: Settings, tenants: tuple[Tenant, Tenant]
) -> None:
    acme, _ = tenants
    with _client(db, settings, max_body_bytes=4096) as client:
        ingest = _deployment(client, acme) + "/acceptance"
        records = [{**RECORD, "request_id": f"r{i}"} for i in range(100)]

        def chunks() -> Iterator[bytes]:
            text = json.dumps({"records": records}).encode()
            for start in range(0, len(text), 1000):
                yield text[start : start + 1000]

        headers = {**acme.headers(Role.ingest), "Content-Type": "application/json"}
        refused = client.post(ingest, content=chunks(), headers=headers)
        assert refused.status_code == 413, refused.text
        assert _error(refused)["details"] == {"limit": "max_body_bytes", "limit_bytes": 4096}
        assert _records(db) == 0
        # A batch under the limit goes through the same gate.
        small = client.post(ingest, json={"records": records[:5]}, headers=acme.headers(Role.ingest))
        assert small.status_code == 200, small.text
        assert _records(db) == 5


# --- path ids ------------------------------------------------------------------------------------


def test_path_ids_no_row_can_have_answer_404(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, _ = tenants
    _deployment(client, acme)
    spec = client.get("/openapi.json").json()
    checked = 0
    for template, operations in spec["paths"].items():
        for method, operation in operations.items():
            params = [p for p in operation.get("parameters", []) if p["in"] == "path"]
            numeric = [p["name"] for p in params if p["schema"].get("type") == "integer"]
            if not numeric:
                continue
            for value in (2**63, 2**31, 2**64, -1):
                names = {p["name"]: "x" for p in params}
                names.update(account=acme.name, deployment="svc", **{n: str(value) for n in numeric})
                path = template.format(**names)
                response = client.request(method.upper(), path, headers=acme.headers(Role.admin), json={})
                assert response.status_code == 404, (method, template, value, response.text)
                checked += 1
    # Drift events (2), jobs (2), drafter versions (3), canaries (4), deliveries, api keys: 13.
    assert checked == 13 * 4


def test_query_numbers_out_of_range_are_refused_not_failed(
    client: TestClient, tenants: tuple[Tenant, Tenant]
) -> None:
    acme, _ = tenants
    _deployment(client, acme)
    spec = client.get("/openapi.json").json()
    checked = 0
    for template, operations in spec["paths"].items():
        reads = operations.get("get")
        if reads is None or not template.startswith("/v1/"):
            continue
        path_params = {p["name"] for p in reads.get("parameters", []) if p["in"] == "path"}
        if not path_params <= {"account", "deployment"}:
            continue
        path = template.format(account=acme.name, deployment="svc")
        for param in reads.get("parameters", []):
            schema = param["schema"]
            types = {schema.get("type")} | {option.get("type") for option in schema.get("anyOf", [])}
            if param["in"] != "query" or "integer" not in types:
                continue
            for value in (2**63, 2**31, -1):
                response = client.get(path, params={param["name"]: value}, headers=acme.headers(Role.admin))
                assert response.status_code in (200, 422), (template, param["name"], value, response.text)
                checked += 1
    assert checked >= 8 * 3  # page sizes, after_id, bucket_seconds, drafter_version ...


def test_stats_windows_outside_the_stored_range_are_refused_not_failed(
    client: TestClient, tenants: tuple[Tenant, Tenant]
) -> None:
    acme, _ = tenants
    _deployment(client, acme)
    path = f"/v1/accounts/{acme.name}/deployments/svc/stats"
    for params in (
        {"end": "0001-01-01T00:00:00Z"},
        {"start": "9999-12-31T23:59:59Z"},
        {"end": "1999-12-31T23:59:59Z"},
        {"start": "not a time"},
    ):
        response = client.get(path, params=params, headers=acme.headers(Role.viewer))
        assert response.status_code == 422, (params, response.text)
        assert next(iter(params)) in response.json()["error"]["message"], response.text
    ok = client.get(path, params={"end": "2030-01-01T00:00:00Z"}, headers=acme.headers(Role.viewer))
    assert ok.status_code == 200, ok.text


def test_every_v1_route_needs_a_key_before_its_body(client: TestClient) -> None:
    """The gate authenticates every /v1/ route from the headers; a route that needed no key would
    have its body read by anyone."""
    spec = client.get("/openapi.json").json()
    oversized = b"x" * (2 * 1024 * 1024)
    checked = 0
    for template, operations in spec["paths"].items():
        if not template.startswith("/v1/"):
            continue
        path = template.replace("{", "").replace("}", "")
        for method in operations:
            response = client.request(method.upper(), path, content=oversized)
            assert response.status_code == 401, (method, template, response.text)
            checked += 1
    assert checked > 50


# --- rates -----------------------------------------------------------------------------------------


def test_each_key_has_its_own_rate(db: Database, settings: Settings, tenants: tuple[Tenant, Tenant]) -> None:
    acme, _ = tenants
    limits = {
        "admin_rate_per_s": 0.01,
        "admin_rate_burst": 3,
        "ingest_rate_per_s": 0.01,
        "ingest_rate_burst": 2,
    }
    with _client(db, settings, **limits) as client:
        url = f"/v1/accounts/{acme.name}/deployments"
        admin, viewer = acme.headers(Role.admin), acme.headers(Role.viewer)
        assert client.post(
            url, json={"target_model": "reference-target", "deployment_id": "svc"}, headers=admin
        ).is_success
        assert [client.get(url, headers=admin).status_code for _ in range(2)] == [200, 200]
        refused = client.get(url, headers=admin)
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1
        assert _error(refused)["details"]["limit"] == "admin_rate_per_s"
        # Another key of the same account is not held back by the first one's rate.
        assert client.get(url, headers=viewer).status_code == 200

        ingest, writer = f"{url}/svc/acceptance", acme.headers(Role.ingest)
        for i in range(2):
            accepted = client.post(
                ingest, json={"records": [{**RECORD, "request_id": f"r{i}"}]}, headers=writer
            )
            assert accepted.status_code == 200, accepted.text
        refused = client.post(ingest, json={"records": [{**RECORD, "request_id": "r9"}]}, headers=writer)
        assert refused.status_code == 429
        assert _error(refused)["details"]["limit"] == "ingest_rate_per_s"
        assert _records(db) == 2
        # Its other routes draw on its other bucket: the role check answers, not the rate.
        assert client.get(f"{url}/svc/stats", headers=writer).status_code == 403


# --- the serving role ----------------------------------------------------------------------------


def test_only_serving_keys_read_what_to_serve(client: TestClient, tenants: tuple[Tenant, Tenant]) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    for role, expected in ((Role.serving, 200), (Role.admin, 200), (Role.ingest, 403), (Role.viewer, 403)):
        for path in ("/serving-config", "/serving-config/export"):
            response = client.get(base + path, headers=acme.headers(role))
            assert response.status_code == expected, (role, path, response.text)
    serving = acme.headers(Role.serving)
    written = client.post(
        base + "/acceptance", json={"records": [{**RECORD, "request_id": "s1"}]}, headers=serving
    )
    assert written.status_code == 200, written.text
    # The fleet's key writes data and reads its config, nothing else.
    assert client.get(base, headers=serving).status_code == 403
    assert client.patch(base, json={"draft_token_count": 5}, headers=serving).status_code == 403


def test_admins_issue_serving_keys(client: TestClient, tenants: tuple[Tenant, Tenant]) -> None:
    acme, _ = tenants
    issued = client.post(
        f"/v1/accounts/{acme.name}/api-keys",
        json={"name": "router", "role": "serving"},
        headers=acme.headers(Role.admin),
    )
    assert issued.status_code == 201, issued.text
    assert issued.json()["role"] == "serving"
    whoami = client.get("/v1/whoami", headers={"Authorization": f"Bearer {issued.json()['key']}"}).json()
    assert whoami["role"] == "serving"
