"""Ingest clients that retry as a careful serving fleet would (the same request ids until the
control plane answers 2xx), and the count of what a database then holds against what they sent:
the measure behind the fault tests' and the reliability bench's records_lost / records_duplicated
(whether the rollups hold each record once is tests/fleet/rollup_audit.py's to say). Also edges
that send windows of aggregates the same way, and a stand-in for the beat task that folds those
windows into the rollups."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psycopg
from sqlalchemy.orm import Session

from controlplane.db.session import get_engine
from controlplane.ingest.aggregate_rollups import fold_aggregate_rollups
from controlplane.ingest.aggregates import EdgeWindow, WindowAccumulator
from controlplane.ingest.record import AcceptanceRecord


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


def edge_window_body(
    edge_id: str, start: datetime, deployment: str, rng: random.Random, requests: int = 20, k: int = 4
) -> dict[str, Any]:
    """One edge's 60-second window of aggregates over ``requests`` served requests of one
    deployment, in some of the categories the per-request clients use."""
    accumulator = WindowAccumulator(k=k)
    for _ in range(requests):
        steps = rng.randint(3, 10)
        per_step = [min(k, int(rng.expovariate(0.6))) for _ in range(steps)]
        accumulator.add(
            deployment,
            AcceptanceRecord(
                request_id="-",
                drafted_tokens=steps * k,
                accepted_tokens=sum(per_step),
                verify_steps=steps,
                generated_tokens=sum(per_step) + steps,
                accepted_per_position=[sum(1 for a in per_step if a > p) for p in range(k)],
                k=k,
                total_ms=rng.uniform(20, 200),
                prompt_tokens=rng.randint(10, 100),
                category=rng.choice(["code", "prose", None]),
            ),
        )
    return EdgeWindow(edge_id, start, 60, accumulator.aggregates()).to_dict()


@dataclass
class EdgeWindowTally:
    """Windows (edge id, window start) the edges sent and the control plane acknowledged."""

    sent: set[tuple[str, str]] = field(default_factory=set)
    acknowledged: set[tuple[str, str]] = field(default_factory=set)
    abandoned: set[tuple[str, str]] = field(default_factory=set)
    refused: set[tuple[str, str]] = field(default_factory=set)
    attempts: int = 0
    failures: Counter[str] = field(default_factory=Counter)


class RetryingEdgeClients:
    """``edges`` threads, each posting its next 60-second window of aggregates of ``deployment``
    to ``url`` (an account's /aggregates), windows consecutive from ``first_window``, re-sending
    the same body until a 2xx as an edge must (a retry of a stored window is acknowledged as a
    duplicate and stores nothing)."""

    def __init__(
        self,
        url: str,
        key: str,
        deployment: str,
        *,
        first_window: datetime,
        edges: int = 2,
        pause_s: float = 0.05,
        give_up_after_s: float = 90.0,
    ) -> None:
        self.url = url
        self.headers = {"Authorization": f"Bearer {key}"}
        self.deployment = deployment
        self.first_window = first_window
        self.edges = edges
        self.pause_s = pause_s
        self.give_up_after_s = give_up_after_s
        self.tally = EdgeWindowTally()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> RetryingEdgeClients:
        for n in range(self.edges):
            thread = threading.Thread(target=self._run, args=(n,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, timeout_s: float = 120.0) -> EdgeWindowTally:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout_s)
        return self.tally

    def _run(self, edge: int) -> None:
        rng = random.Random(1000 + edge)
        edge_id = f"edge-{edge}"
        window = 0
        with httpx.Client(timeout=10.0, headers=self.headers) as http:
            while not self._stopping.is_set():
                start = self.first_window + timedelta(seconds=60 * window)
                window += 1
                key = (edge_id, start.isoformat())
                body = edge_window_body(edge_id, start, self.deployment, rng)
                with self._lock:
                    self.tally.sent.add(key)
                self._deliver(http, key, body)
                time.sleep(self.pause_s)

    def _deliver(self, http: httpx.Client, key: tuple[str, str], body: dict[str, Any]) -> None:
        deadline = time.monotonic() + self.give_up_after_s
        backoff = 0.05
        while True:
            try:
                response: httpx.Response | None = http.post(self.url, json=body)
                outcome = str(response.status_code) if response is not None else "-"
            except httpx.HTTPError as exc:
                response, outcome = None, type(exc).__name__
            with self._lock:
                self.tally.attempts += 1
                if response is not None and response.status_code < 300:
                    self.tally.acknowledged.add(key)
                    return
                if response is not None and response.status_code < 500 and response.status_code != 429:
                    self.tally.refused.add(key)
                    self.tally.failures[f"{outcome}: {response.text[:200]}"] += 1
                    return
                self.tally.failures[outcome] += 1
            if time.monotonic() > deadline:
                with self._lock:
                    self.tally.abandoned.add(key)
                return
            time.sleep(backoff)
            backoff = min(1.0, backoff * 2)


def windows_lost(dsn: str, tally: EdgeWindowTally) -> int:
    """Acknowledged windows the database does not hold."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT edge_id, window_start FROM edge_windows").fetchall()
    stored = {(edge_id, start.astimezone(UTC).isoformat()) for edge_id, start in rows}
    return len(tally.acknowledged - stored)


class AggregateRollupFolder:
    """A thread folding edge windows into the rollups every ``interval_s``, as the beat-scheduled
    task does in production, on its own engine; a fold that fails (the database away) is retried
    at the next tick. ``drain()`` folds until no window is left."""

    def __init__(self, database_url: str, interval_s: float = 0.5) -> None:
        self.database_url = database_url
        self.interval_s = interval_s
        self.folds = 0
        self.failures: Counter[str] = Counter()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> AggregateRollupFolder:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(60)

    def drain(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self._fold_once():
            if time.monotonic() > deadline:
                raise AssertionError(f"edge windows still unfolded after {timeout_s} s: {self.failures}")

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s):
            self._fold_once()

    def _fold_once(self) -> bool:
        """One fold transaction; whether it folded (or failed to fold) anything."""
        engine = get_engine(self.database_url)
        try:
            with Session(bind=engine) as session:
                fold = fold_aggregate_rollups(session=session)
                session.commit()
        except Exception as exc:  # the database away: the next tick tries again
            self.failures[type(exc).__name__] += 1
            engine.dispose()
            time.sleep(0.2)
            return True
        self.folds += 1
        return fold.windows > 0
