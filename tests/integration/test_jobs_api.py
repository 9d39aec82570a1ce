"""Jobs: one active realignment per deployment (even under concurrent requests), the state machine,
progress and cancellation, through the API on both dialects."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, func, select

from controlplane.db.models import Account, Deployment, Job, JobState, Role
from controlplane.db.session import get_engine, get_sessionmaker
from controlplane.jobs.service import (
    finish_job,
    report_progress,
    request_realign,
    start_job,
)
from controlplane.jobs.states import ALLOWED, IllegalTransitionError, can_transition, transition
from tests.conftest import Database, RecordingWorkQueue, Tenant, add_deployment_to, make_tenant

BASE = "/v1/accounts/acme/deployments"


@pytest.fixture
def acme(client: TestClient, tenants: tuple[Tenant, Tenant]) -> Tenant:
    tenant = tenants[0]
    response = client.post(
        BASE,
        json={"target_model": "reference-target", "deployment_id": "svc"},
        headers=tenant.headers(Role.admin),
    )
    assert response.status_code == 201
    return tenant


def test_state_machine_refuses_illegal_transitions() -> None:
    legal = {
        (JobState.queued, JobState.running),
        (JobState.queued, JobState.failed),
        (JobState.queued, JobState.cancelled),
        (JobState.running, JobState.queued),  # an attempt failed or lost its worker: retried later
        (JobState.running, JobState.running),  # redelivered after a worker crash
        (JobState.running, JobState.succeeded),
        (JobState.running, JobState.failed),
        (JobState.running, JobState.cancelled),
    }
    for current in JobState:
        for new in JobState:
            assert can_transition(current, new) == ((current, new) in legal), (current, new)
            if (current, new) not in legal:
                with pytest.raises(IllegalTransitionError):
                    transition(current, new)
    assert set(ALLOWED) == set(JobState)


def test_realign_creates_one_job_and_returns_it_again(
    client: TestClient, acme: Tenant, queue: RecordingWorkQueue
) -> None:
    admin = acme.headers(Role.admin)
    first = client.post(f"{BASE}/svc:realign", json={"params": {"time_budget_s": 60}}, headers=admin)
    assert first.status_code == 202, first.text
    body = first.json()
    assert body["created"] is True and body["state"] == "queued" and body["params"] == {"time_budget_s": 60}
    second = client.post(f"{BASE}/svc:realign", headers=admin)
    assert second.status_code == 200
    assert second.json()["id"] == body["id"] and second.json()["created"] is False
    assert queue.sent == [body["id"]]  # the second request enqueues nothing
    listed = client.get(f"{BASE}/svc/jobs", headers=acme.headers(Role.viewer)).json()["jobs"]
    assert [j["id"] for j in listed] == [body["id"]]
    got = client.get(f"{BASE}/svc/jobs/{body['id']}", headers=acme.headers(Role.viewer)).json()
    assert got["kind"] == "realign" and got["attempts"] == 0
    assert client.get(f"{BASE}/svc/jobs/999999", headers=admin).status_code == 404
    bad = client.post(f"{BASE}/svc:realign", json={"params": {"learning_rate": 1}}, headers=admin)
    assert bad.status_code == 422


def test_roles(client: TestClient, acme: Tenant, queue: RecordingWorkQueue) -> None:
    for role in (Role.viewer, Role.ingest):
        assert client.post(f"{BASE}/svc:realign", headers=acme.headers(role)).status_code == 403
    assert client.get(f"{BASE}/svc/jobs", headers=acme.headers(Role.ingest)).status_code == 403
    job_id = client.post(f"{BASE}/svc:realign", headers=acme.headers(Role.admin)).json()["id"]
    cancel = client.post(f"{BASE}/svc/jobs/{job_id}:cancel", headers=acme.headers(Role.viewer))
    assert cancel.status_code == 403
    assert queue.sent == [job_id]


def test_cancel_and_worker_transitions(
    client: TestClient, acme: Tenant, queue: RecordingWorkQueue, db: Database
) -> None:
    admin = acme.headers(Role.admin)
    job_id = client.post(f"{BASE}/svc:realign", headers=admin).json()["id"]
    session = db.new_session()
    job = start_job(session=session, job_id=job_id, celery_task_id="t1")
    assert job.state == JobState.running and job.attempts == 1
    assert report_progress(session=session, job_id=job_id, fraction=0.25, message="epoch 1")
    session.commit()
    # A redelivered message restarts the running job: one more attempt.
    assert start_job(session=session, job_id=job_id).attempts == 2
    session.commit()
    session.close()
    got = client.get(f"{BASE}/svc/jobs/{job_id}", headers=admin).json()
    assert (
        got["state"] == "running"
        and got["progress"] == 0.25
        and got["progress_message"].startswith("attempt")
    )

    cancelled = client.post(f"{BASE}/svc/jobs/{job_id}:cancel", headers=admin)
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    session = db.new_session()
    # The worker learns of the cancel at its next progress checkpoint, and cannot finish the job.
    assert report_progress(session=session, job_id=job_id, fraction=0.5, message="epoch 2") is False
    with pytest.raises(IllegalTransitionError):
        finish_job(session=session, job_id=job_id, result={})
    session.rollback()
    session.close()
    again = client.post(f"{BASE}/svc/jobs/{job_id}:cancel", headers=admin)
    assert again.status_code == 409
    # The cancelled job no longer blocks a new realignment.
    fresh = client.post(f"{BASE}/svc:realign", headers=admin)
    assert fresh.status_code == 202 and fresh.json()["id"] != job_id
    states = [j["state"] for j in client.get(f"{BASE}/svc/jobs", headers=admin).json()["jobs"]]
    assert states == ["queued", "cancelled"]
    assert client.get(f"{BASE}/svc/jobs?state=cancelled", headers=admin).json()["jobs"][0]["id"] == job_id
    assert client.get(f"{BASE}/svc/jobs?state=bogus", headers=admin).status_code == 422


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_two_concurrent_requests_start_one_job(
    dialect: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Two transactions insert at once: the unique index makes the second return the first's job."""
    if dialect == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        shutil.copy(template, tmp_path / "race.db")
        url = f"sqlite:///{tmp_path / 'race.db'}"
    else:
        url = request.getfixturevalue("migrated_pg_url")
    sessions = get_sessionmaker(url)
    with sessions() as session:
        tenant = make_tenant(session, f"race{dialect}")
        deployment = add_deployment_to(session, tenant.account_id, "svc")
        session.commit()
        deployment_id = deployment.id
    try:
        first_flushed = threading.Event()
        results: dict[str, int] = {}
        errors: list[BaseException] = []

        def first() -> None:
            try:
                with sessions() as session:
                    target = session.get_one(Deployment, deployment_id)
                    outcome = request_realign(session=session, deployment=target, actor="drift:1")
                    first_flushed.set()
                    time.sleep(0.5)  # hold the row uncommitted while the other request arrives
                    session.commit()
                    results["first"] = outcome.job.id
            except BaseException as exc:  # surfaced below
                first_flushed.set()
                errors.append(exc)

        def second() -> None:
            try:
                first_flushed.wait(10)
                with sessions() as session:
                    target = session.get_one(Deployment, deployment_id)
                    outcome = request_realign(session=session, deployment=target, actor="drift:2")
                    session.commit()
                    results["second"] = outcome.job.id
                    results["second_created"] = int(outcome.created)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert results["first"] == results["second"] and results["second_created"] == 0
        with sessions() as session:
            count = session.scalar(
                select(func.count()).select_from(Job).where(Job.deployment_id == deployment_id)
            )
        assert count == 1
    finally:
        with sessions() as session:
            session.execute(delete(Account).where(Account.id == tenant.account_id))
            session.commit()
        if dialect == "sqlite":
            get_engine(url).dispose()


def test_a_worker_process_turns_a_realign_request_into_a_candidate(tmp_path: Path) -> None:
    """The whole path: API request -> Redis -> a real Celery worker on the gpu queue -> candidate."""
    import os
    import subprocess
    import sys

    import redis

    from controlplane.app import create_app
    from controlplane.artifacts.store import VerifiedArtifactCache
    from controlplane.config import Settings
    from controlplane.db.migrate import upgrade_to_head
    from controlplane.db.models import DrafterVersion, Trace, TraceSource
    from tests.conftest import TEST_SECRET, recreate_pg_database
    from workers.engine.hf_io import load_hf_folder, save_hf_folder
    from workers.engine.model import ModelConfig, build_model
    from workers.engine.tokenizer import Tokenizer

    broker = "redis://127.0.0.1:6379/13"
    root = Path(__file__).resolve().parents[2]
    url = recreate_pg_database("controlplane_realign_worker_test")
    upgrade_to_head(url)
    redis.Redis.from_url(broker).flushdb()
    tokenizer = Tokenizer.from_file(root / "workers" / "models" / "reference" / "target")
    config = ModelConfig(
        vocab_size=4096, dim=32, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=64, max_seq_len=256
    )
    models = tmp_path / "models"
    save_hf_folder(build_model(config, seed=1), tokenizer, models / "target")
    save_hf_folder(build_model(config, seed=2), tokenizer, models / "drafter")
    with get_sessionmaker(url)() as session:
        tenant = make_tenant(session, "acme")
        session.commit()
    settings = Settings(
        database_url=url, broker_url=broker, environment="test", secret_key=TEST_SECRET, model_roots=[models]
    )
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")},
        "CONTROLPLANE_DATABASE_URL": url,
        "CONTROLPLANE_BROKER_URL": broker,
        "CONTROLPLANE_RESULT_BACKEND_URL": broker,
        "CONTROLPLANE_SECRET_KEY": TEST_SECRET,
        "CONTROLPLANE_ENVIRONMENT": "test",
        "CONTROLPLANE_ARTIFACT_DIR": str(tmp_path / "artifacts"),
        "CONTROLPLANE_MODEL_ROOTS": json.dumps([str(models)]),
        "OMP_NUM_THREADS": "1",
    }
    log = (tmp_path / "worker.log").open("w")
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "-Q", "gpu", "-P", "solo"],
        cwd=root,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        with TestClient(create_app(settings)) as client:
            admin = tenant.headers(Role.admin)
            for name, folder, drafts_for in (("tiny", "target", []), ("tiny-drafter", "drafter", ["tiny"])):
                registered = client.post(
                    "/v1/accounts/acme/models",
                    json={"name": name, "path": folder, "drafter_for": drafts_for},
                    headers=admin,
                )
                assert registered.status_code == 201, registered.text
            created = client.post(
                BASE,
                json={
                    "target_model": "tiny",
                    "deployment_id": "svc",
                    "draft_model": "tiny-drafter",
                    "draft_token_count": 4,
                },
                headers=admin,
            )
            assert created.status_code == 201, created.text
            with get_sessionmaker(url)() as session:
                deployment_id = session.scalar(select(Deployment.id).where(Deployment.name == "svc"))
                for i in range(24):
                    session.add(
                        Trace(
                            deployment_id=deployment_id,
                            source=TraceSource.sampled,
                            prompt=f"def f{i}(x):\n",
                            completion=f"    return x + {i}\n\nprint(f{i}(2))\n",
                        )
                    )
                session.commit()
            job = client.post(
                f"{BASE}/svc:realign", json={"params": {"time_budget_s": 5}}, headers=admin
            ).json()
            deadline = time.monotonic() + 120
            state = job["state"]
            while time.monotonic() < deadline and state not in ("succeeded", "failed", "cancelled"):
                time.sleep(0.5)
                state = client.get(f"{BASE}/svc/jobs/{job['id']}", headers=admin).json()["state"]
            done = client.get(f"{BASE}/svc/jobs/{job['id']}", headers=admin).json()
        assert done["state"] == "succeeded", (done, (tmp_path / "worker.log").read_text()[-3000:])
        assert done["attempts"] == 1 and done["result"]["drafter_version"] == 1
        with get_sessionmaker(url)() as session:
            versions = list(session.scalars(select(DrafterVersion)))
        assert len(versions) == 1 and versions[0].training_job_id == job["id"]
        # Stored through the default file:// store under the artifact dir, verified by its manifest.
        assert versions[0].artifact_path.startswith("file://") and versions[0].manifest_sha256
        local = VerifiedArtifactCache(tmp_path / "cache").local_folder(
            versions[0].artifact_path, versions[0].manifest_sha256
        )
        load_hf_folder(local, expected_sha256=versions[0].artifact_sha256)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        log.close()
        get_engine(url).dispose()
