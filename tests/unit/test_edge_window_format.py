"""The edge-window format: sums built from requests, validation, the retry digest, sketches, and the
drift detector's equivalence on a stream fed per request and the same stream fed per window."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pytest

from controlplane.drift import MixtureSR, RequestObservation
from controlplane.drift.policy import DriftPolicy
from controlplane.drift.service import DetectorPair
from controlplane.ingest.aggregate_store import aggregate_sums
from controlplane.ingest.aggregates import (
    EdgeWindow,
    EdgeWindowError,
    WindowAccumulator,
    full_matrix,
    parse_edge_window,
    sketch_quantile,
    upper_triangle,
)
from controlplane.ingest.record import AcceptanceRecord

K = 4
NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def served(rng: random.Random, p: float, category: str | None = None, k: int = K) -> AcceptanceRecord:
    steps = rng.randint(6, 30)
    per_step = []
    for _ in range(steps):
        accepted = 0
        while accepted < k and rng.random() < p:
            accepted += 1
        per_step.append(accepted)
    return AcceptanceRecord(
        request_id="-",
        drafted_tokens=steps * k,
        accepted_tokens=sum(per_step),
        verify_steps=steps,
        generated_tokens=sum(per_step) + steps,
        accepted_per_position=[sum(1 for a in per_step if a > j) for j in range(k)],
        k=k,
        inter_token_ms=rng.lognormvariate(2.5, 0.3),
        prompt_tokens=rng.randint(10, 500),
        category=category,
    )


def test_sums_are_the_requests_own_sums() -> None:
    rng = random.Random(0)
    records = [served(rng, 0.7, rng.choice(["prose", "code"])) for _ in range(300)]
    acc = WindowAccumulator(k=K)
    for record in records:
        acc.add("svc", record)
    by_category = {a.category: a for a in acc.aggregates()}
    assert set(by_category) == {"prose", "code"}
    for category, agg in by_category.items():
        mine = [r for r in records if r.category == category]
        assert agg.requests == agg.speculated_requests == len(mine)
        assert agg.accepted_tokens == sum(r.accepted_tokens for r in mine)
        x = np.array(
            [r.accepted_per_position + [r.verify_steps, *r.accepted_per_position[:-1]] for r in mine],
            dtype=float,
        )
        assert agg.accepted_per_position == [int(v) for v in x[:, :K].sum(axis=0)]
        assert agg.reached_per_position == [int(v) for v in x[:, K:].sum(axis=0)]
        assert np.allclose(full_matrix(agg.position_moments, K), x.T @ x)
        d = np.array([r.drafted_tokens for r in mine])
        a = np.array([r.accepted_tokens for r in mine])
        assert agg.spread == [len(mine), d.sum(), a.sum(), (d * d).sum(), (a * d).sum(), (a * a).sum()]
        latencies = sorted(r.inter_token_ms or 0.0 for r in mine)
        median = sketch_quantile(agg.latency["inter_token_ms"], 0.5)
        assert median is not None
        assert abs(median - latencies[len(latencies) // 2]) / latencies[len(latencies) // 2] < 0.05


def _body(**changes: Any) -> dict[str, Any]:
    rng = random.Random(1)
    acc = WindowAccumulator(k=K)
    for _ in range(20):
        acc.add("svc", served(rng, 0.6))
    body = EdgeWindow("edge-1", NOW - timedelta(minutes=5), 60, acc.aggregates()).to_dict()
    body.update(changes)
    return body


def test_a_body_round_trips_and_its_digest_tells_a_retry_from_a_change() -> None:
    body = _body()
    window = parse_edge_window(body, now=NOW)
    again = parse_edge_window(_body(), now=NOW)
    assert window.digest() == again.digest()
    assert window.to_dict()["aggregates"] == body["aggregates"]
    changed = _body()
    changed["aggregates"][0]["requests"] += 1
    assert parse_edge_window(changed, now=NOW).digest() != window.digest()
    # Row order within a window does not make a retry look different.
    two = _body()
    two["aggregates"].append(dict(two["aggregates"][0], deployment="other"))
    swapped = dict(two, aggregates=list(reversed(two["aggregates"])))
    assert parse_edge_window(two, now=NOW).digest() == parse_edge_window(swapped, now=NOW).digest()


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"window_s": 7}, "window_s"),
        ({"window_s": 70}, "window_s"),
        ({"window_start": (NOW - timedelta(minutes=5, seconds=3)).isoformat()}, "window_start"),
        ({"window_start": NOW.isoformat()}, "window_start"),  # not ended yet
        ({"window_start": (NOW - timedelta(days=8)).replace(second=0).isoformat()}, "window_start"),
        ({"window_start": "2026-12-03T11:00:00"}, "window_start"),  # no zone
        ({"edge_id": ""}, "edge_id"),
        ({"format": "edge-window/v9"}, "format"),
        ({"surprise": 1}, "surprise"),
        ({"aggregates": "many"}, "aggregates"),
    ],
)
def test_a_malformed_window_names_its_field(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(EdgeWindowError) as caught:
        parse_edge_window(_body(**changes), now=NOW)
    assert field in [p["field"] for p in caught.value.problems]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"accepted_tokens": 10**6}, "accepted_tokens"),
        ({"requests": -1}, "requests"),
        ({"requests": True}, "requests"),
        ({"reached_per_position": [1, 2]}, "accepted_per_position"),
        ({"accepted_per_position": [10**6, 0, 0, 0]}, "accepted_per_position"),
        ({"position_moments": [0.0] * 5}, "position_moments"),
        ({"position_moments": [float("nan")] * 36}, "position_moments"),
        ({"spread": [1, 2]}, "spread"),
        ({"latency": {"p99": {}}}, "latency"),
        ({"latency": {"total_ms": {"alpha": 0.05, "bins": []}}}, "latency.total_ms"),
        ({"drafter_version": 0}, "drafter_version"),
        ({"deployment": ""}, "deployment"),
        ({"speculated_requests": 10**6}, "speculated_requests"),
    ],
)
def test_a_malformed_aggregate_names_its_field_and_every_problem_is_listed(
    changes: dict[str, Any], field: str
) -> None:
    body = _body()
    good = body["aggregates"][0]
    body["aggregates"] = [dict(good, **changes), dict(good, deployment="other", requests=-5)]
    with pytest.raises(EdgeWindowError) as caught:
        parse_edge_window(body, now=NOW)
    fields = [p["field"] for p in caught.value.problems]
    assert f"aggregates[0].{field}" in fields
    assert "aggregates[1].requests" in fields


def test_upper_triangle_and_full_matrix_invert_each_other() -> None:
    m = np.arange(64, dtype=float).reshape(8, 8)
    m = m + m.T
    assert np.array_equal(full_matrix(upper_triangle(m.tolist()), 4), m)


def _stream(seed: int, n: int, change: int) -> list[AcceptanceRecord]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        category = "code" if rng.random() < 0.3 else "prose"
        base = 0.55 if category == "code" else 0.8
        out.append(served(rng, base * (0.85 if i >= change else 1.0), category))
    return out


def _observation(r: AcceptanceRecord) -> RequestObservation:
    return RequestObservation.from_counts(
        k=K,
        verify_steps=r.verify_steps,
        accepted_per_position=r.accepted_per_position,
        drafted_tokens=r.drafted_tokens,
        accepted_tokens=r.accepted_tokens,
        category=r.category,
    )


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_the_detector_alarms_in_the_same_window_fed_per_request_or_per_window(seed: int) -> None:
    window = 100
    records = _stream(seed, 6_000, change=3_000)
    config = {"arl0": 10_000, "reference_size": 1_000, "n_positions": K, "threshold": "bound"}
    try:
        per_request = MixtureSR(**config)
    except TypeError:  # a detector without a threshold choice runs the bound
        config.pop("threshold")
        per_request = MixtureSR(**config)
    alarm_request = None
    for i, record in enumerate(records):
        per_request.update(_observation(record))
        if per_request.drift_detected:
            alarm_request = i
            break
    per_window = MixtureSR(**config)
    alarm_window = None
    for start in range(0, len(records), window):
        acc = WindowAccumulator(k=K)
        for record in records[start : start + window]:
            acc.add("svc", record)
        groups = []
        for agg in acc.aggregates():
            count, sx, sxx = agg.detector_sums()
            groups.append((agg.category or None, count, sx, sxx))
        per_window.update_window(groups)
        if per_window.drift_detected:
            alarm_window = start // window
            break
    assert alarm_request is not None and alarm_window is not None
    assert alarm_request >= 3_000  # the stream's change, not a false alarm
    assert alarm_window - alarm_request // window in (0, 1)
    # Same reference window (it filled on a window boundary): the same baseline.
    assert per_request.kernel is not None and per_window.kernel is not None
    assert np.allclose(per_request.kernel.p0, per_window.kernel.p0)
    assert per_window.evidence().drop > 0.05


def test_the_detector_pair_reads_stored_sums() -> None:
    rng = random.Random(9)
    policy = DriftPolicy(arl0_requests=10_000, min_drop=0.05, cooldown_s=0, reference_requests=200)
    pair = DetectorPair.new(policy, n_positions=K)
    acc = WindowAccumulator(k=K)
    for _ in range(250):
        acc.add("svc", served(rng, 0.7, "prose"))
    windows = [(a.category, a.speculated_requests, aggregate_sums(a)) for a in acc.aggregates()]
    assert pair.update_window(windows) == 250
    assert not pair.main.in_reference
    assert pair.update_window([("prose", 0, aggregate_sums(acc.aggregates()[0]))]) == 0
