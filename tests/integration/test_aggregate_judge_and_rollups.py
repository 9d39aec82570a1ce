"""Edge aggregates in the canary judge and the rollups, on real databases: the same requests sent
as window aggregates or as records give the same decision and figures, and the same counts in the
stats API; records and windows mix in one canary; each window is folded once; sampled records and
windows sent under a non-serving key are not judged."""

from __future__ import annotations

import itertools
import math
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from controlplane.canary.evaluate import (
    advance_judge,
    evaluate_deployment,
    record_shadow_result,
    recount_judge,
)
from controlplane.canary.service import start_canary
from controlplane.config import Settings
from controlplane.db.models import (
    AcceptanceRollupRow,
    Canary,
    Deployment,
    DrafterState,
    DrafterVersion,
    EdgeWindowRow,
    Role,
)
from controlplane.ingest import rollups
from controlplane.ingest.aggregate_rollups import fold_aggregate_rollups
from controlplane.ingest.aggregates import EdgeWindow, WindowAccumulator
from controlplane.ingest.record import AcceptanceRecord
from controlplane.ingest.rollups import (
    MAX_ROLLUP_CATEGORIES,
    OVERFLOW_CATEGORY,
    QUANTILES,
    RollupDelta,
    apply_deltas_by_deployment,
    hist_quantiles,
)
from tests.conftest import Database, Tenant, add_deployment, add_deployment_to
from tests.fleet.canary_setup import arm_records, passing_shadow

K = 4
BASE = "/v1/accounts/acme/deployments"
POLICY = {"candidate_weight": 0.3, "baseline_weight": 0.3}
Native = dict[str, Any]


def _deployment(client: TestClient, db: Database, tenant: Tenant, name: str) -> int:
    admin = tenant.headers(Role.admin)
    created = client.post(
        BASE,
        json={
            "target_model": "reference-target",
            "deployment_id": name,
            "draft_model": "reference-drafter",
            "draft_token_count": K,
        },
        headers=admin,
    )
    assert created.status_code == 201, created.text
    assert client.patch(f"{BASE}/{name}/canary-policy", json=POLICY, headers=admin).status_code == 200
    with db.new_session() as session:
        return int(
            session.scalars(
                select(Deployment.id).where(
                    Deployment.name == name, Deployment.account_id == tenant.account_id
                )
            ).one()
        )


def _live_canary(db: Database, settings: Settings, deployment_id: int) -> int:
    with db.new_session() as session:
        version = DrafterVersion(
            deployment_id=deployment_id,
            version=1,
            artifact_path="/artifacts/v1",
            artifact_sha256=f"{1:064d}",
            state=DrafterState.candidate,
            training_metrics={},
            eval_metrics={},
        )
        session.add(version)
        session.flush()
        canary, _job = start_canary(session=session, version=version)
        session.commit()
        canary_id = canary.id
    with db.new_session() as session:
        phase = record_shadow_result(
            session=session, canary_id=canary_id, result=passing_shadow(), settings=settings
        )
        session.commit()
    assert phase == "live"
    return canary_id


def _winning_traffic(seed: int, scale: int = 1) -> list[Native]:
    """The candidate faster than both other arms in both categories; arm shares fit the weights."""
    out: list[Native] = []
    for category, offset in (("prose", 0), ("code", 50_000)):
        start = seed * 100_000 + offset
        for arm, n, tps, ms, hit in (
            ("live", 80, 1.4, 5.0, 0.12),
            ("canary:1", 60, 2.8, 2.4, 0.55),
            ("baseline", 60, 1.0, 5.4, 0.0),
        ):
            version = 1 if arm.startswith("canary:") else None
            records = arm_records(arm, n * scale, tps=tps, ms=ms, hit=hit, version=version, start=start)
            out += [{**r, "category": category} for r in records]
            start += 1000
    random.Random(seed).shuffle(out)
    return out


def _with_latencies(records: list[Native], seed: int) -> list[Native]:
    """Records with total and TTFT latencies too (the rollups' histograms and decode throughput)."""
    rng = random.Random(seed)
    out = []
    for record in records:
        ttft = rng.lognormvariate(3.0, 0.5)
        out.append({**record, "ttft_ms": ttft, "total_ms": ttft + rng.lognormvariate(5.5, 0.6)})
    return out


def _record(native: Native) -> AcceptanceRecord:
    return AcceptanceRecord(**native)


def _post_records(client: TestClient, tenant: Tenant, name: str, records: list[Native]) -> None:
    for start in range(0, len(records), 200):
        reply = client.post(
            f"{BASE}/{name}/acceptance",
            json={"format": "native", "records": records[start : start + 200]},
            headers=tenant.headers(Role.serving),
        )
        assert reply.status_code == 200, reply.text


# Each posted window takes the next minute, so that no two windows of the edge share one.
_MINUTES = itertools.count(1)


def _post_windows(
    client: TestClient,
    tenant: Tenant,
    name: str,
    records: list[Native],
    *,
    windows: int = 4,
    role: Role = Role.serving,
) -> list[int]:
    """``records`` summed into ``windows`` consecutive one-minute windows of one edge; returns
    their edge-window ids."""
    ids = []
    per_window = math.ceil(len(records) / windows)
    for start in range(0, len(records), per_window):
        acc = WindowAccumulator(k=K)
        for native in records[start : start + per_window]:
            acc.add(name, _record(native))
        minute = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(hours=3)
        window = EdgeWindow("edge-a", minute + timedelta(minutes=next(_MINUTES)), 60, acc.aggregates())
        reply = client.post(
            f"/v1/accounts/{tenant.name}/aggregates", json=window.to_dict(), headers=tenant.headers(role)
        )
        assert reply.status_code == 200 and reply.json()["stored"], reply.text
        ids.append(int(reply.json()["edge_window_id"]))
    return ids


def _evaluate(db: Database, settings: Settings, deployment_id: int) -> dict[str, Any]:
    with db.new_session() as session:
        outcome = evaluate_deployment(session=session, deployment_id=deployment_id, settings=settings)
        session.commit()
    assert outcome is not None
    return outcome


def _arms(db: Database, canary_id: int) -> dict[str, Any]:
    with db.new_session() as session:
        return dict(session.get_one(Canary, canary_id).arms)


# Figures of when a tick ran, not of the traffic.
_CLOCK_FIGURES = {"elapsed_s"}


def _assert_close(got: Any, want: Any, where: str = "") -> None:
    """Equal structure, equal strings and integers, floats within float-rounding distance."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, got, want)
        for key in set(want) - _CLOCK_FIGURES:
            _assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_close(a, b, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9), where
    else:
        assert got == want, where


def test_a_canary_on_aggregates_decides_as_on_the_same_requests_as_records(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    traffic = _winning_traffic(1)
    canaries = {}
    for name in ("by-records", "by-windows"):
        deployment_id = _deployment(client, db, acme, name)
        canaries[name] = (deployment_id, _live_canary(db, settings, deployment_id))
    _post_records(client, acme, "by-records", traffic)
    _post_windows(client, acme, "by-windows", traffic)
    by_records = _evaluate(db, settings, canaries["by-records"][0])
    by_windows = _evaluate(db, settings, canaries["by-windows"][0])
    assert by_records["decision"] == by_windows["decision"] == "promote", (by_records, by_windows)
    assert by_windows["reason"] == by_records["reason"]
    record_arms, window_arms = (_arms(db, canaries[name][1]) for name in ("by-records", "by-windows"))
    # The decision's figures (arm counts, comparisons, confidence bounds) and each category's.
    _assert_close(window_arms["decision_figures"], record_arms["decision_figures"], "decision_figures")
    _assert_close(window_arms["per_category"], record_arms["per_category"], "per_category")
    judged = window_arms["per_category_judge"]
    assert judged["records"] == judged["aggregated_requests"] == len(traffic)
    assert record_arms["per_category_judge"]["aggregated_requests"] == 0


def test_windows_are_folded_once_and_whole_up_to_the_cap(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    deployment_id = _deployment(client, db, acme, "svc")
    before_live = _post_windows(client, acme, "svc", _winning_traffic(2), windows=1)
    canary_id = _live_canary(db, settings, deployment_id)
    traffic = _winning_traffic(3)  # 400 requests
    first = _post_windows(client, acme, "svc", traffic[:300], windows=3)
    with db.new_session() as session:
        canary = session.get_one(Canary, canary_id)
        # Seen, not yet settled: in the view only.
        view = advance_judge(session=session, canary=canary, max_requests=10_000)
        assert view.records == 300 and canary.judge_state["tally"]["records"] == 0
        assert canary.judge_state["edge_watermark"] == before_live[0]
        session.commit()  # SQLite: the ingest below writes from another connection
        second = _post_windows(client, acme, "svc", traffic[300:], windows=3)
        for _ in range(3):
            view = advance_judge(session=session, canary=canary, max_requests=10_000)
            assert view.records == 400  # never a window twice, nor the one from before going live
            assert (
                view.to_state()
                == recount_judge(session=session, canary=canary, max_requests=10_000).to_state()
            )
        assert canary.judge_state["tally"]["records"] == 400
        assert canary.judge_state["edge_watermark"] == canary.judge_state["edge_horizon"] == second[-1]
        # A state written before windows were judged starts at the canary's start.
        canary.judge_state = {
            key: value for key, value in canary.judge_state.items() if not key.startswith("edge_")
        } | {"tally": None}
        view = advance_judge(session=session, canary=canary, max_requests=10_000)
        assert view.records == view.aggregated_requests == 400
        # The cap: whole windows (100 requests each) while the tally holds fewer than 150.
        canary.judge_state = {}
        for _ in range(3):
            view = advance_judge(session=session, canary=canary, max_requests=150)
            assert view.records == 200
        assert canary.judge_state["tally"]["records"] == 200
        assert canary.judge_state["edge_watermark"] == first[1]
        # A canary far behind reads a few rows a tick, in whole windows (six rows each here).
        canary.judge_state = {}
        seen = [
            advance_judge(session=session, canary=canary, max_requests=10_000, window_row_limit=8).records
            for _ in range(10)
        ]
        assert seen == sorted(seen) and seen[-1] == canary.judge_state["tally"]["records"] == 400


def test_records_and_windows_mix_and_only_trusted_unsampled_input_is_judged(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant], settings: Settings
) -> None:
    acme = tenants[0]
    traffic = _winning_traffic(4)
    ids = {name: _deployment(client, db, acme, name) for name in ("mixed", "by-records")}
    canaries = {name: _live_canary(db, settings, deployment_id) for name, deployment_id in ids.items()}
    _post_records(client, acme, "by-records", traffic)
    half = len(traffic) // 2
    _post_records(client, acme, "mixed", traffic[:half])
    _post_windows(client, acme, "mixed", traffic[half:], windows=2)
    # The edge's raw samples of its aggregated traffic: kept, never judged twice.
    samples = [
        {**r, "request_id": f"sample-{r['request_id']}", "counted_in_aggregate": True} for r in traffic[half:]
    ]
    _post_records(client, acme, "mixed", samples[::3])
    # A window an ingest key sends, in which the candidate loses badly, steers nothing.
    forged = arm_records("canary:1", 300, tps=1.0, ms=40.0, hit=0.01, version=1, start=900_000)
    _post_windows(client, acme, "mixed", forged, windows=1, role=Role.ingest)
    mixed = _evaluate(db, settings, ids["mixed"])
    reference = _evaluate(db, settings, ids["by-records"])
    assert mixed["decision"] == reference["decision"] == "promote", (mixed, reference)
    mixed_arms, reference_arms = _arms(db, canaries["mixed"]), _arms(db, canaries["by-records"])
    judged = mixed_arms["per_category_judge"]
    assert judged["records"] == len(traffic) and judged["aggregated_requests"] == len(traffic) - half
    counts = mixed_arms["decision_figures"]["arm_counts"]
    for arm, figures in reference_arms["decision_figures"]["arm_counts"].items():
        assert counts[arm]["requests"] == figures["requests"]
        assert counts[arm]["ms_per_token"] == pytest.approx(figures["ms_per_token"], rel=1e-6)


def _stats_total(client: TestClient, tenant: Tenant, name: str) -> dict[str, Any]:
    reply = client.get(f"{BASE}/{name}/stats", headers=tenant.headers(Role.viewer))
    assert reply.status_code == 200, reply.text
    body = reply.json()
    return {"total": body["total"], "per_category": {c["category"]: c for c in body["per_category"]}}


def _fold(db: Database, **limits: int) -> int:
    with db.new_session() as session:
        fold = fold_aggregate_rollups(session=session, **limits)
        session.commit()
    return fold.windows


def test_rollups_from_windows_count_as_the_same_records_exactly_once(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant]
) -> None:
    acme = tenants[0]
    traffic = _with_latencies(_winning_traffic(5), seed=5)
    for name in ("by-records", "by-windows"):
        _deployment(client, db, acme, name)
    _post_records(client, acme, "by-records", traffic)
    windows = _post_windows(client, acme, "by-windows", traffic, windows=3)
    # A fold that is rolled back marks nothing: its windows are still pending.
    with db.new_session() as session:
        assert fold_aggregate_rollups(session=session).windows == 3
        session.rollback()
    # Whole windows, as many as fit the aggregate budget (at least one).
    assert _fold(db, aggregate_limit=1) == 1
    assert _fold(db) == 2
    assert _fold(db) == 0  # exactly once
    with db.new_session() as session:
        pending = session.scalar(
            select(func.count()).select_from(EdgeWindowRow).where(EdgeWindowRow.rolled_up_at.is_(None))
        )
        assert pending == 0 and windows
    want, got = _stats_total(client, acme, "by-records"), _stats_total(client, acme, "by-windows")
    exact = ("requests", "drafted_tokens", "accepted_tokens", "verify_steps", "generated_tokens", "hit_rate")
    for name in (*exact, "per_position_acceptance", "mean_accepted_length"):
        assert got["total"][name] == want["total"][name], name
    assert got["total"]["requests"] == len(traffic)
    for name in ("total_latency_ms_p50", "total_latency_ms_p95", "ttft_ms_p50", "inter_token_latency_ms_p95"):
        # Deterministic: seeded latencies (random.Random(5)); the windows' quantiles come from merged
        # sketches, the records' from exact values, hence a tolerance rather than equality.
        assert got["total"][name] == pytest.approx(want["total"][name], rel=0.06), name
    assert got["total"]["decode_tokens_per_s"] == pytest.approx(
        want["total"]["decode_tokens_per_s"], rel=0.01
    )
    assert set(got["per_category"]) == set(want["per_category"]) == {"prose", "code"}
    for category, figures in want["per_category"].items():
        assert got["per_category"][category]["requests"] == figures["requests"]
        assert got["per_category"][category]["accepted_tokens"] == figures["accepted_tokens"]
    # One more window: only it is added.
    more = _with_latencies(_winning_traffic(6), seed=6)[:50]
    _post_windows(client, acme, "by-windows", more, windows=1)
    assert _fold(db) == 1 and _fold(db) == 0
    assert _stats_total(client, acme, "by-windows")["total"]["requests"] == len(traffic) + 50


def test_one_fold_over_many_deployments_keeps_each_ones_category_cap(
    client: TestClient, db: Database, tenants: tuple[Tenant, Tenant]
) -> None:
    acme = tenants[0]
    names = ("wide", "narrow")
    for name in names:
        _deployment(client, db, acme, name)
    # Two more categories than the rollups keep for "wide"; two for "narrow"; one window.
    categories = {"wide": [f"c{i:02d}" for i in range(MAX_ROLLUP_CATEGORIES + 2)], "narrow": ["a", "b"]}
    acc = WindowAccumulator(k=K)
    for name in names:
        for i, category in enumerate(categories[name]):
            for native in arm_records("live", 3, tps=2.0, ms=3.0, hit=0.5, version=None, start=1000 * i):
                acc.add(name, _record({**native, "category": category}))
    minute = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(hours=4)
    body = EdgeWindow("edge-b", minute, 60, acc.aggregates()).to_dict()
    reply = client.post(f"/v1/accounts/{acme.name}/aggregates", json=body, headers=acme.headers(Role.ingest))
    assert reply.status_code == 200, reply.text
    assert _fold(db) == 1
    wide, narrow = (_stats_total(client, acme, name) for name in names)
    assert wide["total"]["requests"] == 3 * (MAX_ROLLUP_CATEGORIES + 2)
    # Categories take the free places in name order; the last two are summed as "other".
    assert set(wide["per_category"]) == {*categories["wide"][:MAX_ROLLUP_CATEGORIES], OVERFLOW_CATEGORY}
    assert wide["per_category"][OVERFLOW_CATEGORY]["requests"] == 6
    assert set(narrow["per_category"]) == {"a", "b"} and narrow["total"]["requests"] == 6


def _rollup_delta(requests: int, hist: dict[int, int]) -> RollupDelta:
    return RollupDelta(
        requests=requests,
        drafted_tokens=4 * requests,
        accepted_tokens=3 * requests,
        verify_steps=requests,
        generated_tokens=4 * requests,
        total_ms_sum=1.5 * requests,
        timed_requests=requests,
        accepted_per_position=[requests, requests // 2],
        total_ms_hist=dict(hist),
    )


@pytest.mark.parametrize("db", ["postgres"], indirect=True)  # the read-before-lock path is PostgreSQL's
def test_a_fold_adds_to_rows_other_writers_change_between_its_read_and_its_locks(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL's many-deployment path reads rows before locking them: a row another writer
    changes, deletes or creates in between is read again once locked, and nothing is lost."""
    assert db.dialect == "postgresql"
    session = db.new_session()
    a = add_deployment(session, "interleaved", "a").id
    b = add_deployment_to(session, session.get_one(Deployment, a).account_id, "b").id
    first_minute = datetime(2026, 3, 4, 10, 1, tzinfo=UTC)
    second_minute = first_minute + timedelta(minutes=1)
    first = {d: {(first_minute, "live", 0, ""): _rollup_delta(10, {100: 4, 102: 6})} for d in (a, b)}
    apply_deltas_by_deployment(session=session, deltas=first)
    hour = (a, 3600, first_minute.replace(minute=0))
    five_minutes = (b, 300, first_minute.replace(minute=0))
    created_minute = (a, 60, second_minute)

    read_rows = rollups._read_rows
    calls = []

    def interleaved(cursor: Any, keys: Any) -> Any:
        found = read_rows(cursor, keys)
        # After the first read, before the locks: another writer's changes (in a subtransaction
        # here, so its rows get another xmin, as a concurrent writer's would).
        if not calls:
            cursor.execute("SAVEPOINT other_writer")
            cursor.execute(
                "UPDATE acceptance_rollups SET requests = requests + 1000, total_ms_hist = '[99, 7]' "
                "WHERE deployment_id = %s AND resolution_s = %s AND bucket_start = %s",
                hour,
            )
            cursor.execute(
                "DELETE FROM acceptance_rollups WHERE deployment_id = %s AND resolution_s = %s "
                "AND bucket_start = %s",
                five_minutes,
            )
            cursor.execute(
                "INSERT INTO acceptance_rollups (deployment_id, resolution_s, bucket_start, arm, "
                "drafter_version, category, requests, drafted_tokens, accepted_tokens, verify_steps, "
                "generated_tokens, prompt_tokens, total_ms_sum, timed_requests, accepted_per_position, "
                "inter_token_hist, total_ms_hist, ttft_hist) VALUES (%s, %s, %s, 'live', 0, '', 5, 0, 0, "
                "0, 0, 0, 0.0, 0, '[5]', '[]', '[101, 5]', '[]')",
                created_minute,
            )
            cursor.execute("RELEASE SAVEPOINT other_writer")
        calls.append(len(keys))
        return found

    monkeypatch.setattr(rollups, "_read_rows", interleaved)
    second = {d: {(second_minute, "live", 0, ""): _rollup_delta(20, {101: 1, 103: 2})} for d in (a, b)}
    apply_deltas_by_deployment(session=session, deltas=second)
    assert calls == [10, 3]  # the rows changed, deleted and created in between are read again

    def row(deployment_id: int, resolution: int, start: datetime) -> Any:
        r = AcceptanceRollupRow
        return session.execute(
            select(
                r.requests, r.accepted_per_position, r.total_ms_hist, r.total_ms_p50, r.total_ms_p95
            ).where(r.deployment_id == deployment_id, r.resolution_s == resolution, r.bucket_start == start)
        ).one()

    want = {
        hour: (1030, [30, 15], [99, 7, 0, 1, 0, 2]),  # what the other writer left, then the fold
        five_minutes: (20, [20, 10], [101, 1, 0, 2]),  # deleted: the second minute's delta alone
        created_minute: (25, [25, 10], [101, 6, 0, 2]),  # created by the other writer, added to
        (b, 3600, first_minute.replace(minute=0)): (30, [30, 15], [100, 4, 1, 6, 2]),  # untouched
    }
    for (deployment_id, resolution, start), (requests, positions, hist) in want.items():
        got = row(deployment_id, resolution, start)
        assert (got.requests, got.accepted_per_position, got.total_ms_hist) == (requests, positions, hist)
        assert [got.total_ms_p50, got.total_ms_p95] == hist_quantiles(hist, QUANTILES)
    session.close()
