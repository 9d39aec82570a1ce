"""The Celery app's reliability settings and that every scheduled task exists."""

from __future__ import annotations

from workers import tasks  # noqa: F401  (registers the tasks)
from workers.celery_app import QUEUE_DEFAULT, QUEUE_GPU, VISIBILITY_TIMEOUT_S, celery_app


def test_every_beat_entry_names_a_registered_task() -> None:
    scheduled = {entry["task"] for entry in celery_app.conf.beat_schedule.values()}
    assert scheduled <= set(celery_app.tasks), scheduled - set(celery_app.tasks)
    assert "drift.monitor_all" in scheduled


def test_tasks_survive_worker_loss() -> None:
    conf = celery_app.conf
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    assert conf.broker_transport_options["visibility_timeout"] == VISIBILITY_TIMEOUT_S >= 3600
    assert {q.name for q in conf.task_queues} == {QUEUE_DEFAULT, QUEUE_GPU}
