"""Fleet scale with real processes on the machine's PostgreSQL and Redis: two API processes side by
side take edge windows for the same deployments (every window stored once, whichever process a
retry lands on), and the drift monitor over aggregates sharded across two Celery worker processes
(each deployment consumed once, by its shard; the drifted one raises its event)."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import func, select

from controlplane.db.models import (
    AcceptanceAggregateRow,
    Deployment,
    DriftEvent,
    DriftMonitorState,
    EdgeWindowRow,
    Role,
    SpeculationMode,
)
from controlplane.db.session import get_engine, get_sessionmaker
from controlplane.ingest.aggregates import EdgeWindow, WindowAccumulator
from tests.conftest import TEST_SECRET, Tenant, make_tenant, prepare_database, recreate_pg_database
from tests.fleet.processes import ControlPlaneProcess, clean_env
from tests.integration.test_edge_aggregates import served

BROKER = "redis://127.0.0.1:6379/12"
ROOT = Path(__file__).resolve().parents[2]
K = 4


@pytest.fixture
def fleet_db() -> Iterator[str]:
    url = recreate_pg_database("controlplane_fleet_processes")
    prepare_database(url)
    redis.Redis.from_url(BROKER).flushdb()
    yield url
    get_engine(url).dispose()


def _tenant_with_deployments(url: str, names: list[str]) -> tuple[Tenant, dict[str, int]]:
    with get_sessionmaker(url)() as session:
        tenant = make_tenant(session, "acme")
        for name in names:
            session.add(
                Deployment(
                    account_id=tenant.account_id,
                    name=name,
                    target_model="reference-target",
                    speculation_mode=SpeculationMode.default,
                    draft_token_count=K,
                    drift_policy={"arl0_requests": 10_000, "reference_requests": 400},
                    canary_policy={},
                )
            )
        session.commit()
        ids = {name: int(i) for name, i in session.execute(select(Deployment.name, Deployment.id))}
    return tenant, ids


def _windows(
    names: list[str], minutes: int, drifted: str | None, seed: int, edge: str
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    start = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(hours=2)
    out = []
    for minute in range(minutes):
        acc = WindowAccumulator(k=K)
        for name in names:
            p = 0.5 if (name == drifted and minute >= minutes // 2) else 0.8
            for _ in range(100):
                acc.add(name, served(rng, p, "prose"))
        out.append(EdgeWindow(edge, start + timedelta(minutes=minute), 60, acc.aggregates()).to_dict())
    return out


def test_two_api_processes_store_every_window_once(fleet_db: str, tmp_path: Path) -> None:
    names = [f"svc-{i}" for i in range(3)]
    tenant, _ = _tenant_with_deployments(fleet_db, names)
    env = {
        "CONTROLPLANE_DATABASE_URL": fleet_db,
        "CONTROLPLANE_ENVIRONMENT": "test",
        "CONTROLPLANE_SECRET_KEY": TEST_SECRET,
        "CONTROLPLANE_DRIFT_ENQUEUE_ON_INGEST": "false",
    }
    apis = []
    for i in range(2):
        workdir = tmp_path / f"api{i}"
        workdir.mkdir()
        apis.append(ControlPlaneProcess(workdir, **env).start())
    try:
        headers = tenant.headers(Role.serving)
        bodies = [w for e in range(3) for w in _windows(names, 4, None, seed=e, edge=f"edge-{e}")]
        # Every window is sent to both processes at once (an edge's retry racing its first try).
        jobs = [(api.url, body) for body in bodies for api in apis]

        def post(job: tuple[str, dict[str, Any]]) -> httpx.Response:
            base, body = job
            return httpx.post(f"{base}/v1/accounts/acme/aggregates", json=body, headers=headers, timeout=60)

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(post, jobs))
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
        stored = [r.json()["stored"] for r in replies]
        assert stored.count(True) == len(bodies)  # exactly one of the two tries stored each window
        with get_sessionmaker(fleet_db)() as session:
            assert session.scalar(select(func.count()).select_from(EdgeWindowRow)) == len(bodies)
            requests = session.scalar(select(func.sum(AcceptanceAggregateRow.requests)))
        assert requests == len(bodies) * len(names) * 100
    finally:
        for api in apis:
            api.stop()


def _worker(env: dict[str, str], log: Path, name: str) -> subprocess.Popen[bytes]:
    command = [
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
        "-n",
        f"{name}@%h",
        "--loglevel=INFO",
    ]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def test_the_aggregate_monitor_runs_sharded_across_two_workers(fleet_db: str, tmp_path: Path) -> None:
    names = [f"svc-{i}" for i in range(6)]
    tenant, ids = _tenant_with_deployments(fleet_db, names)
    drifted = "svc-1"
    from fastapi.testclient import TestClient

    from controlplane.app import create_app
    from controlplane.config import Settings

    settings = Settings(
        database_url=fleet_db, environment="test", secret_key=TEST_SECRET, drift_enqueue_on_ingest=False
    )
    with TestClient(create_app(settings)) as client:
        for body in _windows(names, 10, drifted, seed=4, edge="edge-0"):
            reply = client.post(
                "/v1/accounts/acme/aggregates", json=body, headers=tenant.headers(Role.serving)
            )
            assert reply.status_code == 200, reply.text
    env = clean_env(
        CONTROLPLANE_DATABASE_URL=fleet_db,
        CONTROLPLANE_BROKER_URL=BROKER,
        CONTROLPLANE_RESULT_BACKEND_URL=BROKER,
        CONTROLPLANE_SECRET_KEY=TEST_SECRET,
        CONTROLPLANE_ENVIRONMENT="test",
        CONTROLPLANE_DRIFT_MONITOR_SHARDS="2",
    )
    workers = [_worker(env, tmp_path / f"worker{i}.log", f"w{i}") for i in range(2)]
    try:
        # As beat does: the drift pass fans out one task per shard, every couple of seconds.
        send = (
            "from workers.tasks import monitor_all; import time\n"
            "for _ in range(12):\n    monitor_all.delay(); time.sleep(1.5)\n"
        )
        sender = subprocess.Popen([sys.executable, "-c", send], cwd=ROOT, env=env)
        sessions = get_sessionmaker(fleet_db)
        deadline = time.monotonic() + 90
        consumed: dict[int, int] = {}
        while time.monotonic() < deadline:
            with sessions() as session:
                rows = session.execute(
                    select(DriftMonitorState.deployment_id, DriftMonitorState.records_examined)
                )
                consumed = {int(d): int(n) for d, n in rows}
            if len(consumed) == len(names) and set(consumed.values()) == {1_000}:
                break
            time.sleep(1.0)
        sender.wait(timeout=60)
        logs = "\n".join((tmp_path / f"worker{i}.log").read_text()[-2000:] for i in range(2))
        assert consumed == {ids[name]: 1_000 for name in names}, logs
        with sessions() as session:
            events = session.scalars(select(DriftEvent.deployment_id)).all()
        # Deterministic: every window is drawn from random.Random(seed) and each deployment's windows
        # are consumed in order, whichever worker takes them.
        assert events == [ids[drifted]], logs
        # Both workers took shard passes (the tasks are spread over the default queue).
        for i in range(2):
            assert "drift.monitor_aggregates" in (tmp_path / f"worker{i}.log").read_text(), logs
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(timeout=30)
