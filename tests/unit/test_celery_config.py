"""The Celery app's reliability settings and that every scheduled task exists."""

from __future__ import annotations

import pytest

from controlplane import messaging
from controlplane.messaging import QUEUE_DEFAULT, QUEUE_GPU
from workers import (  # noqa: F401  (registers the tasks)
    actuator_tasks,
    aggregate_tasks,
    canary_tasks,
    scrape_tasks,
    storage_tasks,
    tasks,
)
from workers.celery_app import VISIBILITY_TIMEOUT_S, celery_app, make_celery

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


def _project_tasks() -> set[str]:
    return {name for name in celery_app.tasks if not name.startswith("celery.")}


def _routed_queue(task: str) -> str:
    """The queue Celery's own router sends ``task`` to (what ``.delay`` and beat would use)."""
    route = celery_app.amqp.router.route({}, task, (), {})
    return str(route["queue"].name)


def test_every_registered_task_is_in_the_messaging_table() -> None:
    assert _project_tasks() == set(messaging.TASKS)


@pytest.mark.parametrize(
    ("task", "queue"),
    [
        ("realign.run", "gpu"),
        ("canary.shadow_replay", "gpu"),
        # The judge runs every few seconds: it must never wait behind a training run.
        ("canary.evaluate_all", "default"),
        ("drift.monitor_all", "default"),
        ("drift.monitor_deployment", "default"),
        ("jobs.resend_stale_queued", "default"),
        ("traces.apply_retention", "default"),
    ],
)
def test_each_task_is_routed_to_the_queue_of_what_it_needs(task: str, queue: str) -> None:
    assert task in _project_tasks()
    assert messaging.queue_for(task) == queue
    assert _routed_queue(task) == queue


def test_beat_entries_route_by_the_same_table() -> None:
    for entry in celery_app.conf.beat_schedule.values():
        assert _routed_queue(entry["task"]) == messaging.queue_for(entry["task"]) == QUEUE_DEFAULT


class _RecordingProducer:
    def __init__(self, fail: bool = False) -> None:
        self.sent: list[tuple[str, dict[str, object]]] = []
        self.fail = fail

    def send_task(self, name: str, *args: object, **kwargs: object) -> None:
        if self.fail:
            raise ConnectionError("broker down")
        self.sent.append((name, kwargs))


def test_a_message_goes_to_its_tasks_queue_and_a_refused_send_is_reported() -> None:
    producer = _RecordingProducer()
    sent = messaging.send_all(
        producer,
        [
            messaging.TaskMessage(messaging.SHADOW_REPLAY, (7,)),
            messaging.TaskMessage(messaging.DRIFT_MONITOR_DEPLOYMENT, (3,), countdown=2.0),
        ],
    )
    assert sent == 2
    assert [(name, kw["queue"], kw["args"], kw["countdown"]) for name, kw in producer.sent] == [
        ("canary.shadow_replay", "gpu", [7], None),
        ("drift.monitor_deployment", "default", [3], 2.0),
    ]
    assert (
        messaging.send(_RecordingProducer(fail=True), messaging.TaskMessage(messaging.REALIGN, (1,))) is False
    )


def test_an_unknown_task_name_is_refused_where_the_message_is_made() -> None:
    with pytest.raises(KeyError):
        messaging.TaskMessage("canary.evaluate_everything")
