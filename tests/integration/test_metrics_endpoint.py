"""``GET /metrics`` parsed with prometheus_client's own parser, on both databases, over the seeded
drift → realign → canary → promotion history: names, types, labels and values."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from controlplane.db.models import Role
from tests.conftest import TEST_SECRET, Database, make_tenant
from tests.e2e.dashboard_seed import SeededHistory, seed_loop_history

ROOT = Path(__file__).resolve().parents[2]
RECORD = {
    "request_id": "fresh-1",
    "drafted_tokens": 8,
    "accepted_tokens": 6,
    "verify_steps": 2,
    "generated_tokens": 8,
    "accepted_per_position": [2, 2, 1, 1],
    "k": 4,
}


@pytest.fixture
def seeded(db: Database) -> SeededHistory:
    session = db.new_session()
    history = seed_loop_history(session, account_name="acme", secret=TEST_SECRET, now=datetime.now(UTC))
    session.commit()
    session.close()
    return history


def _scrape(client: TestClient, key: str) -> dict[str, tuple[str, list[Sample]]]:
    response = client.get("/metrics", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(response.text)}


def _value(samples: list[Sample], name: str, **labels: str) -> float:
    matches = [
        s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


def test_metrics_follow_the_loop(client: TestClient, seeded: SeededHistory) -> None:
    families = _scrape(client, seeded.viewer_key)
    chat = {"account": "acme", "deployment": seeded.deployment}

    kind, samples = families["specctl_acceptance_records"]
    assert kind == "counter"
    per_arm = {s.labels["arm"]: s.value for s in samples if s.name == "specctl_acceptance_records_total"}
    assert set(per_arm) == {"live", "canary:2", "baseline"}
    assert sum(per_arm.values()) == seeded.records
    _, drafted = families["specctl_drafted_tokens"]
    _, accepted = families["specctl_accepted_tokens"]
    assert _value(accepted, "specctl_accepted_tokens_total", arm="live", **chat) < _value(
        drafted, "specctl_drafted_tokens_total", arm="live", **chat
    )

    kind, samples = families["specctl_hit_ratio"]
    assert kind == "gauge"
    assert 0.5 < _value(samples, "specctl_hit_ratio", arm="live", **chat) < 0.8
    _, samples = families["specctl_accepted_length_tokens"]
    assert 2.5 < _value(samples, "specctl_accepted_length_tokens", arm="live", **chat) < 5

    _, samples = families["specctl_active_drafter_version"]
    assert _value(samples, "specctl_active_drafter_version", **chat) == 2
    _, statistic = families["specctl_drift_statistic"]
    _, threshold = families["specctl_drift_threshold"]
    assert (
        0
        <= _value(statistic, "specctl_drift_statistic", **chat)
        < _value(threshold, "specctl_drift_threshold", **chat)
    )
    kind, samples = families["specctl_drift_events"]
    assert kind == "counter" and _value(samples, "specctl_drift_events_total", **chat) == 1
    _, samples = families["specctl_drift_events_open"]
    assert _value(samples, "specctl_drift_events_open", **chat) == 0

    _, samples = families["specctl_jobs"]
    assert _value(samples, "specctl_jobs", kind="realign", state="succeeded", **chat) == 1
    assert _value(samples, "specctl_jobs", kind="realign", state="running", **chat) == 1
    assert _value(samples, "specctl_jobs", kind="canary", state="succeeded", **chat) == 1
    _, samples = families["specctl_job_progress_ratio"]
    assert _value(samples, "specctl_job_progress_ratio", job_id=str(seeded.running_job_id), **chat) == 0.2
    kind, samples = families["specctl_job_duration_seconds"]
    assert kind == "histogram"
    realign = {"kind": "realign", "state": "succeeded", **chat}
    assert _value(samples, "specctl_job_duration_seconds_count", **realign) == 1
    # The seeded realignment ran 68 minutes: above the 1800 s bucket, inside the 7200 s one.
    assert _value(samples, "specctl_job_duration_seconds_sum", **realign) == pytest.approx(68 * 60)
    assert _value(samples, "specctl_job_duration_seconds_bucket", le="3600.0", **realign) == 0
    assert _value(samples, "specctl_job_duration_seconds_bucket", le="7200.0", **realign) == 1

    kind, samples = families["specctl_canary_decisions"]
    assert kind == "counter"
    assert _value(samples, "specctl_canary_decisions_total", decision="promote", **chat) == 1
    _, samples = families["specctl_drafter_promotions"]
    assert _value(samples, "specctl_drafter_promotions_total", **chat) == 1
    _, samples = families["specctl_drafter_rollbacks"]
    assert _value(samples, "specctl_drafter_rollbacks_total", **chat) == 0

    # Ingesting moves the counter on the next scrape (nothing is cached in the process).
    response = client.post(
        f"/v1/accounts/acme/deployments/{seeded.deployment}/acceptance",
        json={"records": [RECORD]},
        headers={"Authorization": f"Bearer {seeded.ingest_key}"},
    )
    assert response.status_code == 200, response.text
    _, samples = _scrape(client, seeded.viewer_key)["specctl_acceptance_records"]
    assert _value(samples, "specctl_acceptance_records_total", arm="live", **chat) == per_arm["live"] + 1


def test_metrics_need_a_reading_key_and_show_only_its_account(
    client: TestClient, seeded: SeededHistory, db: Database
) -> None:
    assert client.get("/metrics").status_code == 401
    ingest = client.get("/metrics", headers={"Authorization": f"Bearer {seeded.ingest_key}"})
    assert ingest.status_code == 403
    session = db.new_session()
    other = make_tenant(session, "globex")
    session.commit()
    session.close()
    families = _scrape(client, other.keys[Role.viewer])
    accounts = {s.labels.get("account") for _, samples in families.values() for s in samples}
    assert accounts == {"globex"}
    _, samples = families["specctl_acceptance_records"]
    assert samples == []


def test_every_metric_the_grafana_dashboard_queries_is_exposed(
    client: TestClient, seeded: SeededHistory
) -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "specctl.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queried = {name for expr in exprs for name in re.findall(r"specctl_[a-z0-9_]+", expr)}
    exposed = {s.name for _, samples in _scrape(client, seeded.viewer_key).values() for s in samples}
    assert queried and queried <= exposed, queried - exposed
