"""Job services: request a realignment (one active per deployment), read, cancel, and the
worker-side transitions (start, progress, finish, fail), each checked by the state machine.

The database is the arbiter of "one queued or running realignment per deployment" (a partial
unique index): a request simply tries to insert, and when the index refuses, the job that won
is returned instead. No check-then-insert race is possible, whichever process asks.

Worker-side writes are conditional updates (``... WHERE state = 'running'``) so that a cancel that
lands between two progress reports is seen at the next one instead of being overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.audit.service import record_change
from controlplane.db.models import (
    Account,
    Deployment,
    DriftEvent,
    DriftResolution,
    Job,
    JobKind,
    JobState,
    SpeculationMode,
)
from controlplane.deployments.lookup import resource_name
from controlplane.drift.events import end_events_of_job, mark_realigning
from controlplane.errors import ConflictError, NotFoundError, ValidationProblem
from controlplane.jobs.states import ACTIVE, TERMINAL, IllegalTransitionError, transition
from controlplane.timestamps import utcnow

MAX_PAGE_SIZE = 500
# Job params a caller may set by hand; everything else is chosen by the trainer.
REALIGN_PARAM_KEYS = frozenset({"time_budget_s", "seed", "since", "replay_share", "max_traces"})


@dataclass(frozen=True, slots=True)
class RealignRequest:
    job: Job
    created: bool  # False: a queued or running realignment already existed and is returned


def _resource(session: Session, deployment: Deployment, job_id: int | None = None) -> str:
    account = session.get_one(Account, deployment.account_id)
    name = resource_name(account.name, deployment.name)
    return f"{name}/jobs/{job_id}" if job_id is not None else name


def active_realign_job(*, session: Session, deployment_id: int) -> Job | None:
    """The deployment's queued or running realignment, if any."""
    return session.scalar(
        select(Job).where(
            Job.deployment_id == deployment_id,
            Job.kind == JobKind.realign,
            Job.state.in_([s.value for s in ACTIVE]),
        )
    )


def validate_realign_params(params: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(params) - REALIGN_PARAM_KEYS)
    if unknown:
        raise ValidationProblem(
            f"unknown realign parameter(s) {unknown}; allowed: {sorted(REALIGN_PARAM_KEYS)}"
        )
    budget = params.get("time_budget_s")
    if budget is not None and not (isinstance(budget, int | float) and 1 <= budget <= 24 * 3600):
        raise ValidationProblem("time_budget_s must be a number of seconds between 1 and 86400")
    share = params.get("replay_share")
    if share is not None and not (isinstance(share, int | float) and 0 <= share < 1):
        raise ValidationProblem("replay_share must be in [0, 1)")
    return dict(params)


def request_realign(
    *,
    session: Session,
    deployment: Deployment,
    actor: str = "system",
    drift_event_id: int | None = None,
    params: dict[str, Any] | None = None,
) -> RealignRequest:
    """Create a queued realignment job, or return the one already queued or running."""
    job = Job(
        deployment_id=deployment.id,
        kind=JobKind.realign,
        state=JobState.queued,
        drift_event_id=drift_event_id,
        requested_by=actor,
        attempts=0,
        progress=0.0,
        progress_message="queued",
        params=validate_realign_params(params or {}),
        result={},
        # The caller sends the message right after its commit (see controlplane.jobs.queue).
        enqueued_at=utcnow(),
    )
    try:
        with session.begin_nested():
            session.add(job)
            session.flush()
    except IntegrityError:
        existing = active_realign_job(session=session, deployment_id=deployment.id)
        if existing is None:  # some other constraint failed: not ours to hide
            raise
        return RealignRequest(existing, created=False)
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=actor,
        action="job.create",
        resource=_resource(session, deployment, job.id),
        before=None,
        after={"kind": job.kind.value, "drift_event_id": drift_event_id, "params": job.params},
    )
    return RealignRequest(job, created=True)


# Modes whose drafter is a model that realignment can train; an n-gram or disabled deployment has none.
REALIGNABLE_MODES = frozenset({SpeculationMode.default, SpeculationMode.draft_model})


def realign_on_drift(*, session: Session, deployment: Deployment, event: DriftEvent) -> RealignRequest | None:
    """The automatic response to a drift event: queue a realignment if the deployment wants one.

    Runs in the transaction that records the event (outbox style): the event and its job commit
    together or not at all, and the caller sends ``realign.run`` only after that commit. When a
    realignment is already queued or running (another event, a manual request), that job is
    returned instead (``created`` False): two simultaneous events start one job. The event becomes
    ``realigning`` and names its job in its evidence (``realign_job_id``). None when the
    deployment does not realign automatically (``auto_realign`` off, or a speculation mode
    without a drafter model): the event stays ``open`` for a person.
    """
    if not deployment.auto_realign or deployment.speculation_mode not in REALIGNABLE_MODES:
        return None
    outcome = request_realign(
        session=session, deployment=deployment, actor=f"drift-event:{event.id}", drift_event_id=event.id
    )
    mark_realigning(event=event, job_id=outcome.job.id)
    return outcome


def claim_stale_queued_realigns(*, session: Session, older_than: datetime, limit: int = 100) -> list[int]:
    """Realign jobs still queued whose last message was sent before ``older_than``: the message
    was lost (the send after commit failed, or the broker dropped it). Each is claimed by moving
    its ``enqueued_at`` to now, with a compare-and-set so two sweepers never both take one; the
    caller commits, then sends ``realign.run`` for the returned ids.
    """
    stale = (
        Job.kind == JobKind.realign,
        Job.state == JobState.queued,
        or_(Job.enqueued_at.is_(None), Job.enqueued_at < older_than),
    )
    job_ids = session.scalars(select(Job.id).where(*stale).order_by(Job.id).limit(limit)).all()
    now = utcnow()
    claimed: list[int] = []
    for job_id in job_ids:
        # Still stale at the update: another sweeper that claimed it first moved enqueued_at.
        result = session.execute(
            update(Job)
            .where(Job.id == job_id, *stale)
            .values(enqueued_at=now)
            .execution_options(synchronize_session=False)
        )
        if getattr(result, "rowcount", 0) == 1:
            claimed.append(int(job_id))
    return claimed


def get_job(*, session: Session, deployment_id: int, job_id: int) -> Job:
    job = session.scalar(select(Job).where(Job.id == job_id, Job.deployment_id == deployment_id))
    if job is None:
        raise NotFoundError(f"job {job_id} not found")
    return job


def list_jobs(
    *, session: Session, deployment_id: int, state: str | None = None, limit: int = 100
) -> list[Job]:
    query = select(Job).where(Job.deployment_id == deployment_id)
    if state is not None:
        try:
            query = query.where(Job.state == JobState(state))
        except ValueError:
            raise ValidationProblem(f"unknown job state {state!r}") from None
    return list(session.scalars(query.order_by(Job.id.desc()).limit(max(1, min(limit, MAX_PAGE_SIZE)))))


def cancel_job(*, session: Session, deployment: Deployment, job_id: int, actor: str) -> Job:
    """Cancel a queued or running job; a running worker stops at its next progress checkpoint."""
    job = get_job(session=session, deployment_id=deployment.id, job_id=job_id)
    before = job.state
    try:
        job.state = transition(job.state, JobState.cancelled)
    except IllegalTransitionError as exc:
        raise ConflictError(str(exc)) from exc
    job.finished_at = utcnow()
    job.progress_message = f"cancelled by {actor}"
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=actor,
        action="job.cancel",
        resource=_resource(session, deployment, job.id),
        before={"state": before.value},
        after={"state": job.state.value},
    )
    if job.kind == JobKind.realign:
        end_events_of_job(
            session=session,
            drift_event_id=job.drift_event_id,
            resolution=DriftResolution.realignment_failed,
            note=f"realign job {job.id} cancelled by {actor}",
        )
    session.flush()
    return job


# ------------------------------------------------------------------------ worker-side transitions


def start_job(*, session: Session, job_id: int, celery_task_id: str | None = None) -> Job:
    """queued -> running (or a redelivered running job restarting): one more attempt.

    Raises IllegalTransitionError for a finished job (the caller drops the message).
    """
    job = session.get(Job, job_id, with_for_update=True)
    if job is None:
        raise NotFoundError(f"job {job_id} not found")
    job.state = transition(job.state, JobState.running)
    job.attempts += 1
    job.started_at = job.started_at or utcnow()
    job.celery_task_id = celery_task_id or job.celery_task_id
    job.progress_message = f"attempt {job.attempts} started"
    job.error = None
    session.flush()
    return job


def report_progress(*, session: Session, job_id: int, fraction: float, message: str) -> bool:
    """Record progress on a running job; False when it is no longer running (cancelled: stop)."""
    fraction = min(1.0, max(0.0, float(fraction)))
    result = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state == JobState.running)
        .values(progress=fraction, progress_message=message[:500])
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(result, "rowcount", 0))


def finish_job(*, session: Session, job_id: int, result: dict[str, Any]) -> Job:
    """running -> succeeded, with the result (the new drafter version and the training metrics)."""
    job = session.get_one(Job, job_id, with_for_update=True)
    job.state = transition(job.state, JobState.succeeded)
    job.result = result
    job.progress = 1.0
    job.progress_message = "succeeded"
    job.finished_at = utcnow()
    session.flush()
    return job


def fail_job(
    *,
    session: Session,
    job_id: int,
    error: str,
    resolution: DriftResolution = DriftResolution.realignment_failed,
) -> Job:
    """queued | running -> failed, keeping the error for the humans.

    A failed realignment ends the drift event it answered with ``resolution`` (too little
    post-drift traffic is ``not_enough_data``), so the detector re-arms instead of staying
    latched on an event nothing will answer.
    """
    job = session.get_one(Job, job_id, with_for_update=True)
    if job.state in TERMINAL:
        return job  # cancelled while failing: the cancel stands
    job.state = transition(job.state, JobState.failed)
    job.error = error[:10_000]
    job.progress_message = "failed"
    job.finished_at = utcnow()
    if job.kind == JobKind.realign:
        end_events_of_job(
            session=session, drift_event_id=job.drift_event_id, resolution=resolution, note=error[:500]
        )
    session.flush()
    return job


def job_summary(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "kind": job.kind.value,
        "state": job.state.value,
        "deployment_id": job.deployment_id,
        "drift_event_id": job.drift_event_id,
        "requested_by": job.requested_by,
        "attempts": job.attempts,
        "progress": job.progress,
        "progress_message": job.progress_message,
        "params": job.params,
        "result": job.result,
        "error": job.error,
        "created_at": job.created_at.isoformat() if job.created_at else None,
        "enqueued_at": job.enqueued_at.isoformat() if job.enqueued_at else None,
        "started_at": job.started_at.isoformat() if job.started_at else None,
        "finished_at": job.finished_at.isoformat() if job.finished_at else None,
    }
