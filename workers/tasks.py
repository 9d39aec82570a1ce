"""Thin Celery tasks: open a unit of work, call a control-plane service, map errors to retries.

No SQL, statistics or training logic lives here: the services are ``controlplane.drift``,
``controlplane.jobs`` and ``controlplane.traces``; training is ``workers.training``.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from controlplane import messaging
from controlplane.adaptation.service import AdaptationOutcome, adapt_deployment
from controlplane.artifacts.store import open_store
from controlplane.config import Settings, get_settings
from controlplane.db.models import DriftResolution
from controlplane.db.session import TRANSIENT_DATABASE_ERRORS, unit_of_work
from controlplane.drift.aggregate_monitor import DetectorCache
from controlplane.drift.service import deployments_with_new_records
from controlplane.errors import ConflictError, DomainError
from controlplane.jobs.recovery import heartbeat_interval_s
from controlplane.jobs.service import (
    claim_stale_queued_realigns,
    end_failed_attempt,
    fail_job,
    recover_lapsed_leases,
    renew_lease,
    report_progress,
)
from controlplane.loop import realign as realign_job
from controlplane.loop.drift import advance_monitor, monitor_aggregates
from controlplane.speculation_check.service import CheckOutcome, run_check
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
    """Beat entry point: fan out one monitor task per deployment that has new records, and one
    pass per shard over edge aggregates."""
    settings = get_settings()
    try:
        with unit_of_work(settings.database_url) as session:
            deployment_ids = deployments_with_new_records(session=session)
    except TRANSIENT_DATABASE_ERRORS as exc:
        raise TransientError(str(exc)) from exc
    shards = settings.drift_monitor_shards
    messaging.send_all(
        celery_app,
        [messaging.TaskMessage(messaging.DRIFT_MONITOR_DEPLOYMENT, (d,)) for d in deployment_ids]
        + [messaging.TaskMessage(messaging.DRIFT_MONITOR_AGGREGATES, (s, shards)) for s in range(shards)],
    )
    return deployment_ids


# This worker process's detectors as it last wrote them (see controlplane.drift.aggregate_monitor).
_AGGREGATE_DETECTORS = DetectorCache()


@project_task(messaging.DRIFT_MONITOR_AGGREGATES, ignore_result=True)
def monitor_aggregate_shard(shard: int, shards: int) -> dict[str, Any]:
    """One set-based pass over the edge aggregates of one shard of deployments."""
    settings = get_settings()
    try:
        with unit_of_work(settings.database_url) as session:
            outcome = monitor_aggregates(
                session=session, settings=settings, shard=shard, shards=shards, cache=_AGGREGATE_DETECTORS
            )
    except ConflictError:
        # Another writer advanced one of these deployments meanwhile: the next pass consumes them.
        return {"shard": shard, "shards": shards, "skipped": "concurrent run"}
    except TRANSIENT_DATABASE_ERRORS as exc:
        raise TransientError(str(exc)) from exc
    outcome.commit(_AGGREGATE_DETECTORS)
    if outcome.events_raised:
        log.warning("drift detected from aggregates: events %s", outcome.events_raised)
    # The jobs committed with their events; a send that fails leaves them queued for the sweeper.
    messaging.send_all(
        celery_app, [messaging.TaskMessage(messaging.REALIGN, (job_id,)) for job_id in outcome.realign_jobs]
    )
    return outcome.as_dict()


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
    adapted = _adapt(deployment_id, settings)
    if adapted is not None and adapted.job_id is not None:
        messages.append(messaging.TaskMessage(messaging.REALIGN, (adapted.job_id,)))
    checked = _check_speculation(deployment_id, settings)
    if checked is not None:
        messages += [messaging.TaskMessage(messaging.REALIGN, (job_id,)) for job_id in checked.realign_jobs]
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
        "adaptation": adapted.as_dict() if adapted is not None else None,
        "speculation_check": {"verdict": checked.verdict, "action": checked.action} if checked else None,
    }


def _adapt(deployment_id: int, settings: Settings) -> AdaptationOutcome | None:
    """The first-drafter and continuous triggers, in their own unit of work: a failure here is
    logged and leaves the drift monitor's work (already committed) and other deployments alone."""
    try:
        with unit_of_work(settings.database_url) as session:
            return adapt_deployment(session=session, deployment_id=deployment_id, settings=settings)
    except Exception:
        log.exception("adaptation triggers of deployment %s failed; the next pass tries again", deployment_id)
        return None


def _check_speculation(deployment_id: int, settings: Settings) -> CheckOutcome | None:
    """Does speculation pay: the standing test and its actions, in their own unit of work, so a
    failure here is logged and leaves the drift monitor and other deployments alone."""
    try:
        with unit_of_work(settings.database_url) as session:
            return run_check(session=session, deployment_id=deployment_id, settings=settings)
    except Exception:
        log.exception("speculation check of deployment %s failed; the next pass tries again", deployment_id)
        return None


@project_task(messaging.JOBS_RESEND_STALE_QUEUED, ignore_result=True)
def resend_stale_queued() -> list[int]:
    """Beat entry point: recover realign jobs that lost their worker, and send the queued ones
    that need a message.

    First, running jobs whose lease lapsed (their worker was killed or hung) go back to queued
    after the backoff, or fail once their attempts are spent. Then each queued job whose retry is
    due, or whose message is overdue (lost), is claimed (its ``enqueued_at`` moves to now) and
    committed before its message goes out, so the next sweep waits a full threshold again. A
    duplicate message is harmless: ``realign.run`` starts only a queued job, by compare-and-set.
    """
    settings = get_settings()
    now = utcnow()
    cutoff = now - timedelta(seconds=settings.realign_resend_after_s)
    try:
        with unit_of_work(settings.database_url) as session:
            recovered = recover_lapsed_leases(session=session, settings=settings, now=now)
        with unit_of_work(settings.database_url) as session:
            job_ids = claim_stale_queued_realigns(session=session, older_than=cutoff, now=now)
    except TRANSIENT_DATABASE_ERRORS as exc:
        raise TransientError(str(exc)) from exc
    for job_id in recovered.requeued:
        log.warning("realign job %s lost its worker (lease lapsed); queued for another attempt", job_id)
    for job_id in recovered.failed:
        log.warning("realign job %s lost its worker on its last attempt; failed", job_id)
    for job_id in job_ids:
        log.info("sending realign job %s (retry due, or its message was lost)", job_id)
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
    """Training stopped without a result: the job was cancelled, its attempt was given up, or
    there was too little data (the job is already failed as ``not_enough_data``)."""


class _Permanent(Exception):
    """A failure that another attempt cannot fix (no drafter to realign): the job fails at once."""


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


def time_budget_s(params: dict[str, Any], settings: Settings) -> float:
    """The attempt's training budget: the job's, else the settings', else the default; never past
    the ceiling that keeps the whole task below the broker's visibility timeout."""
    wanted = float(params.get("time_budget_s") or settings.realign_time_budget_s or DEFAULT_TIME_BUDGET_S)
    return max(1.0, min(wanted, settings.realign_budget_ceiling_s))


class Heartbeat:
    """Renews a running attempt's lease from a thread, every third of the lease, for at most the
    attempt's allotted time (the trace wait, the budget and the margin): an attempt that hangs
    past it lets its lease lapse, and the sweep recovers the job. ``lost`` is set once the
    attempt is no longer the job's running one (cancelled, or given up): the run must stop."""

    def __init__(self, url: str, job_id: int, attempt: int, lease_s: float, allotted_s: float) -> None:
        self.url, self.job_id, self.attempt, self.lease_s = url, job_id, attempt, lease_s
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._deadline = time.monotonic() + allotted_s
        self._thread = threading.Thread(target=self._run, name=f"lease-job-{job_id}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(heartbeat_interval_s(self.lease_s)):
            if time.monotonic() > self._deadline:
                log.warning(
                    "realign job %s attempt %s ran past its time; lease left to lapse",
                    self.job_id,
                    self.attempt,
                )
                return
            try:
                with unit_of_work(self.url) as session:
                    held = renew_lease(
                        session=session, job_id=self.job_id, attempt=self.attempt, lease_s=self.lease_s
                    )
            except TRANSIENT_DATABASE_ERRORS:
                log.warning("realign job %s: could not renew its lease", self.job_id, exc_info=True)
                continue  # the next beat tries again; two misses in a row and the lease lapses
            if not held:
                self.lost.set()
                return


@project_task(messaging.REALIGN, bind=True)
def run_realign(self: InstrumentedTask, job_id: int) -> dict[str, Any]:
    """Realign a deployment's drafter for one attempt of one job; a message for a job that is
    not queued (running under another delivery, finished) does nothing (see
    ``controlplane.jobs.realign.claim_job``)."""
    settings = get_settings()
    url = settings.database_url
    lease_s = settings.realign_lease_s
    try:
        with unit_of_work(url) as session:
            claim = realign_job.claim_job(
                session=session, job_id=job_id, delivery_id=self.request.id, lease_s=lease_s
            )
    except TRANSIENT_DATABASE_ERRORS as exc:
        raise TransientError(str(exc)) from exc
    if claim.done is not None:
        return claim.done
    attempt = claim.attempt
    log.info("realign job %s attempt %s started in process %s", job_id, attempt, os.getpid())
    # Past the trace wait, its budget and the margin, an attempt is hung: its lease may lapse.
    budget_s = time_budget_s(claim.params, settings)
    allotted_s = settings.realign_max_wait_s + budget_s + settings.realign_margin_s
    with Heartbeat(url, job_id, attempt, lease_s, allotted_s) as heartbeat:

        def progress(fraction: float, message: str) -> bool:
            if heartbeat.lost.is_set():
                return False
            self.report_progress(fraction, message)
            with unit_of_work(url) as session:
                return report_progress(
                    session=session,
                    job_id=job_id,
                    fraction=fraction,
                    message=message,
                    attempt=attempt,
                    lease_s=lease_s,
                )

        return _run_attempt(job_id, attempt, settings, progress, claim.after_drift)


def _give_up_attempt(
    job_id: int, attempt: int, error: str, settings: Settings, *, retry: bool
) -> dict[str, Any]:
    """Record a failed attempt: queued again after the backoff (while attempts remain), or failed."""
    with unit_of_work(settings.database_url) as session:
        if retry:
            job = end_failed_attempt(
                session=session, job_id=job_id, attempt=attempt, error=error, settings=settings
            )
        else:
            job = fail_job(session=session, job_id=job_id, error=error, attempt=attempt)
        outcome = job.state.value if job is not None else "superseded"
    return {"job_id": job_id, "attempt": attempt, "failed": error, "job_state": outcome}


def _run_attempt(
    job_id: int, attempt: int, settings: Settings, progress: Progress, after_drift: bool
) -> dict[str, Any]:
    url = settings.database_url
    try:
        if after_drift:
            _wait_for_traces(url, job_id, settings.realign_min_traces, settings.realign_max_wait_s, progress)
        with unit_of_work(url) as session:
            inputs = realign_job.realign_inputs(session=session, job_id=job_id)
    except _Stopped as stop:
        return {"job_id": job_id, "attempt": attempt, "stopped": str(stop)}
    except DomainError as exc:  # e.g. the target was unregistered: no model to train against
        return _give_up_attempt(job_id, attempt, exc.message, settings, retry=False)
    except Exception as exc:  # the database went away, a bug: another attempt may fare better
        log.exception("realign job %s attempt %s could not read its inputs", job_id, attempt)
        return _give_up_attempt(job_id, attempt, f"{type(exc).__name__}: {exc}", settings, retry=True)

    try:
        metrics, artifact = _train_and_save(inputs, job_id, attempt, settings, progress)
    except _Stopped as stop:
        log.info("realign job %s stopped: %s", job_id, stop)
        return {"job_id": job_id, "attempt": attempt, "stopped": str(stop)}
    except _Permanent as exc:
        return _give_up_attempt(job_id, attempt, str(exc), settings, retry=False)
    except Exception as exc:  # out of memory, a corrupt file, a bug: retried up to the cap
        log.exception("realign job %s attempt %s failed", job_id, attempt)
        return _give_up_attempt(job_id, attempt, f"{type(exc).__name__}: {exc}", settings, retry=True)

    with unit_of_work(url) as session:
        registered = realign_job.register_trained(
            session=session,
            job_id=job_id,
            inputs=inputs,
            artifact_path=artifact.uri,
            artifact_sha256=artifact.sha256,
            manifest_sha256=artifact.manifest_sha256,
            metrics=metrics,
            attempt=attempt,
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
    inputs: realign_job.RealignInputs, job_id: int, attempt: int, settings: Settings, progress: Progress
) -> tuple[dict[str, Any], StoredArtifact]:
    # torch is imported here, not at module import: the beat and drift tasks share this module.
    import torch

    from workers.devices import resolve_device, weights_dtype
    from workers.engine.hf_io import load_hf_folder
    from workers.engine.tokenizer import ensure_same_tokenizer
    from workers.loading import VerifiedModels
    from workers.model_cache import TARGETS
    from workers.training.realign import (
        realign,
        save_drafter,
    )

    device = resolve_device(settings.worker_device)
    dtype = weights_dtype(device)
    torch.set_num_threads(torch_threads_for_this_process())
    models = VerifiedModels(settings)
    target_folder = models.folder(inputs.target)
    target, tokenizer = TARGETS.get(
        target_folder,
        identity=inputs.target.identity,
        device=device,
        dtype=dtype,
        loader=lambda: load_hf_folder(target_folder, device=device, dtype=dtype),
    )
    params = inputs.params
    incumbent_folder = models.folder(inputs.incumbent) if inputs.incumbent is not None else None
    from workers.engine.head_io import is_head_folder

    incumbent_is_head = incumbent_folder is not None and is_head_folder(incumbent_folder)
    kind = params.get("drafter_kind") or ("eagle3" if incumbent_is_head else "draft_model")
    if kind == "eagle3":
        return _train_and_save_head(
            inputs,
            job_id,
            attempt,
            settings,
            progress,
            target,
            tokenizer,
            device,
            incumbent_folder if incumbent_is_head else None,
        )
    if inputs.incumbent is None or incumbent_is_head:
        # No drafter yet (day 0), or a head to be replaced by a small model: a narrow one starts
        # from the target's own embeddings, then is distilled on the traces.
        from workers.training.first_drafter import narrow_drafter_from_target

        incumbent = narrow_drafter_from_target(target)
        shape = f"{incumbent.config.n_layers}x{incumbent.config.dim}"
        incumbent_name = f"first-drafter:narrow-{shape}-of-{inputs.target.name}"
        incumbent_identity = f"{inputs.target.identity}:narrow[{shape}]"
    else:
        # The incumbent is trained in place, so it is loaded fresh (never from the shared cache), in
        # float32: the optimizer keeps master weights at full precision (autocast runs bf16 on CUDA).
        assert incumbent_folder is not None and inputs.incumbent is not None
        incumbent, incumbent_tok = load_hf_folder(incumbent_folder, device=device)
        ensure_same_tokenizer(tokenizer, incumbent_tok, inputs.target.name, inputs.incumbent.name)
        incumbent_name, incumbent_identity = inputs.incumbent.name, inputs.incumbent.identity
    cfg = _job_config(params, settings, device)
    if inputs.incumbent is None or incumbent_is_head:
        from workers.training.first_drafter import FIRST_DRAFTER_MAX_EPOCHS

        cfg.max_epochs = FIRST_DRAFTER_MAX_EPOCHS
    recent, older = _trace_texts(inputs)
    with _training_outcomes(job_id, attempt, settings):
        result = realign(target, incumbent, tokenizer, recent, older, cfg, progress=progress)
    metrics = {
        **{k: v for k, v in result.metrics.items() if k != "config"},
        "drafter_kind": "draft_model",
        "seed": cfg.seed,
        "time_budget_s": cfg.time_budget_s,
        "attempt": attempt,
        "device": str(device),
        "target": inputs.target.name,
        "target_identity": inputs.target.identity,
        "incumbent": incumbent_name,
        "incumbent_identity": incumbent_identity,
        "tokenizer_fingerprint": tokenizer.fingerprint,
    }
    # Each attempt writes its own folder: a late attempt that was given up never writes into the
    # folder of the attempt that replaced it.
    key = f"deployment-{inputs.deployment_id}/job-{job_id}/attempt-{attempt}"
    staging = settings.var_dir / "staging" / key
    artifact = save_drafter(
        result.model,
        tokenizer,
        staging,
        metadata={
            "job_id": job_id,
            "attempt": attempt,
            "deployment_id": inputs.deployment_id,
            "target": inputs.target.name,
        },
    )
    return metrics, _store(artifact.path, artifact.sha256, artifact.manifest_sha256, key, settings, progress)


def _store(
    folder: Path, sha256: str, manifest_sha256: str, key: str, settings: Settings, progress: Progress
) -> StoredArtifact:
    uri = open_store(settings.artifact_store, s3_endpoint_url=settings.s3_endpoint_url).upload_folder(
        folder, key
    )
    shutil.rmtree(folder, ignore_errors=True)  # the store holds it now
    progress(0.99, "artifact stored")
    return StoredArtifact(uri, sha256, manifest_sha256)


def _job_config(params: dict[str, Any], settings: Settings, device: Any) -> Any:
    """The training settings a realign job's parameters and the worker's settings give (drafter or head)."""
    from workers.training.realign import RealignConfig

    cfg = RealignConfig(
        seed=int(params.get("seed", 0)),
        time_budget_s=time_budget_s(params, settings),
        device=str(device),
        teacher_memory_mb=settings.worker_teacher_memory_mb,
    )
    if params.get("replay_share") is not None:
        cfg.replay_share = float(params["replay_share"])
    return cfg


def _trace_texts(inputs: realign_job.RealignInputs) -> tuple[list[Any], list[Any]]:
    """The job's recent and older traces as the trainers take them."""
    from workers.training.realign import TraceText

    def texts(traces: Any) -> list[Any]:
        return [TraceText(t.key, t.prompt, t.completion, t.category, t.document) for t in traces]

    return texts(inputs.recent), texts(inputs.older)


@contextmanager
def _training_outcomes(job_id: int, attempt: int, settings: Settings) -> Iterator[None]:
    """A cancelled run stops the attempt; too little data fails the job for good (another attempt on
    the same traffic would find it just as thin)."""
    from workers.training.realign import NotEnoughDataError, RealignCancelledError

    try:
        yield
    except RealignCancelledError as exc:
        raise _Stopped(f"cancelled at: {exc}") from exc
    except NotEnoughDataError as exc:
        with unit_of_work(settings.database_url) as session:
            fail_job(
                session=session,
                job_id=job_id,
                error=str(exc),
                resolution=DriftResolution.not_enough_data,
                attempt=attempt,
            )
        raise _Stopped(str(exc)) from exc


def _train_and_save_head(
    inputs: realign_job.RealignInputs,
    job_id: int,
    attempt: int,
    settings: Settings,
    progress: Progress,
    target: Any,
    tokenizer: Any,
    device: Any,
    incumbent_folder: Path | None,
) -> tuple[dict[str, Any], StoredArtifact]:
    """Train an EAGLE-3 head: from the incumbent head, or built for a target that has none."""
    from workers.engine.head_io import load_head_folder
    from workers.engine.tokenizer import ensure_same_tokenizer
    from workers.training.eagle import HeadOptions, save_head, train_head

    head = None
    incumbent_name = f"new-eagle3-head-of-{inputs.target.name}"
    if incumbent_folder is not None and inputs.incumbent is not None:
        head, head_tok = load_head_folder(incumbent_folder, target)
        ensure_same_tokenizer(tokenizer, head_tok, inputs.target.name, inputs.incumbent.name)
        incumbent_name = inputs.incumbent.name
    params = inputs.params
    cfg = _job_config(params, settings, device)
    recent, older = _trace_texts(inputs)
    with _training_outcomes(job_id, attempt, settings):
        result = train_head(target, head, tokenizer, recent, older, cfg, HeadOptions(), progress=progress)
    metrics = {
        **result.metrics,
        "seed": cfg.seed,
        "time_budget_s": cfg.time_budget_s,
        "attempt": attempt,
        "target": inputs.target.name,
        "target_identity": inputs.target.identity,
        "incumbent": incumbent_name,
        "tokenizer_fingerprint": tokenizer.fingerprint,
    }
    key = f"deployment-{inputs.deployment_id}/job-{job_id}/attempt-{attempt}"
    staging = settings.var_dir / "staging" / key
    saved = save_head(
        result.model,
        tokenizer,
        staging,
        verifier=inputs.target.name,
        verifier_family=target.config.family,
        metadata={
            "job_id": job_id,
            "attempt": attempt,
            "deployment_id": inputs.deployment_id,
            "target": inputs.target.name,
            "drafter_kind": "eagle3",
        },
    )
    return metrics, _store(saved.path, saved.sha256, saved.manifest_sha256, key, settings, progress)
