"""Faults under real processes: PostgreSQL restarted and the API SIGKILLed while retrying clients
ingest (every acknowledged record stored exactly once, the API answering again on its own), and
Redis restarted under a Celery worker and beat (work queued afterwards still runs). The servers
are private to each test (tests/fleet/services.py), never the machine's shared ones."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from controlplane.db.models import Deployment, DriftEvent, Role, SpeculationMode
from controlplane.db.session import get_engine, get_sessionmaker
from controlplane.ingest.formats import parse_batch
from controlplane.ingest.service import store_records
from tests.conftest import TEST_SECRET, Tenant, make_tenant, prepare_database, recreate_pg_database
from tests.fleet.ingest_load import RetryingIngestClients, count_stored
from tests.fleet.processes import ROOT, ControlPlaneProcess
from tests.fleet.services import PrivatePostgres, PrivateRedis
from tests.integration.test_drift_monitor import request_record


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    with PrivatePostgres() as pg:
        prepare_database(pg.url)
        yield pg
        get_engine(pg.url).dispose()


def _api_on(pg: PrivatePostgres, workdir: Path) -> tuple[ControlPlaneProcess, Tenant, int]:
    """A tenant with a deployment ``svc`` on ``pg`` and the API process serving it."""
    with get_sessionmaker(pg.url)() as session:
        tenant = make_tenant(session, "acme")
        deployment = Deployment(
            account_id=tenant.account_id,
            name="svc",
            target_model="reference-target",
            speculation_mode=SpeculationMode.default,
            drift_policy={},
            canary_policy={},
        )
        session.add(deployment)
        session.commit()
        deployment_id = deployment.id
    get_engine(pg.url).dispose()  # the test process holds no connection across the restarts
    api = ControlPlaneProcess(
        workdir,
        CONTROLPLANE_DATABASE_URL=pg.url,
        CONTROLPLANE_ENVIRONMENT="test",
        CONTROLPLANE_SECRET_KEY=TEST_SECRET,
        CONTROLPLANE_DRIFT_ENQUEUE_ON_INGEST="false",
        CONTROLPLANE_VAR_DIR=str(workdir / "var"),
    ).start()
    return api, tenant, deployment_id


def _wait_for_more(clients: RetryingIngestClients, than: int, timeout_s: float = 20.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        count = clients.acknowledged_count()
        if count > than:
            return count
        time.sleep(0.05)
    raise AssertionError(f"no acknowledgement beyond {than} within {timeout_s} s: {clients.tally.failures}")


def _ingest_url(api: ControlPlaneProcess) -> str:
    return f"{api.url}/v1/accounts/acme/deployments/svc/acceptance"


def test_ingest_survives_postgres_restarts_without_losing_or_duplicating(
    private_pg: PrivatePostgres, tmp_path: Path
) -> None:
    api, tenant, deployment_id = _api_on(private_pg, tmp_path)
    try:
        clients = RetryingIngestClients(
            _ingest_url(api), tenant.keys[Role.ingest], clients=4, batch=5
        ).start()
        seen = _wait_for_more(clients, 50)
        private_pg.restart()  # immediate: the server is back before the pool notices
        seen = _wait_for_more(clients, seen + 50)
        private_pg.restart(down_s=2.0)  # requests arrive while nothing listens
        _wait_for_more(clients, seen + 50)
        tally = clients.stop()
        # The same process, never restarted, answers again: its pool recovered on its own.
        assert api.process is not None and api.process.poll() is None
        assert httpx.get(f"{api.url}/readyz", timeout=5).status_code == 200
        counted = count_stored(private_pg.admin_dsn(), deployment_id, tally)
        assert not tally.refused and not tally.abandoned, tally.failures
        assert counted.lost == 0 and counted.duplicated == 0, (counted, tally.failures)
        assert counted.stored >= counted.acknowledged > 150
        assert sum(tally.failures.values()) > 0, "the restarts failed no request: they were not under load"
        # While the database was away the API said so (503 with Retry-After), never a bare 500.
        assert "500" not in tally.failures, tally.failures
    finally:
        api.stop()


def test_ingest_survives_the_api_being_killed(private_pg: PrivatePostgres, tmp_path: Path) -> None:
    api, tenant, deployment_id = _api_on(private_pg, tmp_path)
    try:
        clients = RetryingIngestClients(
            _ingest_url(api), tenant.keys[Role.ingest], clients=4, batch=5
        ).start()
        seen = _wait_for_more(clients, 50)
        api.stop(kill=True)
        time.sleep(0.5)
        api.start()
        _wait_for_more(clients, seen + 100)
        tally = clients.stop()
        counted = count_stored(private_pg.admin_dsn(), deployment_id, tally)
        assert not tally.refused and not tally.abandoned, tally.failures
        assert counted.lost == 0 and counted.duplicated == 0, (counted, tally.failures)
        assert counted.acknowledged > 150
        assert sum(tally.failures.values()) > 0, "the kill failed no request: it was not under load"
    finally:
        api.stop()


def test_worker_and_beat_carry_on_after_redis_restarts(tmp_path: Path) -> None:
    """Beat queues the drift monitor every few seconds on the private Redis; after Redis restarts
    (empty), a drop ingested afterwards is still detected: beat re-sent and the worker took it."""
    url = recreate_pg_database("controlplane_faults_redis")
    prepare_database(url)
    sessions = get_sessionmaker(url)
    rng = random.Random(21)
    with sessions() as session:
        tenant = make_tenant(session, "acme")
        deployment = Deployment(
            account_id=tenant.account_id,
            name="svc",
            target_model="reference-target",
            speculation_mode=SpeculationMode.default,
            draft_token_count=4,
            drift_policy={},
            canary_policy={},
        )
        session.add(deployment)
        session.commit()
        store_records(
            session=session,
            deployment_id=deployment.id,
            records=parse_batch({"records": [request_record(i, rng, 0.8) for i in range(1500)]}),
        )
        session.commit()
        deployment_id = deployment.id
    with PrivateRedis() as broker:
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")},
            "PYTHONPATH": str(ROOT),
            "CONTROLPLANE_DATABASE_URL": url,
            "CONTROLPLANE_BROKER_URL": broker.url,
            "CONTROLPLANE_RESULT_BACKEND_URL": broker.url,
            "CONTROLPLANE_SECRET_KEY": TEST_SECRET,
            "CONTROLPLANE_ENVIRONMENT": "test",
            "CONTROLPLANE_VAR_DIR": str(tmp_path / "var"),
        }
        (tmp_path / "var").mkdir()
        log_path = tmp_path / "celery.log"
        celery = [sys.executable, "-m", "celery", "-A", "workers.celery_app"]
        with log_path.open("wb") as log:
            worker = subprocess.Popen(
                [*celery, "worker", "-Q", "default", "-P", "solo", "--loglevel=INFO"],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            beat = subprocess.Popen(
                [*celery, "beat", "--schedule", str(tmp_path / "var" / "beat-schedule"), "--loglevel=INFO"],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            _wait_for_log(log_path, "drift.monitor_all", 60.0, "the worker's first monitor run")
            broker.restart(down_s=1.0)
            before = log_path.read_text(errors="replace").count("succeeded")
            with sessions() as session:
                store_records(
                    session=session,
                    deployment_id=deployment_id,
                    records=parse_batch(
                        {"records": [request_record(5000 + i, rng, 0.5) for i in range(400)]}
                    ),
                )
                session.commit()
            deadline = time.monotonic() + 40
            events = 0
            while time.monotonic() < deadline and not events:
                time.sleep(0.5)
                with sessions() as session:
                    events = session.scalar(select(func.count()).select_from(DriftEvent)) or 0
            text = log_path.read_text(errors="replace")
            assert events == 1, text[-4000:]
            assert text.count("succeeded") > before, text[-4000:]
            assert worker.poll() is None and beat.poll() is None, text[-4000:]
        finally:
            for process in (beat, worker):
                process.terminate()
            for process in (beat, worker):
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    get_engine(url).dispose()


def _wait_for_log(path: Path, needle: str, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if needle in path.read_text(errors="replace"):
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}\n{path.read_text(errors='replace')[-4000:]}")
