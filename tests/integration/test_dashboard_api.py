"""The dashboard's JSON and pages, on both databases, over a seeded drift → realign → canary →
promotion history (tests/e2e/dashboard_seed.py). Access control is in test_access_control.py."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from controlplane.audit.service import record_change
from controlplane.dashboard.routes import CONTENT_SECURITY_POLICY
from controlplane.dashboard.service import RANGES
from controlplane.db.models import Account, Canary
from controlplane.speculation_math import ASSUMED_DRAFTER_COST_RATIO
from tests.conftest import TEST_SECRET, Database
from tests.e2e.dashboard_seed import CANARY_START, SHIFT_AT, SeededHistory, seed_loop_history


@pytest.fixture
def seeded(db: Database) -> SeededHistory:
    session = db.new_session()
    history = seed_loop_history(session, account_name="acme", secret=TEST_SECRET, now=datetime.now(UTC))
    session.commit()
    session.close()
    return history


def _get(client: TestClient, history: SeededHistory, suffix: str, key: str | None = None) -> dict:  # type: ignore[type-arg]
    response = client.get(
        f"/v1/accounts/{history.account}/dashboard{suffix}",
        headers={"Authorization": f"Bearer {key or history.viewer_key}"},
    )
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def test_deployment_view_has_series_markers_and_positions(client: TestClient, seeded: SeededHistory) -> None:
    view = _get(client, seeded, f"/deployments/{seeded.deployment}?range=6h")
    assert view["range"]["bucket_seconds"] == 300
    points = [b for b in view["series"] if b["hit_rate"] is not None]
    assert len(points) >= 70
    assert {m["kind"] for m in view["markers"]} == {"drift", "job", "canary", "promotion"}
    spans = [m for m in view["markers"] if m["kind"] in ("job", "canary")]
    assert all(m["end"] is not None for m in spans)

    # The hit rate falls at the workload shift and recovers after the promotion.
    end = datetime.fromisoformat(view["range"]["end"])

    def mean_hit(minutes_from: int, minutes_to: int) -> float:
        lo, hi = end - timedelta(minutes=minutes_from), end - timedelta(minutes=minutes_to)
        rates = [b["hit_rate"] for b in points if lo <= datetime.fromisoformat(b["start"]) < hi]
        return sum(rates) / len(rates)

    before, drifted, after = (
        mean_hit(340, SHIFT_AT + 10),
        mean_hit(SHIFT_AT - 10, CANARY_START),
        mean_hit(40, 5),
    )
    # Deterministic: the history is drawn from random.Random(seed) (tests/e2e/dashboard_seed.py).
    assert drifted < before - 0.2 and after > drifted + 0.2, (before, drifted, after)

    positions = view["positions"]
    assert len(positions["current"]) == 4 and all(0 < p <= 1 for p in positions["current"])
    assert positions["last_drift_event_baseline"] == [0.82, 0.81, 0.82, 0.8]

    # Same rollups, same figures as the stats API.
    stats = client.get(
        f"/v1/accounts/{seeded.account}/deployments/{seeded.deployment}/stats",
        params={"start": view["range"]["start"], "end": view["range"]["end"], "bucket_seconds": 300},
        headers={"Authorization": f"Bearer {seeded.viewer_key}"},
    ).json()
    assert view["total"]["hit_rate"] == pytest.approx(stats["total"]["hit_rate"])
    whole_day = _get(client, seeded, f"/deployments/{seeded.deployment}?range=24h")
    assert whole_day["total"]["requests"] == seeded.records


def test_every_range_answers_and_a_past_end_shows_nothing(client: TestClient, seeded: SeededHistory) -> None:
    for name, chosen in RANGES.items():
        view = _get(client, seeded, f"/deployments/{seeded.deployment}?range={name}")
        assert view["range"]["bucket_seconds"] == chosen.bucket_seconds
        assert len(view["series"]) <= chosen.seconds // chosen.bucket_seconds
    past = (datetime.now(UTC) - timedelta(days=3)).isoformat()
    response = client.get(
        f"/v1/accounts/{seeded.account}/dashboard/deployments/{seeded.deployment}",
        params={"range": "1h", "end": past},
        headers={"Authorization": f"Bearer {seeded.viewer_key}"},
    )
    assert response.status_code == 200
    assert response.json()["series"] == [] and response.json()["markers"] == []
    bad = client.get(
        f"/v1/accounts/{seeded.account}/dashboard/deployments/{seeded.deployment}?range=2y",
        headers={"Authorization": f"Bearer {seeded.viewer_key}"},
    )
    assert bad.status_code == 422


def test_overview_canaries_promotions_and_jobs(
    client: TestClient, seeded: SeededHistory, db: Database
) -> None:
    # A promotion of a deployment whose name merely starts with "chat" is not chat's.
    session = db.new_session()
    record_change(
        session=session,
        account_id=session.scalars(select(Account.id).where(Account.name == seeded.account)).one(),
        actor="system",
        action="drafter.promote",
        resource=f"accounts/{seeded.account}/deployments/{seeded.deployment}-2/drafters/1",
        before=None,
        after=None,
    )
    session.commit()
    session.close()

    overview = _get(client, seeded, "/overview")
    rows = {row["deployment_id"]: row for row in overview["deployments"]}
    chat, docs = rows[seeded.deployment], rows[seeded.idle_deployment]
    assert (chat["active_drafter_version"], chat["k"], chat["speculation_mode"]) == (2, 4, "draft_model")
    # Deterministic: seeded history, as above.
    assert 0.5 < chat["hit_rate"] < 0.8 and chat["speedup_estimate"] > 1.5
    assert chat["running_jobs"] == 1 and chat["open_drift_events"] == 0
    assert docs["hit_rate"] is None and docs["speedup_estimate"] is None and docs["requests_last_hour"] == 0

    canaries = _get(client, seeded, f"/deployments/{seeded.deployment}/canaries")
    (canary,) = canaries["canaries"]
    assert canary["decision"] == "promote" and canary["candidate_version"] == 2
    assert canary["incumbent_version"] == 1
    assert (
        canary["arms"]["decision_figures"]["arms"]["candidate"]["metrics"]["tokens_per_step"]["ci_low"] == 3.6
    )
    assert set(canaries["arm_series"]) == {"live", "canary:2", "baseline"}
    assert all(canaries["arm_series"]["canary:2"])
    empty = _get(client, seeded, f"/deployments/{seeded.idle_deployment}/canaries")
    assert empty == {"canaries": [], "arm_series": {}, "arm_window": None}

    history = _get(client, seeded, f"/deployments/{seeded.deployment}/promotions")
    assert [(v["version"], v["state"]) for v in history["versions"]] == [(2, "active"), (1, "retired")]
    assert [m["action"] for m in history["moves"]] == ["drafter.promote"]

    jobs = _get(client, seeded, "/jobs")["jobs"]
    assert [j["state"] for j in jobs[:2]] == ["queued", "running"]  # active first, newest first
    assert {j["deployment"] for j in jobs} == {seeded.deployment, seeded.idle_deployment}
    running = next(j for j in jobs if j["id"] == seeded.running_job_id)
    assert any("started" in line for line in running["log"])


def test_overview_estimate_uses_the_measured_drafter_cost_once_a_shadow_replay_has_one(
    client: TestClient, seeded: SeededHistory, db: Database
) -> None:
    def chat_row() -> dict:  # type: ignore[type-arg]
        rows = _get(client, seeded, "/overview")["deployments"]
        return next(row for row in rows if row["deployment_id"] == seeded.deployment)

    assumed = chat_row()
    assert assumed["draft_cost_ratio"] == ASSUMED_DRAFTER_COST_RATIO
    assert assumed["draft_cost_source"].startswith("default")
    session = db.new_session()
    canary = session.get(Canary, seeded.canary_id)
    assert canary is not None
    canary.arms = {**(canary.arms or {}), "shadow": {"costs": {"cost_ratio": 0.3}}}
    session.commit()
    session.close()
    measured = chat_row()
    assert measured["draft_cost_ratio"] == 0.3
    assert measured["draft_cost_source"] == f"canary {seeded.canary_id} shadow replay"
    # A dearer drafter at the same hit rate and k: a smaller expected speed-up.
    assert measured["hit_rate"] == assumed["hit_rate"]
    assert measured["speedup_estimate"] < assumed["speedup_estimate"]


def test_pages_need_no_key_carry_no_data_and_load_nothing_from_elsewhere(client: TestClient) -> None:
    for path in (
        "/dashboard",
        "/dashboard/login",
        "/dashboard/deployments/chat",
        "/dashboard/deployments/chat/canary",
        "/dashboard/jobs",
        "/dashboard/audit",
    ):
        response = client.get(path)
        assert response.status_code == 200, path
        assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert not re.search(r"(src|href)=\"(https?:)?//", response.text), path
    script = client.get("/dashboard/static/dashboard.js")
    assert script.status_code == 200 and "sessionStorage" in script.text
    assert not re.search(r"https?://", script.text)
    bundle = client.get("/dashboard/static/vendor/plotly.min.js")
    assert bundle.status_code == 200 and len(bundle.content) > 1_000_000
    assert client.get("/dashboard/static/..%2Fservice.py").status_code == 404
    assert client.get("/dashboard/static/service.py").status_code == 404
    assert "default-src 'self'" in CONTENT_SECURITY_POLICY and "connect-src 'self'" in CONTENT_SECURITY_POLICY
