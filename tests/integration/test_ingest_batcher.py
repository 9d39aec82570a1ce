"""The ingest batcher's lanes on real PostgreSQL: kept connections, large flushes side by side, a
new connection after the database drops one, none left behind on close, and small flushes'
rollup sums deferred to one fold that readers never outrun."""

from __future__ import annotations

import asyncio
import shutil
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from controlplane.dashboard.service import deployment_view, overview
from controlplane.db.models import (
    AcceptanceRecordRow,
    AcceptanceRollupPendingRow,
    AcceptanceRollupRow,
    Account,
    Deployment,
)
from controlplane.db.session import get_engine, get_sessionmaker
from controlplane.ingest import batcher as batcher_module
from controlplane.ingest.batcher import FLUSH_LANES, BatcherClosedError, IngestBatcher
from controlplane.ingest.record import AcceptanceRecord
from controlplane.ingest.rollups import MINUTE
from controlplane.ingest.service import IngestResult, store_batches
from controlplane.stats.service import acceptance_series
from tests.conftest import PG_ADMIN_URL, add_deployment, prepare_database, recreate_pg_database


def _record(request_id: str) -> AcceptanceRecord:
    return AcceptanceRecord(
        request_id=request_id,
        drafted_tokens=8,
        accepted_tokens=5,
        verify_steps=2,
        generated_tokens=7,
        accepted_per_position=[4, 1],
        inter_token_ms=9.5,
        total_ms=120.0,
    )


def _terminate_backends(database: str) -> int:
    """Kill every server process connected to ``database`` (what a database restart does)."""
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        killed = conn.scalar(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = :name AND pid <> pg_backend_pid()"
            ),
            {"name": database},
        )
    admin.dispose()
    return int(killed or 0)


@pytest.fixture
def pg_deployment() -> tuple[str, int]:
    url = recreate_pg_database("controlplane_batcher")
    prepare_database(url)
    with get_sessionmaker(url)() as session:
        deployment_id = add_deployment(session, "batcher").id
        session.commit()
    return url, deployment_id


def test_flushes_keep_their_connections_and_store_everything(pg_deployment: tuple[str, int]) -> None:
    url, deployment_id = pg_deployment
    engine = get_engine(url)
    batcher = IngestBatcher(get_sessionmaker(url), engine=engine)

    async def run() -> list[int]:
        results = []
        for wave in range(5):
            outcomes = await asyncio.gather(
                *(batcher.submit(deployment_id, [_record(f"w{wave}-r{i}")]) for i in range(8))
            )
            results += [outcome.inserted for outcome in outcomes]
            # Between flushes the lanes keep their connections checked out of the pool: no
            # per-flush checkout (and its ping). The rollup fold keeps one more.
            assert 1 <= engine.pool.checkedout() <= FLUSH_LANES + 1  # type: ignore[attr-defined]
        await batcher.close()
        return results

    inserted = asyncio.run(run())
    assert inserted == [1] * 40
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]  # close returned them
    _assert_stored(url, 40)


def test_large_flushes_run_side_by_side(pg_deployment: tuple[str, int]) -> None:
    url, deployment_id = pg_deployment
    engine = get_engine(url)
    batcher = IngestBatcher(get_sessionmaker(url), engine=engine)
    size = 10_000  # a flush of this takes a good tenth of a second

    async def run() -> list[int]:
        first = asyncio.ensure_future(batcher.submit(deployment_id, [_record(f"a{i}") for i in range(size)]))
        await asyncio.sleep(0.02)  # its flush has started
        second = await batcher.submit(deployment_id, [_record(f"b{i}") for i in range(size)])
        # The second batch did not wait for the first one's lane: both lanes hold a connection.
        assert engine.pool.checkedout() == 2  # type: ignore[attr-defined]
        outcomes = [await first, second]
        await batcher.close()
        return [outcome.inserted for outcome in outcomes]

    assert asyncio.run(run()) == [size, size]
    _assert_stored(url, 2 * size)


def _assert_stored(url: str, count: int) -> None:
    """``count`` records stored, and the minute rollups count each of them once."""
    with get_sessionmaker(url)() as session:
        stored = session.scalar(select(func.count()).select_from(AcceptanceRecordRow))
        minute_requests = session.scalar(
            select(func.sum(AcceptanceRollupRow.requests)).where(AcceptanceRollupRow.resolution_s == MINUTE)
        )
    assert stored == count
    assert minute_requests == count


def test_a_connection_the_database_dropped_is_replaced(pg_deployment: tuple[str, int]) -> None:
    url, deployment_id = pg_deployment
    database = url.rsplit("/", 1)[1]
    # One lane, so that the flush after the kill is known to run on the killed connection.
    batcher = IngestBatcher(
        get_sessionmaker(url), engine=get_engine(url), kept_connection_idle_s=0.5, lanes=1
    )

    async def run() -> None:
        assert (await batcher.submit(deployment_id, [_record("before")])).inserted == 1
        # Dropped right after use: the next flush finds out by failing, with the database's own
        # error, and stores nothing; the one after runs on a new connection.
        assert _terminate_backends(database) >= 1
        with pytest.raises(OperationalError):
            await batcher.submit(deployment_id, [_record("lost")])
        assert (await batcher.submit(deployment_id, [_record("lost")])).inserted == 1
        # Dropped during a quiet spell: the flush after it checks out a pinged connection and
        # no request fails.
        assert _terminate_backends(database) >= 1
        time.sleep(0.6)
        assert (await batcher.submit(deployment_id, [_record("after-idle")])).inserted == 1
        await batcher.close()

    asyncio.run(run())
    with get_sessionmaker(url)() as session:
        ids = set(session.scalars(select(AcceptanceRecordRow.request_id)))
        minute_requests = session.scalar(
            select(func.sum(AcceptanceRollupRow.requests)).where(AcceptanceRollupRow.resolution_s == MINUTE)
        )
    assert ids == {"before", "lost", "after-idle"}
    assert minute_requests == 3


def test_close_finishes_the_flushes_in_flight_and_refuses_the_rest(
    pg_deployment: tuple[str, int],
) -> None:
    """No request is left waiting forever: each is stored and answered, or answered with a 503
    error and stores nothing."""
    url, deployment_id = pg_deployment
    # One request per flush: two flushes run, the other requests queue behind them.
    batcher = IngestBatcher(get_sessionmaker(url), engine=get_engine(url), max_records=200)

    async def run() -> list[IngestResult | BaseException]:
        tasks = [
            asyncio.ensure_future(batcher.submit(deployment_id, [_record(f"c{i}-{j}") for j in range(200)]))
            for i in range(30)
        ]
        await asyncio.sleep(0.01)  # the first flushes start
        await batcher.close()
        done, pending = await asyncio.wait(tasks, timeout=30)
        assert not pending, "a request was left waiting after close"
        return [task.result() if task.exception() is None else task.exception() for task in tasks]  # type: ignore[misc]

    outcomes = asyncio.run(run())
    stored = [o for o in outcomes if isinstance(o, IngestResult)]
    refused = [o for o in outcomes if not isinstance(o, IngestResult)]
    assert stored, "the flushes in flight at close were not finished"
    assert refused, "close did not refuse the queued requests"
    assert all(isinstance(o, BatcherClosedError) and o.status_code == 503 for o in refused)
    assert all(o.inserted == 200 for o in stored)
    _assert_stored(url, 200 * len(stored))


def test_sqlite_flushes_in_one_lane(sqlite_template: Path, tmp_path: Path) -> None:
    """SQLite has one writer at a time: a second lane would only queue on its lock."""
    path = tmp_path / "controlplane.db"
    shutil.copy(sqlite_template, path)
    url = f"sqlite:///{path}"
    engine = get_engine(url)
    with get_sessionmaker(url)() as session:
        deployment_id = add_deployment(session, "lite").id
        session.commit()
    batcher = IngestBatcher(get_sessionmaker(url), engine=engine)

    async def run() -> list[int]:
        first = asyncio.ensure_future(batcher.submit(deployment_id, [_record(f"a{i}") for i in range(5_000)]))
        await asyncio.sleep(0.02)
        second = await batcher.submit(deployment_id, [_record(f"b{i}") for i in range(5_000)])
        assert engine.pool.checkedout() == 1  # type: ignore[attr-defined]
        outcomes = [await first, second]
        await batcher.close()
        return [outcome.inserted for outcome in outcomes]

    try:
        assert asyncio.run(run()) == [5_000, 5_000]
        _assert_stored(url, 10_000)
    finally:
        engine.dispose()


def _pending_and_minute_sum(url: str) -> tuple[int, int]:
    with get_sessionmaker(url)() as session:
        pending = session.scalar(select(func.count()).select_from(AcceptanceRollupPendingRow))
        minute_requests = session.scalar(
            select(func.sum(AcceptanceRollupRow.requests)).where(AcceptanceRollupRow.resolution_s == MINUTE)
        )
    return int(pending or 0), int(minute_requests or 0)


def test_small_flushes_leave_rollups_to_a_fold_that_readers_run_first(pg_deployment: tuple[str, int]) -> None:
    url, deployment_id = pg_deployment
    # No background fold during the test: only the reader and close() fold.
    batcher = IngestBatcher(get_sessionmaker(url), engine=get_engine(url), fold_delay_s=60)
    now = datetime.now(UTC)
    window = {"start": now - timedelta(days=1), "end": now + timedelta(days=1)}

    async def run() -> None:
        outcomes = await asyncio.gather(
            *(batcher.submit(deployment_id, [_record(f"s{i}")]) for i in range(20))
        )
        assert [outcome.inserted for outcome in outcomes] == [1] * 20
        # Stored and acknowledged, the sums still queued for the fold.
        assert _pending_and_minute_sum(url) == (20, 0)
        # A retry of stored ids queues nothing.
        assert (await batcher.submit(deployment_id, [_record("s0")])).duplicates == 1
        assert _pending_and_minute_sum(url) == (20, 0)
        with get_sessionmaker(url)() as session:
            series = acceptance_series(
                session=session, deployment_id=deployment_id, bucket_seconds=86400, **window
            )
            # The reader folded first: every acknowledged record counted, with its tokens.
            assert series["total"]["requests"] == 20
            assert series["total"]["hit_rate"] == pytest.approx(5 / 8)
            session.commit()
        assert _pending_and_minute_sum(url) == (0, 20)
        await asyncio.gather(*(batcher.submit(deployment_id, [_record(f"t{i}")]) for i in range(5)))
        assert _pending_and_minute_sum(url) == (5, 20)
        await batcher.close()  # folds what is left

    asyncio.run(run())
    assert _pending_and_minute_sum(url) == (0, 25)
    _assert_stored(url, 25)


def test_the_batcher_folds_soon_after_flushes_without_any_reader(pg_deployment: tuple[str, int]) -> None:
    url, deployment_id = pg_deployment
    batcher = IngestBatcher(get_sessionmaker(url), engine=get_engine(url), fold_delay_s=0.05)

    async def run() -> tuple[int, int]:
        for i in range(10):
            await batcher.submit(deployment_id, [_record(f"f{i}")])
        deadline = time.monotonic() + 10
        while _pending_and_minute_sum(url) != (0, 10) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        folded = _pending_and_minute_sum(url)
        await batcher.close()
        return folded

    assert asyncio.run(run()) == (0, 10)


def test_rollups_stay_inline_when_deferral_is_off(pg_deployment: tuple[str, int]) -> None:
    url, deployment_id = pg_deployment
    batcher = IngestBatcher(get_sessionmaker(url), engine=get_engine(url), defer_rollups=False)

    async def run() -> None:
        await batcher.submit(deployment_id, [_record("inline")])
        assert _pending_and_minute_sum(url) == (0, 1)
        await batcher.close()

    asyncio.run(run())


def test_relaxed_commit_applies_to_flush_transactions_only(
    pg_deployment: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, deployment_id = pg_deployment
    engine = get_engine(url)
    seen: list[str] = []
    store = batcher_module.store_batches

    def watching_store(*, session: Session, **kwargs: Any) -> list[IngestResult]:
        seen.append(str(session.execute(text("SHOW synchronous_commit")).scalar()))
        return store(session=session, **kwargs)

    monkeypatch.setattr(batcher_module, "store_batches", watching_store)

    async def run(synchronous: bool, request_id: str) -> None:
        batcher = IngestBatcher(get_sessionmaker(url), engine=engine, lanes=1, synchronous_commit=synchronous)
        assert (await batcher.submit(deployment_id, [_record(request_id)])).inserted == 1
        await batcher.close()

    asyncio.run(run(True, "durable"))
    asyncio.run(run(False, "relaxed"))
    assert seen == ["on", "off"]
    # SET LOCAL: the connection the relaxed flush used went back to the pool as it came.
    with engine.connect() as connection:
        assert connection.scalar(text("SHOW synchronous_commit")) == "on"
    _assert_stored(url, 2)


def test_dashboard_readers_count_deferred_records(pg_deployment: tuple[str, int]) -> None:
    """The overview and the deployment page fold once up front, then read every series of the
    page without folding again: each count includes records whose sums were deferred."""
    url, deployment_id = pg_deployment
    sessions = get_sessionmaker(url)
    with sessions() as session:
        for i in range(6):
            store_batches(session=session, batches=[(deployment_id, [_record(f"d{i}")])], defer_rollups=True)
        session.commit()
    assert _pending_and_minute_sum(url) == (6, 0)
    with sessions() as session:
        deployment = session.get(Deployment, deployment_id)
        assert deployment is not None
        account_name = str(session.scalar(select(Account.name).where(Account.id == deployment.account_id)))
        now = datetime.now(UTC)
        rows = overview(session=session, account_id=deployment.account_id, account_name=account_name, now=now)
        assert [row["requests_last_hour"] for row in rows["deployments"]] == [6]
    assert _pending_and_minute_sum(url) == (0, 6)
    with sessions() as session:
        store_batches(session=session, batches=[(deployment_id, [_record("d6")])], defer_rollups=True)
        session.commit()
        deployment = session.get(Deployment, deployment_id)
        assert deployment is not None
        page = deployment_view(
            session=session, deployment=deployment, account_name="a", range_name="1h", end=None, now=now
        )
        assert page["total"]["requests"] == 7
    assert _pending_and_minute_sum(url) == (0, 7)
