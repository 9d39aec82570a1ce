"""Sending work to the Celery workers by task name, without importing the workers package.

The API process only produces messages; it never imports torch or the task code. Sends are
throttled per key and made off the request path, so ingestion never waits on the broker.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any

from celery import Celery

log = logging.getLogger(__name__)


@lru_cache(maxsize=4)
def _producer(broker_url: str) -> Celery:
    return Celery("controlplane-producer", broker=broker_url)


class TaskSender:
    """Fire-and-forget task messages, at most one per key per ``min_interval_s``."""

    def __init__(self, broker_url: str, *, min_interval_s: float = 2.0) -> None:
        self._broker_url = broker_url
        self._min_interval_s = min_interval_s
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="task-sender")

    def send_throttled(self, key: str, task_name: str, args: list[Any], queue: str = "default") -> bool:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, float("-inf")) < self._min_interval_s:
                return False
            self._last[key] = now
        self._pool.submit(self._send, task_name, args, queue)
        return True

    def _send(self, task_name: str, args: list[Any], queue: str) -> None:
        try:
            _producer(self._broker_url).send_task(task_name, args=args, queue=queue)
        except Exception:  # the beat schedule is the fallback; a broker hiccup must not fail ingestion
            log.warning("could not enqueue %s%s", task_name, args, exc_info=True)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
