"""The Celery app's reliability settings and that every scheduled task exists."""

from __future__ import annotations

import pytest

from workers import canary_tasks, tasks  # noqa: F401  (registers the tasks)
from workers.celery_app import QUEUE_DEFAULT, QUEUE_GPU, VISIBILITY_TIMEOUT_S, celery_app, make_celery

REDIS = "redis://127.0.0.1:6379/0"


def _app_with(monkeypatch: pytest.MonkeyPatch, **env: str) -> object:
    from controlplane.config import get_settings

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    try:
        return make_celery()
    finally:
        get_settings.cache_clear()


def test_every_beat_entry_names_a_registered_task() -> None:
    scheduled = {entry["task"] for entry in celery_app.conf.beat_schedule.values()}
    assert scheduled <= set(celery_app.tasks), scheduled - set(celery_app.tasks)
    assert "drift.monitor_all" in scheduled


def test_tasks_survive_worker_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    conf = _app_with(monkeypatch, CONTROLPLANE_BROKER_URL=REDIS).conf  # type: ignore[attr-defined]
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    assert conf.broker_transport_options["visibility_timeout"] == VISIBILITY_TIMEOUT_S >= 3600
    assert {q.name for q in conf.task_queues} == {QUEUE_DEFAULT, QUEUE_GPU}


def test_the_embedded_broker_gets_no_redis_options(monkeypatch: pytest.MonkeyPatch) -> None:
    # kombu's SQLAlchemy transport passes its options to create_engine, which refuses unknown ones.
    conf = _app_with(monkeypatch, CONTROLPLANE_BROKER_URL="sqla+sqlite:///var/broker.db").conf  # type: ignore[attr-defined]
    assert conf.broker_transport_options == {}


def test_beat_resends_lost_realign_jobs() -> None:
    entries = {entry["task"]: entry["schedule"] for entry in celery_app.conf.beat_schedule.values()}
    assert "jobs.resend_stale_queued" in entries and 10 <= entries["jobs.resend_stale_queued"] <= 60
    assert celery_app.tasks["jobs.resend_stale_queued"].name == "jobs.resend_stale_queued"


def test_the_visibility_timeout_comes_from_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    app = _app_with(monkeypatch, CONTROLPLANE_BROKER_URL=REDIS, CONTROLPLANE_CELERY_VISIBILITY_TIMEOUT_S="4")
    options = app.conf.broker_transport_options  # type: ignore[attr-defined]
    assert options["visibility_timeout"] == 4
    # A short timeout is only useful if abandoned messages are looked for as often.
    assert options["unacked_restore_interval"] <= 4 and options["unacked_restore_throttle"] == 1
