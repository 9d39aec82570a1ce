"""Ingest clients that retry as a careful serving fleet would (the same request ids until the
control plane answers 2xx), and the count of what a database then holds against what they sent:
the measure behind the fault tests' and the reliability bench's records_lost / records_duplicated
(whether the rollups hold each record once is tests/fleet/rollup_audit.py's to say)."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import psycopg


def acceptance_record(
    request_id: str, rng: random.Random, k: int = 4, categories: Sequence[str] = ()
) -> dict[str, Any]:
    """One served request's native record, stamped now (in one of ``categories`` or none)."""
    steps = rng.randint(3, 10)
    per_step = [min(k, int(rng.expovariate(0.6))) for _ in range(steps)]
    record: dict[str, Any] = {
        "request_id": request_id,
        "drafted_tokens": steps * k,
        "accepted_tokens": sum(per_step),
        "verify_steps": steps,
        "generated_tokens": sum(per_step) + steps,
        "accepted_per_position": [sum(1 for a in per_step if a > p) for p in range(k)],
        "k": k,
        "total_ms": rng.uniform(20, 200),
        "created_at": datetime.now(UTC).isoformat(),
    }
    if categories:
        record["category"] = rng.choice([*categories, None])
    return record


@dataclass
class IngestTally:
    """What the clients sent and what the control plane acknowledged."""

    sent: set[str] = field(default_factory=set)
    acknowledged: set[str] = field(default_factory=set)
    # Ids of batches still unacknowledged when the clients had to stop retrying.
    abandoned: set[str] = field(default_factory=set)
    # Ids the control plane refused with a 4xx: a correct batch must never be refused.
    refused: set[str] = field(default_factory=set)
    attempts: int = 0
    failures: Counter[str] = field(default_factory=Counter)


class RetryingIngestClients:
    """``clients`` threads, each posting batches of ``batch`` new records to ``url`` as fast as the
    API answers, retrying a batch (same ids, same body) on a connection error or a 5xx. A
    sequence ``batch`` gives client n batches of ``batch[n % len(batch)]`` records; records carry
    one of ``categories`` or none."""

    def __init__(
        self,
        url: str,
        key: str,
        *,
        clients: int = 4,
        batch: int | Sequence[int] = 5,
        prefix: str = "r",
        categories: Sequence[str] = (),
        pause_s: float = 0.0,
        give_up_after_s: float = 90.0,
    ) -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {key}"}
        self.clients = clients
        self.batches = [batch] if isinstance(batch, int) else list(batch)
        self.prefix = prefix
        self.categories = tuple(categories)
        self.pause_s = pause_s
        self.give_up_after_s = give_up_after_s
        self.tally = IngestTally()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> RetryingIngestClients:
        for n in range(self.clients):
            thread = threading.Thread(target=self._run, args=(n,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, timeout_s: float = 120.0) -> IngestTally:
        """Stop sending new batches; each client still retries the one in hand until it is acknowledged."""
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout_s)
        return self.tally

    def acknowledged_count(self) -> int:
        with self._lock:
            return len(self.tally.acknowledged)

    def _run(self, client: int) -> None:
        rng = random.Random(client)
        sequence = 0
        size = self.batches[client % len(self.batches)]
        with httpx.Client(timeout=10.0, headers=self.headers) as http:
            while not self._stopping.is_set():
                ids = [f"{self.prefix}-{client}-{sequence + i}" for i in range(size)]
                sequence += size
                body = {"records": [acceptance_record(i, rng, categories=self.categories) for i in ids]}
                with self._lock:
                    self.tally.sent.update(ids)
                self._deliver(http, ids, body)
                if self.pause_s:
                    time.sleep(self.pause_s)

    def _deliver(self, http: httpx.Client, ids: list[str], body: dict[str, Any]) -> None:
        deadline = time.monotonic() + self.give_up_after_s
        backoff = 0.05
        while True:
            outcome: str
            try:
                response = http.post(self.url, json=body)
                outcome = str(response.status_code)
            except httpx.HTTPError as exc:
                response = None
                outcome = type(exc).__name__
            with self._lock:
                self.tally.attempts += 1
                if response is not None and response.status_code < 300:
                    self.tally.acknowledged.update(ids)
                    return
                if response is not None and response.status_code < 500 and response.status_code != 429:
                    self.tally.refused.update(ids)
                    self.tally.failures[f"{outcome}: {response.text[:200]}"] += 1
                    return
                self.tally.failures[outcome] += 1
            if time.monotonic() > deadline:
                with self._lock:
                    self.tally.abandoned.update(ids)
                return
            time.sleep(backoff)
            backoff = min(1.0, backoff * 2)


@dataclass(frozen=True)
class StoredCount:
    """The clients' ids against the rows one deployment holds."""

    lost: int  # acknowledged, not stored
    duplicated: int  # stored more than once, or stored though never sent
    stored: int
    acknowledged: int


def count_stored(dsn: str, deployment_id: int, tally: IngestTally) -> StoredCount:
    """Compare the rows of ``deployment_id`` with what the clients were told (psycopg ``dsn``)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT request_id, count(*) FROM acceptance_records"
            " WHERE deployment_id = %s GROUP BY request_id",
            (deployment_id,),
        ).fetchall()
    per_id = {request_id: int(n) for request_id, n in rows}
    lost = len(tally.acknowledged - per_id.keys())
    duplicated = sum(n - 1 for n in per_id.values()) + len(per_id.keys() - tally.sent)
    return StoredCount(
        lost=lost, duplicated=duplicated, stored=len(per_id), acknowledged=len(tally.acknowledged)
    )
