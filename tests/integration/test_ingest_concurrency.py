"""Concurrent writers on real PostgreSQL: overlapping request ids and shared rollup rows.

Several threads, each with its own connection and transactions (as several API processes
would), store batches that repeat each other's ids, through both write paths (the one-statement
INSERT for small batches, COPY for large ones). Every id must be stored once, every batch's
inserted + duplicate counts must add up to what was stored, no writer may deadlock, and every
rollup tier must equal a recount of the stored rows. With deferred rollups, a folding thread
runs beside the writers (as the batcher of every API process does) and must add each record's
sums exactly once.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select, text

from controlplane.db.models import (
    AcceptanceRecordRow,
    AcceptanceRollupRow,
)
from controlplane.db.session import get_sessionmaker
from controlplane.ingest.record import AcceptanceRecord
from controlplane.ingest.rollups import RESOLUTIONS
from controlplane.ingest.service import SMALL_BATCH_RECORDS, IngestResult, fold_pending_rollups, store_batches
from tests.conftest import add_deployment, prepare_database, recreate_pg_database

WRITERS = 4
ROUNDS = 30
START = datetime(2026, 11, 2, 5, 58, tzinfo=UTC)  # minutes cross an hour and a 6-hour edge


def _record(request_id: str, rng: random.Random) -> AcceptanceRecord:
    accepted = rng.randint(0, 8)
    return AcceptanceRecord(
        request_id=request_id,
        drafted_tokens=8,
        accepted_tokens=accepted,
        verify_steps=2,
        generated_tokens=accepted + 2,
        accepted_per_position=[min(accepted, 4), max(0, min(accepted - 4, 4))],
        inter_token_ms=rng.uniform(5, 30),
        total_ms=rng.uniform(100, 900),
        arm=rng.choice(["live", "baseline"]),
        created_at=START + timedelta(seconds=rng.randrange(0, 5 * 60)),
    )


@pytest.mark.parametrize(
    ("batch_size", "deferred"),
    [
        (1, False),
        (SMALL_BATCH_RECORDS, False),
        (SMALL_BATCH_RECORDS * 4, False),
        (1, True),
        (SMALL_BATCH_RECORDS, True),
    ],
)
def test_concurrent_writers_store_each_id_once_and_keep_rollups_exact(
    batch_size: int, deferred: bool
) -> None:
    url = recreate_pg_database(f"controlplane_writers_{batch_size}_{int(deferred)}")
    prepare_database(url)
    sessions = get_sessionmaker(url)
    with sessions() as session:
        deployment_id = add_deployment(session, "writers").id
        session.commit()

    # Ids drawn from a pool shared by every writer, so batches collide both inside one round
    # and with what earlier rounds stored.
    pool = [f"req-{i}" for i in range(batch_size * WRITERS * 3)]
    results: list[IngestResult] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(WRITERS)
    lock = threading.Lock()

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(ROUNDS):
                ids = rng.sample(pool, batch_size)
                # A request id's values follow from the id: every writer re-sends the same record
                # (a different one would be a conflict, refused whole).
                records = [_record(request_id, random.Random(request_id)) for request_id in ids]
                barrier.wait(timeout=60)
                # No retry: on PostgreSQL a duplicate, even one in flight, must never fail a batch.
                with sessions() as session:
                    [result] = store_batches(
                        session=session, batches=[(deployment_id, records)], defer_rollups=deferred
                    )
                    session.commit()
                with lock:
                    results.append(result)
        except BaseException as exc:  # reported below, with the barrier released for the others
            errors.append(exc)
            barrier.abort()

    writing = threading.Event()
    writing.set()
    folds: list[int] = []

    def folder() -> None:
        # Each fold in a transaction of its own, with either filter, as the batchers of several
        # API processes and readers of rollups run them.
        try:
            while writing.is_set():
                with sessions() as session:
                    folds.append(fold_pending_rollups(session=session))
                    session.commit()
                with sessions() as session:
                    folds.append(fold_pending_rollups(session=session, deployment_ids=[deployment_id]))
                    session.commit()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(seed,)) for seed in range(WRITERS)]
    folders = [threading.Thread(target=folder) for _ in range(2 if deferred else 0)]
    for thread in threads + folders:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    writing.clear()
    for thread in folders:
        thread.join(timeout=60)
    assert not errors, errors
    if deferred:
        assert sum(folds) > 0  # the folders ran while writers wrote
        with sessions() as session:
            fold_pending_rollups(session=session)
            session.commit()
    assert len(results) == WRITERS * ROUNDS

    with sessions() as session:
        stored = session.scalars(
            select(AcceptanceRecordRow.request_id).where(AcceptanceRecordRow.deployment_id == deployment_id)
        ).all()
        assert len(stored) == len(set(stored))  # the unique constraint held
        assert sum(r.inserted for r in results) == len(stored)
        assert sum(r.inserted + r.duplicates for r in results) == WRITERS * ROUNDS * batch_size
        assert any(r.duplicates for r in results)  # the ids really collided

        # Every tier equals a recount of the stored rows, per arm.
        truth = Counter()
        for arm, requests, accepted in session.execute(
            select(AcceptanceRecordRow.arm, func.count(), func.sum(AcceptanceRecordRow.accepted_tokens))
            .where(AcceptanceRecordRow.deployment_id == deployment_id)
            .group_by(AcceptanceRecordRow.arm)
        ):
            truth[(arm, "requests")] = requests
            truth[(arm, "accepted")] = accepted
        for resolution in RESOLUTIONS:
            tier = Counter()
            for arm, requests, accepted in session.execute(
                select(
                    AcceptanceRollupRow.arm,
                    func.sum(AcceptanceRollupRow.requests),
                    func.sum(AcceptanceRollupRow.accepted_tokens),
                )
                .where(
                    AcceptanceRollupRow.deployment_id == deployment_id,
                    AcceptanceRollupRow.resolution_s == resolution,
                )
                .group_by(AcceptanceRollupRow.arm)
            ):
                tier[(arm, "requests")] = requests
                tier[(arm, "accepted")] = accepted
            assert tier == truth, resolution
        # Histograms count every stored request once, in every tier.
        hist_total = session.execute(
            text(
                "SELECT resolution_s, SUM((SELECT SUM(value::bigint)"
                " FROM json_array_elements_text(total_ms_hist) WITH ORDINALITY AS e(value, n)"
                " WHERE n > 1)) FROM acceptance_rollups"
                " WHERE deployment_id = :d GROUP BY resolution_s"
            ),
            {"d": deployment_id},
        ).all()
        assert {resolution: int(total) for resolution, total in hist_total} == dict.fromkeys(
            RESOLUTIONS, len(stored)
        )
