"""Every Celery task the project sends, the queue each one runs on, and the one way to send them.

A task's queue follows from what it needs: training and the shadow replay need a GPU and go to
``gpu``; everything else (drift monitoring, the canary judge, sweeps, retention) goes to
``default``, so a five-second judgement never waits behind a training run. The Celery app in
``workers.celery_app`` routes by this same table, and the control plane sends by task name, so it
never imports ``workers/`` (or torch).

A message that names a database row is sent only after the transaction that wrote the row has
committed (outbox style): a lost message leaves a queued job that a sweep sends again, and a
duplicate is absorbed by the task's idempotence.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

from celery import Celery

log = logging.getLogger(__name__)

QUEUE_GPU = "gpu"
QUEUE_DEFAULT = "default"
QUEUES = (QUEUE_DEFAULT, QUEUE_GPU)

REALIGN = "realign.run"
SHADOW_REPLAY = "canary.shadow_replay"
CANARY_EVALUATE_ALL = "canary.evaluate_all"
DRIFT_MONITOR_ALL = "drift.monitor_all"
DRIFT_MONITOR_DEPLOYMENT = "drift.monitor_deployment"
DRIFT_MONITOR_AGGREGATES = "drift.monitor_aggregates"
JOBS_RESEND_STALE_QUEUED = "jobs.resend_stale_queued"
TRACES_APPLY_RETENTION = "traces.apply_retention"
ACCEPTANCE_STORAGE_MAINTAIN = "acceptance.maintain_storage"
ACCEPTANCE_ROLLUP_AGGREGATES = "acceptance.rollup_aggregates"
METRICS_SCRAPE_ALL = "metrics.scrape_all"
ACTUATOR_DELIVER = "actuator.deliver"
ACTUATOR_RESEND_DUE = "actuator.resend_due"

# What each task needs decides its queue; nothing else does.
NEEDS_GPU: dict[str, bool] = {
    REALIGN: True,
    SHADOW_REPLAY: True,
    CANARY_EVALUATE_ALL: False,
    DRIFT_MONITOR_ALL: False,
    DRIFT_MONITOR_DEPLOYMENT: False,
    DRIFT_MONITOR_AGGREGATES: False,
    JOBS_RESEND_STALE_QUEUED: False,
    TRACES_APPLY_RETENTION: False,
    ACCEPTANCE_STORAGE_MAINTAIN: False,
    ACCEPTANCE_ROLLUP_AGGREGATES: False,
    METRICS_SCRAPE_ALL: False,
    ACTUATOR_DELIVER: False,
    ACTUATOR_RESEND_DUE: False,
}
TASKS = frozenset(NEEDS_GPU)


def queue_for(task: str) -> str:
    """The queue a task runs on; KeyError for a name this table does not know.

    >>> queue_for("canary.evaluate_all"), queue_for("realign.run")
    ('default', 'gpu')
    """
    return QUEUE_GPU if NEEDS_GPU[task] else QUEUE_DEFAULT


def celery_routes() -> dict[str, dict[str, str]]:
    """``task_routes`` for the Celery app: every task by its exact name (no wildcards)."""
    return {task: {"queue": queue_for(task)} for task in sorted(TASKS)}


@dataclass(frozen=True, slots=True)
class TaskMessage:
    """A task to send by name, once the transaction that asked for it has committed."""

    task: str
    args: tuple[Any, ...] = ()
    countdown: float | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        queue_for(self.task)  # an unknown task name is a bug: fail where it is made

    @property
    def queue(self) -> str:
        return queue_for(self.task)


class Producer(Protocol):
    """What sends a message: a Celery app (the workers' own, or a producer-only one)."""

    def send_task(self, name: str, *args: Any, **kwargs: Any) -> Any: ...


@lru_cache(maxsize=4)
def producer(broker_url: str) -> Celery:
    """A producer-only Celery app for a broker: the API process sends, it never runs tasks."""
    return Celery("controlplane-producer", broker=broker_url)


def send(sender: Producer, message: TaskMessage) -> bool:
    """Send one message to its task's queue; False (logged) when the broker refused it.

    A refused send is never an error for the caller: the row it names stays as committed, and
    the beat sweeps (or the next tick) pick it up.
    """
    try:
        sender.send_task(
            message.task,
            args=list(message.args),
            kwargs=dict(message.kwargs),
            queue=message.queue,
            countdown=message.countdown,
        )
    except Exception:
        log.warning("could not send %s%s", message.task, message.args, exc_info=True)
        return False
    return True


def send_all(sender: Producer, messages: list[TaskMessage]) -> int:
    """Send each message (after a commit); returns how many the broker took."""
    return sum(send(sender, message) for message in messages)


class BackgroundSender:
    """Sends off the request path, at most one message per key per ``min_interval_s``.

    The API uses it so that ingestion and admin requests never wait on the broker.
    """

    def __init__(self, broker_url: str, *, min_interval_s: float = 2.0) -> None:
        self._broker_url = broker_url
        self._min_interval_s = min_interval_s
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="task-sender")

    def send_throttled(self, key: str, message: TaskMessage) -> bool:
        """Queue ``message`` for sending unless one with ``key`` went out within the interval."""
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, float("-inf")) < self._min_interval_s:
                return False
            self._last[key] = now
        self._pool.submit(send, producer(self._broker_url), message)
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class WorkQueue(Protocol):
    """The API's seam for handing a committed job to the gpu workers (tests record instead)."""

    def enqueue_realign(self, job_id: int) -> None: ...

    def enqueue_shadow_replay(self, job_id: int) -> None: ...


class CeleryWorkQueue:
    """Sends ``realign.run`` / ``canary.shadow_replay`` for a committed job, off the request path."""

    def __init__(self, broker_url: str) -> None:
        # Throttled per job only: each job is sent once per request, never coalesced with another.
        self._sender = BackgroundSender(broker_url, min_interval_s=0.0)

    def enqueue_realign(self, job_id: int) -> None:
        self._sender.send_throttled(f"realign:{job_id}", TaskMessage(REALIGN, (job_id,)))

    def enqueue_shadow_replay(self, job_id: int) -> None:
        self._sender.send_throttled(f"replay:{job_id}", TaskMessage(SHADOW_REPLAY, (job_id,)))

    def close(self) -> None:
        self._sender.close()
