"""The Celery application: broker and queues from Settings, reliability knobs, beat schedule,
and the one task base every project task uses.

Embedded default broker: kombu's SQLAlchemy transport on a SQLite file (``sqla+sqlite:///``).
It is a real Celery transport that needs no server, survives restarts (messages live in the
file) and works across the separate API, worker and beat processes of ``controlplane up``.
Production uses Redis; only the URL differs.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import Celery, Task
from kombu import Queue

from controlplane.config import get_settings

log = logging.getLogger(__name__)

QUEUE_GPU = "gpu"
QUEUE_DEFAULT = "default"
# Longer than the longest job (realignment is budgeted at minutes; canary replay likewise), so
# Redis never re-delivers a task that is still running.
VISIBILITY_TIMEOUT_S = 6 * 3600
DRIFT_MONITOR_INTERVAL_S = 5.0


def make_celery() -> Celery:
    settings = get_settings()
    settings.ensure_local_dirs()
    app = Celery(
        "controlplane",
        broker=settings.broker_url,
        backend=settings.result_backend_url,
        include=["workers.tasks"],
    )
    app.conf.update(
        task_default_queue=QUEUE_DEFAULT,
        task_queues=(Queue(QUEUE_DEFAULT), Queue(QUEUE_GPU)),
        task_routes={"realign.*": {"queue": QUEUE_GPU}, "canary.*": {"queue": QUEUE_GPU}},
        # A task is acknowledged only once it finished, and a worker that dies mid-task hands it
        # back: jobs must therefore be idempotent (they are keyed by job id).
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT_S},
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_expires=24 * 3600,
        beat_schedule={
            "drift-monitor": {"task": "drift.monitor_all", "schedule": DRIFT_MONITOR_INTERVAL_S},
            "trace-retention": {"task": "traces.apply_retention", "schedule": 3600.0},
        },
        timezone="UTC",
    )
    return app


class TransientError(Exception):
    """A failure worth retrying (database or broker briefly unavailable)."""


class InstrumentedTask(Task):  # type: ignore[misc]
    """Project-wide task base: explicit names, timing logs, retries for transient errors only."""

    autoretry_for = (TransientError,)
    retry_backoff = True
    retry_backoff_max = 300
    retry_jitter = True
    max_retries = 5

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return super().__call__(*args, **kwargs)
        finally:
            log.info("task %s took %.3f s", self.name, time.perf_counter() - started)

    def report_progress(self, fraction: float, message: str) -> None:
        """Publish progress to the result backend (jobs also record it in their row)."""
        if self.request.id:
            self.update_state(state="PROGRESS", meta={"fraction": fraction, "message": message})


celery_app = make_celery()
