"""Thin Celery tasks: open a unit of work, call a control-plane service, map errors to retries.

No statistics or training logic lives here (see controlplane.drift and workers.training).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from controlplane.config import get_settings
from controlplane.db.models import (
    AcceptanceRecordRow,
    Deployment,
    DrafterState,
    DrafterVersion,
    DriftEvent,
    Job,
    JobState,
    Trace,
    utcnow,
)
from controlplane.db.session import unit_of_work
from controlplane.deployments.service import active_drafter
from controlplane.drift.service import advance_monitor, deployments_with_new_records
from controlplane.errors import ConflictError
from controlplane.ingest.record import ARM_LIVE
from controlplane.jobs.handoff import TaskMessage, on_realign_succeeded
from controlplane.jobs.service import (
    claim_stale_queued_realigns,
    fail_job,
    finish_job,
    report_progress,
    start_job,
)
from controlplane.jobs.states import TERMINAL
from controlplane.traces.service import apply_retention
from workers.celery_app import (
    QUEUE_GPU,
    InstrumentedTask,
    TransientError,
    celery_app,
    torch_threads_for_this_process,
)

log = logging.getLogger(__name__)

SETTLE_INTERVAL_S = 2.0


@celery_app.task(name="drift.monitor_all", base=InstrumentedTask, ignore_result=True)
def monitor_all() -> list[int]:
    """Beat entry point: fan out one monitor task per deployment that has new records."""
    settings = get_settings()
    try:
        with unit_of_work(settings.database_url) as session:
            deployment_ids = deployments_with_new_records(session=session)
    except OperationalError as exc:
        raise TransientError(str(exc)) from exc
    for deployment_id in deployment_ids:
        monitor_deployment.delay(deployment_id)
    return deployment_ids


@celery_app.task(name="drift.monitor_deployment", base=InstrumentedTask)
def monitor_deployment(deployment_id: int) -> dict[str, Any]:
    """Advance one deployment's detector over its new records (exactly once, see the service)."""
    settings = get_settings()
    try:
        with unit_of_work(settings.database_url) as session:
            outcome = advance_monitor(session=session, deployment_id=deployment_id, settings=settings)
    except ConflictError:
        # Another monitor run advanced this deployment at the same time; its work stands.
        return {"deployment_id": deployment_id, "skipped": "concurrent run"}
    except OperationalError as exc:
        raise TransientError(str(exc)) from exc
    if outcome.pending:
        # Newer records settle within one interval; come back for them rather than wait for beat.
        monitor_deployment.apply_async((deployment_id,), countdown=SETTLE_INTERVAL_S)
    if outcome.events_raised:
        log.warning("drift detected on deployment %s: events %s", deployment_id, outcome.events_raised)
    # The jobs committed with their events; a send that fails leaves them queued for the sweeper.
    for job_id in outcome.realign_jobs:
        send_realign(job_id)
    return {
        "deployment_id": deployment_id,
        "records_consumed": outcome.records_consumed,
        "events_raised": outcome.events_raised,
        "realign_jobs": outcome.realign_jobs,
        "skipped": outcome.skipped,
    }


def send_realign(job_id: int) -> bool:
    """Send ``realign.run(job_id)`` to the gpu queue; False (logged) when the broker refused it.

    Only ever called after the job row committed. A lost send is not an error here: the job stays
    queued, and ``jobs.resend_stale_queued`` sends it again once it is overdue.
    """
    try:
        run_realign.apply_async((job_id,), queue=QUEUE_GPU)
    except Exception:
        log.warning("could not enqueue realign job %s; the sweeper will re-send it", job_id, exc_info=True)
        return False
    return True


def _send_after_commit(messages: list[TaskMessage]) -> None:
    for message in messages:
        try:
            celery_app.send_task(
                message.task, args=list(message.args), kwargs=message.kwargs, queue=message.queue
            )
        except Exception:
            log.warning("could not send %s%s", message.task, message.args, exc_info=True)


@celery_app.task(name="jobs.resend_stale_queued", base=InstrumentedTask, ignore_result=True)
def resend_stale_queued() -> list[int]:
    """Beat entry point: re-send realign jobs queued too long without a worker starting them.

    Each overdue job is claimed (its ``enqueued_at`` moves to now) and committed before its
    message goes out, so the next sweep waits a full threshold again. A duplicate message is
    harmless: ``realign.run`` skips a job that another delivery runs or that already finished.
    """
    settings = get_settings()
    cutoff = utcnow() - timedelta(seconds=settings.realign_resend_after_s)
    try:
        with unit_of_work(settings.database_url) as session:
            job_ids = claim_stale_queued_realigns(session=session, older_than=cutoff)
    except OperationalError as exc:
        raise TransientError(str(exc)) from exc
    for job_id in job_ids:
        log.warning("realign job %s was queued without starting; sending it again", job_id)
        send_realign(job_id)
    return job_ids


@celery_app.task(name="traces.apply_retention", base=InstrumentedTask)
def apply_trace_retention() -> dict[str, int]:
    """Beat entry point: delete traces older than each deployment's retention limit."""
    settings = get_settings()
    try:
        with unit_of_work(settings.database_url) as session:
            deleted = apply_retention(session=session, now=utcnow())
    except OperationalError as exc:
        raise TransientError(str(exc)) from exc
    return {str(deployment_id): count for deployment_id, count in deleted.items()}


# ------------------------------------------------------------------------------------ realignment

REFERENCE_MODELS = Path(__file__).resolve().parent / "models" / "reference"
# Traces from a little before the alarm count as post-drift: detection lags the change itself.
DRIFT_LOOKBACK = timedelta(minutes=15)
MAX_RECENT_TRACES = 4000
MAX_REPLAY_TRACES = 2000
DEFAULT_TIME_BUDGET_S = 240.0
# The change-point estimate is itself noisy: start the post-drift window a little earlier.
DRIFT_POINT_MARGIN = 1.5
DRIFT_POINT_EXTRA_RECORDS = 10
TRACE_POLL_S = 2.0


def _model_folder(name: str | None, fallback: Path) -> Path:
    """A local HF folder for a model name: the path itself, a reference model's name, else the fallback.

    Deployments on the reference setup name their models loosely ("m", "reference"); the fallback
    is recorded in the version's training metrics, so a silent substitution stays visible.
    """
    if name:
        for candidate in (Path(name), REFERENCE_MODELS / name):
            if (candidate / "config.json").is_file():
                return candidate
    return fallback


@dataclass
class _RealignInputs:
    deployment_id: int
    target_model: str
    target_folder: Path
    incumbent_folder: Path
    incumbent_sha256: str | None
    parent_version_id: int | None
    recent: list[Any]
    older: list[Any]
    window_start: datetime | None
    window_end: datetime | None
    params: dict[str, Any]


def _trace_texts(rows: list[Trace]) -> list[Any]:
    from workers.training.realign import TraceText

    return [TraceText(f"trace-{t.id}", t.prompt, t.completion) for t in rows]


def _drift_point(session: Session, event: DriftEvent) -> datetime:
    """When the drift began: the live record the detector's change-point estimate points at (its
    detection delay before the alarm), with a margin; else a fixed lookback before the alarm."""
    delay = event.detection_delay_estimate
    if event.last_record_id is not None and delay is not None and delay >= 0:
        back = int(delay * DRIFT_POINT_MARGIN) + DRIFT_POINT_EXTRA_RECORDS
        created = session.scalar(
            select(AcceptanceRecordRow.created_at)
            .where(
                AcceptanceRecordRow.deployment_id == event.deployment_id,
                AcceptanceRecordRow.id <= event.last_record_id,
                AcceptanceRecordRow.arm == ARM_LIVE,
            )
            .order_by(AcceptanceRecordRow.id.desc())
            .offset(back)
            .limit(1)
        )
        if created is not None:
            return created
        # Fewer live records than the margin: all of them are post-drift as far as we can tell.
        first = session.scalar(
            select(func.min(AcceptanceRecordRow.created_at)).where(
                AcceptanceRecordRow.deployment_id == event.deployment_id
            )
        )
        if first is not None:
            return first
    return event.detected_at - DRIFT_LOOKBACK


def _traffic_since(session: Session, job: Job) -> datetime | None:
    """The start of the traffic a job trains on: its ``since`` parameter, else the drift point."""
    params = dict(job.params or {})
    if params.get("since"):
        return datetime.fromisoformat(str(params["since"]))
    if job.drift_event_id is not None:
        event = session.get(DriftEvent, job.drift_event_id)
        if event is not None:
            return _drift_point(session, event)
    return None


def _wait_for_traces(url: str, job_id: int, minimum: int, max_wait_s: float, progress: Any) -> int:
    """Right after an alarm there is little post-drift traffic to learn from: wait (reporting
    progress, honouring a cancel) until ``minimum`` traces arrived since the drift point, or
    ``max_wait_s`` passed; then train on what there is. Returns the count seen."""
    deadline = time.monotonic() + max_wait_s
    while True:
        with unit_of_work(url) as session:
            job = session.get_one(Job, job_id)
            since = _traffic_since(session, job)
            query = select(func.count()).select_from(Trace).where(Trace.deployment_id == job.deployment_id)
            if since is not None:
                query = query.where(Trace.created_at >= since)
            count = int(session.scalar(query) or 0)
        if count >= minimum or time.monotonic() >= deadline:
            return count
        if not progress(0.0, f"collecting traffic since the drift point: {count}/{minimum} traces"):
            raise _Stopped("cancelled while collecting traffic")
        time.sleep(TRACE_POLL_S)


def _realign_inputs(session: Session, job: Job) -> _RealignInputs:
    deployment = session.get_one(Deployment, job.deployment_id)
    params = dict(job.params or {})
    since = _traffic_since(session, job)
    recent_q = select(Trace).where(Trace.deployment_id == deployment.id)
    if since is not None:
        recent_q = recent_q.where(Trace.created_at >= since)
    limit = int(params.get("max_traces") or MAX_RECENT_TRACES)
    recent = list(session.scalars(recent_q.order_by(Trace.id.desc()).limit(limit)))[::-1]
    older: list[Trace] = []
    if since is not None:
        older = list(
            session.scalars(
                select(Trace)
                .where(Trace.deployment_id == deployment.id, Trace.created_at < since)
                .order_by(Trace.id.desc())
                .limit(MAX_REPLAY_TRACES)
            )
        )[::-1]
    active = active_drafter(session=session, deployment_id=deployment.id)
    if active is not None:
        incumbent, incumbent_sha = Path(active.artifact_path), active.artifact_sha256
    else:
        incumbent = _model_folder(deployment.draft_model, REFERENCE_MODELS / "generic-drafter")
        incumbent_sha = None
    return _RealignInputs(
        deployment_id=deployment.id,
        target_model=deployment.target_model,
        target_folder=_model_folder(deployment.target_model, REFERENCE_MODELS / "target"),
        incumbent_folder=incumbent,
        incumbent_sha256=incumbent_sha,
        parent_version_id=active.id if active is not None else None,
        recent=_trace_texts(recent),
        older=_trace_texts(older),
        window_start=recent[0].created_at if recent else None,
        window_end=recent[-1].created_at if recent else None,
        params=params,
    )


def _version_of_job(session: Session, job_id: int) -> DrafterVersion | None:
    return session.scalar(select(DrafterVersion).where(DrafterVersion.training_job_id == job_id))


def _succeed_with(session: Session, job: Job, version: DrafterVersion) -> dict[str, Any]:
    result = {"drafter_version": version.version, "drafter_version_id": version.id}
    if job.state in (JobState.queued, JobState.running):
        if job.state == JobState.queued:
            start_job(session=session, job_id=job.id)
        finish_job(session=session, job_id=job.id, result={**result, "metrics": version.training_metrics})
    return result


@celery_app.task(name="realign.run", base=InstrumentedTask, bind=True)
def run_realign(self: InstrumentedTask, job_id: int) -> dict[str, Any]:
    """Realign a deployment's drafter for one job; safe to run again for the same job.

    A redelivered message (the worker died) restarts training from the incumbent: training is
    minutes, and a restart needs no checkpoint to trust. The version is registered under a lock
    on the job row, and only if none exists for the job: never two versions for one job.
    """
    settings = get_settings()
    url = settings.database_url
    try:
        with unit_of_work(url) as session:
            job = session.get(Job, job_id)
            if job is None:
                return {"job_id": job_id, "skipped": "no such job"}
            if (existing := _version_of_job(session, job_id)) is not None:
                return {
                    "job_id": job_id,
                    **_succeed_with(session, job, existing),
                    "skipped": "already registered",
                }
            if job.state in TERMINAL:
                return {"job_id": job_id, "skipped": f"job is {job.state.value}"}
            if (
                job.state == JobState.running
                and job.celery_task_id
                and self.request.id
                and job.celery_task_id != self.request.id
            ):
                # A second message for a job that another delivery runs (the sweeper re-sent it
                # while the first waited in the queue). A redelivery after a worker died carries
                # the same task id as the run it replaces, and does restart.
                return {"job_id": job_id, "skipped": "running under another delivery"}
            start_job(session=session, job_id=job_id, celery_task_id=self.request.id)
            after_drift = job.drift_event_id is not None
    except OperationalError as exc:
        raise TransientError(str(exc)) from exc

    def progress(fraction: float, message: str) -> bool:
        self.report_progress(fraction, message)
        with unit_of_work(url) as session:
            return report_progress(session=session, job_id=job_id, fraction=fraction, message=message)

    try:
        if after_drift:
            _wait_for_traces(url, job_id, settings.realign_min_traces, settings.realign_max_wait_s, progress)
        with unit_of_work(url) as session:
            inputs = _realign_inputs(session, session.get_one(Job, job_id))
    except _Stopped as stop:
        return {"job_id": job_id, "stopped": str(stop)}
    except OperationalError as exc:
        raise TransientError(str(exc)) from exc

    try:
        metrics, artifact = _train_and_save(inputs, job_id, settings.artifact_dir, progress)
    except _Stopped as stop:
        log.info("realign job %s stopped: %s", job_id, stop)
        return {"job_id": job_id, "stopped": str(stop)}
    except Exception as exc:  # a bug or bad data does not get better on retry: record it and stop
        log.exception("realign job %s failed", job_id)
        with unit_of_work(url) as session:
            fail_job(session=session, job_id=job_id, error=f"{type(exc).__name__}: {exc}")
        return {"job_id": job_id, "failed": str(exc)}

    with unit_of_work(url) as session:
        job = session.get_one(Job, job_id, with_for_update=True)
        if (existing := _version_of_job(session, job_id)) is not None:
            return {"job_id": job_id, **_succeed_with(session, job, existing)}
        if job.state != JobState.running:
            return {"job_id": job_id, "skipped": f"job became {job.state.value} while training"}
        last = session.scalar(
            select(func.max(DrafterVersion.version)).where(
                DrafterVersion.deployment_id == inputs.deployment_id
            )
        )
        version = DrafterVersion(
            deployment_id=inputs.deployment_id,
            version=int(last or 0) + 1,
            parent_version_id=inputs.parent_version_id,
            training_job_id=job_id,
            traffic_window_start=inputs.window_start,
            traffic_window_end=inputs.window_end,
            artifact_path=str(artifact.path),
            artifact_sha256=artifact.sha256,
            target_model=inputs.target_model,
            state=DrafterState.candidate,
            training_metrics=metrics,
            eval_metrics={},
        )
        session.add(version)
        session.flush()
        outcome = {"job_id": job_id, **_succeed_with(session, job, version)}
        # Once per job: a redelivery finds the version above and never reaches this line.
        messages = on_realign_succeeded(session, job, version)
    _send_after_commit(messages)
    return outcome


class _Stopped(Exception):
    """Training stopped without a result: the job was cancelled, or there was too little data."""


def _train_and_save(
    inputs: _RealignInputs, job_id: int, artifact_dir: Path, progress: Any
) -> tuple[dict[str, Any], Any]:
    # torch is imported here, not at module import: the beat and drift tasks share this module.
    import torch

    from workers.engine.hf_io import load_hf_folder
    from workers.training.realign import (
        NotEnoughDataError,
        RealignCancelledError,
        RealignConfig,
        realign,
        save_drafter,
    )

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(torch_threads_for_this_process())
    default_budget = get_settings().realign_time_budget_s or DEFAULT_TIME_BUDGET_S
    target, tokenizer = load_hf_folder(inputs.target_folder, device=device)
    incumbent, incumbent_tok = load_hf_folder(
        inputs.incumbent_folder, device=device, expected_sha256=inputs.incumbent_sha256
    )
    if incumbent_tok.fingerprint != tokenizer.fingerprint:
        raise ValueError("the incumbent drafter's tokenizer differs from the target's")
    params = inputs.params
    cfg = RealignConfig(
        seed=int(params.get("seed", 0)),
        time_budget_s=float(params.get("time_budget_s", default_budget)),
        device=device,
    )
    if params.get("replay_share") is not None:
        cfg.replay_share = float(params["replay_share"])
    try:
        result = realign(target, incumbent, tokenizer, inputs.recent, inputs.older, cfg, progress=progress)
    except RealignCancelledError as exc:
        raise _Stopped(f"cancelled at: {exc}") from exc
    except NotEnoughDataError as exc:
        with unit_of_work(get_settings().database_url) as session:
            fail_job(session=session, job_id=job_id, error=str(exc))
        raise _Stopped(str(exc)) from exc
    metrics = {
        **{k: v for k, v in result.metrics.items() if k != "config"},
        "seed": cfg.seed,
        "time_budget_s": cfg.time_budget_s,
        "target_folder": str(inputs.target_folder),
        "incumbent_folder": str(inputs.incumbent_folder),
        "tokenizer_fingerprint": tokenizer.fingerprint,
    }
    folder = Path(artifact_dir) / f"deployment-{inputs.deployment_id}" / f"job-{job_id}"
    artifact = save_drafter(
        result.model,
        tokenizer,
        folder,
        metadata={
            "job_id": job_id,
            "deployment_id": inputs.deployment_id,
            "target": str(inputs.target_folder),
        },
    )
    progress(0.99, "artifact saved")
    return metrics, artifact
