"""PostgreSQL crashing under ingest (the postmaster SIGKILLed, restarted with crash recovery) loses
no acknowledged record and leaves every rollup tier equal to the stored raw records: none summed
twice, none left out. Real API process, private PostgreSQL (tests/fleet/services.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.db.models import Role
from controlplane.db.session import get_engine
from tests.conftest import prepare_database
from tests.fleet.ingest_load import RetryingIngestClients, count_stored
from tests.fleet.rollup_audit import audit_rollups
from tests.fleet.services import PrivatePostgres
from tests.integration.test_faults import _api_on, _ingest_url, _wait_for_more


@pytest.fixture
def crashing_pg() -> Iterator[PrivatePostgres]:
    with PrivatePostgres() as pg:
        prepare_database(pg.url)
        yield pg
        get_engine(pg.url).dispose()


def test_postgres_crashes_lose_nothing_and_sum_nothing_twice(
    crashing_pg: PrivatePostgres, tmp_path: Path
) -> None:
    pg = crashing_pg
    api, tenant, deployment_id = _api_on(pg, tmp_path)
    try:
        # Batches of 5 leave their rollup sums to the API's fold; batches of 100 go by COPY and
        # are summed in their own transaction: a crash can land in either.
        clients = RetryingIngestClients(
            _ingest_url(api), tenant.keys[Role.ingest], clients=4, batch=(5, 5, 5, 100), categories=("a", "b")
        ).start()
        seen = _wait_for_more(clients, 200)
        pg.crash()  # back at once: the pool's connections are dead, the server is new
        seen = _wait_for_more(clients, seen + 200)
        pg.crash(down_s=2.0)  # requests arrive while nothing listens
        _wait_for_more(clients, seen + 200)
        tally = clients.stop()
        assert pg.recoveries() == 2  # each start replayed the WAL: these were crashes
        counted = count_stored(pg.admin_dsn(), deployment_id, tally)
        assert not tally.refused and not tally.abandoned, tally.failures
        assert counted.lost == 0, (counted, tally.failures)
        assert sum(tally.failures.values()) > 0, "the crashes failed no request: they were not under load"
        # The API folds deferred sums within a second of a flush (retrying each second while the
        # database is away); the audit counts pending records apart, so wait for them to go.
        deadline = time.monotonic() + 30
        while (audit := audit_rollups(pg.admin_dsn(), [deployment_id])).pending_records:
            assert time.monotonic() < deadline, f"{audit.pending_records} records never folded"
            time.sleep(0.5)
        assert audit.raw_records == counted.stored
        assert audit.double_counted_records == 0, audit.samples
        assert audit.missing_records == 0, audit.samples
        assert audit.mismatched_buckets == 0, audit.samples
    finally:
        api.stop()
