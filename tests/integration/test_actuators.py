"""Actuators against real receivers, on real PostgreSQL and SQLite: a webhook receiver (an HTTP
server in a thread) that checks every signature with the secret the API returned once; a canary
that waits for its candidate pool, goes live when the pool answers ready, and is promoted, with
each event delivered and listed; retries with backoff; a pool that never becomes ready; the
signed ready callback; and the command actuator with an operator-configured program."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from controlplane.canary.evaluate import evaluate_deployment, record_shadow_result
from controlplane.canary.service import start_canary
from controlplane.config import Settings
from controlplane.db.models import ActuatorDelivery, Canary, Deployment, DrafterVersion, Role
from controlplane.fleet import payloads
from controlplane.fleet.actuators import deliver, due_deliveries
from controlplane.timestamps import as_utc, utcnow
from tests.conftest import TEST_SECRET, Database, Tenant
from tests.integration.test_canary_service import _add_version, _deployment, _records, _shadow

BASE = "/v1/accounts/acme/deployments/svc"
# The operator's command: writes the event JSON it reads on stdin to the file named by its argument.
RECORD_STDIN = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_bytes(sys.stdin.buffer.read())"


class Receiver:
    """A fleet's webhook endpoint (``/hook``) and a candidate backend's readiness URL (``/ready``,
    200 once a canary-start arrived); ``/never`` never becomes ready."""

    def __init__(self) -> None:
        self.secret: str | None = None
        self.events: list[dict[str, Any]] = []
        self.bad_signatures = 0
        self.fail_next = 0
        self.ready = False
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, code: int) -> None:
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                self._answer(200 if self.path == "/ready" and receiver.ready else 503)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                assert receiver.secret is not None
                if not payloads.verify(
                    receiver.secret,
                    self.headers.get(payloads.HEADER_TIMESTAMP),
                    body,
                    self.headers.get(payloads.HEADER_SIGNATURE),
                ):
                    receiver.bad_signatures += 1
                    self._answer(401)
                    return
                event = json.loads(body)
                assert self.headers.get(payloads.HEADER_EVENT) == event["event"]
                assert self.headers.get(payloads.HEADER_DELIVERY) == str(event["delivery_id"])
                receiver.events.append(event)
                if receiver.fail_next > 0:
                    receiver.fail_next -= 1
                    self._answer(500)
                    return
                if event["event"] == payloads.EVENT_CANARY_START:
                    receiver.ready = True  # the candidate pool "loaded" the candidate
                self._answer(200)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.close()


@pytest.fixture
def settings(db: Database, tmp_path: Path) -> Settings:
    return Settings(
        database_url=db.url,
        environment="test",
        secret_key=TEST_SECRET,
        drift_enqueue_on_ingest=False,
        api_gc_freeze=False,
        api_url="https://cp.example",
        actuator_commands={"record": [sys.executable, "-c", RECORD_STDIN, str(tmp_path / "event.json")]},
    )


def _webhook(client: TestClient, tenant: Tenant, receiver: Receiver, ready_timeout_s: int = 600) -> None:
    put = client.put(
        f"{BASE}/actuator",
        json={"kind": "webhook", "url": f"{receiver.url}/hook", "ready_timeout_s": ready_timeout_s},
        headers=tenant.headers(Role.admin),
    )
    assert put.status_code == 200, put.text
    receiver.secret = put.json()["signing_secret"]
    assert receiver.secret and receiver.secret.startswith("whsec_")


def _deliver_due(db: Database, settings: Settings, now: Any = None) -> list[dict[str, Any]]:
    """What the beat and the deliver task do, called directly."""
    with db.new_session() as session:
        ids = due_deliveries(session=session, now=now)
    return [deliver(new_session=db.new_session, delivery_id=i, settings=settings, now=now) for i in ids]


def _shadow_passes(db: Database, settings: Settings) -> tuple[int, int]:
    version_id = _add_version(db, 1)
    with db.new_session() as session:
        canary, _job = start_canary(session=session, version=session.get_one(DrafterVersion, version_id))
        session.commit()
        canary_id, deployment_id = canary.id, canary.deployment_id
    with db.new_session() as session:
        phase = record_shadow_result(
            session=session, canary_id=canary_id, result=_shadow(3.0, 1.3), settings=settings
        )
        session.commit()
    assert phase == "shadow"  # waiting for the candidate pool, no traffic split yet
    return canary_id, deployment_id


def _evaluate(db: Database, settings: Settings, deployment_id: int) -> dict[str, Any]:
    with db.new_session() as session:
        outcome = evaluate_deployment(session=session, deployment_id=deployment_id, settings=settings)
        session.commit()
    assert outcome is not None
    return outcome


def test_a_canary_waits_for_its_pool_then_goes_live_and_each_event_is_delivered_signed(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings, receiver: Receiver
) -> None:
    acme = tenants[0]
    admin, viewer = acme.headers(Role.admin), acme.headers(Role.viewer)
    _deployment(client, acme)
    _webhook(client, acme, receiver)
    shown = client.get(f"{BASE}/actuator", headers=viewer).json()
    assert shown == {
        "kind": "webhook",
        "url": f"{receiver.url}/hook",
        "command": None,
        "ready_timeout_s": 600,
        "signing_secret": None,  # shown once, never again
    }
    for backend in (
        {"name": "inc-0", "pool": "incumbent", "url": "http://10.0.0.5:8000"},
        {
            "name": "cand-0",
            "pool": "candidate",
            "url": "http://10.0.0.6:8000",
            "drafter_version": 1,
            "readiness_url": f"{receiver.url}/ready",
        },
    ):
        assert client.post(f"{BASE}/backends", json=backend, headers=admin).status_code == 201
    policy = {"candidate_weight": 0.3, "baseline_weight": 0.3, "tune_draft_length": False}
    assert client.patch(f"{BASE}/canary-policy", json=policy, headers=admin).status_code == 200

    canary_id, deployment_id = _shadow_passes(db, settings)
    config = client.get(f"{BASE}/serving-config", headers=acme.headers(Role.serving)).json()
    # Outside the live split: the live arm and the standing no-speculation share.
    assert [a["arm"] for a in config["arms"]] == ["live", "baseline"]
    assert [b["name"] for b in config["backends"]] == ["cand-0", "inc-0"]
    pool = client.get(f"{BASE}/canaries/{canary_id}", headers=viewer).json()["arms"]["pool"]
    assert pool["state"] == "waiting" and pool["deadline"] > pool["since"]
    assert _evaluate(db, settings, deployment_id)["pool"] == "waiting"  # not loaded yet: 503

    # The canary-start event reaches the fleet, which loads the candidate and answers ready.
    assert [d["state"] for d in _deliver_due(db, settings)] == ["delivered"]
    start = receiver.events[-1]
    assert start["event"] == "canary-start" and start["canary_id"] == canary_id
    assert start["drafter_version"] == 1 and start["k"] == 4
    assert start["vllm_speculative_config"] == {
        "method": "draft_model",
        "model": "/artifacts/v1",
        "num_speculative_tokens": 4,
    }
    assert "--speculative-draft-model-path" in start["sglang_args"]
    assert start["ready_callback_url"] == (
        f"https://cp.example/v1/accounts/acme/deployments/svc/canaries/{canary_id}/ready"
    )
    assert _evaluate(db, settings, deployment_id)["pool"] == "ready"
    arms = {
        a["arm"]: a["weight"]
        for a in client.get(f"{BASE}/serving-config", headers=acme.headers(Role.serving)).json()["arms"]
    }
    assert arms == {"live": 0.4, "canary:1": 0.3, "baseline": 0.3}

    _records(db, deployment_id, "live", 120, tps=1.3, ms=5.2, hit=0.1, version=None, start=100)
    _records(db, deployment_id, "canary:1", 90, tps=3.0, ms=2.2, hit=0.6, version=1, start=1000)
    _records(db, deployment_id, "baseline", 90, tps=1.0, ms=5.0, hit=0.0, version=None, start=2000)
    assert _evaluate(db, settings, deployment_id)["decision"] == "promote"
    assert [d["state"] for d in _deliver_due(db, settings)] == ["delivered"]
    assert receiver.events[-1]["event"] == "promotion" and receiver.events[-1]["drafter_version"] == 1
    assert receiver.bad_signatures == 0

    listed = client.get(f"{BASE}/deliveries", headers=viewer).json()["deliveries"]
    assert [(d["event"], d["state"], d["attempts"], d["last_status"]) for d in listed] == [
        ("promotion", "delivered", 1, 200),
        ("canary-start", "delivered", 1, 200),
    ]
    assert listed[0]["payload"]["canary_id"] == canary_id and listed[0]["delivered_at"]


def test_a_failing_receiver_is_retried_with_backoff_until_it_answers(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings, receiver: Receiver
) -> None:
    acme = tenants[0]
    admin = acme.headers(Role.admin)
    _deployment(client, acme)
    _webhook(client, acme, receiver)
    _add_version(db, 1)
    receiver.fail_next = 2
    assert client.post(f"{BASE}/drafter-versions/1:promote", headers=admin).status_code == 200

    before = utcnow()
    first = _deliver_due(db, settings)
    after = utcnow()
    assert [d["state"] for d in first] == ["pending"]
    delivery_id = first[0]["delivery_id"]
    assert _deliver_due(db, settings) == []  # not due again before its backoff
    with db.new_session() as session:
        row = session.get_one(ActuatorDelivery, delivery_id)
        due = as_utc(row.next_attempt_at)
        assert (row.attempts, row.last_status) == (1, 500) and "HTTP 500" in (row.last_error or "")
    # Deterministic: the first backoff (10 s) counts from the attempt, which happened between
    # `before` and `after`, however long a loaded machine took over it.
    assert before + timedelta(seconds=10) <= due <= after + timedelta(seconds=10)
    assert [d["state"] for d in _deliver_due(db, settings, now=due)] == ["pending"]
    with db.new_session() as session:
        row = session.get_one(ActuatorDelivery, delivery_id)
        later = as_utc(row.next_attempt_at)
    assert later - due == timedelta(seconds=20)
    assert [d["state"] for d in _deliver_due(db, settings, now=later)] == ["delivered"]
    got = client.get(f"{BASE}/deliveries", headers=acme.headers(Role.viewer)).json()["deliveries"][0]
    assert (got["state"], got["attempts"], got["last_status"], got["last_error"]) == (
        "delivered",
        3,
        200,
        None,
    )
    assert [e["event"] for e in receiver.events] == ["promotion"] * 3 and receiver.bad_signatures == 0

    # A rollback is an event too; with no earlier version the registered drafter serves again.
    assert client.post(f"{BASE}:rollback", headers=admin).status_code == 200
    assert [d["state"] for d in _deliver_due(db, settings)] == ["delivered"]
    rollback = receiver.events[-1]
    assert rollback["event"] == "rollback" and rollback["drafter_version"] is None
    assert rollback["artifact"]["uri"].endswith("generic-drafter")
    # An admin may send a delivery again.
    retried = client.post(f"{BASE}/deliveries/{delivery_id}/retry", headers=admin)
    assert retried.status_code == 202 and retried.json()["state"] == "pending"
    assert [d["state"] for d in _deliver_due(db, settings)] == ["delivered"]


def test_a_pool_that_never_becomes_ready_ends_the_canary_inconclusive(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings, receiver: Receiver
) -> None:
    acme = tenants[0]
    admin, viewer = acme.headers(Role.admin), acme.headers(Role.viewer)
    _deployment(client, acme)
    _webhook(client, acme, receiver, ready_timeout_s=1)
    backend = {
        "name": "cand",
        "pool": "candidate",
        "url": "http://10.0.0.6:8000",
        "readiness_url": f"{receiver.url}/never",
    }
    assert client.post(f"{BASE}/backends", json=backend, headers=admin).status_code == 201
    canary_id, deployment_id = _shadow_passes(db, settings)
    assert _evaluate(db, settings, deployment_id)["pool"] == "waiting"
    time.sleep(1.1)
    outcome = _evaluate(db, settings, deployment_id)
    assert outcome["decision"] == "inconclusive"
    got = client.get(f"{BASE}/canaries/{canary_id}", headers=viewer).json()
    assert got["phase"] == "decided" and got["decision"] == "inconclusive"
    assert "candidate pool never became ready" in got["reason"]
    assert got["routing_weights"] == {}
    versions = client.get(f"{BASE}/drafter-versions", headers=viewer).json()["drafter_versions"]
    assert [v["state"] for v in versions] == ["candidate"]  # back to candidate; the incumbent serves
    assert [
        a["arm"]
        for a in client.get(f"{BASE}/serving-config", headers=acme.headers(Role.serving)).json()["arms"]
    ] == ["live", "baseline"]


def test_the_ready_callback_takes_the_webhook_signature_or_an_admin_key(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings, receiver: Receiver
) -> None:
    acme, globex = tenants
    _deployment(client, acme)
    _webhook(client, acme, receiver)
    canary_id, deployment_id = _shadow_passes(db, settings)
    # No candidate backend declares a readiness URL: only the callback can say it is ready.
    assert _evaluate(db, settings, deployment_id)["pool"] == "waiting"
    url = f"{BASE}/canaries/{canary_id}/ready"
    body = b'{"pool": "candidate"}'
    assert receiver.secret is not None
    forged = payloads.signed_headers("whsec_guess", "ready", 0, body)
    assert client.post(url, content=body, headers=forged).status_code == 401
    assert client.post(url, headers=acme.headers(Role.viewer)).status_code == 403
    assert client.post(url, headers=globex.headers(Role.admin)).status_code == 404
    assert client.post(url).status_code == 401
    signed = payloads.signed_headers(receiver.secret, "ready", 0, body)
    answer = client.post(url, content=body, headers=signed)
    assert answer.status_code == 200, answer.text
    assert answer.json()["phase"] == "live"
    assert answer.json()["arms"]["pool"]["by"] == "actuator:webhook-signature"
    again = client.post(url, headers=acme.headers(Role.admin))  # idempotent
    assert again.status_code == 200 and again.json()["phase"] == "live"


def test_the_command_actuator_runs_only_configured_commands_with_the_event_on_stdin(
    client: TestClient,
    db: Database,
    tenants: tuple[Tenant, Tenant],
    settings: Settings,
    tmp_path: Path,
) -> None:
    acme, globex = tenants
    admin = acme.headers(Role.admin)
    _deployment(client, acme)
    for refused in (
        {"kind": "command", "command": "rm-everything"},
        {"kind": "command", "command": [sys.executable, "-c", "print(1)"]},
        {"kind": "command", "command": "record", "argv": ["/bin/sh"]},
        {"kind": "webhook", "url": "ftp://x/hook"},
        {"kind": "teleport"},
    ):
        answer = client.put(f"{BASE}/actuator", json=refused, headers=admin)
        assert answer.status_code == 422, (refused, answer.text)
        assert answer.json()["error"]["details"][0]["field"] in {"command", "argv", "url", "kind"}
    assert client.get(f"{BASE}/actuator", headers=admin).json()["kind"] == "reference"  # nothing stored
    put = client.put(f"{BASE}/actuator", json={"kind": "command", "command": "record"}, headers=admin)
    assert put.status_code == 200 and put.json()["signing_secret"] is None
    assert (
        client.put(
            f"{BASE}/actuator",
            json={"kind": "command", "command": "record"},
            headers=acme.headers(Role.viewer),
        ).status_code
        == 403
    )
    for path in ("actuator", "backends", "deliveries"):
        assert client.get(f"{BASE}/{path}", headers=globex.headers(Role.admin)).status_code == 404

    _add_version(db, 1)
    assert client.post(f"{BASE}/drafter-versions/1:promote", headers=admin).status_code == 200
    assert [d["state"] for d in _deliver_due(db, settings)] == ["delivered"]
    event = json.loads((tmp_path / "event.json").read_text())
    assert event["event"] == "promotion" and event["drafter_version"] == 1
    assert event["deployment"] == "accounts/acme/deployments/svc" and event["account"] == "acme"
    listed = client.get(f"{BASE}/deliveries", headers=admin).json()["deliveries"]
    assert (listed[0]["actuator"], listed[0]["state"], listed[0]["last_status"]) == (
        "command",
        "delivered",
        0,
    )


def test_backends_are_validated_unique_and_listed_in_the_serving_config(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant]
) -> None:
    acme = tenants[0]
    admin, viewer = acme.headers(Role.admin), acme.headers(Role.viewer)
    _deployment(client, acme)
    before = client.get(f"{BASE}/serving-config", headers=acme.headers(Role.serving)).json()
    good = {"name": "b-1", "pool": "baseline", "url": "https://10.0.0.7:8000"}
    for bad, field in (
        ({**good, "name": "Bad_Name"}, "name"),
        ({**good, "pool": "canary"}, "pool"),
        ({**good, "url": "10.0.0.7:8000"}, "url"),
        ({**good, "drafter_version": "two"}, "drafter_version"),
        ({**good, "readiness_url": "gopher://x"}, "readiness_url"),
    ):
        answer = client.post(f"{BASE}/backends", json=bad, headers=admin)
        assert answer.status_code == 422 and answer.json()["error"]["details"][0]["field"] == field, (
            answer.text
        )
    assert client.post(f"{BASE}/backends", json=good, headers=viewer).status_code == 403
    assert client.post(f"{BASE}/backends", json=good, headers=admin).status_code == 201
    assert client.post(f"{BASE}/backends", json=good, headers=admin).status_code == 409
    after = client.get(f"{BASE}/serving-config", headers=acme.headers(Role.serving)).json()
    assert after["backends"] == [{**good, "drafter_version": None, "readiness_url": None}]
    assert after["config_version"] != before["config_version"]
    assert client.delete(f"{BASE}/backends/b-1", headers=admin).status_code == 204
    assert client.delete(f"{BASE}/backends/b-1", headers=admin).status_code == 404
    assert client.get(f"{BASE}/backends", headers=viewer).json() == {"backends": []}
    with db.new_session() as session:
        deployment = session.scalars(select(Deployment).where(Deployment.name == "svc")).one()
        assert session.scalars(select(Canary).where(Canary.deployment_id == deployment.id)).first() is None
