"""Figures per request category on both databases: rollups keyed by category (written inline and
by the deferred fold), the stats API's category filter and per-category figures, the cap on
categories per deployment, and the category label on /metrics."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from controlplane.db.models import AcceptanceRecordRow, AcceptanceRollupRow, Role
from controlplane.ingest.record import AcceptanceRecord
from controlplane.ingest.rollups import MAX_ROLLUP_CATEGORIES, OVERFLOW_CATEGORY, RESOLUTIONS
from controlplane.ingest.service import store_records
from tests.conftest import Database, Tenant, add_deployment

K = 4
# Per category: (live requests, accepted tokens per request, live ms per token, no-speculation ms
# per token). Each live request drafts 4 steps of K tokens and generates accepted + 4 tokens.
PLAN = {
    "prose": (6, 10, 10.0, 25.0),
    "structured": (4, 2, 20.0, 24.0),
    None: (2, 8, 12.0, None),
}


def _record(n: int, category: str | None, accepted: int, ms_per_token: float, arm: str) -> dict[str, Any]:
    steps = 4
    if arm == "baseline":
        drafted, accepted, positions, steps, k = 0, 0, [], 0, None
        generated = 20
    else:
        # The accepted tokens spread over the steps as evenly as runs allow.
        runs = [accepted // steps + (1 if s < accepted % steps else 0) for s in range(steps)]
        drafted, positions, k = steps * K, [sum(1 for run in runs if run > p) for p in range(K)], K
        generated = accepted + steps
    return {
        "request_id": f"r-{n}",
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "verify_steps": steps,
        "generated_tokens": generated,
        "accepted_per_position": positions,
        "k": k,
        "total_ms": ms_per_token * generated,
        "arm": arm,
        "category": category,
    }


def _traffic() -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for category, (requests, accepted, live_ms, plain_ms) in PLAN.items():
        for _ in range(requests):
            records.append(_record(len(records), category, accepted, live_ms, "live"))
        if plain_ms is not None:
            for _ in range(2):
                records.append(_record(len(records), category, 0, plain_ms, "baseline"))
    return records


def _deployment(client: TestClient, tenant: Tenant) -> str:
    response = client.post(
        f"/v1/accounts/{tenant.name}/deployments",
        json={"target_model": "reference-target", "deployment_id": "mixed"},
        headers=tenant.headers(Role.admin),
    )
    assert response.status_code == 201, response.text
    return f"/v1/accounts/{tenant.name}/deployments/mixed"


def test_stats_filter_by_category_and_report_each_one(
    client: TestClient, tenants: tuple[Tenant, Tenant]
) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    batch = {"records": _traffic()}
    sent = client.post(f"{base}/acceptance", json=batch, headers=acme.headers(Role.ingest))
    assert sent.status_code == 200, sent.text
    viewer = acme.headers(Role.viewer)

    everything = client.get(f"{base}/stats", params={"bucket_seconds": 3600}, headers=viewer)
    assert everything.status_code == 200, everything.text
    body = everything.json()
    assert body["category"] is None
    assert body["total"]["requests"] == 6 + 2 + 4 + 2 + 2
    figures = {f["category"]: f for f in body["per_category"]}
    # Most requests first; records without a category under "".
    assert [f["category"] for f in body["per_category"]] == ["prose", "structured", ""]
    prose, structured, untagged = figures["prose"], figures["structured"], figures[""]
    assert (prose["requests"], prose["no_speculation_requests"]) == (8, 2)
    # Hit rate over every arm kept by the filters: baseline records draft nothing.
    assert prose["hit_rate"] == pytest.approx(6 * 10 / (6 * 16))
    assert structured["hit_rate"] == pytest.approx(2 / 16)
    assert untagged["hit_rate"] == pytest.approx(8 / 16)
    # Speed-up: no-speculation ms per token over the speculating arms' ms per token.
    assert prose["speedup_vs_no_speculation"] == pytest.approx(25.0 / 10.0)
    assert structured["speedup_vs_no_speculation"] == pytest.approx(24.0 / 20.0)
    assert untagged["speedup_vs_no_speculation"] is None
    assert untagged["no_speculation_requests"] == 0

    # The category filter narrows the series and the total to that category.
    hourly = {"bucket_seconds": 3600}
    only = client.get(f"{base}/stats", params={**hourly, "category": "structured"}, headers=viewer)
    assert only.status_code == 200, only.text
    narrowed = only.json()
    assert narrowed["category"] == "structured"
    assert narrowed["total"]["requests"] == 6
    assert narrowed["total"]["hit_rate"] == pytest.approx(structured["hit_rate"])
    assert sum(b["requests"] for b in narrowed["buckets"]) == 6
    assert [f["category"] for f in narrowed["per_category"]] == ["structured"]
    # The arm filter keeps the speed-up's no-speculation side.
    live = client.get(
        f"{base}/stats", params={"bucket_seconds": 3600, "category": "prose", "arm": "live"}, headers=viewer
    ).json()
    assert live["total"]["requests"] == 6
    assert live["per_category"][0]["speedup_vs_no_speculation"] == pytest.approx(2.5)
    assert live["per_category"][0]["hit_rate"] == pytest.approx(10 / 16)

    # "" means every category, like no filter; an unknown category has no records.
    empty = client.get(f"{base}/stats", params={**hourly, "category": ""}, headers=viewer).json()
    assert empty["total"] == body["total"] and empty["category"] is None
    unknown = client.get(f"{base}/stats", params={**hourly, "category": "code"}, headers=viewer)
    assert unknown.status_code == 200
    assert unknown.json()["total"]["requests"] == 0 and unknown.json()["per_category"] == []

    too_long = client.get(f"{base}/stats", params={"category": "x" * 101}, headers=viewer)
    assert too_long.status_code == 422, too_long.text
    assert client.get(f"{base}/stats", params={"category": "x" * 100}, headers=viewer).status_code == 200

    # /metrics: the recent hit rate per arm, and per arm and category.
    scrape = client.get("/metrics", headers=viewer)
    assert scrape.status_code == 200, scrape.text
    samples = [s for f in text_string_to_metric_families(scrape.text) for s in f.samples]

    def value(name: str, **labels: str) -> float:
        found = [s.value for s in samples if s.name == name and s.labels.items() >= labels.items()]
        assert len(found) == 1, (name, labels, found)
        return found[0]

    mine = {"account": acme.name, "deployment": "mixed", "arm": "live"}
    assert value("specctl_category_hit_ratio", **mine, category="prose") == pytest.approx(10 / 16)
    assert value("specctl_category_hit_ratio", **mine, category="structured") == pytest.approx(2 / 16)
    assert value("specctl_category_hit_ratio", **mine, category="") == pytest.approx(8 / 16)
    assert value("specctl_hit_ratio", **mine) == pytest.approx((60 + 8 + 16) / (12 * 16))


def _records(prefix: str, categories: list[str | None], at: datetime) -> list[AcceptanceRecord]:
    return [
        AcceptanceRecord(
            request_id=f"{prefix}-{i}",
            drafted_tokens=8,
            accepted_tokens=i % 3,
            verify_steps=2,
            generated_tokens=i % 3 + 2,
            accepted_per_position=[int(i % 3 >= 1), int(i % 3 >= 2)],
            k=4,
            total_ms=50.0,
            category=category,
            created_at=at + timedelta(seconds=i),
        )
        for i, category in enumerate(categories)
    ]


def test_rollups_keep_at_most_the_cap_of_categories_per_deployment(db: Database) -> None:
    session = db.new_session()
    deployment = add_deployment(session, "capped")
    other = add_deployment(session, "uncapped")
    at = datetime(2026, 11, 2, 9, 0, tzinfo=UTC)
    names = [f"c{n:02d}" for n in range(MAX_ROLLUP_CATEGORIES + 3)]
    # The first batch fills the cap exactly (plus records without one): every category is kept.
    first = names[:MAX_ROLLUP_CATEGORIES] + [None, ""]
    store_records(session=session, deployment_id=deployment.id, records=_records("a", first, at))
    # Later batches: a known category keeps its rows; new ones go to the overflow category.
    second = [names[0], names[-1], names[-2], names[-3], names[-1]]
    store_records(session=session, deployment_id=deployment.id, records=_records("b", second, at))
    # The cap is per deployment: another one keeps its own categories.
    store_records(session=session, deployment_id=other.id, records=_records("c", names[-3:], at))
    session.commit()

    r = AcceptanceRollupRow

    def categories(deployment_id: int, resolution: int) -> dict[str, int]:
        rows = session.execute(
            select(r.category, func.sum(r.requests))
            .where(r.deployment_id == deployment_id, r.resolution_s == resolution)
            .group_by(r.category)
        )
        return {category: int(total) for category, total in rows}

    for resolution in RESOLUTIONS:
        counted = categories(deployment.id, resolution)
        assert set(counted) == {*names[:MAX_ROLLUP_CATEGORIES], "", OVERFLOW_CATEGORY}, resolution
        assert counted[OVERFLOW_CATEGORY] == 4
        assert counted[names[0]] == 2
        assert counted[""] == 2
        assert sum(counted.values()) == len(first) + len(second)
        assert categories(other.id, resolution) == dict.fromkeys(names[-3:], 1)
    # The raw records keep the category they were sent with.
    raw = AcceptanceRecordRow
    stored = session.scalars(select(raw.category).where(raw.deployment_id == deployment.id).distinct())
    assert set(names) <= set(stored)
    session.close()
