"""The Celery application: broker and queues from Settings, reliability knobs, beat schedule,
and the one task base every project task uses.

Embedded default broker: kombu's SQLAlchemy transport on a SQLite file (``sqla+sqlite:///``).
It is a real Celery transport that needs no server, survives restarts (messages live in the
file) and works across the separate API, worker and beat processes of ``controlplane up``.
Production uses Redis; only the URL differs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

from celery import Celery, Task
from kombu import Queue  # type: ignore[attr-defined]  # kombu re-exports it without __all__

from controlplane import messaging
from controlplane.config import get_settings

log = logging.getLogger(__name__)

# Live canaries are judged on every tick: the decision rule is valid however often it looks.
CANARY_EVALUATE_INTERVAL_S = 5.0
# Backends' /metrics are pulled this often (each scrape becomes one delta record per engine).
SCRAPE_INTERVAL_S = 15.0
# Actuator deliveries whose retry time has come are sent again this often.
ACTUATOR_RESEND_INTERVAL_S = 5.0
# The default of Settings.celery_visibility_timeout_s: longer than the longest job (a realign
# job's budget is checked against it), so Redis never re-delivers a task that is still running.
# A realign job whose worker was killed does not wait for it: its lease lapses within a minute.
VISIBILITY_TIMEOUT_S = 6 * 3600
DRIFT_MONITOR_INTERVAL_S = 5.0
# Edge windows reach the rollups (the stats API, dashboards) within about this long.
AGGREGATE_ROLLUP_INTERVAL_S = 5.0
# How often beat looks for realign jobs whose message was lost (Settings.realign_resend_after_s
# says when a queued job counts as lost), whose retry is due, or whose lease lapsed; more often
# when the lease is short (see job_sweep_interval_s).
JOB_SWEEP_INTERVAL_S = 30.0


def job_sweep_interval_s(lease_s: float) -> float:
    """The sweep runs at least twice per lease, so a dead worker's job waits at most about one
    and a half leases before it is queued again.

    >>> job_sweep_interval_s(60.0), job_sweep_interval_s(2.0)
    (30.0, 1.0)
    """
    return max(0.5, min(JOB_SWEEP_INTERVAL_S, lease_s / 2))


def transport_options(broker_url: str, visibility_timeout_s: int) -> dict[str, Any]:
    """Redis transport options. A worker looks for messages left unacknowledged by a dead worker
    every ``unacked_restore_interval`` s times ``unacked_restore_throttle`` (100 s by default),
    which only matters when the visibility timeout itself is that short (tests).

    Other transports get none: kombu's SQLAlchemy transport (the embedded default) hands its
    options to ``create_engine``, which refuses a visibility timeout."""
    if not broker_url.startswith(("redis://", "rediss://", "redis+socket://")):
        return {}
    options: dict[str, Any] = {"visibility_timeout": visibility_timeout_s}
    if visibility_timeout_s < 600:
        options |= {
            "unacked_restore_interval": max(1, visibility_timeout_s // 2),
            "unacked_restore_throttle": 1,
        }
    return options


def make_celery() -> Celery:
    settings = get_settings()
    settings.ensure_local_dirs()
    app = Celery(
        "controlplane",
        broker=settings.broker_url,
        backend=settings.result_backend_url,
        include=[
            "workers.tasks",
            "workers.canary_tasks",
            "workers.scrape_tasks",
            "workers.actuator_tasks",
            "workers.storage_tasks",
            "workers.aggregate_tasks",
        ],
    )
    app.conf.update(
        task_default_queue=messaging.QUEUE_DEFAULT,
        task_queues=tuple(Queue(name) for name in messaging.QUEUES),  # type: ignore[no-untyped-call]
        # Each task by its exact name, to the queue of what it needs (a GPU or not).
        task_routes=messaging.celery_routes(),
        # A task is acknowledged only once it finished, and a worker that dies mid-task hands it
        # back: jobs must therefore be idempotent (they are keyed by job id).
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options=transport_options(settings.broker_url, settings.celery_visibility_timeout_s),
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_expires=24 * 3600,
        beat_schedule={
            "drift-monitor": {"task": messaging.DRIFT_MONITOR_ALL, "schedule": DRIFT_MONITOR_INTERVAL_S},
            "trace-retention": {"task": messaging.TRACES_APPLY_RETENTION, "schedule": 3600.0},
            "acceptance-storage": {"task": messaging.ACCEPTANCE_STORAGE_MAINTAIN, "schedule": 3600.0},
            "aggregate-rollups": {
                "task": messaging.ACCEPTANCE_ROLLUP_AGGREGATES,
                "schedule": AGGREGATE_ROLLUP_INTERVAL_S,
            },
            "realign-resend": {
                "task": messaging.JOBS_RESEND_STALE_QUEUED,
                "schedule": job_sweep_interval_s(settings.realign_lease_s),
            },
            "canary-evaluate": {
                "task": messaging.CANARY_EVALUATE_ALL,
                "schedule": CANARY_EVALUATE_INTERVAL_S,
            },
            "metrics-scrape": {"task": messaging.METRICS_SCRAPE_ALL, "schedule": SCRAPE_INTERVAL_S},
            "actuator-resend": {
                "task": messaging.ACTUATOR_RESEND_DUE,
                "schedule": ACTUATOR_RESEND_INTERVAL_S,
            },
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

P = ParamSpec("P")
R = TypeVar("R")


def project_task(
    name: str, *, bind: bool = False, ignore_result: bool = False
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """The one way to declare a task: its name from ``controlplane.messaging`` (which also routes
    it), the project's base class, and the function's own signature kept for type checking."""
    if name not in messaging.TASKS:
        raise KeyError(f"{name!r} is not in controlplane.messaging's task table")

    def register(function: Callable[P, R]) -> Callable[P, R]:
        task = celery_app.task(name=name, base=InstrumentedTask, bind=bind, ignore_result=ignore_result)
        return cast(Callable[P, R], task(function))

    return register


def torch_threads_for_this_process() -> int:
    """How many torch threads a task in this worker process should use (see Settings)."""
    settings = get_settings()
    if settings.worker_torch_threads:
        return settings.worker_torch_threads
    return max(1, (os.cpu_count() or 1) // settings.worker_concurrency)
