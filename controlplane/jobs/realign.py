"""The realign job's reads and writes, for the worker that runs it: claim the job and find the
traffic it trains on (since the drift point). Registering what it trained as a candidate and
handing it to its canary is the loop's step (``controlplane.loop.realign``). The worker
(``workers.tasks``) holds no SQL; it trains between these calls. Afterwards, ``trained_content``
reads back which prompts and documents a version may have trained on, so that nothing presented
as held out shares one with them.

Every function runs in the caller's unit of work and is safe to call again for the same job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from controlplane.db.models import (
    AcceptanceRecordRow,
    Deployment,
    DrafterVersion,
    DriftEvent,
    Job,
    JobState,
    Trace,
)
from controlplane.deployments.guardrail import guardrail_fallback
from controlplane.drafters import service as drafters
from controlplane.drafters.serving import incumbent_location, target_location
from controlplane.ingest.record import ARM_LIVE
from controlplane.jobs.service import finish_job, start_attempt, start_job
from controlplane.jobs.states import TERMINAL
from controlplane.models.location import ModelLocation
from controlplane.models.service import default_drafter_of, find_model, location_of
from controlplane.timestamps import as_utc, parse_utc, utcnow
from controlplane.traces.holdout import (
    REALIGN_HOLDOUT_SHARE,
    TrainedContent,
    content_key,
    content_of,
    is_held_out,
)

# Traces from a little before the alarm count as post-drift: detection lags the change itself.
DRIFT_LOOKBACK = timedelta(minutes=15)
MAX_RECENT_TRACES = 4000
MAX_REPLAY_TRACES = 2000
# The change-point estimate is itself noisy: start the post-drift window a little earlier.
DRIFT_POINT_MARGIN = 1.5
DRIFT_POINT_EXTRA_RECORDS = 10


@dataclass(frozen=True, slots=True)
class Claim:
    """The outcome of claiming a job: ``done`` says why there is nothing to run (the task returns
    it as its result); otherwise the job is running its attempt number ``attempt`` under this
    delivery, holding a lease the worker must renew."""

    done: dict[str, Any] | None
    after_drift: bool = False
    attempt: int = 0
    params: dict[str, Any] = field(default_factory=dict)


def claim_job(
    *, session: Session, job_id: int, delivery_id: str | None, lease_s: float, now: datetime | None = None
) -> Claim:
    """Start the job's next attempt for this delivery, or say why not: no such job, a version is
    already registered (a redelivery after the commit), finished, running (under a live lease:
    a duplicate or redelivered message; a lapsed one is the sweep's to recover, with its backoff
    and attempt cap), its retry is not due yet, or another delivery started it first.

    Only a ``queued`` job starts, by a compare-and-set on its state and attempt count: however many
    messages name the job, one attempt runs at a time.
    """
    now = now or utcnow()
    job = session.get(Job, job_id)
    if job is None:
        return Claim({"job_id": job_id, "skipped": "no such job"})
    if (existing := drafters.version_of_job(session=session, job_id=job_id)) is not None:
        return Claim(
            {"job_id": job_id, **succeed_with(session, job, existing), "skipped": "already registered"}
        )
    if job.state in TERMINAL:
        return Claim({"job_id": job_id, "skipped": f"job is {job.state.value}"})
    if job.state == JobState.running:
        return Claim({"job_id": job_id, "skipped": f"attempt {job.attempts} is running"})
    if job.next_attempt_at is not None and as_utc(job.next_attempt_at) > now:
        return Claim(
            {
                "job_id": job_id,
                "skipped": f"next attempt not before {as_utc(job.next_attempt_at).isoformat()}",
            }
        )
    attempt = start_attempt(session=session, job=job, delivery_id=delivery_id, lease_s=lease_s, now=now)
    if attempt is None:
        return Claim({"job_id": job_id, "skipped": "started by another delivery"})
    return Claim(
        None, after_drift=job.drift_event_id is not None, attempt=attempt, params=dict(job.params or {})
    )


def succeed_with(session: Session, job: Job, version: DrafterVersion) -> dict[str, Any]:
    result = {"drafter_version": version.version, "drafter_version_id": version.id}
    if job.state in (JobState.queued, JobState.running):
        if job.state == JobState.queued:
            start_job(session=session, job_id=job.id)
        finish_job(session=session, job_id=job.id, result={**result, "metrics": version.training_metrics})
    return result


def drift_point(session: Session, event: DriftEvent) -> datetime:
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


def traffic_since(session: Session, job: Job) -> datetime | None:
    """The start of the traffic a job trains on: its ``since`` parameter, else the drift point."""
    params = dict(job.params or {})
    if params.get("since"):
        return parse_utc(str(params["since"]))
    if job.drift_event_id is not None:
        event = session.get(DriftEvent, job.drift_event_id)
        if event is not None:
            return drift_point(session, event)
    return None


def traces_to_train_on(*, session: Session, job_id: int) -> int:
    """How many traces the job would train on now (those since its traffic start)."""
    job = session.get_one(Job, job_id)
    since = traffic_since(session, job)
    query = select(func.count()).select_from(Trace).where(Trace.deployment_id == job.deployment_id)
    if since is not None:
        query = query.where(Trace.created_at >= since)
    return int(session.scalar(query) or 0)


@dataclass(frozen=True, slots=True)
class TrainingTrace:
    key: str
    prompt: str
    completion: str
    # The request's category (None: the client gave none): the trainer sizes its replay of older
    # traffic per category, by how much of each the recent window still carries.
    category: str | None = None
    # The source document the prompt was cut from (None: not given): the held-out split keeps all
    # of one document's prompts on one side.
    document: str | None = None


@dataclass(frozen=True, slots=True)
class RealignInputs:
    """Everything a realign job trains from, read in one transaction."""

    deployment_id: int
    account_id: int
    target_model: str
    target: ModelLocation
    # The active version's artifact, else the registered drafter the deployment names or inherits.
    incumbent: ModelLocation | None
    parent_version_id: int | None
    recent: list[TrainingTrace]
    # Traffic before the window (newest ``MAX_REPLAY_TRACES``): replayed against forgetting, and
    # part of it held out to measure what the new drafter kept of it.
    older: list[TrainingTrace]
    window_start: datetime | None
    window_end: datetime | None
    drift_event_id: int | None
    params: dict[str, Any]


def _training_traces(rows: list[Trace]) -> list[TrainingTrace]:
    return [
        TrainingTrace(content_key(t.prompt, t.document), t.prompt, t.completion, t.category, t.document)
        for t in rows
    ]


def _older_traffic(deployment_id: int, before: datetime) -> Select[Trace]:
    """The traffic a job replays against forgetting: the newest ``MAX_REPLAY_TRACES`` before its
    window's start."""
    return (
        select(Trace)
        .where(Trace.deployment_id == deployment_id, Trace.created_at < before)
        .order_by(Trace.id.desc())
        .limit(MAX_REPLAY_TRACES)
    )


def trained_content(*, session: Session, version: DrafterVersion) -> TrainedContent:
    """The prompts and documents ``version`` may have trained on: every trace of its training
    window and of the older traffic its job could replay that the seed's split did not hold out.

    A superset of the rows it trained on (the replay takes a share of that pool, and the trainer
    drops held-out traces that share a prompt or document with these), so a prompt outside it
    never reached the version's training. A version whose job is gone is reckoned against the
    ``MAX_REPLAY_TRACES`` traces before its window as well; one with no window trained on none.
    """
    end = version.traffic_window_end
    if end is None:
        return TrainedContent()
    seed, share = holdout_of(version)
    start = version.traffic_window_start
    window = select(Trace.prompt, Trace.document).where(
        Trace.deployment_id == version.deployment_id, Trace.created_at <= end
    )
    if start is not None:
        window = window.where(Trace.created_at >= start)
    job = session.get(Job, version.training_job_id) if version.training_job_id is not None else None
    since = traffic_since(session, job) if job is not None else start
    rows = [(prompt, document) for prompt, document in session.execute(window)]
    if since is not None:
        older = _older_traffic(version.deployment_id, since).subquery()
        rows += [tuple(row) for row in session.execute(select(older.c.prompt, older.c.document))]
    return TrainedContent.of(
        content_of(prompt, document)
        for prompt, document in rows
        if not is_held_out(content_key(prompt, document), seed, share)
    )


def holdout_of(version: DrafterVersion) -> tuple[int, float]:
    """The seed and held-out share the version's training split by (from its training metrics)."""
    metrics = version.training_metrics or {}
    share = (metrics.get("config") or {}).get("holdout_share")
    return int(metrics.get("seed", 0)), float(share) if share is not None else REALIGN_HOLDOUT_SHARE


def last_drafter_location(*, session: Session, deployment: Deployment) -> ModelLocation | None:
    """The registered drafter a guardrail switched the deployment away from: the one it named,
    else its target's default drafter (None: not in a guardrail fallback, or none registered)."""
    marker = guardrail_fallback(deployment)
    if marker is None:
        return None
    name = marker.get("draft_model")
    if isinstance(name, str) and name:
        model = find_model(session=session, account_id=deployment.account_id, name=name)
    else:
        target = find_model(session=session, account_id=deployment.account_id, name=deployment.target_model)
        model = default_drafter_of(session=session, target=target) if target is not None else None
    return location_of(model) if model is not None else None


def realign_inputs(*, session: Session, job_id: int) -> RealignInputs:
    """The recent traffic (since the drift point, newest ``max_traces``) and the older traffic to
    replay against forgetting, the incumbent and the target."""
    job = session.get_one(Job, job_id)
    deployment = session.get_one(Deployment, job.deployment_id)
    params = dict(job.params or {})
    since = traffic_since(session, job)
    recent_q = select(Trace).where(Trace.deployment_id == deployment.id)
    if since is not None:
        recent_q = recent_q.where(Trace.created_at >= since)
    limit = int(params.get("max_traces") or MAX_RECENT_TRACES)
    recent = list(session.scalars(recent_q.order_by(Trace.id.desc()).limit(limit)))[::-1]
    older: list[Trace] = []
    if since is not None:
        older = list(session.scalars(_older_traffic(deployment.id, since)))[::-1]
    active = drafters.active_drafter(session=session, deployment_id=deployment.id)
    incumbent = incumbent_location(session=session, deployment=deployment)
    if incumbent is None:
        # A guardrail switched the deployment to its fallback: realign the drafter that served.
        incumbent = last_drafter_location(session=session, deployment=deployment)
    return RealignInputs(
        deployment_id=deployment.id,
        account_id=deployment.account_id,
        target_model=deployment.target_model,
        target=target_location(session=session, deployment=deployment),
        incumbent=incumbent,
        parent_version_id=active.id if active is not None else None,
        recent=_training_traces(recent),
        older=_training_traces(older),
        window_start=recent[0].created_at if recent else None,
        window_end=recent[-1].created_at if recent else None,
        drift_event_id=job.drift_event_id,
        params=params,
    )
