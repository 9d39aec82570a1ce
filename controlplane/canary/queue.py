"""Handing canary work to the Celery workers by task name (the control plane never imports workers/).

The canary job row is committed first; the message names only its id, so a lost message leaves a
queued job the sweeper or a retry recovers, and a duplicate is absorbed by the task's idempotence.
"""

from __future__ import annotations

from typing import Protocol

from controlplane.task_queue import TaskSender

SHADOW_REPLAY_TASK = "canary.shadow_replay"
GPU_QUEUE = "gpu"


class CanaryQueue(Protocol):
    def enqueue_shadow_replay(self, job_id: int) -> None: ...


class CeleryCanaryQueue:
    """Sends ``canary.shadow_replay(job_id)`` to the gpu queue, off the request path."""

    def __init__(self, broker_url: str) -> None:
        self._sender = TaskSender(broker_url, min_interval_s=0.0)

    def enqueue_shadow_replay(self, job_id: int) -> None:
        self._sender.send_throttled(f"canary:{job_id}", SHADOW_REPLAY_TASK, [job_id], queue=GPU_QUEUE)

    def close(self) -> None:
        self._sender.close()
