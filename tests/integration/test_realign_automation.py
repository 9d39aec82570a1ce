"""Automatic realignment, end to end with a real Redis and a real Celery worker process.

- a drift event on an ``auto_realign`` deployment queues a job in the event's transaction; the
  worker trains it into a candidate version whose artifact matches its checksum;
- a worker SIGKILLed mid-job, then a new worker: the attempt's lease lapses, the sweep queues the
  job again and sends it, and the job ends with exactly one candidate (its second attempt's);
- two simultaneous drift events start one job;
- a lost message is re-sent by the beat sweeper, and a cancel during training ends the job
  cancelled with no version;
- a new target model flags the deployment's drafter stale (API, both dialects).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from celery import Celery
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from controlplane.artifacts.store import VerifiedArtifactCache
from controlplane.canary.phases import CanaryDecision
from controlplane.canary.service import UnverifiedArtifactError, promote, start_canary
from controlplane.config import Settings, get_settings
from controlplane.db.migrate import upgrade_to_head
from controlplane.db.models import (
    AuditEntry,
    Canary,
    Deployment,
    DrafterState,
    DrafterVersion,
    DriftEvent,
    DriftState,
    Job,
    JobState,
    Role,
    SpeculationMode,
    Trace,
    TraceSource,
)
from controlplane.db.session import get_engine, get_sessionmaker
from controlplane.drafters.serving import serving_config
from controlplane.ingest.formats import parse_batch
from controlplane.ingest.service import store_records
from controlplane.jobs.service import (
    cancel_job,
    claim_stale_queued_realigns,
    realign_on_drift,
    request_realign,
)
from controlplane.loop.drift import advance_monitor
from controlplane.models.service import ModelSource, register_model
from controlplane.timestamps import utcnow
from tests import s3_server
from tests.conftest import TEST_SECRET, Database, Tenant, make_tenant, recreate_pg_database
from tests.integration.test_drift_monitor import request_record
from workers.engine.hf_io import load_hf_folder, save_hf_folder
from workers.engine.model import ModelConfig, build_model
from workers.engine.tokenizer import Tokenizer
from workers.training.realign import verify_artifact

# A Redis database of its own: other test modules flush 13 and 14.
BROKER = "redis://127.0.0.1:6379/9"
ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "workers" / "models" / "reference"
# A dead worker's attempt is given up once its lease lapses (production: a minute).
LEASE_S = 2
LINES = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    total += i\n",
    "if x is None:\n    raise ValueError('x')\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "with open(path) as f:\n    data = f.read()\n",
    "import os\nprint(os.getcwd())\n",
]


# ------------------------------------------------------------------------------------ the stack


class Worker:
    """One ``celery worker -Q default,gpu -P solo`` process in its own process group."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = env
        self.log_dir = log_dir
        self.started = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.started += 1
        log = (self.log_dir / f"worker-{self.started}.log").open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "workers.celery_app",
                "worker",
                "-Q",
                "default,gpu",
                "-P",
                "solo",
                "-n",
                f"realign-auto-{self.started}@%h",
                "--loglevel=INFO",
            ],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so a SIGKILL takes all of it
        )
        log.close()

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self) -> str:
        logs = sorted(self.log_dir.glob("worker-*.log"))
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in logs)


@dataclass
class Stack:
    url: str
    sessions: sessionmaker[Session]
    worker: Worker
    producer: Celery
    tenant: Tenant
    models: Path
    settings: Settings  # what the worker runs with: the model root and the S3 artifact store

    def local_artifact(self, version: DrafterVersion) -> Path:
        """The version's artifact fetched from the store into a verified local copy."""
        cache = VerifiedArtifactCache(
            self.settings.artifact_cache_dir, s3_endpoint_url=self.settings.s3_endpoint_url
        )
        return cache.local_folder(version.artifact_path, version.manifest_sha256)

    def deployment(self, name: str, *, traces: int = 160) -> int:
        """A draft-model deployment on the tiny target and drafter, with ``traces`` recent traces."""
        with self.sessions() as session:
            deployment = Deployment(
                account_id=self.tenant.account_id,
                name=name,
                target_model="tiny-target",
                speculation_mode=SpeculationMode.draft_model,
                draft_model="tiny-drafter",
                draft_token_count=4,
                drift_policy={},
                canary_policy={},
            )
            session.add(deployment)
            session.commit()
        self.add_traces(deployment.id, traces)
        return deployment.id

    def add_traces(self, deployment_id: int, traces: int) -> None:
        with self.sessions() as session:
            for i in range(traces):
                a, b = LINES[i % len(LINES)], LINES[(i * 5 + 1) % len(LINES)]
                session.add(
                    Trace(
                        deployment_id=deployment_id,
                        source=TraceSource.sampled,
                        prompt=f"{a}# {i}\n",
                        completion=b + LINES[(i + 2) % len(LINES)],
                    )
                )
            session.commit()

    def job(self, job_id: int) -> Job:
        with self.sessions() as session:
            return session.get_one(Job, job_id)

    def wait_for(self, what: str, predicate: Callable[[], Any], timeout_s: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}\n{self.worker.log_tail()}")

    def versions(self, job_id: int) -> list[DrafterVersion]:
        with self.sessions() as session:
            return list(
                session.scalars(select(DrafterVersion).where(DrafterVersion.training_job_id == job_id))
            )


def _tiny_models(folder: Path) -> Path:
    """A peaked tiny target (random 0.02-std weights would be near-uniform: nothing to learn)
    and, as the incumbent drafter, a perturbed copy of it."""
    tokenizer = Tokenizer.from_file(REFERENCE / "target")
    config = ModelConfig(
        vocab_size=4096, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=128, max_seq_len=256
    )
    target = build_model(config, seed=1)
    with torch.no_grad():
        for p in target.parameters():
            if p.ndim >= 2:
                p.mul_(25.0)
    drafter = build_model(config, seed=1)
    drafter.load_state_dict(target.state_dict())
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.ndim >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.6)
    save_hf_folder(target, tokenizer, folder / "target")
    save_hf_folder(drafter, tokenizer, folder / "drafter")
    return folder


s3_endpoint = s3_server.s3_endpoint


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("realign-auto")
    url = recreate_pg_database("controlplane_realign_auto")
    upgrade_to_head(url)
    redis.Redis.from_url(BROKER).flushdb()
    bucket = f"realign-{os.getpid()}"
    s3_server.s3_client(s3_endpoint).create_bucket(Bucket=bucket)
    models = _tiny_models(tmp / "models")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")},
        **s3_server.TEST_CREDENTIALS,
        "CONTROLPLANE_MODEL_ROOTS": json.dumps([str(models)]),
        "CONTROLPLANE_ARTIFACT_STORE_URI": f"s3://{bucket}/artifacts",
        "CONTROLPLANE_S3_ENDPOINT_URL": s3_endpoint,
        "CONTROLPLANE_ARTIFACT_CACHE_DIR": str(tmp / "worker-cache"),
        "CONTROLPLANE_DATABASE_URL": url,
        "CONTROLPLANE_BROKER_URL": BROKER,
        "CONTROLPLANE_RESULT_BACKEND_URL": BROKER,
        "CONTROLPLANE_SECRET_KEY": TEST_SECRET,
        "CONTROLPLANE_ENVIRONMENT": "test",
        "CONTROLPLANE_ARTIFACT_DIR": str(tmp / "artifacts"),
        "CONTROLPLANE_REALIGN_LEASE_S": str(LEASE_S),
        "CONTROLPLANE_REALIGN_RETRY_BACKOFF_S": "0.5",
        # Jobs started by drift events carry no params: keep their training short.
        "CONTROLPLANE_REALIGN_TIME_BUDGET_S": "4",
        # The traces are all there before the event: no waiting for post-drift traffic.
        "CONTROLPLANE_REALIGN_MIN_TRACES": "1",
        "CONTROLPLANE_REALIGN_MAX_WAIT_S": "5",
        "OMP_NUM_THREADS": "1",
    }
    settings = Settings(
        database_url=url,
        environment="test",
        secret_key=TEST_SECRET,
        model_roots=[models],
        artifact_store_uri=f"s3://{bucket}/artifacts",
        s3_endpoint_url=s3_endpoint,
        artifact_cache_dir=tmp / "test-cache",
    )
    for name, value in s3_server.TEST_CREDENTIALS.items():
        os.environ.setdefault(name, value)
    sessions = get_sessionmaker(url)
    with sessions() as session:
        tenant = make_tenant(session, "acme")
        register_model(
            session=session,
            account_id=tenant.account_id,
            name="tiny-target",
            source=ModelSource(path="target"),
            settings=settings,
        )
        register_model(
            session=session,
            account_id=tenant.account_id,
            name="tiny-drafter",
            source=ModelSource(path="drafter"),
            settings=settings,
            drafter_for=["tiny-target"],
        )
        session.commit()
    worker = Worker(env, tmp)
    worker.start()
    producer = Celery("test-producer", broker=BROKER, backend=BROKER)
    try:
        yield Stack(url, sessions, worker, producer, tenant, models, settings)
    finally:
        worker.stop()
        producer.close()
        get_engine(url).dispose()


# --------------------------------------------------------------------- through the worker process


def test_a_drift_event_becomes_a_job_and_the_job_a_candidate(stack: Stack) -> None:
    deployment_id = stack.deployment("drifting", traces=0)
    with stack.sessions() as session:
        rng = random.Random(21)
        records = [request_record(i, rng, 0.8) for i in range(1500)]
        records += [request_record(5000 + i, rng, 0.5) for i in range(400)]
        store_records(session=session, deployment_id=deployment_id, records=parse_batch({"records": records}))
        session.commit()
    # The shifted traffic's traces arrive with (after) its records: they are what the job trains on.
    stack.add_traces(deployment_id, 160)
    # As beat would: the monitor comes back by itself until the records settle.
    stack.producer.send_task("drift.monitor_all", queue="default")

    def the_job() -> Job | None:
        with stack.sessions() as session:
            return session.scalar(select(Job).where(Job.deployment_id == deployment_id))

    job = stack.wait_for("the drift event's job", the_job)
    with stack.sessions() as session:
        events = list(session.scalars(select(DriftEvent).where(DriftEvent.deployment_id == deployment_id)))
    assert len(events) == 1 and job.drift_event_id == events[0].id
    assert job.requested_by == f"drift-event:{events[0].id}" and job.params == {}
    # The event is being answered by its job (it ends when the candidate's canary decides).
    assert events[0].evidence["realign_job_id"] == job.id and events[0].state == DriftState.realigning
    done = stack.wait_for("the job to finish", lambda: (j := stack.job(job.id)).finished_at and j, 90)
    assert done.state == JobState.succeeded, (done.error, stack.worker.log_tail())
    assert done.attempts == 1 and done.result["drafter_version"] == 1
    [version] = stack.versions(job.id)
    # auto_realign: the candidate went straight to its canary (the shadow replay was queued).
    assert version.state == DrafterState.canary and version.target_model == "tiny-target"
    assert version.artifact_path.startswith("s3://") and version.manifest_sha256 is not None
    assert version.training_metrics["time_budget_s"] == 4.0  # the settings' budget for param-less jobs
    local = stack.local_artifact(version)  # verified: the manifest's digest, then every file
    load_hf_folder(local, expected_sha256=version.artifact_sha256)
    assert verify_artifact(local, version.manifest_sha256)
    with stack.sessions() as session:
        handed = session.scalar(
            select(func.count()).where(
                AuditEntry.action == "drafter_version.candidate",
                AuditEntry.resource.endswith("/deployments/drifting/drafter-versions/1"),
            )
        )
    assert handed == 1  # the handoff hook ran once, in the registering transaction


def test_a_verified_candidate_in_the_s3_store_is_promoted_and_served_by_reference(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    deployment_id = stack.deployment("promoted", traces=240)
    with stack.sessions() as session:
        deployment = session.get_one(Deployment, deployment_id)
        deployment.auto_realign = False
        job_id = request_realign(session=session, deployment=deployment, params={"time_budget_s": 4}).job.id
        session.commit()
    stack.producer.send_task("realign.run", args=[job_id], queue="gpu")
    done = stack.wait_for("the job to finish", lambda: (j := stack.job(job_id)).finished_at and j, 90)
    assert done.state == JobState.succeeded, (done.error, stack.worker.log_tail())
    monkeypatch.setenv("CONTROLPLANE_S3_ENDPOINT_URL", stack.settings.s3_endpoint_url or "")
    monkeypatch.setenv("CONTROLPLANE_ARTIFACT_CACHE_DIR", str(stack.settings.artifact_cache_dir))
    get_settings.cache_clear()
    try:
        with stack.sessions() as session:
            promote(session=session, deployment_id=deployment_id, version_number=1, actor="test", reason="ok")
            session.commit()
            config = serving_config(session=session, deployment=session.get_one(Deployment, deployment_id))
    finally:
        get_settings.cache_clear()
    live = config["arms"][0]
    # The fleet is told the registered target by folder and digests, and the drafter by its S3 URI
    # and manifest digest: what a server verifies before it loads either.
    assert config["target"]["name"] == "tiny-target" and config["target"]["files"]
    assert live["drafter_version"] == 1 and live["drafter"]["uri"].startswith("s3://")
    assert live["drafter"]["manifest_sha256"] == stack.versions(job_id)[0].manifest_sha256


def test_a_worker_killed_mid_job_leaves_exactly_one_candidate(stack: Stack) -> None:
    deployment_id = stack.deployment("killed", traces=240)
    with stack.sessions() as session:
        job = request_realign(
            session=session,
            deployment=session.get_one(Deployment, deployment_id),
            params={"time_budget_s": 8},
        ).job
        session.commit()
        job_id = job.id
    stack.producer.send_task("realign.run", args=[job_id], queue="gpu")
    # Mid-job: training under way (past the dataset, the target pass and the first step).
    stack.wait_for(
        "training to start",
        lambda: (j := stack.job(job_id)).state == JobState.running and j.progress >= 0.1,
    )
    stack.worker.kill()
    assert stack.job(job_id).state == JobState.running and not stack.versions(job_id)
    stack.worker.start()

    def sweep_until_restarted() -> bool:
        # As beat would: the sweep gives up the dead worker's attempt once its lease lapsed,
        # and sends the job again once its backoff is over.
        if stack.job(job_id).attempts >= 2:
            return True
        stack.producer.send_task("jobs.resend_stale_queued", queue="default")
        time.sleep(1.0)
        return False

    stack.wait_for("the second attempt", sweep_until_restarted, 90)
    done = stack.wait_for("the restarted job", lambda: (j := stack.job(job_id)).finished_at and j, 90)
    assert done.state == JobState.succeeded, (done.error, stack.worker.log_tail())
    assert done.attempts == 2  # the killed run, then the restart
    assert "attempt 1 lost its worker" in (done.error or "")
    versions = stack.versions(job_id)
    assert len(versions) == 1 and versions[0].state == DrafterState.canary  # handed to its canary
    load_hf_folder(stack.local_artifact(versions[0]), expected_sha256=versions[0].artifact_sha256)
    with stack.sessions() as session:
        total = session.scalar(
            select(func.count())
            .select_from(DrafterVersion)
            .where(DrafterVersion.deployment_id == deployment_id)
        )
    assert total == 1


def test_two_simultaneous_drift_events_start_one_job(stack: Stack) -> None:
    deployment_id = stack.deployment("racing", traces=0)
    barrier = threading.Barrier(2, timeout=20)
    outcomes: dict[int, tuple[int, int, bool]] = {}
    errors: list[BaseException] = []

    def raise_event(n: int) -> None:
        try:
            with stack.sessions() as session:
                deployment = session.get_one(Deployment, deployment_id)
                event = DriftEvent(
                    deployment_id=deployment_id, detector=f"test-{n}", state=DriftState.open, evidence={}
                )
                session.add(event)
                session.flush()
                barrier.wait()  # both events exist, neither is committed
                outcome = realign_on_drift(session=session, deployment=deployment, event=event)
                assert outcome is not None
                session.commit()
                outcomes[n] = (event.id, outcome.job.id, outcome.created)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=raise_event, args=(n,)) for n in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert sorted(created for _, _, created in outcomes.values()) == [False, True]
    assert len({job_id for _, job_id, _ in outcomes.values()}) == 1
    with stack.sessions() as session:
        jobs = list(session.scalars(select(Job).where(Job.deployment_id == deployment_id)))
        evidence = [session.get_one(DriftEvent, e).evidence for e, _, _ in outcomes.values()]
        assert len(jobs) == 1 and jobs[0].state == JobState.queued
        assert all(e["realign_job_id"] == jobs[0].id for e in evidence)  # both events name it
        # Nothing was sent for it: cancel, so that no later sweep picks it up.
        cancel_job(
            session=session,
            deployment=session.get_one(Deployment, deployment_id),
            job_id=jobs[0].id,
            actor="t",
        )
        session.commit()


def test_a_lost_message_is_resent_by_the_sweeper_and_a_cancel_stops_training(stack: Stack) -> None:
    deployment_id = stack.deployment("lost", traces=240)
    with stack.sessions() as session:
        deployment = session.get_one(Deployment, deployment_id)
        fresh = request_realign(session=session, deployment=deployment, params={"time_budget_s": 60}).job
        session.commit()
        job_id = fresh.id
        # Not overdue yet: the message may simply still be on its way.
        assert claim_stale_queued_realigns(session=session, older_than=utcnow() - timedelta(minutes=2)) == []
        # The send after commit never happened (say the broker was down): the job is overdue.
        session.execute(update(Job).where(Job.id == job_id).values(enqueued_at=utcnow() - timedelta(hours=1)))
        session.commit()
    stack.producer.send_task("jobs.resend_stale_queued", queue="default")
    stack.wait_for(
        "the re-sent job to train",
        lambda: (j := stack.job(job_id)).state == JobState.running and j.progress >= 0.1,
    )
    with stack.sessions() as session:
        # Claimed by the sweep: the next one does not send it again.
        assert claim_stale_queued_realigns(session=session, older_than=utcnow() - timedelta(minutes=2)) == []
        cancel_job(
            session=session, deployment=session.get_one(Deployment, deployment_id), job_id=job_id, actor="t"
        )
        session.commit()
    # The worker sees the cancel at its next progress checkpoint, stops and registers nothing.
    job = stack.job(job_id)
    assert job.celery_task_id is not None
    outcome = stack.producer.AsyncResult(job.celery_task_id).get(timeout=60)
    assert outcome["stopped"].startswith("cancelled at"), outcome
    job = stack.job(job_id)
    assert job.state == JobState.cancelled and job.attempts == 1
    assert stack.versions(job_id) == []


def test_a_tampered_artifact_fails_its_canary_and_is_never_promoted(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    deployment_id = stack.deployment("tampered", traces=240)
    with stack.sessions() as session:
        deployment = session.get_one(Deployment, deployment_id)
        deployment.auto_realign = False  # the candidate waits: the test tampers before its canary
        job_id = request_realign(session=session, deployment=deployment, params={"time_budget_s": 4}).job.id
        session.commit()
    stack.producer.send_task("realign.run", args=[job_id], queue="gpu")
    done = stack.wait_for("the job to finish", lambda: (j := stack.job(job_id)).finished_at and j, 90)
    assert done.state == JobState.succeeded, (done.error, stack.worker.log_tail())
    [version] = stack.versions(job_id)
    assert version.state == DrafterState.candidate and version.artifact_path.startswith("s3://")
    # One byte of one file changes in the bucket after the version was registered.
    bucket, _, prefix = version.artifact_path.removeprefix("s3://").partition("/")
    client = s3_server.s3_client(stack.settings.s3_endpoint_url or "")
    original = client.get_object(Bucket=bucket, Key=f"{prefix}/config.json")["Body"].read()
    client.put_object(Bucket=bucket, Key=f"{prefix}/config.json", Body=original.replace(b"{", b"[", 1))

    # A person cannot promote it: promotion verifies the artifact first.
    monkeypatch.setenv("CONTROLPLANE_S3_ENDPOINT_URL", stack.settings.s3_endpoint_url or "")
    monkeypatch.setenv("CONTROLPLANE_ARTIFACT_CACHE_DIR", str(stack.settings.artifact_cache_dir))
    get_settings.cache_clear()
    try:
        with stack.sessions() as session, pytest.raises(UnverifiedArtifactError, match="config.json"):
            promote(
                session=session, deployment_id=deployment_id, version_number=1, actor="test", reason="try"
            )
    finally:
        get_settings.cache_clear()

    # Its canary's shadow replay refuses it and rejects the candidate, saying why.
    with stack.sessions() as session:
        canary, canary_job = start_canary(
            session=session, version=session.get_one(DrafterVersion, version.id)
        )
        session.commit()
        canary_id, canary_job_id = canary.id, canary_job.id
    stack.producer.send_task("canary.shadow_replay", args=[canary_job_id], queue="gpu")

    def decided() -> Canary | None:
        with stack.sessions() as session:
            row = session.get_one(Canary, canary_id)
            return row if row.decided_at is not None else None

    canary = stack.wait_for("the canary to be decided", decided, 60)
    assert canary.decision == CanaryDecision.reject, canary.reason
    assert "candidate artifact refused" in (canary.reason or "") and "config.json" in (canary.reason or "")
    assert stack.job(canary_job_id).state == JobState.failed
    with stack.sessions() as session:
        assert session.get_one(DrafterVersion, version.id).state == DrafterState.rejected
        assert session.get_one(Deployment, deployment_id).draft_model == "tiny-drafter"  # unchanged


# ----------------------------------------------------------------------- in process, both dialects


def _svc(client: TestClient, tenant: Tenant, **extra: Any) -> None:
    response = client.post(
        f"/v1/accounts/{tenant.name}/deployments",
        json={
            "target_model": "reference-target",
            "deployment_id": "svc",
            "draft_model": "reference-drafter",
            "draft_token_count": 4,
            **extra,
        },
        headers=tenant.headers(Role.admin),
    )
    assert response.status_code == 201, response.text


def _drift(db: Database, settings: Settings) -> tuple[int, list[int], list[int]]:
    session = db.new_session()
    deployment_id = int(session.scalar(select(Deployment.id).where(Deployment.name == "svc")) or 0)
    rng = random.Random(11)
    records = [request_record(i, rng, 0.8) for i in range(1600)]
    records += [request_record(5000 + i, rng, 0.5) for i in range(400)]
    store_records(session=session, deployment_id=deployment_id, records=parse_batch({"records": records}))
    session.commit()
    events: list[int] = []
    jobs: list[int] = []
    for _ in range(3):
        outcome = advance_monitor(session=session, deployment_id=deployment_id, settings=settings)
        session.commit()
        events += outcome.events_raised
        jobs += outcome.realign_jobs
    session.close()
    return deployment_id, events, jobs


def test_the_event_and_its_job_commit_together(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database, settings: Settings
) -> None:
    acme, _ = tenants
    _svc(client, acme)
    deployment_id, events, jobs = _drift(db, settings)
    assert len(events) == 1 and len(jobs) == 1
    got = client.get(
        f"/v1/accounts/acme/deployments/svc/jobs/{jobs[0]}", headers=acme.headers(Role.viewer)
    ).json()
    assert got["state"] == "queued" and got["drift_event_id"] == events[0] and got["enqueued_at"]


def test_no_job_without_auto_realign(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database, settings: Settings
) -> None:
    acme, _ = tenants
    _svc(client, acme, auto_realign=False)
    deployment_id, events, jobs = _drift(db, settings)
    assert len(events) == 1 and jobs == []
    session = db.new_session()
    assert (
        session.scalar(select(func.count()).select_from(Job).where(Job.deployment_id == deployment_id)) == 0
    )
    session.close()


def test_a_new_target_flags_the_drafter_stale(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database
) -> None:
    acme, _ = tenants
    admin = acme.headers(Role.admin)
    for name, path, drafts_for in (
        ("target-v2", "reference/target", []),
        ("shared-drafter", "reference/generic-drafter", ["reference-target", "target-v2"]),
    ):
        registered = client.post(
            "/v1/accounts/acme/models",
            json={"name": name, "path": path, "drafter_for": drafts_for},
            headers=admin,
        )
        assert registered.status_code == 201, registered.text
    _svc(client, acme, draft_model="shared-drafter")
    session = db.new_session()
    deployment_id = int(session.scalar(select(Deployment.id).where(Deployment.name == "svc")) or 0)
    for n, state in ((1, DrafterState.active), (2, DrafterState.candidate), (3, DrafterState.retired)):
        session.add(
            DrafterVersion(
                deployment_id=deployment_id,
                version=n,
                artifact_path="x",
                artifact_sha256="0" * 64,
                target_model="reference-target",
                state=state,
            )
        )
    session.commit()
    session.close()
    base = "/v1/accounts/acme/deployments/svc"
    before = client.get(base, headers=admin).json()
    assert before["drafter_stale"] is False and before["drafter_stale_reason"] is None
    changed = client.patch(base, json={"target_model": "target-v2"}, headers=admin)
    assert changed.status_code == 200, changed.text
    body = changed.json()
    assert body["target_model"] == "target-v2" and body["drafter_stale"] is True
    assert (
        "'reference-target'" in body["drafter_stale_reason"] and "'target-v2'" in body["drafter_stale_reason"]
    )
    assert client.get(base, headers=acme.headers(Role.viewer)).json()["drafter_stale"] is True
    audit = client.get("/v1/accounts/acme/audit?deployment=svc", headers=admin).json()["entries"]
    stale = [e for e in audit if e["action"] == "drafter.stale"]
    assert len(stale) == 1
    assert [v["version"] for v in stale[0]["after"]["stale_versions"]] == [1, 2]  # not the retired one
    assert client.patch(base, json={"target_model": ""}, headers=admin).status_code == 422
    back = client.patch(base, json={"target_model": "reference-target"}, headers=admin).json()
    assert back["drafter_stale"] is False  # derived from the recorded target, not a sticky flag
