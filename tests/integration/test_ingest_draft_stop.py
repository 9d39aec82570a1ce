"""Draft-stop counts through the ingest API on real databases: stored as sent on every write
path, part of what a retry must repeat, and bad counts a 422 that stores nothing."""

from __future__ import annotations

import random
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from controlplane.db.models import AcceptanceRecordRow, Role
from tests.conftest import Database, Tenant
from tests.integration.test_ingest_api import native_record


def with_counts(i: int, rng: random.Random) -> dict[str, Any]:
    """A native record and counts consistent with it: every step drafted k."""
    record = native_record(i, rng)
    rounds, drafted, accepted = record["verify_steps"], record["drafted_tokens"], record["accepted_tokens"]
    cut = rng.randint(0, rounds)  # rounds a doubtful first draft would have ended at one token
    record["draft_stop_counts"] = {
        "thresholds": [0.25, 0.5],
        "rounds": rounds,
        "drafted": [drafted, drafted - cut * (record["k"] - 1)],
        "accepted": [accepted, min(accepted, drafted - cut * (record["k"] - 1))],
    }
    return record


def _deployment(client: TestClient, tenant: Tenant) -> str:
    reply = client.post(
        f"/v1/accounts/{tenant.name}/deployments",
        json={"target_model": "reference-target", "deployment_id": "svc"},
        headers=tenant.headers(Role.admin),
    )
    assert reply.status_code == 201, reply.text
    return f"/v1/accounts/{tenant.name}/deployments/svc"


def _stored(db: Database) -> dict[str, AcceptanceRecordRow]:
    session = db.new_session()
    try:
        return {row.request_id: row for row in session.scalars(select(AcceptanceRecordRow))}
    finally:
        session.close()


@pytest.mark.parametrize("size", [3, 80])  # 80: past the small-batch INSERT, COPY on PostgreSQL
def test_counts_are_stored_as_sent(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database, size: int
) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    rng = random.Random(size)
    records = [with_counts(i, rng) if i % 3 else native_record(i, rng) for i in range(size)]
    reply = client.post(f"{base}/acceptance", json={"records": records}, headers=acme.headers(Role.ingest))
    assert reply.status_code == 200, reply.text
    assert reply.json()["inserted"] == size
    stored = _stored(db)
    for record in records:
        assert stored[record["request_id"]].draft_stop_counts == record.get("draft_stop_counts")
    # A retry with the same counts is a duplicate; other counts under the same id are a 409
    # naming the field, and store nothing.
    again = client.post(f"{base}/acceptance", json={"records": records}, headers=acme.headers(Role.ingest))
    assert again.json()["duplicates"] == size
    changed = dict(records[1])
    changed["draft_stop_counts"] = dict(changed["draft_stop_counts"], thresholds=[0.25, 0.6])
    conflict = client.post(
        f"{base}/acceptance", json={"records": [changed]}, headers=acme.headers(Role.ingest)
    )
    assert conflict.status_code == 409, conflict.text
    assert "draft_stop_counts" in conflict.json()["error"]["details"][0]["message"]


def test_bad_counts_are_a_422_naming_the_field_and_store_nothing(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    rng = random.Random(7)
    good = with_counts(0, rng)
    bad = with_counts(1, rng)
    bad["draft_stop_counts"] = dict(bad["draft_stop_counts"], accepted=[bad["drafted_tokens"] + 1, 0])
    reply = client.post(
        f"{base}/acceptance", json={"records": [good, bad]}, headers=acme.headers(Role.ingest)
    )
    assert reply.status_code == 422, reply.text
    assert "draft_stop_counts.accepted[0]" in reply.text
    session = db.new_session()
    try:
        assert session.scalar(select(func.count()).select_from(AcceptanceRecordRow)) == 0
    finally:
        session.close()
