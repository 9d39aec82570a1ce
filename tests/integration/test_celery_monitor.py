"""The drift monitor through a real Celery worker process on the machine's Redis and PostgreSQL."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import func, select

from controlplane.db.models import Deployment, DriftEvent, SpeculationMode
from controlplane.db.session import get_engine, get_sessionmaker
from controlplane.ingest.formats import parse_batch
from controlplane.ingest.service import store_records
from tests.conftest import TEST_SECRET, make_tenant, prepare_database, recreate_pg_database
from tests.integration.test_drift_monitor import request_record

BROKER = "redis://127.0.0.1:6379/14"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def worker_env() -> Iterator[dict[str, str]]:
    url = recreate_pg_database("controlplane_celery_test")
    prepare_database(url)
    redis.Redis.from_url(BROKER).flushdb()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")},
        "CONTROLPLANE_DATABASE_URL": url,
        "CONTROLPLANE_BROKER_URL": BROKER,
        "CONTROLPLANE_RESULT_BACKEND_URL": BROKER,
        "CONTROLPLANE_SECRET_KEY": TEST_SECRET,
        "CONTROLPLANE_ENVIRONMENT": "test",
    }
    yield env
    get_engine(url).dispose()


def test_a_worker_process_detects_the_drop(worker_env: dict[str, str], tmp_path: Path) -> None:
    url = worker_env["CONTROLPLANE_DATABASE_URL"]
    sessions = get_sessionmaker(url)
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
        pk = deployment.id
        rng = random.Random(21)
        records = [request_record(i, rng, 0.8) for i in range(1500)]
        records += [request_record(5000 + i, rng, 0.5) for i in range(400)]
        store_records(session=session, deployment_id=pk, records=parse_batch({"records": records}))
        session.commit()
    log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "workers.celery_app",
            "worker",
            "-Q",
            "default",
            "-P",
            "solo",
            "--loglevel=INFO",
        ],
        cwd=ROOT,
        env=worker_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        env_for_client = {**worker_env}
        # Send from a separate process too, as the beat process would.
        send = (
            "from workers.tasks import monitor_all; import time\n"
            "for _ in range(3):\n    monitor_all.delay(); time.sleep(1.5)\n"
        )
        subprocess.run([sys.executable, "-c", send], cwd=ROOT, env=env_for_client, check=True, timeout=60)
        deadline = time.monotonic() + 60
        events = 0
        while time.monotonic() < deadline:
            with sessions() as session:
                events = session.scalar(select(func.count()).select_from(DriftEvent)) or 0
            if events:
                break
            time.sleep(0.5)
        # Deterministic: the records come from random.Random(21).
        assert events == 1, (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        log.close()


def test_ingestion_alone_drives_the_monitor(worker_env: dict[str, str], tmp_path: Path) -> None:
    """No beat: the API's ingest nudges the worker, which comes back until the records settle."""
    from fastapi.testclient import TestClient

    from controlplane.app import create_app
    from controlplane.config import Settings
    from controlplane.db.models import Role

    url = worker_env["CONTROLPLANE_DATABASE_URL"]
    settings = Settings(database_url=url, broker_url=BROKER, environment="test", secret_key=TEST_SECRET)
    with get_sessionmaker(url)() as session:
        tenant = make_tenant(session, "acme")
        session.commit()
    log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "-Q", "default", "-P", "solo"],
        cwd=ROOT,
        env=worker_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        with TestClient(create_app(settings)) as client:
            headers = tenant.headers(Role.admin)
            client.post(
                "/v1/accounts/acme/deployments",
                json={
                    "target_model": "reference-target",
                    "deployment_id": "svc",
                    "draft_model": "reference-drafter",
                    "draft_token_count": 4,
                },
                headers=headers,
            )
            rng = random.Random(5)
            records = [request_record(i, rng, 0.8) for i in range(1500)]
            records += [request_record(5000 + i, rng, 0.5) for i in range(400)]
            for start in range(0, len(records), 500):
                response = client.post(
                    "/v1/accounts/acme/deployments/svc/acceptance",
                    json={"records": records[start : start + 500]},
                    headers=tenant.headers(Role.ingest),
                )
                assert response.status_code == 200
            deadline = time.monotonic() + 60
            events: list[dict[str, object]] = []
            while time.monotonic() < deadline and not events:
                time.sleep(0.5)
                events = client.get("/v1/accounts/acme/deployments/svc/drift-events", headers=headers).json()[
                    "drift_events"
                ]
        # Deterministic: the records come from random.Random(5).
        assert len(events) == 1, (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        log.close()
