"""Handing a job to the Celery workers, by task name (the control plane never imports workers/).

The job row is written and committed first; the message only names its id, so a lost message
leaves a queued job that the beat sweeper (``jobs.resend_stale_queued``, after
``Settings.realign_resend_after_s``) sends again, and a duplicated message is absorbed by the
task's idempotence.
"""

from __future__ import annotations

from typing import Protocol

from controlplane.task_queue import TaskSender

REALIGN_TASK = "realign.run"
GPU_QUEUE = "gpu"


class JobQueue(Protocol):
    def enqueue_realign(self, job_id: int) -> None: ...


class CeleryJobQueue:
    """Sends ``realign.run(job_id)`` to the gpu queue, off the request path."""

    def __init__(self, broker_url: str) -> None:
        # Throttle per job id only: each job is sent once per request, never coalesced with another.
        self._sender = TaskSender(broker_url, min_interval_s=0.0)

    def enqueue_realign(self, job_id: int) -> None:
        self._sender.send_throttled(f"realign:{job_id}", REALIGN_TASK, [job_id], queue=GPU_QUEUE)

    def close(self) -> None:
        self._sender.close()
