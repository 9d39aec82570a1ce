"""Group commit for ingestion: concurrent requests share one transaction per flush.

A commit on PostgreSQL costs a WAL flush (~3 ms on this kind of machine) and the rollup rows of
the current minute are a hot spot every writer locks. Writing each request in its own
transaction therefore caps single-record ingestion at a few hundred requests per second. Here
one writer per process takes whatever requests queued up while the previous flush ran and
stores them together: under load a flush holds many requests; when idle a request is flushed at
once, so batching adds no waiting. Each request still gets its own result (inserted and
duplicate counts).

One request must never fail another, whatever account sent it: records are checked against
what the database stores before they queue (controlplane.ingest.formats.storage_problems), and a
flush that fails all the same, with the database still reachable (a value refused, a conflicting
request id), is split in halves and each half flushed again, down to single requests, so only
the requests that fail alone fail (a refused value as a 422 naming the database's reason) and
every other one is stored and acknowledged. With one offender in n requests that costs about
2·log2(n) more flushes. A database that is away fails every request of the flush at once.

Given an engine, flushes run in lanes, each on a connection it keeps: checking one out of the
pool per flush cost a liveness ping (a round trip) and the pool's bookkeeping, ~0.25 ms of CPU in
a flush of ~1.5 ms. A kept connection goes back to the pool after a second unused (the next
checkout pings it), and a flush that fails for any reason but a duplicate id drops it, so the
next flush of that lane starts on a fresh one. Two lanes let a large flush run its Python while
the other waits on the database (its COPY, its commit), so neither side of a 2-core machine
idles (batch ingest 54-59k -> 69-70k records/s); they share nothing but the rollup rows, which
the database serialises (see rollups). Small flushes still go one at a time (see _run).

On PostgreSQL with an engine, a small flush leaves its rollup sums to a fold (see
controlplane.ingest.service.fold_pending_rollups): the rollup read-merge-write of five hot rows
was more than half of a single-record flush (1.8 ms in isolation, 0.7 ms without it). The
batcher folds at most FOLD_DELAY_S after a flush, on a connection of its own, summing whatever
queued meanwhile in one transaction, and once more when it closes; readers of rollups fold
before they read, so none of them sees a lagging sum.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from fastapi.concurrency import run_in_threadpool
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DataError, IntegrityError, StatementError
from sqlalchemy.orm import Session

from controlplane.db.session import driver_cursor
from controlplane.errors import DomainError, UnavailableError, ValidationProblem
from controlplane.ingest.record import AcceptanceRecord
from controlplane.ingest.service import (
    SMALL_BATCH_RECORDS,
    IngestResult,
    database_unreachable,
    fold_pending_rollups,
    is_unique_violation,
    rollups_deferrable,
    store_batches,
)

log = logging.getLogger(__name__)

MAX_RECORDS_PER_FLUSH = 50_000
# A kept connection idle longer than this goes back to the pool and the flush checks out another,
# which the pool pings first: a database restart during a quiet spell then costs no request.
# Under load flushes follow each other within milliseconds and never pay for the ping.
KEPT_CONNECTION_IDLE_S = 1.0
FLUSH_LANES = 2
# A flush smaller than this waits for the one in flight instead of running beside it.
PARALLEL_FLUSH_MIN_RECORDS = SMALL_BATCH_RECORDS
# How long deferred rollup sums may wait for their fold. Longer folds more records per
# transaction; readers never wait for it (they fold first).
FOLD_DELAY_S = 0.05
# After a failed fold (the database away), the next try waits this long.
FOLD_RETRY_S = 1.0


class BatcherClosedError(UnavailableError):
    """The batcher was closed before this request's records were flushed (an HTTP 503)."""


class StorageRefusedError(ValidationProblem):
    """The database refused a value of this request's records, alone (an HTTP 422)."""


# The database's reason is quoted to the caller: its first line, cut to this length.
MAX_REASON_CHARS = 500


@dataclass(slots=True)
class _Pending:
    deployment_id: int
    records: Sequence[AcceptanceRecord]
    done: asyncio.Future[IngestResult] = field(repr=False)


class _Lane:
    """Runs one flush at a time, on a connection it keeps (or, without an engine, on a new
    session of the factory each time)."""

    def __init__(
        self,
        session_factory: Callable[[], Session],
        engine: Engine | None,
        kept_connection_idle_s: float,
        synchronous_commit: bool = True,
    ) -> None:
        self._session_factory = session_factory
        self._engine = engine
        # Only ever relaxed per transaction (SET LOCAL): the kept connection goes back to the
        # pool with the server's own setting.
        self._relax_commit = (
            not synchronous_commit and engine is not None and engine.dialect.name == "postgresql"
        )
        self._kept_connection_idle_s = kept_connection_idle_s
        self._connection: Connection | None = None
        self._connection_used_at = 0.0
        # Held by a flush for its whole run: closing waits for the one in flight (its thread
        # outlives a cancelled task) before closing the connection under it.
        self._lock = threading.Lock()

    def flush(
        self, batches: list[tuple[int, Sequence[AcceptanceRecord]]], defer_rollups: bool = False
    ) -> list[IngestResult]:
        with self._lock, self._dropping_connection_on_failure():
            for attempt in range(2):
                with self._open_session() as session:
                    try:
                        if self._relax_commit:
                            with driver_cursor(session) as cursor:
                                cursor.execute("SET LOCAL synchronous_commit TO OFF")
                        results = store_batches(session=session, batches=batches, defer_rollups=defer_rollups)
                        session.commit()
                        return results
                    except IntegrityError as exc:
                        session.rollback()
                        # Another writer stored one of our ids between lookup and write:
                        # retry once, the second pass sees it and reports it as a duplicate.
                        if attempt == 1 or not is_unique_violation(exc):
                            raise
            raise AssertionError("unreachable")

    def flush_isolating(
        self, batches: list[tuple[int, Sequence[AcceptanceRecord]]], defer_rollups: bool = False
    ) -> list[IngestResult | Exception]:
        """Flush ``batches``; should that fail with the database reachable, flush each half
        again (recursively), so each batch gets its own result or the error it fails with alone."""
        try:
            return list(self.flush(batches, defer_rollups))
        except Exception as exc:
            if database_unreachable(exc):
                return [exc] * len(batches)
            if len(batches) == 1:
                return [_as_request_error(exc)]
            log.warning(
                "a flush of %d requests failed (%s); flushing its halves apart",
                len(batches),
                type(exc).__name__,
            )
        middle = len(batches) // 2
        return self.flush_isolating(batches[:middle], defer_rollups) + self.flush_isolating(
            batches[middle:], defer_rollups
        )

    def fold(self) -> int:
        """Fold every pending rollup sum in one transaction; returns the records folded."""
        with self._lock, self._dropping_connection_on_failure(), self._open_session() as session:
            folded = fold_pending_rollups(session=session)
            session.commit()
            return folded

    @contextmanager
    def _dropping_connection_on_failure(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            # Whatever failed may have broken the kept connection: the next run gets a new one.
            self._drop_connection()
            raise

    def close(self) -> None:
        with self._lock:
            self._drop_connection()

    def _open_session(self) -> Session:
        if self._engine is None:
            return self._session_factory()
        now = time.monotonic()
        if self._connection is not None and now - self._connection_used_at > self._kept_connection_idle_s:
            self._drop_connection()
        if self._connection is None:
            self._connection = self._engine.connect()
        self._connection_used_at = now
        return Session(bind=self._connection, expire_on_commit=False)

    def _drop_connection(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()


class IngestBatcher:
    """Coalesces ingest requests of one process into shared transactions."""

    def __init__(
        self,
        session_factory: Callable[[], Session],
        *,
        engine: Engine | None = None,
        max_records: int = MAX_RECORDS_PER_FLUSH,
        kept_connection_idle_s: float = KEPT_CONNECTION_IDLE_S,
        lanes: int = FLUSH_LANES,
        defer_rollups: bool = True,
        fold_delay_s: float = FOLD_DELAY_S,
        synchronous_commit: bool = True,
    ):
        """Flushes run in ``lanes`` lanes on connections of ``engine`` when one is given (one on
        SQLite); else in one lane, on a new session of ``session_factory`` each (tests bind those
        to a transaction they roll back, which two threads must not share). Small flushes
        defer their rollup sums to a fold ``fold_delay_s`` later when ``defer_rollups`` and the
        engine is PostgreSQL's. ``synchronous_commit=False`` lets flushes on PostgreSQL
        acknowledge before their WAL is on disk (see Settings.ingest_synchronous_commit)."""
        if lanes < 1:
            raise ValueError(f"lanes must be at least 1, got {lanes}")
        # SQLite takes one writer at a time: a second lane would only wait for its lock.
        count = lanes if engine is not None and engine.dialect.name != "sqlite" else 1
        self._lanes = [
            _Lane(session_factory, engine, kept_connection_idle_s, synchronous_commit) for _ in range(count)
        ]
        self._defer_rollups = defer_rollups and engine is not None and engine.dialect.name == "postgresql"
        self._fold_lane = (
            _Lane(session_factory, engine, kept_connection_idle_s) if self._defer_rollups else None
        )
        self._fold_delay_s = fold_delay_s
        self._fold_wanted = False
        self._folder: asyncio.Task[None] | None = None
        self._max_records = max_records
        self._queue: asyncio.Queue[_Pending] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._in_flight: set[asyncio.Task[None]] = set()

    async def submit(
        self, deployment_id: int, records: Sequence[AcceptanceRecord], *, from_serving_key: bool = False
    ) -> IngestResult:
        """Store a batch; returns once it is committed (or raises why this batch, alone, could
        not be stored). ``from_serving_key``: the caller holds the fleet's serving key."""
        if from_serving_key:
            for record in records:
                record.from_serving_key = True
        loop = asyncio.get_running_loop()
        if self._queue is None or self._worker is None or self._worker.done():
            self._queue = asyncio.Queue()
            self._worker = loop.create_task(self._run(self._queue), name="ingest-batcher")
        pending = _Pending(deployment_id, records, loop.create_future())
        await self._queue.put(pending)
        return await pending.done

    async def close(self) -> None:
        """Stop taking requests, let the flushes in flight finish, return the connections.

        Requests not yet in a flush fail with ``BatcherClosedError`` (nothing of them stored)
        rather than wait forever.
        """
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None
        if self._queue is not None:
            waiting: list[_Pending] = []
            self._take_queued(self._queue, waiting, 0, limit=math.inf)
            _fail(waiting, BatcherClosedError("the API is shutting down; nothing of this batch was stored"))
        if self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)
        if self._folder is not None:
            self._folder.cancel()
            await asyncio.gather(self._folder, return_exceptions=True)
            self._folder = None
        if self._fold_lane is not None:
            # Nothing left pending by a clean shutdown (a crash leaves it to the next fold).
            try:
                await run_in_threadpool(self._fold_lane.fold)
            except Exception:
                log.exception("final rollup fold failed; the next fold or reader will add the sums")
            await run_in_threadpool(self._fold_lane.close)
        for lane in self._lanes:
            await run_in_threadpool(lane.close)

    async def _run(self, queue: asyncio.Queue[_Pending]) -> None:
        free: asyncio.Queue[_Lane] = asyncio.Queue()
        for lane in self._lanes:
            free.put_nowait(lane)
        group: list[_Pending] = []
        try:
            while True:
                # A lane first, then the requests: whatever arrives while every lane is busy
                # joins the next flush.
                lane = await free.get()
                group = [await queue.get()]
                size = self._take_queued(queue, group, len(group[0].records), self._max_records)
                if size < PARALLEL_FLUSH_MIN_RECORDS and self._in_flight:
                    # Small flushes cost mostly per-flush work (round trips, the rollup rows,
                    # which a flush beside this one would hold locked anyway): one at a time,
                    # each taking everything that queued meanwhile (single-record p99 at 500/s:
                    # 14 ms with overlapping small flushes, 10-12 without).
                    await asyncio.wait(set(self._in_flight))
                    size = self._take_queued(queue, group, size, self._max_records)
                task = asyncio.get_running_loop().create_task(self._flush(lane, group, free))
                self._in_flight.add(task)
                task.add_done_callback(self._in_flight.discard)
                group = []
        except asyncio.CancelledError:
            _fail(group, BatcherClosedError("the API is shutting down; nothing of this batch was stored"))
            raise

    @staticmethod
    def _take_queued(queue: asyncio.Queue[_Pending], group: list[_Pending], size: int, limit: float) -> int:
        """Move queued requests into ``group`` until it holds ``limit`` records or the queue is
        empty; returns the group's record count."""
        while size < limit and not queue.empty():
            item = queue.get_nowait()
            group.append(item)
            size += len(item.records)
        return size

    async def _flush(self, lane: _Lane, group: list[_Pending], free: asyncio.Queue[_Lane]) -> None:
        try:
            results = await run_in_threadpool(
                lane.flush_isolating,
                [(item.deployment_id, item.records) for item in group],
                self._defer_rollups,
            )
        except Exception as exc:  # every request of the flush learns why it failed
            _fail(group, exc)
            return
        finally:
            free.put_nowait(lane)
        if self._defer_rollups and _defers_any(group):
            self._want_fold()
        for item, result in zip(group, results, strict=True):
            if item.done.done():
                continue
            if isinstance(result, Exception):
                item.done.set_exception(result)
            else:
                item.done.set_result(result)

    def _want_fold(self) -> None:
        self._fold_wanted = True
        if self._folder is None or self._folder.done():
            self._folder = asyncio.get_running_loop().create_task(self._fold_soon(), name="rollup-fold")

    async def _fold_soon(self) -> None:
        """Fold after FOLD_DELAY_S, again after each later flush, until flushes stop."""
        assert self._fold_lane is not None
        delay = self._fold_delay_s
        while self._fold_wanted:
            self._fold_wanted = False
            await asyncio.sleep(delay)
            try:
                await run_in_threadpool(self._fold_lane.fold)
                delay = self._fold_delay_s
            except Exception:
                log.exception("rollup fold failed; retrying in %.1f s", FOLD_RETRY_S)
                self._fold_wanted, delay = True, FOLD_RETRY_S


def _defers_any(group: Sequence[_Pending]) -> bool:
    """Whether a flush of ``group`` deferred some rollup sums (see store_batches)."""
    counts: dict[int, int] = {}
    for item in group:
        counts[item.deployment_id] = counts.get(item.deployment_id, 0) + len(item.records)
    return any(rollups_deferrable(count) for count in counts.values())


def _as_request_error(exc: Exception) -> Exception:
    """What one request that failed alone answers: a domain error as it is (a 409 conflict, a
    422), a value the database refused as a 422 quoting the database's reason, anything else
    as it is (a 500)."""
    if isinstance(exc, DomainError):
        return exc
    refused = isinstance(exc, DataError | IntegrityError) or (
        isinstance(exc, StatementError) and isinstance(exc.orig, OverflowError | ValueError)
    )
    if isinstance(exc, OverflowError | ValueError):
        refused = True
    if not refused:
        return exc
    origin = exc.orig if isinstance(exc, StatementError) and exc.orig is not None else exc
    reason = (str(origin).strip().splitlines() or [type(origin).__name__])[0][:MAX_REASON_CHARS]
    return StorageRefusedError(
        f"the database refused a value of this batch: {reason}; nothing of this batch was stored",
        details=[{"field": "", "message": reason}],
    )


def _fail(group: Sequence[_Pending], exc: BaseException) -> None:
    for item in group:
        if not item.done.done():
            item.done.set_exception(exc)
