"""Rollup sums equal the sums of the stored raw records after retried and duplicated batches, on
real PostgreSQL: batches re-sent after they were stored, re-sent within one shared flush, partly
overlapping, large enough to go by COPY, and deferred to the fold; and the audit that says so
(tests/fleet/rollup_audit.py) finds a record summed twice or not at all when one is. Also: a
crashed private PostgreSQL (postmaster SIGKILLed) recovers every committed row."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from sqlalchemy import text

from controlplane.db.models import Deployment
from controlplane.db.session import get_engine, get_sessionmaker
from controlplane.ingest.aggregate_rollups import fold_aggregate_rollups
from controlplane.ingest.aggregate_store import store_edge_window
from controlplane.ingest.aggregates import parse_edge_window
from controlplane.ingest.batcher import IngestBatcher
from controlplane.ingest.formats import parse_batch
from controlplane.ingest.record import AcceptanceRecord
from controlplane.ingest.service import IngestResult, fold_pending_rollups
from tests.conftest import add_deployment, prepare_database, recreate_pg_database
from tests.fleet.ingest_load import acceptance_record, edge_window_body
from tests.fleet.rollup_audit import RESOLUTIONS, audit_rollups
from tests.fleet.services import PrivatePostgres


@pytest.fixture(scope="module")
def audited_url() -> str:
    url = recreate_pg_database("controlplane_rollup_audit")
    prepare_database(url)
    return url


def _dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def _records(prefix: str, count: int, rng: random.Random, start: datetime) -> list[dict[str, object]]:
    """``count`` native records spread over two hours (several buckets of every tier but the
    day), some with a category, arm and latencies of their own."""
    out = []
    for i in range(count):
        record = acceptance_record(f"{prefix}-{i}", rng)
        record["created_at"] = (start + timedelta(seconds=rng.uniform(0, 7200))).isoformat()
        if i % 3 == 0:
            record["category"] = rng.choice(["code", "prose", "sql"])
        if i % 4 == 0:
            record["arm"] = "baseline"
            record.update(drafted_tokens=0, accepted_tokens=0, accepted_per_position=[], k=None)
            record["generated_tokens"] = record["verify_steps"]
        if i % 5 == 0:
            record.update(ttft_ms=rng.uniform(5, 50), inter_token_ms=rng.uniform(1, 9))
        out.append(record)
    return out


def _parsed(records: Sequence[dict[str, object]]) -> list[AcceptanceRecord]:
    return parse_batch({"records": list(records)})


def _submit(url: str, requests: Sequence[tuple[int, list[dict[str, object]]]]) -> list[IngestResult]:
    """Submit ``requests`` in one tick (so they share flushes), through a batcher of their own."""

    async def run() -> list[IngestResult | BaseException]:
        batcher = IngestBatcher(get_sessionmaker(url), engine=get_engine(url))
        outcomes = await asyncio.gather(
            *(batcher.submit(deployment_id, _parsed(records)) for deployment_id, records in requests),
            return_exceptions=True,
        )
        await batcher.close()
        return list(outcomes)

    outcomes = asyncio.run(run())
    failed = [o for o in outcomes if not isinstance(o, IngestResult)]
    assert not failed, failed
    return [o for o in outcomes if isinstance(o, IngestResult)]


def test_rollups_equal_raw_sums_after_retried_and_duplicated_batches(audited_url: str) -> None:
    url = audited_url
    with get_sessionmaker(url)() as session:
        deployment_id = add_deployment(session, "retries").id
        session.commit()
    rng = random.Random(5)
    start = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    small = [_records(f"s{b}", 5, rng, start) for b in range(12)]  # deferred to the fold
    large = _records("copy", 300, rng, start)  # past SMALL_BATCH_RECORDS: COPY, summed in place
    first = _submit(url, [(deployment_id, batch) for batch in small] + [(deployment_id, large)])
    assert sum(r.inserted for r in first) == 12 * 5 + 300
    # Every batch again, twice within one flush, plus batches half old and half new; the large
    # one again, whose COPY now meets stored ids.
    overlapping = [small[b][:3] + _records(f"n{b}", 2, rng, start) for b in range(4)]
    again = [(deployment_id, batch) for batch in small for _ in range(2)]
    again += [(deployment_id, large), (deployment_id, large[:150] + _records("copy-new", 100, rng, start))]
    again += [(deployment_id, batch) for batch in overlapping]
    second = _submit(url, again)
    assert sum(r.inserted for r in second) == 100 + 4 * 2
    assert sum(r.duplicates for r in second) == 2 * 12 * 5 + 300 + 150 + 4 * 3
    audit = audit_rollups(_dsn(url), [deployment_id])
    assert audit.pending_records == 0  # the batcher folded on close
    assert audit.raw_records == 12 * 5 + 300 + 100 + 4 * 2
    assert audit.double_counted_records == 0, audit.samples
    assert audit.missing_records == 0, audit.samples
    assert audit.mismatched_buckets == 0, audit.samples
    assert audit.unknown_resolution_rows == 0


def _clean_deployment(url: str, name: str) -> int:
    """A deployment holding 20 records over half an hour, folded, whose audit finds nothing."""
    with get_sessionmaker(url)() as session:
        deployment_id = add_deployment(session, name).id
        session.commit()
    rng = random.Random(name)
    start = datetime.now(UTC) - timedelta(minutes=30)
    _submit(url, [(deployment_id, _records(f"c{b}", 5, rng, start)) for b in range(4)])
    audit = audit_rollups(_dsn(url), [deployment_id])
    assert (audit.double_counted_records, audit.missing_records, audit.mismatched_buckets) == (0, 0, 0)
    return deployment_id


def _execute(url: str, sql: str, deployment_id: int) -> int:
    with get_engine(url).begin() as conn:
        return int(conn.execute(text(sql), {"d": deployment_id}).scalar_one())


def test_the_audit_finds_a_record_summed_twice(audited_url: str) -> None:
    deployment_id = _clean_deployment(audited_url, "summed-twice")
    # A fold that sums one record again: its pending row put back after it was folded.
    _execute(
        audited_url,
        "INSERT INTO acceptance_rollup_pending (record_id, deployment_id)"
        " SELECT min(id), :d FROM acceptance_records WHERE deployment_id = :d RETURNING record_id",
        deployment_id,
    )
    with get_sessionmaker(audited_url)() as session:
        assert fold_pending_rollups(session=session, deployment_ids=[deployment_id]) == 1
        session.commit()
    audit = audit_rollups(_dsn(audited_url), [deployment_id])
    assert audit.double_counted_by_resolution == dict.fromkeys(RESOLUTIONS, 1)
    assert audit.missing_records == 0 and audit.mismatched_buckets == len(RESOLUTIONS)


def test_the_audit_finds_records_missing_from_one_tier(audited_url: str) -> None:
    deployment_id = _clean_deployment(audited_url, "row-lost")
    gone = _execute(
        audited_url,
        "DELETE FROM acceptance_rollups WHERE id = (SELECT min(id) FROM acceptance_rollups"
        " WHERE deployment_id = :d AND resolution_s = 60) RETURNING requests",
        deployment_id,
    )
    audit = audit_rollups(_dsn(audited_url), [deployment_id])
    assert gone >= 1
    assert audit.missing_by_resolution == {**dict.fromkeys(RESOLUTIONS, 0), 60: gone}
    assert audit.double_counted_records == 0 and audit.mismatched_buckets == 1


def test_the_audit_finds_tokens_summed_wrong_where_request_counts_agree(audited_url: str) -> None:
    deployment_id = _clean_deployment(audited_url, "tokens-off")
    _execute(
        audited_url,
        "UPDATE acceptance_rollups SET drafted_tokens = drafted_tokens + 1 WHERE id = (SELECT"
        " max(id) FROM acceptance_rollups WHERE deployment_id = :d AND resolution_s = 86400)"
        " RETURNING id",
        deployment_id,
    )
    audit = audit_rollups(_dsn(audited_url), [deployment_id])
    assert (audit.double_counted_records, audit.missing_records, audit.mismatched_buckets) == (0, 0, 1)
    assert "drafted_tokens" in audit.samples[0] and ", 86400, " in audit.samples[0]


def test_edge_aggregates_are_audited_with_the_records_and_a_window_folded_twice_is_found(
    audited_url: str,
) -> None:
    deployment_id = _clean_deployment(audited_url, "with-edges")
    rng = random.Random(8)
    first = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(days=2)
    # The deployment's own account sends the windows: aggregates name deployments within it.
    with get_sessionmaker(audited_url)() as session:
        account_id = session.get_one(Deployment, deployment_id).account_id
        for n in range(6):
            body = edge_window_body("edge-a", first + timedelta(minutes=n), "d", rng)
            store_edge_window(
                session=session, account_id=account_id, window=parse_edge_window(body), from_serving_key=False
            )
        session.commit()
    with get_sessionmaker(audited_url)() as session:
        assert fold_aggregate_rollups(session=session).windows == 6
        session.commit()
    audit = audit_rollups(_dsn(audited_url), [deployment_id])
    assert audit.aggregated_requests == 6 * 20
    assert (audit.double_counted_records, audit.missing_records, audit.mismatched_buckets) == (0, 0, 0)
    # One window folded again, as a fold that forgot its mark would.
    _execute(
        audited_url,
        "UPDATE edge_windows SET rolled_up_at = NULL WHERE id = (SELECT min(w.id) FROM edge_windows w"
        " JOIN acceptance_aggregates a ON a.edge_window_id = w.id WHERE a.deployment_id = :d) RETURNING id",
        deployment_id,
    )
    with get_sessionmaker(audited_url)() as session:
        assert fold_aggregate_rollups(session=session).windows == 1
        session.commit()
    twice = audit_rollups(_dsn(audited_url), [deployment_id])
    assert twice.double_counted_by_resolution == dict.fromkeys(RESOLUTIONS, 20)


def test_a_crashed_private_postgres_recovers_every_committed_row() -> None:
    with PrivatePostgres() as pg:
        with psycopg.connect(pg.admin_dsn(), autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (n integer)")
            conn.execute("INSERT INTO kept SELECT generate_series(1, 1000)")
        open_transaction = psycopg.connect(pg.admin_dsn())
        open_transaction.execute("INSERT INTO kept VALUES (-1)")  # never committed
        pg.crash()
        open_transaction.close()
        assert pg.recoveries() == 1  # the start replayed the WAL: no shutdown checkpoint was written
        with psycopg.connect(pg.admin_dsn()) as conn:
            assert conn.execute("SELECT count(*), min(n) FROM kept").fetchone() == (1000, 1)
        pg.restart()
        assert pg.recoveries() == 1  # a clean restart needs none
