"""Posts the reference server's acceptance records and sampled traces to the control plane, off the
request path.

A completion only puts its record (and, when sampled, its trace) on a bounded in-memory queue; one
background thread drains it, groups items per deployment and kind, and POSTs batches to
``{base}/v1/accounts/{account}/deployments/{model}/acceptance`` (``{"records": [...]}``) and
``.../traces`` (``{"traces": [...]}``). A full queue drops the item and counts it (completions never
wait on the control plane); a failed POST is retried a few times with backoff (records are
idempotent by request id, so a retry after a lost reply is harmless), then dropped and counted.
``close()`` flushes what is queued, bounded by a timeout. No torch here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

log = logging.getLogger(__name__)

Kind = Literal["acceptance", "traces"]
BODY_KEY: dict[Kind, str] = {"acceptance": "records", "traces": "traces"}
# The traces route takes at most 1,000 items per batch; records allow 10,000.
MAX_BATCH: dict[Kind, int] = {"acceptance": 500, "traces": 200}


@dataclass
class ReporterStats:
    queued: int = 0
    posted: dict[str, int] = field(default_factory=lambda: {"acceptance": 0, "traces": 0})
    dropped_full: int = 0
    dropped_failed: int = 0
    batches: int = 0
    last_error: str | None = None


class ControlPlaneReporter:
    """Background batcher: ``record(model, rec)`` and ``trace(model, prompt, completion)`` never block."""

    def __init__(
        self,
        url_template: str,
        *,
        api_key: str | None = None,
        max_queue: int = 10_000,
        flush_interval_s: float = 0.5,
        retries: int = 3,
        timeout_s: float = 10.0,
        client: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``url_template``: the deployment's base URL with ``{model}``, e.g.
        ``http://127.0.0.1:8600/v1/accounts/default/deployments/{model}``."""
        self.url_template = url_template.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = client or httpx.Client(timeout=timeout_s)
        self._headers = headers
        self._queue: queue.Queue[tuple[Kind, str, dict[str, Any]] | None] = queue.Queue(maxsize=max_queue)
        self._flush_interval = flush_interval_s
        self._retries = retries
        self._sleep = sleep
        self._stop = threading.Event()
        self._outstanding = 0  # queued or in a batch, not yet posted or dropped
        self._settled = threading.Condition()
        self.stats = ReporterStats()
        self._thread = threading.Thread(target=self._run, name="controlplane-reporter", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- producer side (request path)
    def record(self, model: str, record: dict[str, Any]) -> None:
        self._put("acceptance", model, record)

    def trace(
        self,
        model: str,
        prompt: str,
        completion: str,
        category: str | None = None,
        document: str | None = None,
    ) -> None:
        item: dict[str, Any] = {"prompt": prompt, "completion": completion}
        if category is not None:
            item["category"] = category
        if document is not None:
            item["document"] = document
        self._put("traces", model, item)

    def _put(self, kind: Kind, model: str, item: dict[str, Any]) -> None:
        with self._settled:
            try:
                self._queue.put_nowait((kind, model, item))
            except queue.Full:
                self.stats.dropped_full += 1
                return
            self._outstanding += 1
            self.stats.queued += 1

    # ---------------------------------------------------------------------------- consumer thread
    def _run(self) -> None:
        pending: dict[tuple[Kind, str], list[dict[str, Any]]] = defaultdict(list)
        stopping = False
        while not stopping:
            deadline = time.monotonic() + self._flush_interval
            while True:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    break
                try:
                    entry = self._queue.get(timeout=timeout)
                except queue.Empty:
                    break
                if entry is None:
                    stopping = True
                    break
                kind, model, item = entry
                pending[(kind, model)].append(item)
                if len(pending[(kind, model)]) >= MAX_BATCH[kind]:
                    break
            for key in list(pending):
                items = pending.pop(key)
                for start in range(0, len(items), MAX_BATCH[key[0]]):
                    batch = items[start : start + MAX_BATCH[key[0]]]
                    self._post(key[0], key[1], batch)
                    with self._settled:
                        self._outstanding -= len(batch)
                        self._settled.notify_all()

    def _post(self, kind: Kind, model: str, items: list[dict[str, Any]]) -> None:
        url = f"{self.url_template.format(model=model)}/{kind}"
        delay = 0.5
        for attempt in range(self._retries + 1):
            try:
                resp = self._client.post(url, json={BODY_KEY[kind]: items}, headers=self._headers)
                if resp.status_code < 400:
                    self.stats.posted[kind] += len(items)
                    self.stats.batches += 1
                    return
                self.stats.last_error = f"{kind} POST {resp.status_code}: {resp.text[:300]}"
                if resp.status_code < 500 and resp.status_code != 429:
                    break  # refused as invalid: a retry would be refused again
            except httpx.HTTPError as exc:
                self.stats.last_error = f"{kind} POST failed: {exc!r}"
            if attempt < self._retries and not self._stop.is_set():
                self._sleep(delay)
                delay *= 2
        log.warning("dropped %d %s item(s) for %s: %s", len(items), kind, model, self.stats.last_error)
        self.stats.dropped_failed += len(items)

    # ------------------------------------------------------------------------------------ control
    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything queued so far was posted (or dropped); False on timeout."""
        with self._settled:
            return self._settled.wait_for(lambda: self._outstanding == 0, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Post what is queued (within ``timeout_s``), then stop the thread."""
        self._stop.set()
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        self._client.close()
