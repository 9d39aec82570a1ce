"""The pure recovery rules of realign jobs: backoff, leases, the attempt cap, the sweep's cadence,
the time budget against the broker's visibility timeout, and the bounds of realign params."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from controlplane.config import Settings
from controlplane.errors import ValidationProblem
from controlplane.jobs.recovery import (
    MAX_RETRY_DELAY_S,
    after_failed_attempt,
    heartbeat_interval_s,
    lease_lapsed,
    next_attempt_time,
    retry_delay_s,
)
from controlplane.jobs.service import validate_realign_params
from workers.celery_app import celery_app, job_sweep_interval_s
from workers.tasks import time_budget_s

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def test_backoff_doubles_per_failed_attempt_and_is_capped() -> None:
    assert [retry_delay_s(n, base_s=60) for n in (1, 2, 3, 4)] == [60.0, 120.0, 240.0, 480.0]
    assert retry_delay_s(1, base_s=0.5) == 0.5
    assert retry_delay_s(40, base_s=3600) == MAX_RETRY_DELAY_S
    assert retry_delay_s(10**9, base_s=1) == MAX_RETRY_DELAY_S  # no overflow on absurd counts
    with pytest.raises(ValueError, match="at least 1"):
        retry_delay_s(0, base_s=60)


def test_attempts_are_capped() -> None:
    steps = [after_failed_attempt(attempts=n, max_attempts=3, backoff_base_s=10) for n in (1, 2, 3, 4)]
    assert [s.retry for s in steps] == [True, True, False, False]
    assert [s.delay_s for s in steps[:2]] == [10.0, 20.0]
    assert after_failed_attempt(attempts=1, max_attempts=1).retry is False  # one attempt: never retried
    assert next_attempt_time(NOW, steps[1]) == NOW + timedelta(seconds=20)


def test_a_lease_lapses_when_it_runs_out_or_was_never_taken() -> None:
    assert lease_lapsed(None, now=NOW)
    assert lease_lapsed(NOW, now=NOW)
    assert lease_lapsed(NOW - timedelta(seconds=1), now=NOW)
    assert not lease_lapsed(NOW + timedelta(seconds=1), now=NOW)


def test_the_heartbeat_and_the_sweep_keep_pace_with_the_lease() -> None:
    assert heartbeat_interval_s(60) == 20.0 and heartbeat_interval_s(3) == 1.0
    # At least twice per lease (never more often than twice a second), at most every 30 s.
    assert job_sweep_interval_s(60) == 30.0
    assert job_sweep_interval_s(600) == 30.0
    assert job_sweep_interval_s(2) == 1.0
    assert job_sweep_interval_s(0.2) == 0.5
    sweep = celery_app.conf.beat_schedule["realign-resend"]
    assert sweep["task"] == "jobs.resend_stale_queued"
    assert sweep["schedule"] == job_sweep_interval_s(Settings().realign_lease_s) == 30.0


def _settings(**values: Any) -> Settings:
    return Settings(environment="test", **values)


def test_settings_refuse_a_budget_that_outlasts_the_visibility_timeout() -> None:
    with pytest.raises(ValueError) as caught:
        _settings(celery_visibility_timeout_s=1000, realign_max_wait_s=600, realign_time_budget_s=301)
    message = str(caught.value)
    assert "realign_time_budget_s" in message and "celery_visibility_timeout_s" in message
    assert "at most 300 s" in message  # 1000 - 600 - a margin of 10%
    ok = _settings(celery_visibility_timeout_s=1000, realign_max_wait_s=600, realign_time_budget_s=300)
    assert ok.realign_budget_ceiling_s == 300.0
    assert _settings(celery_visibility_timeout_s=400, realign_max_wait_s=0).realign_margin_s == 60.0
    assert _settings().realign_budget_ceiling_s == 6 * 3600 - 600 - 0.1 * 6 * 3600


def test_the_worker_clamps_its_budget_below_the_visibility_timeout() -> None:
    settings = _settings(celery_visibility_timeout_s=900, realign_max_wait_s=600)  # ceiling 210 s
    assert time_budget_s({}, settings) == 210.0  # the worker's default (240 s) does not fit
    assert time_budget_s({"time_budget_s": 10_000}, settings) == 210.0  # an old, unchecked job
    assert time_budget_s({"time_budget_s": 30}, settings) == 30.0
    tight = _settings(celery_visibility_timeout_s=100, realign_max_wait_s=60)
    assert time_budget_s({}, tight) == 1.0  # the ceiling is below a second: the floor holds


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"time_budget_s": 0}, "time_budget_s"),
        ({"time_budget_s": True}, "time_budget_s"),
        ({"time_budget_s": float("nan")}, "time_budget_s"),
        ({"time_budget_s": "60"}, "time_budget_s"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**40}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"replay_share": 1}, "replay_share"),
        ({"replay_share": -0.1}, "replay_share"),
        ({"max_traces": 0}, "max_traces"),
        ({"max_traces": 10**9}, "max_traces"),
        ({"since": "yesterday"}, "since"),
        ({"since": "2026-01-01T00:00:00Z" + " " * 100}, "since"),
        ({"since": "2999-01-01T00:00:00Z"}, "since"),
        ({"since": 20260101}, "since"),
        ({"learning_rate": 1}, "params"),
    ],
)
def test_realign_params_are_bounded_and_the_field_is_named(params: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationProblem) as caught:
        validate_realign_params(params)
    assert field in caught.value.message
    assert [p["field"] for p in caught.value.details] == [field]


def test_every_bad_param_is_reported_at_once_and_good_ones_are_normalised() -> None:
    with pytest.raises(ValidationProblem) as caught:
        validate_realign_params({"seed": -1, "replay_share": 2, "bogus": 1})
    assert {p["field"] for p in caught.value.details} == {"seed", "replay_share", "params"}
    clean = validate_realign_params(
        {"since": "2026-01-01T02:00:00+02:00", "seed": 7, "time_budget_s": 30, "max_traces": None}
    )
    assert clean == {"since": "2026-01-01T00:00:00+00:00", "seed": 7, "time_budget_s": 30}


def test_a_budget_past_the_visibility_timeout_is_refused_naming_both() -> None:
    settings = _settings(celery_visibility_timeout_s=1000, realign_max_wait_s=600)
    assert validate_realign_params({"time_budget_s": 300}, settings=settings) == {"time_budget_s": 300}
    with pytest.raises(ValidationProblem) as caught:
        validate_realign_params({"time_budget_s": 301}, settings=settings)
    [problem] = caught.value.details
    assert problem["field"] == "time_budget_s"
    assert "celery_visibility_timeout_s = 1000 s" in problem["message"]
    assert "realign_max_wait_s = 600 s" in problem["message"] and "at most 300 s" in problem["message"]
