"""Recovery of realign jobs and drift events: every event ends in a named resolution with its
reason and the detector re-arms; failed attempts are retried with backoff up to a cap; a killed
worker's attempt is recovered through its lapsed lease.

- in process, both dialects: a realignment that keeps failing is retried with backoff, then fails
  and resolves its event ``realignment_failed`` with the reason (API, audit, /metrics, dashboard);
  after the cooldown the detector raises a new event; a job started by hand that answered an
  automatic event ends that event too; bad params and policies get a 422 naming the field;
- the realign task in process (SQLite): too few traces resolves ``not_enough_data`` at once (no
  retry) and re-arms the detector;
- real processes (PostgreSQL, the embedded SQLite broker, a beat process and a Celery worker): a
  worker SIGKILLed mid-training loses its message; its lease lapses, the sweep queues the job
  again and the second attempt succeeds into its own folder; a job whose worker dies on every
  attempt ends ``failed`` after the cap, and the deployment takes a new realignment.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from controlplane.config import Settings
from controlplane.db.migrate import upgrade_to_head
from controlplane.db.models import (
    AuditEntry,
    Deployment,
    DrafterVersion,
    DriftEvent,
    DriftMonitorState,
    DriftResolution,
    DriftState,
    Job,
    JobState,
    Role,
    SpeculationMode,
    Trace,
    TraceSource,
)
from controlplane.db.session import get_engine, get_sessionmaker
from controlplane.jobs.realign import claim_job
from controlplane.jobs.service import (
    claim_stale_queued_realigns,
    end_failed_attempt,
    recover_lapsed_leases,
    request_realign,
)
from controlplane.loop.drift import advance_monitor, monitor_status
from controlplane.messaging import QUEUES
from controlplane.models.service import ModelSource, register_model
from controlplane.timestamps import as_utc, utcnow
from tests.conftest import TEST_SECRET, Database, Tenant, make_tenant, recreate_pg_database
from tests.in_process import in_process_settings
from tests.integration.test_drift_monitor import request_record

ROOT = Path(__file__).resolve().parents[2]
BASE = "/v1/accounts/acme/deployments/svc"
LEASE_S = 60.0


# ----------------------------------------------------------------------- in process, both dialects


def _create_svc(client: TestClient, tenant: Tenant, **extra: Any) -> None:
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


def _ingest(client: TestClient, tenant: Tenant, records: list[dict[str, Any]]) -> None:
    for start in range(0, len(records), 2000):
        response = client.post(
            f"{BASE}/acceptance",
            json={"records": records[start : start + 2000]},
            headers=tenant.headers(Role.ingest),
        )
        assert response.status_code == 200, response.text


def _monitor(db: Database, deployment_id: int, settings: Settings) -> list[int]:
    raised: list[int] = []
    for _ in range(3):  # the first run only records the horizon; later runs consume settled ids
        with db.new_session() as session:
            raised += advance_monitor(
                session=session, deployment_id=deployment_id, settings=settings
            ).events_raised
            session.commit()
    return raised


def _svc_pk(db: Database) -> int:
    with db.new_session() as session:
        return int(session.scalar(select(Deployment.id).where(Deployment.name == "svc")) or 0)


def _drift_with_a_job(
    client: TestClient, tenant: Tenant, db: Database, settings: Settings, rng: random.Random
) -> tuple[int, int, int]:
    """A deployment whose hit rate dropped: one event, answered by one queued realign job."""
    _ingest(client, tenant, [request_record(i, rng, 0.8) for i in range(1600)])
    pk = _svc_pk(db)
    assert _monitor(db, pk, settings) == []
    _ingest(client, tenant, [request_record(5000 + i, rng, 0.55) for i in range(400)])
    [event_id] = _monitor(db, pk, settings)
    with db.new_session() as session:
        event = session.get_one(DriftEvent, event_id)
        assert event.state == DriftState.realigning
        return pk, event_id, int(event.evidence["realign_job_id"])


def _scrape(client: TestClient, tenant: Tenant) -> dict[str, list[Any]]:
    response = client.get("/metrics", headers=tenant.headers(Role.viewer))
    assert response.status_code == 200, response.text
    return {f.name: f.samples for f in text_string_to_metric_families(response.text)}


def test_a_failing_realignment_is_retried_with_backoff_then_resolves_its_event_and_the_detector_rearms(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database, settings: Settings, queue: Any
) -> None:
    acme, _ = tenants
    admin, viewer = acme.headers(Role.admin), acme.headers(Role.viewer)
    _create_svc(client, acme)
    cooldown_s = 4
    assert (
        client.patch(f"{BASE}/drift-policy", json={"cooldown_s": cooldown_s}, headers=admin).status_code
        == 200
    )
    rng = random.Random(5)
    pk, event_id, job_id = _drift_with_a_job(client, acme, db, settings, rng)
    assert settings.realign_max_attempts == 3 and settings.realign_retry_backoff_s == 60.0

    t = utcnow()
    error = "RuntimeError: CUDA out of memory"
    delays = []
    for attempt in (1, 2, 3):
        with db.new_session() as session:
            claim = claim_job(
                session=session, job_id=job_id, delivery_id=f"d{attempt}", lease_s=LEASE_S, now=t
            )
            assert claim.done is None and claim.attempt == attempt
            # A duplicate message while the attempt runs under its lease starts nothing.
            duplicate = claim_job(session=session, job_id=job_id, delivery_id="dup", lease_s=LEASE_S, now=t)
            assert duplicate.done == {"job_id": job_id, "skipped": f"attempt {attempt} is running"}
            job = end_failed_attempt(
                session=session, job_id=job_id, attempt=attempt, error=error, settings=settings, now=t
            )
            assert job is not None
            session.commit()
        got = client.get(f"{BASE}/jobs/{job_id}", headers=viewer).json()
        assert got["attempts"] == attempt and error in got["error"]
        if attempt == 3:
            assert got["state"] == "failed" and got["next_attempt_at"] is None
            assert "no attempts left" in got["error"]
            break
        assert got["state"] == "queued" and got["lease_expires_at"] is None
        due = as_utc(parse_iso(got["next_attempt_at"]))
        delays.append((due - t).total_seconds())
        with db.new_session() as session:
            # Not due yet: neither a message nor the sweep starts it.
            early = claim_job(session=session, job_id=job_id, delivery_id="early", lease_s=LEASE_S, now=t)
            assert early.done is not None and "not before" in early.done["skipped"]
            assert claim_stale_queued_realigns(session=session, older_than=t, now=t) == []
            # Once due, the sweep claims it for exactly one message.
            assert claim_stale_queued_realigns(session=session, older_than=t, now=due) == [job_id]
            assert claim_stale_queued_realigns(session=session, older_than=t, now=due) == []
            session.commit()
        t = due
    assert delays == [60.0, 120.0]  # base * 2^(attempts-1)

    event = client.get(f"{BASE}/drift-events/{event_id}", headers=viewer).json()
    assert event["state"] == "resolved" and event["resolution"] == "realignment_failed"
    assert error in event["resolution_reason"] and "attempt 3 of 3" in event["resolution_reason"]
    audit = client.get("/v1/accounts/acme/audit?deployment=svc", headers=admin).json()["entries"]
    actions = [e["action"] for e in audit]
    assert actions.count("job.retry") == 2 and actions.count("job.fail") == 1
    [resolved] = [e for e in audit if e["action"] == "drift_event.resolve"]
    assert resolved["after"]["resolution"] == "realignment_failed" and error in resolved["after"]["reason"]
    samples = _scrape(client, acme)
    [count] = [
        s.value
        for s in samples["specctl_drift_events_resolved"]
        if s.name == "specctl_drift_events_resolved_total" and s.labels["resolution"] == "realignment_failed"
    ]
    assert count == 1
    [attempts] = [s.value for s in samples["specctl_job_attempts"] if s.labels["kind"] == "realign"]
    assert attempts == 3
    markers = client.get("/v1/accounts/acme/dashboard/deployments/svc?range=1h", headers=viewer).json()[
        "markers"
    ]
    [label] = [m["label"] for m in markers if m["kind"] == "drift"]
    assert "realignment_failed" in label and "out of memory" in label

    # Re-armed at once (no event left unanswered), quiet for the cooldown after the event ended.
    status = client.get(f"{BASE}/drift-status", headers=viewer).json()
    assert status["open_events"] == 0 and status["detector"]["armed"] is True
    assert status["detector"]["drift_detected"] is False
    quiet_until = as_utc(parse_iso(status["detector"]["next_alarm_not_before"]))
    assert quiet_until >= as_utc(parse_iso(event["resolved_at"])) + timedelta(seconds=cooldown_s)
    # The failed job no longer holds the deployment: a person may ask again.
    again = client.post(f"{BASE}:realign", headers=admin)
    assert again.status_code == 202, again.text
    assert client.post(f"{BASE}/jobs/{again.json()['id']}:cancel", headers=admin).status_code == 200
    # The drop is still there: once the quiet period is over, the detector raises a new event.
    _ingest(client, acme, [request_record(9000 + i, rng, 0.55) for i in range(400)])
    wait = (quiet_until - utcnow()).total_seconds()
    if wait > 0:
        time.sleep(wait + 0.1)
    _ingest(client, acme, [request_record(12000 + i, rng, 0.55) for i in range(400)])
    [second] = _monitor(db, pk, settings)
    assert second != event_id
    new_event = client.get(f"{BASE}/drift-events/{second}", headers=viewer).json()
    assert as_utc(parse_iso(new_event["detected_at"])) >= quiet_until
    assert new_event["state"] == "realigning" and new_event["evidence"]["realign_job_id"] != job_id


def parse_iso(text: str) -> Any:
    from controlplane.timestamps import parse_utc

    return parse_utc(text)


def test_a_hand_started_job_that_answered_an_automatic_event_ends_it_when_it_fails(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database, settings: Settings, queue: Any
) -> None:
    acme, _ = tenants
    admin, viewer = acme.headers(Role.admin), acme.headers(Role.viewer)
    _create_svc(client, acme)
    manual = client.post(f"{BASE}:realign", json={"params": {"time_budget_s": 30}}, headers=admin).json()
    rng = random.Random(8)
    pk, event_id, job_id = _drift_with_a_job(client, acme, db, settings, rng)
    assert job_id == manual["id"]  # the event found the hand-started job and named it
    with db.new_session() as session:
        claim = claim_job(session=session, job_id=job_id, delivery_id="m", lease_s=LEASE_S)
        assert claim.attempt == 1
        # Its worker died and the lease lapsed on the last allowed attempt.
        capped = settings.model_copy(update={"realign_max_attempts": 1})
        later = utcnow() + timedelta(seconds=LEASE_S + 1)
        sweep = recover_lapsed_leases(session=session, settings=capped, now=later)
        assert sweep.failed == [job_id] and sweep.requeued == []
        session.commit()
    job = client.get(f"{BASE}/jobs/{job_id}", headers=viewer).json()
    assert job["state"] == "failed" and "lost its worker" in job["error"]
    event = client.get(f"{BASE}/drift-events/{event_id}", headers=viewer).json()
    assert event["state"] == "resolved" and event["resolution"] == "realignment_failed"
    assert "lost its worker" in event["resolution_reason"]
    with db.new_session() as session:
        state = session.get_one(DriftMonitorState, pk)
        assert state.detector_state is not None and state.detector_state["main"]["alarm"] is None


def test_a_lapsed_lease_with_attempts_left_is_queued_again_after_the_backoff(
    client: TestClient, tenants: tuple[Tenant, Tenant], db: Database, settings: Settings, queue: Any
) -> None:
    acme, _ = tenants
    _create_svc(client, acme)
    job_id = client.post(f"{BASE}:realign", headers=acme.headers(Role.admin)).json()["id"]
    t = utcnow()
    with db.new_session() as session:
        assert claim_job(session=session, job_id=job_id, delivery_id="a", lease_s=LEASE_S, now=t).attempt == 1
        # Within the lease: the sweep leaves it alone.
        assert (
            recover_lapsed_leases(session=session, settings=settings, now=t + timedelta(seconds=30)).requeued
            == []
        )
        later = t + timedelta(seconds=LEASE_S + 1)
        assert recover_lapsed_leases(session=session, settings=settings, now=later).requeued == [job_id]
        session.commit()
        job = session.get_one(Job, job_id)
        session.refresh(job)
        assert job.state == JobState.queued and job.attempts == 1
        assert as_utc(job.next_attempt_at) == later + timedelta(seconds=settings.realign_retry_backoff_s)
        # The dead worker's late writes change nothing once its attempt was given up.
        from controlplane.jobs.service import fail_job, renew_lease, report_progress

        assert not renew_lease(session=session, job_id=job_id, attempt=1, lease_s=LEASE_S)
        assert not report_progress(session=session, job_id=job_id, fraction=0.5, message="late", attempt=1)
        assert fail_job(session=session, job_id=job_id, error="late", attempt=1).state == JobState.queued
        session.commit()


def test_bad_realign_params_and_policies_get_a_422_naming_the_field(
    client: TestClient, tenants: tuple[Tenant, Tenant], queue: Any
) -> None:
    acme, _ = tenants
    admin = acme.headers(Role.admin)
    _create_svc(client, acme)
    for params, field in (
        ({"time_budget_s": 10**6}, "time_budget_s"),
        ({"seed": -3}, "seed"),
        ({"since": "not a time"}, "since"),
        ({"max_traces": 0}, "max_traces"),
        ({"replay_share": 5}, "replay_share"),
    ):
        response = client.post(f"{BASE}:realign", json={"params": params}, headers=admin)
        assert response.status_code == 422, response.text
        assert field in response.text
    # Below the 24-hour bound but past what the broker's visibility timeout allows.
    budget = Settings(environment="test").realign_budget_ceiling_s + 1
    response = client.post(f"{BASE}:realign", json={"params": {"time_budget_s": budget}}, headers=admin)
    assert response.status_code == 422 and "celery_visibility_timeout_s" in response.text
    assert queue.sent == []  # nothing stored, nothing sent
    assert client.get(f"{BASE}/jobs", headers=admin).json()["jobs"] == []
    many = {f"field_{i}": 1 for i in range(200)}
    policy = client.patch(f"{BASE}/drift-policy", json={**many, "cooldown_s": -1}, headers=admin)
    assert policy.status_code == 422 and "cooldown_s" in policy.text and len(policy.text) < 5000
    assert client.get(f"{BASE}/drift-events?state=bogus", headers=admin).status_code == 422


# --------------------------------------------------------------- the realign task, in process (SQLite)


def _tiny_models(folder: Path) -> Path:
    from workers.engine.hf_io import save_hf_folder
    from workers.engine.model import ModelConfig, build_model
    from workers.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_file(ROOT / "workers" / "models" / "reference" / "target")
    config = ModelConfig(
        vocab_size=4096, dim=32, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=64, max_seq_len=256
    )
    save_hf_folder(build_model(config, seed=1), tokenizer, folder / "target")
    save_hf_folder(build_model(config, seed=2), tokenizer, folder / "drafter")
    return folder


def _register_tiny(session: Session, account_id: int, settings: Settings) -> None:
    for name, path, drafts_for in (
        ("tiny-target", "target", []),
        ("tiny-drafter", "drafter", ["tiny-target"]),
    ):
        register_model(
            session=session,
            account_id=account_id,
            name=name,
            source=ModelSource(path=path),
            settings=settings,
            drafter_for=drafts_for,
        )


def _add_traces(sessions: Callable[[], Session], deployment_id: int, n: int, start: int = 0) -> None:
    with sessions() as session:
        for i in range(start, start + n):
            session.add(
                Trace(
                    deployment_id=deployment_id,
                    source=TraceSource.sampled,
                    prompt=f"def f{i}(x):\n",
                    completion=f"    return x + {i}\n\nprint(f{i}(2))\n",
                )
            )
        session.commit()


def test_too_few_traces_resolve_not_enough_data_at_once_and_rearm(
    sqlite_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import workers.tasks

    settings = in_process_settings(
        sqlite_template,
        tmp_path,
        "recovery.db",
        model_roots=[_tiny_models(tmp_path / "models")],
        realign_min_traces=1,
        realign_max_wait_s=0,
    )
    url = settings.database_url
    monkeypatch.setattr(workers.tasks, "get_settings", lambda: settings)
    sessions = get_sessionmaker(url)
    with sessions() as session:
        tenant = make_tenant(session, "acme")
        _register_tiny(session, tenant.account_id, settings)
        deployment = Deployment(
            account_id=tenant.account_id,
            name="svc",
            target_model="tiny-target",
            speculation_mode=SpeculationMode.draft_model,
            draft_model="tiny-drafter",
            draft_token_count=4,
            drift_policy={"cooldown_s": 0},
            canary_policy={},
        )
        session.add(deployment)
        session.commit()
        pk = deployment.id
    rng = random.Random(3)
    from controlplane.ingest.formats import parse_batch
    from controlplane.ingest.service import store_records

    def ingest(records: list[dict[str, Any]]) -> list[int]:
        with sessions() as session:
            store_records(session=session, deployment_id=pk, records=parse_batch({"records": records}))
            session.commit()
        raised: list[int] = []
        for _ in range(3):
            with sessions() as session:
                raised += advance_monitor(session=session, deployment_id=pk, settings=settings).events_raised
                session.commit()
        return raised

    assert ingest([request_record(i, rng, 0.8) for i in range(1600)]) == []
    [event_id] = ingest([request_record(5000 + i, rng, 0.55) for i in range(400)])
    _add_traces(sessions, pk, 2)  # two traces since the drift: nothing to hold out and train on
    with sessions() as session:
        job_id = int(session.get_one(DriftEvent, event_id).evidence["realign_job_id"])
    outcome = workers.tasks.run_realign(job_id)
    assert "stopped" in outcome and "usable training rows" in outcome["stopped"], outcome
    with sessions() as session:
        job = session.get_one(Job, job_id)
        event = session.get_one(DriftEvent, event_id)
        assert job.state == JobState.failed and job.attempts == 1 and job.next_attempt_at is None
        assert event.resolution == DriftResolution.not_enough_data
        assert event.resolution_reason is not None and "usable training rows" in event.resolution_reason
        status = monitor_status(
            session=session, deployment=session.get_one(Deployment, pk), settings=settings
        )
        assert status["detector"]["armed"] is True and status["detector"]["drift_detected"] is False
    # Still drifting: the re-armed detector alarms again, and that event starts a new job.
    [second] = ingest([request_record(9000 + i, rng, 0.55) for i in range(400)])
    with sessions() as session:
        assert session.get_one(DriftEvent, second).evidence["realign_job_id"] != job_id
    get_engine(url).dispose()


# ------------------------------------------------------------------------------- real processes

# Short enough that a dead worker's job is recovered within seconds (production: a minute).
PROCESS_LEASE_S = 2.0
PROCESS_BACKOFF_S = 0.5


class Processes:
    """Two Celery workers (``-Q default,gpu``, one prefork child each) and a beat, each in its own
    process group, on the embedded SQLite broker (a killed worker's message is lost there)."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = env
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def _spawn(self, args: list[str], log_name: str) -> None:
        with (self.log_dir / log_name).open("wb") as log:
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "celery", "-A", "workers.celery_app", *args],
                    cwd=ROOT,
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group, so a SIGKILL takes all of it
                )
            )

    def start(self, workers: int) -> None:
        self._spawn(["beat", "-s", str(self.log_dir / "beat-schedule"), "--loglevel=INFO"], "beat.log")
        for n in range(1, workers + 1):
            self._spawn(
                ["worker", "-Q", "default,gpu", "-c", "1", "-n", f"recovery-{n}@%h", "--loglevel=INFO"],
                f"worker-{n}.log",
            )

    def running(self, job_id: int, attempt: int) -> int | None:
        """The pool process that runs the attempt (each attempt logs its process id)."""
        pattern = re.compile(rf"realign job {job_id} attempt {attempt} started in process (\d+)")
        for log in self.log_dir.glob("worker-*.log"):
            if match := pattern.search(log.read_text(errors="replace")):
                return int(match.group(1))
        return None

    def kill_pool_process(self, pid: int) -> None:
        """SIGKILL the pool process running a task; its worker's main process lives on."""
        os.kill(pid, signal.SIGKILL)

    def kill_worker_of(self, pid: int) -> None:
        """SIGKILL the whole worker that runs ``pid``: its main process and its pool process."""
        group = os.getpgid(pid)
        os.killpg(group, signal.SIGKILL)
        for proc in self.procs:
            if proc.pid == group:
                proc.wait(timeout=30)

    def stop(self) -> None:
        # Nothing of theirs outlives the test (a temporary broker, a dropped database): no need
        # to wait out a warm shutdown.
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )


@dataclass
class Stack:
    sessions: sessionmaker[Session]
    processes: Processes
    tenant: Tenant
    broker: str

    def deployment(self, name: str, traces: int) -> int:
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
                auto_realign=False,  # the candidate stays a candidate: no canary in these tests
            )
            session.add(deployment)
            session.commit()
            pk = deployment.id
        _add_traces(self.sessions, pk, traces)
        return pk

    def send(self, job_id: int) -> None:
        from celery import Celery

        producer = Celery("recovery-test-producer", broker=self.broker)
        try:
            producer.send_task("realign.run", args=[job_id], queue="gpu")
        finally:
            producer.close()

    def job(self, job_id: int) -> Job:
        with self.sessions() as session:
            return session.get_one(Job, job_id)

    def wait_for(self, what: str, predicate: Callable[[], Any], timeout_s: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}\n{self.processes.logs()}")


def _declare_queues(broker: str) -> None:
    """Create the embedded broker's queue rows before any process starts: kombu's SQLAlchemy
    transport creates a queue's row on first use with a select-then-insert, and the beat and two
    workers starting together raced on it (a worker died of "UNIQUE constraint failed:
    kombu_queue.name" under a loaded CI run, leaving no worker for the second attempt)."""
    from kombu import Connection, Queue

    with Connection(broker) as connection:
        channel = connection.default_channel
        for name in QUEUES:
            Queue(name, channel=channel).declare()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("recovery")
    url = recreate_pg_database("controlplane_recovery")
    upgrade_to_head(url)
    models = _tiny_models(tmp / "models")
    broker = f"sqla+sqlite:///{tmp / 'broker.db'}"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")},
        "CONTROLPLANE_DATABASE_URL": url,
        "CONTROLPLANE_BROKER_URL": broker,
        "CONTROLPLANE_RESULT_BACKEND_URL": f"db+sqlite:///{tmp / 'results.db'}",
        "CONTROLPLANE_SECRET_KEY": TEST_SECRET,
        "CONTROLPLANE_ENVIRONMENT": "test",
        "CONTROLPLANE_VAR_DIR": str(tmp / "var"),
        "CONTROLPLANE_ARTIFACT_DIR": str(tmp / "artifacts"),
        "CONTROLPLANE_MODEL_ROOTS": json.dumps([str(models)]),
        "CONTROLPLANE_REALIGN_LEASE_S": str(PROCESS_LEASE_S),
        "CONTROLPLANE_REALIGN_RETRY_BACKOFF_S": str(PROCESS_BACKOFF_S),
        "CONTROLPLANE_REALIGN_MAX_ATTEMPTS": "2",
        "CONTROLPLANE_REALIGN_MIN_TRACES": "1",
        "CONTROLPLANE_REALIGN_MAX_WAIT_S": "0",
        "OMP_NUM_THREADS": "1",
    }
    settings = Settings(database_url=url, environment="test", secret_key=TEST_SECRET, model_roots=[models])
    sessions = get_sessionmaker(url)
    with sessions() as session:
        tenant = make_tenant(session, "acme")
        _register_tiny(session, tenant.account_id, settings)
        session.commit()
    _declare_queues(broker)
    processes = Processes(env, tmp)
    processes.start(workers=2)
    try:
        yield Stack(sessions, processes, tenant, broker)
    finally:
        processes.stop()
        get_engine(url).dispose()


def test_a_job_whose_worker_dies_on_every_attempt_fails_after_the_cap_and_frees_the_deployment(
    stack: Stack,
) -> None:
    deployment_id = stack.deployment("doomed", traces=40)
    with stack.sessions() as session:
        event = DriftEvent(deployment_id=deployment_id, detector="test", state=DriftState.open, evidence={})
        session.add(event)
        session.flush()
        from controlplane.jobs.service import realign_on_drift

        deployment = session.get_one(Deployment, deployment_id)
        deployment.auto_realign = True
        outcome = realign_on_drift(session=session, deployment=deployment, event=event)
        assert outcome is not None
        deployment.auto_realign = False
        session.commit()
        job_id, event_id = outcome.job.id, event.id
    stack.send(job_id)
    killed = []
    for attempt in (1, 2):
        pid = stack.wait_for(
            f"attempt {attempt} to run", lambda a=attempt: stack.processes.running(job_id, a)
        )
        assert stack.job(job_id).attempts == attempt
        stack.processes.kill_pool_process(pid)
        killed.append(pid)
        # Its worker hands the message back (the pool process was lost) and it is delivered
        # again: the job is running under that attempt's lease, so it starts nothing. The lease
        # lapses, and the sweep queues the job again (or, after the last attempt, fails it).
    done = stack.wait_for("the job to end", lambda: (j := stack.job(job_id)).finished_at and j, 60)
    assert done.state == JobState.failed and done.attempts == 2, (done.error, stack.processes.logs())
    assert "attempt 2 lost its worker" in (done.error or "") and "no attempts left" in (done.error or "")
    assert len(set(killed)) == 2  # two different pool processes died, one per attempt
    with stack.sessions() as session:
        ended = session.get_one(DriftEvent, event_id)
        assert ended.resolution == DriftResolution.realignment_failed
        assert "lost its worker" in (ended.resolution_reason or "")
        # The failed job no longer holds the deployment.
        again = request_realign(session=session, deployment=session.get_one(Deployment, deployment_id))
        assert again.created and again.job.id != job_id
        from controlplane.jobs.service import cancel_job

        cancel_job(
            session=session,
            deployment=session.get_one(Deployment, deployment_id),
            job_id=again.job.id,
            actor="t",
        )
        session.commit()


def test_a_worker_killed_mid_training_is_recovered_by_its_lease_into_a_second_attempts_folder(
    stack: Stack,
) -> None:
    deployment_id = stack.deployment("killed", traces=120)
    with stack.sessions() as session:
        job_id = request_realign(
            session=session,
            deployment=session.get_one(Deployment, deployment_id),
            params={"time_budget_s": 6},
        ).job.id
        session.commit()
    stack.send(job_id)
    stack.wait_for(
        "training to start",
        lambda: (j := stack.job(job_id)).state == JobState.running and j.progress >= 0.1,
    )
    pid = stack.processes.running(job_id, 1)
    assert pid is not None
    killed_at = utcnow()
    # The whole worker dies; the embedded broker loses the message it had handed out. The other
    # worker of the fleet is still there.
    stack.processes.kill_worker_of(pid)
    # Recovered through the lease (about one lease, a backoff and two sweeps: seconds), not by a
    # broker's redelivery hours later (the embedded broker never redelivers it at all). The bound
    # sits between the two, far above a loaded machine's start-up of a worker's training.
    stack.wait_for("the second attempt", lambda: stack.processes.running(job_id, 2), timeout_s=300)
    assert (utcnow() - killed_at).total_seconds() < 300
    done = stack.wait_for("the job to finish", lambda: (j := stack.job(job_id)).finished_at and j, 90)
    assert done.state == JobState.succeeded, (done.error, stack.processes.logs())
    assert done.attempts == 2 and "attempt 1 lost its worker" in (done.error or "")
    with stack.sessions() as session:
        versions = list(
            session.scalars(select(DrafterVersion).where(DrafterVersion.training_job_id == job_id))
        )
        retries = session.scalar(
            select(func.count()).where(
                AuditEntry.action == "job.retry", AuditEntry.resource.endswith(f"/jobs/{job_id}")
            )
        )
    assert len(versions) == 1 and versions[0].training_metrics["attempt"] == 2
    assert versions[0].artifact_path.rstrip("/").endswith(f"job-{job_id}/attempt-2")
    assert retries == 1
