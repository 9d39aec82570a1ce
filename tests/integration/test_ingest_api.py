"""Acceptance ingestion through the API on real databases: idempotency, all-or-nothing, stats."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from controlplane.db.models import AcceptanceRecordRow, AcceptanceRollup, Role
from tests.conftest import Database, Tenant

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def native_record(
    i: int, rng: random.Random, *, k: int = 4, when: datetime = T0, arm: str = "live"
) -> dict[str, Any]:
    steps = rng.randint(3, 12)
    per_step = [min(k, int(rng.expovariate(0.6))) for _ in range(steps)]
    positions = [sum(1 for a in per_step if a > p) for p in range(k)]
    accepted = sum(per_step)
    if arm == "baseline":  # no speculation: every token comes from a plain target step
        per_step, positions, accepted, k, steps = [], [], 0, 0, 0
    return {
        "request_id": f"req-{i}",
        "drafted_tokens": len(per_step) * k,
        "accepted_tokens": accepted,
        "verify_steps": len(per_step),
        "generated_tokens": accepted + len(per_step) if per_step else rng.randint(10, 60),
        "accepted_per_position": positions,
        "k": k,
        "prompt_tokens": rng.randint(10, 200),
        "ttft_ms": rng.uniform(5, 50),
        "inter_token_ms": rng.uniform(2, 20),
        "total_ms": rng.uniform(50, 500),
        "arm": arm,
        "created_at": (when + timedelta(seconds=i)).isoformat(),
    }


def _deployment(client: TestClient, tenant: Tenant, name: str = "svc") -> str:
    response = client.post(
        f"/v1/accounts/{tenant.name}/deployments",
        json={"target_model": "reference-target", "deployment_id": name},
        headers=tenant.headers(Role.admin),
    )
    assert response.status_code == 201, response.text
    return f"/v1/accounts/{tenant.name}/deployments/{name}"


def _counts(db: Database) -> tuple[int, int]:
    session = db.new_session()
    try:
        records = session.scalar(select(func.count()).select_from(AcceptanceRecordRow)) or 0
        requests = session.scalar(select(func.coalesce(func.sum(AcceptanceRollup.requests), 0))) or 0
        return int(records), int(requests)
    finally:
        session.close()


def test_batch_is_stored_once_even_when_retried(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    rng = random.Random(1)
    batch = {"format": "native", "records": [native_record(i, rng) for i in range(500)]}
    headers = acme.headers(Role.ingest)
    first = client.post(f"{base}/acceptance", json=batch, headers=headers)
    assert first.status_code == 200, first.text
    assert (first.json()["inserted"], first.json()["duplicates"]) == (500, 0)
    again = client.post(f"{base}/acceptance", json=batch, headers=headers)
    assert (again.json()["inserted"], again.json()["duplicates"]) == (0, 500)
    assert again.json()["duplicate_request_ids"][:2] == ["req-0", "req-1"]
    assert _counts(db) == (500, 500)
    # A batch mixing new and already-stored ids (same values: a retry) stores only the new ones.
    mixed = {"records": batch["records"][490:] + [native_record(i, rng) for i in range(500, 510)]}
    response = client.post(f"{base}/acceptance", json=mixed, headers=headers).json()
    assert (response["inserted"], response["duplicates"]) == (10, 10)
    assert _counts(db) == (510, 510)


def test_a_reused_request_id_with_other_values_is_a_conflict(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    rng = random.Random(2)
    headers = acme.headers(Role.ingest)
    sent = [native_record(i, rng) for i in range(5)]
    assert client.post(f"{base}/acceptance", json={"records": sent}, headers=headers).status_code == 200
    changed = dict(sent[3], generated_tokens=sent[3]["generated_tokens"] + 1)
    # Same id, other values, next to a new record: 409 naming the id, and nothing of the batch
    # is stored (all or nothing, as for a 422).
    reply = client.post(
        f"{base}/acceptance", json={"records": [sent[2], changed, native_record(7, rng)]}, headers=headers
    )
    assert reply.status_code == 409, reply.text
    details = reply.json()["error"]["details"]
    assert [d.get("request_id") for d in details] == ["req-3"]
    assert "generated_tokens" in details[0]["message"]
    assert _counts(db) == (5, 5)
    # The same batch without the changed record goes in: the conflict stored nothing earlier.
    reply = client.post(
        f"{base}/acceptance", json={"records": [sent[2], native_record(8, rng)]}, headers=headers
    )
    assert (reply.json()["inserted"], reply.json()["duplicates"]) == (1, 1)
    assert _counts(db) == (6, 6)
    # The server stamps a record sent without created_at: a retry of it is a duplicate.
    stamped = {k: v for k, v in native_record(9, rng).items() if k != "created_at"}
    for _ in range(2):
        again = client.post(f"{base}/acceptance", json={"records": [stamped]}, headers=headers)
        assert again.status_code == 200, again.text
    assert again.json()["duplicates"] == 1
    assert _counts(db) == (7, 7)


def test_invalid_records_reject_the_whole_batch(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    rng = random.Random(2)
    records = [native_record(i, rng) for i in range(20)]
    records[3]["accepted_tokens"] = records[3]["drafted_tokens"] + 1
    records[7]["verify_steps"] = -1
    records[11]["arm"] = "sideways"
    response = client.post(f"{base}/acceptance", json={"records": records}, headers=acme.headers(Role.ingest))
    assert response.status_code == 422
    problems = response.json()["error"]["details"]
    assert {p["index"] for p in problems} == {3, 7, 11}
    assert {(p["index"], p["field"]) for p in problems} >= {(7, "verify_steps"), (11, "arm")}
    assert _counts(db) == (0, 0)
    duplicate_ids = [native_record(1, rng), native_record(1, rng)]
    response = client.post(
        f"{base}/acceptance", json={"records": duplicate_ids}, headers=acme.headers(Role.ingest)
    )
    assert response.status_code == 422 and response.json()["error"]["details"][0]["index"] == 1
    for body in (b"{not json", b'{"records": 5}'):
        response = client.post(f"{base}/acceptance", content=body, headers=acme.headers(Role.ingest))
        assert response.status_code == 422, response.text
    assert _counts(db) == (0, 0)


def test_values_the_database_refuses_get_a_clear_422_and_never_touch_another_account(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, globex = tenants
    bad_base, good_base = _deployment(client, acme), _deployment(client, globex)
    rng = random.Random(5)
    poisons = [
        {"drafted_tokens": 2**40, "verify_steps": 2**40, "generated_tokens": 2**40, "k": None},
        {"k": 40_000},
        {"arm": "canary:" + "9" * 30},
        {"category": "c" * 150},
        {"category": "nul\x00"},
        {"created_at": "0001-01-01T00:00:00+00:00"},
        {"total_ms": 1e307},
    ]
    for i, poison in enumerate(poisons):
        record = {**native_record(i, rng), **poison}
        response = client.post(
            f"{bad_base}/acceptance", json={"records": [record]}, headers=acme.headers(Role.ingest)
        )
        assert response.status_code == 422, (poison, response.text)
        assert response.json()["error"]["details"][0]["field"] in {
            *poison,
            "drafter_version",
            "drafted_tokens",
        }
        good = client.post(
            f"{good_base}/acceptance",
            json={"records": [native_record(100 + i, rng)]},
            headers=globex.headers(Role.ingest),
        )
        assert good.status_code == 200 and good.json()["inserted"] == 1, good.text
    assert _counts(db) == (len(poisons), len(poisons))  # only the other account's, every one of them


def test_batch_limit(client: TestClient, tenants: tuple[Tenant, Tenant], db: Database) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    rng = random.Random(3)
    too_many = {"records": [native_record(i, rng) for i in range(10_001)]}
    response = client.post(f"{base}/acceptance", json=too_many, headers=acme.headers(Role.ingest))
    assert response.status_code == 413
    assert _counts(db) == (0, 0)


def test_engine_formats_are_normalised(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    vllm = {
        "request_id": "vllm-1",
        "metrics": {
            "speculative_decoding": {
                "num_spec_steps": 4,
                "num_draft_tokens": 12,
                "num_accepted_draft_tokens": 8,
                "acceptance_histogram": [0, 1, 2, 1],
                "mean_acceptance_length": 3.0,
                "draft_acceptance_rate": 8 / 12,
            }
        },
    }
    response = client.post(
        f"{base}/acceptance", json={"format": "vllm", "records": [vllm]}, headers=acme.headers(Role.ingest)
    )
    assert response.status_code == 200, response.text
    session = db.new_session()
    row = session.scalars(select(AcceptanceRecordRow).where(AcceptanceRecordRow.request_id == "vllm-1")).one()
    # Histogram [0, 1, 2, 1]: steps accepting >=1: 4, >=2: 3, >=3: 1.
    assert (row.drafted_tokens, row.accepted_tokens, row.verify_steps) == (12, 8, 4)
    assert row.accepted_per_position == [4, 3, 1]
    session.close()


def test_stats_match_a_brute_force_recount(client: TestClient, tenants: tuple[Tenant, Tenant]) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    rng = random.Random(4)
    records = [native_record(i, rng, when=T0) for i in range(600)]  # 10 minutes, one per second
    records += [
        native_record(1000 + i, rng, when=T0 - timedelta(seconds=1000), arm="baseline") for i in range(60)
    ]
    response = client.post(f"{base}/acceptance", json={"records": records}, headers=acme.headers(Role.ingest))
    assert response.status_code == 200, response.text
    params = {
        "start": T0.isoformat(),
        "end": (T0 + timedelta(minutes=10)).isoformat(),
        "bucket_seconds": 300,
        "arm": "live",
    }
    stats = client.get(f"{base}/stats", params=params, headers=acme.headers(Role.viewer)).json()
    assert [b["requests"] for b in stats["buckets"]] == [300, 300]
    for bucket, chunk in zip(stats["buckets"], (records[:300], records[300:600]), strict=True):
        drafted = sum(r["drafted_tokens"] for r in chunk)
        accepted = sum(r["accepted_tokens"] for r in chunk)
        steps = sum(r["verify_steps"] for r in chunk)
        assert bucket["hit_rate"] == pytest.approx(accepted / drafted)
        assert bucket["mean_accepted_length"] == pytest.approx(1 + accepted / steps)
        first_position = sum(r["accepted_per_position"][0] for r in chunk)
        assert bucket["per_position_acceptance"][0] == pytest.approx(first_position / steps)
        exact_p95 = sorted(r["total_ms"] for r in chunk)[int(0.95 * len(chunk)) - 1]
        assert bucket["total_latency_ms_p95"] == pytest.approx(exact_p95, rel=0.03)
    every_arm = {key: value for key, value in params.items() if key != "arm"}
    both = client.get(
        f"{base}/stats", params={**every_arm, "bucket_seconds": 600}, headers=acme.headers(Role.viewer)
    ).json()
    assert both["total"]["requests"] == 660
    baseline = client.get(
        f"{base}/stats", params={**params, "arm": "baseline"}, headers=acme.headers(Role.viewer)
    ).json()
    assert baseline["total"]["requests"] == 60
    bad = client.get(
        f"{base}/stats", params={**params, "bucket_seconds": 90}, headers=acme.headers(Role.viewer)
    )
    assert bad.status_code == 422


def _exposition(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> str:
    labels = 'model_name="llama",engine="0"'
    lines = [
        "# TYPE vllm:spec_decode_num_drafts counter",
        f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts}",
        f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {draft_tokens}",
        f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {accepted}",
    ]
    lines += [
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {v}'
        for i, v in enumerate(per_pos)
    ]
    lines.append('vllm:num_requests_running{model_name="llama"} 3')
    return "\n".join(lines) + "\n"


def test_prometheus_pushes_become_counter_deltas(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    headers = acme.headers(Role.ingest)
    url = f"{base}/acceptance/prometheus"
    first = client.post(url, content=_exposition(10, 40, 25, [9, 8, 5, 3]), headers=headers)
    assert first.status_code == 200, first.text
    assert (first.json()["inserted"], first.json()["baseline_label_sets"]) == (0, 1)  # the baseline
    second = client.post(url, content=_exposition(15, 60, 33, [13, 10, 7, 3]), headers=headers)
    assert second.json()["inserted"] == 1
    repeat = client.post(url, content=_exposition(15, 60, 33, [13, 10, 7, 3]), headers=headers)
    assert repeat.json()["inserted"] == 0  # no counter moved: nothing stored twice
    reset = client.post(url, content=_exposition(2, 8, 5, [2, 2, 1, 0]), headers=headers)  # server restarted
    assert reset.json()["inserted"] == 1
    session = db.new_session()
    rows = session.scalars(select(AcceptanceRecordRow).order_by(AcceptanceRecordRow.id)).all()
    deltas = [(r.verify_steps, r.drafted_tokens, r.accepted_tokens, r.accepted_per_position) for r in rows]
    session.close()
    assert deltas == [(5, 20, 8, [4, 2, 2, 0]), (2, 8, 5, [2, 2, 1, 0])]
    garbage = client.post(url, content="this is not prometheus {{{", headers=headers)
    assert garbage.status_code == 422


@pytest.mark.parametrize("size", [1, 3, 20])
def test_stored_rows_equal_what_was_sent(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database, size: int
) -> None:
    """Each write path (a VALUES list for tiny batches, column arrays past 50 parameters on
    PostgreSQL) stores every field as sent, optional ones left out included."""
    acme, _ = tenants
    base = _deployment(client, acme)
    rng = random.Random(size)
    records = [native_record(i, rng) for i in range(size)]
    for i, record in enumerate(records):
        if i % 2:
            for optional in ("prompt_tokens", "ttft_ms", "inter_token_ms", "total_ms"):
                record.pop(optional)
        else:
            record.update(category="sql", drafter_version=3)
    response = client.post(f"{base}/acceptance", json={"records": records}, headers=acme.headers(Role.ingest))
    assert response.json()["inserted"] == size, response.text
    session = db.new_session()
    try:
        stored = {row.request_id: row for row in session.scalars(select(AcceptanceRecordRow))}
    finally:
        session.close()
    assert sorted(stored) == sorted(r["request_id"] for r in records)
    for record in records:
        row = stored[record["request_id"]]
        for field in ("drafted_tokens", "accepted_tokens", "verify_steps", "generated_tokens", "k", "arm"):
            assert getattr(row, field) == record[field], field
        assert row.accepted_per_position == record["accepted_per_position"]
        assert row.prompt_tokens == record.get("prompt_tokens")
        assert row.category == record.get("category")
        assert row.drafter_version == record.get("drafter_version")
        for field in ("ttft_ms", "inter_token_ms", "total_ms"):
            assert (
                getattr(row, field) == pytest.approx(record[field])
                if field in record
                else getattr(row, field) is None
            )
        when = row.created_at if row.created_at.tzinfo else row.created_at.replace(tzinfo=UTC)
        assert when == datetime.fromisoformat(record["created_at"])


def test_records_sent_under_the_serving_key_are_marked_as_the_fleets(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, _ = tenants
    base = _deployment(client, acme)
    rng = random.Random(3)
    # One record (PostgreSQL's one-statement insert) and 100 (its COPY) under each role.
    sizes = {Role.serving: 0, Role.ingest: 1000, Role.admin: 2000}
    for role, offset in sizes.items():
        for start, count in ((offset, 1), (offset + 1, 100)):
            batch = {"records": [native_record(i, rng) for i in range(start, start + count)]}
            reply = client.post(f"{base}/acceptance", json=batch, headers=acme.headers(role))
            assert reply.status_code == 200, reply.text
    session = db.new_session()
    try:
        rows = session.execute(
            select(AcceptanceRecordRow.request_id, AcceptanceRecordRow.from_serving_key)
        ).all()
    finally:
        session.close()
    marked = {int(request_id.removeprefix("req-")) // 1000 for request_id, flag in rows if flag}
    unmarked = {int(request_id.removeprefix("req-")) // 1000 for request_id, flag in rows if not flag}
    assert len(rows) == 303 and marked == {0} and unmarked == {1, 2}
