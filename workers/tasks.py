"""Thin Celery tasks: open a unit of work, call a control-plane service, map errors to retries.

No SQL, statistics or training logic lives here: the services are ``controlplane.drift``,
``controlplane.jobs`` and ``controlplane.traces``; training is ``workers.training``.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from controlplane import messaging
from controlplane.artifacts.store import open_store
from controlplane.config import Settings, get_settings
from controlplane.db.models import DriftResolution
from controlplane.db.session import TRANSIENT_DATABASE_ERRORS, unit_of_work
from controlplane.drift.service import advance_monitor, deployments_with_new_records
from controlplane.errors import ConflictError, DomainError
from controlplane.jobs import realign as realign_job
from controlplane.jobs.service import claim_stale_queued_realigns, fail_job, report_progress
from controlplane.timestamps import utcnow
from controlplane.traces.service import apply_retention
from workers.celery_app import (
    InstrumentedTask,
    TransientError,
    celery_app,
    project_task,
    torch_threads_for_this_process,
)

log = logging.getLogger(__name__)

SETTLE_INTERVAL_S = 2.0
Progress = Callable[[float, str], bool]


@project_task(messaging.DRIFT_MONITOR_ALL, ignore_result=True)
def monitor_all() -> list[int]:
    """Beat entry point: fan out one monitor task per deployment that has new records."""
    settings = get_settings()
    try:
        with unit_of_work(settings.database_url) as session:
            deployment_ids = deployments_with_new_records(session=session)
    except TRANSIENT_DATABASE_ERRORS as exc:
        raise TransientError(str(exc)) from exc
    messaging.send_all(
        celery_app, [messaging.TaskMessage(messaging.DRIFT_MONITOR_DEPLOYMENT, (d,)) for d in deployment_ids]
    )
    return deployment_ids


@project_task(messaging.DRIFT_MONITOR_DEPLOYMENT)
def monitor_deployment(deployment_id: int) -> dict[str, Any]:
    """Advance one deployment's detector over its new records (exactly once, see the service)."""
    settings = get_settings()
    try:
        with unit_of_work(settings.database_url) as session:
            outcome = advance_monitor(session=session, deployment_id=deployment_id, settings=settings)
    except ConflictError:
        # Another monitor run advanced this deployment at the same time; its work stands.
        return {"deployment_id": deployment_id, "skipped": "concurrent run"}
    except TRANSIENT_DATABASE_ERRORS as exc:
        raise TransientError(str(exc)) from exc
    messages = [messaging.TaskMessage(messaging.REALIGN, (job_id,)) for job_id in outcome.realign_jobs]
    if outcome.pending:
        # Newer records settle within one interval; come back for them rather than wait for beat.
        messages.append(
            messaging.TaskMessage(
                messaging.DRIFT_MONITOR_DEPLOYMENT, (deployment_id,), countdown=SETTLE_INTERVAL_S
            )
        )
    if outcome.events_raised:
        log.warning("drift detected on deployment %s: events %s", deployment_id, outcome.events_raised)
    # The jobs committed with their events; a send that fails leaves them queued for the sweeper.
    messaging.send_all(celery_app, messages)
    return {
        "deployment_id": deployment_id,
        "records_consumed": outcome.records_consumed,
        "events_raised": outcome.events_raised,
        "realign_jobs": outcome.realign_jobs,
        "skipped": outcome.skipped,
    }


@project_task(messaging.JOBS_RESEND_STALE_QUEUED, ignore_result=True)
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
    except TRANSIENT_DATABASE_ERRORS as exc:
        raise TransientError(str(exc)) from exc
    for job_id in job_ids:
        log.warning("realign job %s was queued without starting; sending it again", job_id)
    messaging.send_all(celery_app, [messaging.TaskMessage(messaging.REALIGN, (j,)) for j in job_ids])
    return job_ids


@project_task(messaging.TRACES_APPLY_RETENTION)
def apply_trace_retention() -> dict[str, int]:
    """Beat entry point: delete traces older than each deployment's retention limit."""
    settings = get_settings()
    try:
        with unit_of_work(settings.database_url) as session:
            deleted = apply_retention(session=session, now=utcnow())
    except TRANSIENT_DATABASE_ERRORS as exc:
        raise TransientError(str(exc)) from exc
    return {str(deployment_id): count for deployment_id, count in deleted.items()}


# ------------------------------------------------------------------------------------ realignment

DEFAULT_TIME_BUDGET_S = 240.0
TRACE_POLL_S = 2.0


class _Stopped(Exception):
    """Training stopped without a result: the job was cancelled, or there was too little data."""


def _wait_for_traces(url: str, job_id: int, minimum: int, max_wait_s: float, progress: Progress) -> int:
    """Right after an alarm there is little post-drift traffic to learn from: wait (reporting
    progress, honouring a cancel) until ``minimum`` traces arrived since the drift point, or
    ``max_wait_s`` passed; then train on what there is. Returns the count seen."""
    deadline = time.monotonic() + max_wait_s
    while True:
        with unit_of_work(url) as session:
            count = realign_job.traces_to_train_on(session=session, job_id=job_id)
        if count >= minimum or time.monotonic() >= deadline:
            return count
        if not progress(0.0, f"collecting traffic since the drift point: {count}/{minimum} traces"):
            raise _Stopped("cancelled while collecting traffic")
        time.sleep(TRACE_POLL_S)


@project_task(messaging.REALIGN, bind=True)
def run_realign(self: InstrumentedTask, job_id: int) -> dict[str, Any]:
    """Realign a deployment's drafter for one job; safe to run again for the same job (see
    ``controlplane.jobs.realign``)."""
    settings = get_settings()
    url = settings.database_url
    try:
        with unit_of_work(url) as session:
            claim = realign_job.claim_job(session=session, job_id=job_id, delivery_id=self.request.id)
    except TRANSIENT_DATABASE_ERRORS as exc:
        raise TransientError(str(exc)) from exc
    if claim.done is not None:
        return claim.done

    def progress(fraction: float, message: str) -> bool:
        self.report_progress(fraction, message)
        with unit_of_work(url) as session:
            return report_progress(session=session, job_id=job_id, fraction=fraction, message=message)

    try:
        if claim.after_drift:
            _wait_for_traces(url, job_id, settings.realign_min_traces, settings.realign_max_wait_s, progress)
        with unit_of_work(url) as session:
            inputs = realign_job.realign_inputs(session=session, job_id=job_id)
    except _Stopped as stop:
        return {"job_id": job_id, "stopped": str(stop)}
    except TRANSIENT_DATABASE_ERRORS as exc:
        raise TransientError(str(exc)) from exc
    except DomainError as exc:  # e.g. the target was unregistered: no model to train against
        with unit_of_work(url) as session:
            fail_job(session=session, job_id=job_id, error=exc.message)
        return {"job_id": job_id, "failed": exc.message}

    try:
        metrics, artifact = _train_and_save(inputs, job_id, settings, progress)
    except _Stopped as stop:
        log.info("realign job %s stopped: %s", job_id, stop)
        return {"job_id": job_id, "stopped": str(stop)}
    except Exception as exc:  # a bug or bad data does not get better on retry: record it and stop
        log.exception("realign job %s failed", job_id)
        with unit_of_work(url) as session:
            fail_job(session=session, job_id=job_id, error=f"{type(exc).__name__}: {exc}")
        return {"job_id": job_id, "failed": str(exc)}

    with unit_of_work(url) as session:
        registered = realign_job.register_trained(
            session=session,
            job_id=job_id,
            inputs=inputs,
            artifact_path=artifact.uri,
            artifact_sha256=artifact.sha256,
            manifest_sha256=artifact.manifest_sha256,
            metrics=metrics,
        )
    # Once per job: a redelivery finds the version registered and sends nothing.
    messaging.send_all(celery_app, registered.messages)
    return registered.result


@dataclass(frozen=True, slots=True)
class StoredArtifact:
    uri: str
    sha256: str
    manifest_sha256: str


def _train_and_save(
    inputs: realign_job.RealignInputs, job_id: int, settings: Settings, progress: Progress
) -> tuple[dict[str, Any], StoredArtifact]:
    # torch is imported here, not at module import: the beat and drift tasks share this module.
    import torch

    from workers.devices import resolve_device, weights_dtype
    from workers.engine.hf_io import load_hf_folder
    from workers.engine.tokenizer import ensure_same_tokenizer
    from workers.loading import VerifiedModels
    from workers.model_cache import TARGETS
    from workers.training.realign import (
        NotEnoughDataError,
        RealignCancelledError,
        RealignConfig,
        TraceText,
        realign,
        save_drafter,
    )

    if inputs.incumbent is None:
        raise ValueError(
            "the deployment has no drafter to realign: name a draft_model or give its target a "
            "default drafter"
        )
    device = resolve_device(settings.worker_device)
    dtype = weights_dtype(device)
    torch.set_num_threads(torch_threads_for_this_process())
    default_budget = settings.realign_time_budget_s or DEFAULT_TIME_BUDGET_S
    models = VerifiedModels(settings)
    target_folder = models.folder(inputs.target)
    incumbent_folder = models.folder(inputs.incumbent)
    target, tokenizer = TARGETS.get(
        target_folder,
        identity=inputs.target.identity,
        device=device,
        dtype=dtype,
        loader=lambda: load_hf_folder(target_folder, device=device, dtype=dtype),
    )
    # The incumbent is trained in place, so it is loaded fresh (never from the shared cache), in
    # float32: the optimizer keeps master weights at full precision (autocast runs bf16 on CUDA).
    incumbent, incumbent_tok = load_hf_folder(incumbent_folder, device=device)
    ensure_same_tokenizer(tokenizer, incumbent_tok, inputs.target.name, inputs.incumbent.name)
    params = inputs.params
    cfg = RealignConfig(
        seed=int(params.get("seed", 0)),
        time_budget_s=float(params.get("time_budget_s", default_budget)),
        device=str(device),
        teacher_memory_mb=settings.worker_teacher_memory_mb,
    )
    if params.get("replay_share") is not None:
        cfg.replay_share = float(params["replay_share"])
    recent = [TraceText(t.key, t.prompt, t.completion) for t in inputs.recent]
    older = [TraceText(t.key, t.prompt, t.completion) for t in inputs.older]
    try:
        result = realign(target, incumbent, tokenizer, recent, older, cfg, progress=progress)
    except RealignCancelledError as exc:
        raise _Stopped(f"cancelled at: {exc}") from exc
    except NotEnoughDataError as exc:
        with unit_of_work(settings.database_url) as session:
            fail_job(
                session=session, job_id=job_id, error=str(exc), resolution=DriftResolution.not_enough_data
            )
        raise _Stopped(str(exc)) from exc
    metrics = {
        **{k: v for k, v in result.metrics.items() if k != "config"},
        "seed": cfg.seed,
        "time_budget_s": cfg.time_budget_s,
        "device": str(device),
        "target": inputs.target.name,
        "target_identity": inputs.target.identity,
        "incumbent": inputs.incumbent.name,
        "incumbent_identity": inputs.incumbent.identity,
        "tokenizer_fingerprint": tokenizer.fingerprint,
    }
    key = f"deployment-{inputs.deployment_id}/job-{job_id}"
    staging = settings.var_dir / "staging" / key
    artifact = save_drafter(
        result.model,
        tokenizer,
        staging,
        metadata={"job_id": job_id, "deployment_id": inputs.deployment_id, "target": inputs.target.name},
    )
    uri = open_store(settings.artifact_store, s3_endpoint_url=settings.s3_endpoint_url).upload_folder(
        artifact.path, key
    )
    shutil.rmtree(staging, ignore_errors=True)  # the store holds it now
    progress(0.99, "artifact stored")
    return metrics, StoredArtifact(uri, artifact.sha256, artifact.manifest_sha256)
