"""Job services: request a realignment (one active per deployment), read, cancel, and the
worker-side transitions (start an attempt, renew its lease, progress, finish, fail or retry), each
checked by the state machine, and the sweep that recovers attempts whose worker died. Also the
realignments that keep a deployment a guardrail switched to its fallback trying drafters again,
each after a longer wait, until one is promoted or a person takes over.

The database is the arbiter of "one queued or running realignment per deployment" (a partial
unique index): a request simply tries to insert, and when the index refuses, the job that won
is returned instead. No check-then-insert race is possible, whichever process asks.

Worker-side writes are compare-and-sets on the state and the attempt number (``... WHERE state =
'running' AND attempts = n``): a cancel that lands between two progress reports is seen at the next
one instead of being overwritten, and a worker whose attempt was given up (its lease lapsed, the
job was queued again) can neither renew, report, finish nor fail the attempt that replaced it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from controlplane.audit.service import record_change
from controlplane.config import Settings, get_settings
from controlplane.db.models import (
    AcceptanceRecordRow,
    Account,
    Deployment,
    DriftEvent,
    DriftResolution,
    Job,
    JobKind,
    JobState,
    SpeculationMode,
)
from controlplane.deployments.guardrail import FALLBACK_MODES, GUARDRAIL_FALLBACK, guardrail_fallback
from controlplane.deployments.lookup import resource_name
from controlplane.drift import policy as drift_policy
from controlplane.drift.events import end_events_of_job, mark_realigning
from controlplane.errors import ConflictError, NotFoundError, ValidationProblem
from controlplane.jobs import recovery
from controlplane.jobs.states import ACTIVE, TERMINAL, IllegalTransitionError, transition
from controlplane.timestamps import as_utc, parse_utc, utcnow

MAX_PAGE_SIZE = 500
# Job params a caller may set by hand; everything else is chosen by the trainer.
REALIGN_PARAM_KEYS = frozenset(
    {"time_budget_s", "seed", "since", "replay_share", "max_traces", "drafter_kind"}
)
# What a realignment trains: a small causal LM ("draft_model") or an EAGLE-3 head over the target's
# states ("eagle3"). Unset: the incumbent's kind (a small model when there is none).
DRAFTER_KINDS = ("draft_model", "eagle3")

# What started a job (``Job.trigger``): a drift alarm, the continuous policy, a deployment's first
# drafter, speculation found not to pay (a guardrail's fallback), or a person.
TRIGGER_DRIFT = "drift"
TRIGGER_CONTINUOUS = "continuous"
TRIGGER_FIRST_DRAFTER = "first_drafter"
TRIGGER_UNPROFITABLE = "unprofitable"
TRIGGER_MANUAL = "manual"
TRIGGERS = frozenset(
    {TRIGGER_DRIFT, TRIGGER_CONTINUOUS, TRIGGER_FIRST_DRAFTER, TRIGGER_UNPROFITABLE, TRIGGER_MANUAL}
)


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


# Bounds of the params a caller may set (the time budget's upper bound comes from Settings).
MIN_TIME_BUDGET_S = 1.0
MAX_TIME_BUDGET_S = 24 * 3600.0
MAX_SEED = 2**32 - 1
MIN_MAX_TRACES = 1
MAX_MAX_TRACES = 50_000
MAX_SINCE_CHARS = 64


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def validate_realign_params(params: dict[str, Any], *, settings: Settings | None = None) -> dict[str, Any]:
    """Check hand-set realign params; every problem is reported at once (422).

    With ``settings``, the time budget must also leave the trace wait and a margin below the
    broker's visibility timeout (``Settings.realign_budget_ceiling_s``): a task still running when
    it passes is handed to a second worker.
    """
    if not isinstance(params, dict):
        raise ValidationProblem("params must be an object")
    problems: list[dict[str, str]] = []
    unknown = sorted(str(key)[:100] for key in params if key not in REALIGN_PARAM_KEYS)
    if unknown:
        problems.append(
            {
                "field": "params",
                "message": (
                    f"unknown realign parameter(s) {unknown[:10]}; allowed: {sorted(REALIGN_PARAM_KEYS)}"
                ),
            }
        )
    clean = {k: v for k, v in params.items() if k in REALIGN_PARAM_KEYS and v is not None}
    budget = clean.get("time_budget_s")
    if budget is not None:
        ceiling = MAX_TIME_BUDGET_S
        if settings is not None:
            ceiling = min(ceiling, settings.realign_budget_ceiling_s)
        if not _is_number(budget) or not MIN_TIME_BUDGET_S <= budget <= MAX_TIME_BUDGET_S:
            problems.append(
                {
                    "field": "time_budget_s",
                    "message": (
                        f"must be a number of seconds between {MIN_TIME_BUDGET_S:g} and {MAX_TIME_BUDGET_S:g}"
                    ),
                }
            )
        elif budget > ceiling and settings is not None:
            problems.append(
                {
                    "field": "time_budget_s",
                    "message": (
                        f"{budget:g} s does not fit below the broker's visibility timeout "
                        f"(celery_visibility_timeout_s = {settings.celery_visibility_timeout_s} s) less "
                        f"the trace wait (realign_max_wait_s = {settings.realign_max_wait_s:g} s) and a "
                        f"margin of {settings.realign_margin_s:g} s: at most {ceiling:g} s"
                    ),
                }
            )
    seed = clean.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED
    ):
        problems.append({"field": "seed", "message": f"must be an integer in [0, {MAX_SEED}]"})
    kind = clean.get("drafter_kind")
    if kind is not None and kind not in DRAFTER_KINDS:
        problems.append({"field": "drafter_kind", "message": f"must be one of {list(DRAFTER_KINDS)}"})
    share = clean.get("replay_share")
    if share is not None and not (_is_number(share) and 0 <= share < 1):
        problems.append({"field": "replay_share", "message": "must be a number in [0, 1)"})
    max_traces = clean.get("max_traces")
    if max_traces is not None and (
        isinstance(max_traces, bool)
        or not isinstance(max_traces, int)
        or not MIN_MAX_TRACES <= max_traces <= MAX_MAX_TRACES
    ):
        problems.append(
            {"field": "max_traces", "message": f"must be an integer in [{MIN_MAX_TRACES}, {MAX_MAX_TRACES}]"}
        )
    since = clean.get("since")
    if since is not None:
        parsed = None
        if isinstance(since, str) and len(since) <= MAX_SINCE_CHARS:
            try:
                parsed = parse_utc(since)
            except ValueError:
                parsed = None
        if parsed is None:
            problems.append(
                {"field": "since", "message": "must be an ISO-8601 time such as 2026-01-31T12:00:00Z"}
            )
        elif parsed > utcnow():
            problems.append({"field": "since", "message": "must not be in the future"})
        else:
            clean["since"] = parsed.isoformat()
    if problems:
        fields = ", ".join(dict.fromkeys(p["field"] for p in problems))
        raise ValidationProblem(f"invalid realign parameters: {fields}", details=problems)
    return clean


def queue_realign_job(
    *,
    session: Session,
    deployment: Deployment,
    requested_by: str,
    trigger: str,
    params: dict[str, Any],
    settings: Settings | None = None,
    drift_event_id: int | None = None,
    due: datetime | None = None,
    progress_message: str = "queued",
    result: dict[str, Any] | None = None,
) -> RealignRequest:
    """The one way a realign job comes to exist, whatever asked for it (a person, a drift event,
    a guardrail, the adaptation policy, the check that speculation pays): ``trigger`` must be one
    of ``TRIGGERS`` and ``params`` pass ``validate_realign_params``. Without ``due`` the caller
    sends the job's message right after its commit; a job ``due`` later waits for the sweep. When
    a realignment is already queued or running it is returned instead (``created`` False): the
    database holds one per deployment. The caller records the audit entry."""
    if trigger not in TRIGGERS:
        raise ValueError(f"unknown job trigger {trigger!r}; known: {sorted(TRIGGERS)}")
    job = Job(
        deployment_id=deployment.id,
        kind=JobKind.realign,
        state=JobState.queued,
        drift_event_id=drift_event_id,
        requested_by=requested_by,
        trigger=trigger,
        attempts=0,
        progress=0.0,
        progress_message=progress_message,
        params=validate_realign_params(params, settings=settings),
        result=result or {},
        next_attempt_at=due,
        # Sent right after the caller's commit (see controlplane.jobs.queue), or by the sweep once due.
        enqueued_at=utcnow() if due is None else None,
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
    return RealignRequest(job, created=True)


def request_realign(
    *,
    session: Session,
    deployment: Deployment,
    actor: str = "system",
    drift_event_id: int | None = None,
    params: dict[str, Any] | None = None,
    settings: Settings | None = None,
    trigger: str = TRIGGER_MANUAL,
) -> RealignRequest:
    """Create a queued realignment job, or return the one already queued or running.

    ``settings`` bounds the time budget by the broker's visibility timeout (the API passes them);
    ``trigger`` says what asked for it (one of ``TRIGGERS``).
    """
    outcome = queue_realign_job(
        session=session,
        deployment=deployment,
        requested_by=actor,
        trigger=trigger,
        params=params or {},
        settings=settings,
        drift_event_id=drift_event_id,
    )
    if not outcome.created:
        return outcome
    job = outcome.job
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=actor,
        action="job.create",
        resource=_resource(session, deployment, job.id),
        before=None,
        after={
            "kind": job.kind.value,
            "trigger": trigger,
            "drift_event_id": drift_event_id,
            "params": job.params,
        },
    )
    return outcome


# Modes whose drafter is a model that realignment can train; an n-gram or disabled deployment has none.
REALIGNABLE_MODES = frozenset({SpeculationMode.default, SpeculationMode.draft_model})

# --- realigning after a guardrail switch ------------------------------------------------------
#
# A guardrail that switches a deployment to its fallback (n-gram or no speculation) leaves a marker
# on it (controlplane.deployments.guardrail): when, to what, the drafter that served before, and
# how many candidates have lost to the fallback since. While it stands, the loop keeps realigning
# that drafter on the traffic since the switch, each try after a longer wait; a promotion, or a
# person changing the mode, ends it.
GUARDRAIL_ACTOR = "guardrail"


def _guardrail_reason(marker: dict[str, Any]) -> str:
    return f"after guardrail switch to {marker.get('mode')}"


def schedule_guardrail_realign(
    *, session: Session, deployment: Deployment, settings: Settings, now: datetime | None = None
) -> Job | None:
    """Queue the next realignment of the drafter a guardrail switched away from, due after the
    drift policy's cooldown doubled once per candidate that lost to the fallback since (capped,
    see ``recovery.guardrail_realign_delay_s``), on the traffic since the switch. The sweep sends
    it once due. None when the deployment is not in a guardrail fallback or does not realign
    automatically; an active realignment already queued or running is returned as it is."""
    marker = guardrail_fallback(deployment)
    if marker is None or not deployment.auto_realign:
        return None
    now = now or utcnow()
    losses = int(marker.get("losses") or 0)
    cooldown_s = drift_policy.resolve(deployment.drift_policy, settings).cooldown_s
    delay_s = recovery.guardrail_realign_delay_s(losses, cooldown_s=cooldown_s)
    reason = _guardrail_reason(marker)
    due = now + timedelta(seconds=delay_s)
    outcome = queue_realign_job(
        session=session,
        deployment=deployment,
        requested_by=GUARDRAIL_ACTOR,
        # Speculation measured slower than none: the fallback serves until a drafter pays again.
        trigger=TRIGGER_UNPROFITABLE,
        params={"since": str(marker.get("since") or now.isoformat())},
        due=due,
        progress_message=f"queued {reason}; starts after {delay_s:g} s"[:500],
        result={"reason": reason, "losses_since_switch": losses, "delay_s": delay_s},
    )
    job = outcome.job
    if not outcome.created:
        return job
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=GUARDRAIL_ACTOR,
        action="job.create",
        resource=_resource(session, deployment, job.id),
        before=None,
        after={
            "kind": job.kind.value,
            "reason": reason,
            "next_attempt_at": due.isoformat(),
            "losses_since_switch": losses,
            "params": job.params,
        },
    )
    return job


def enter_guardrail_fallback(
    *,
    session: Session,
    deployment: Deployment,
    settings: Settings,
    previous_draft_model: str | None,
    previous_version: int | None,
    reason: str,
    canary_id: int | None = None,
) -> Job | None:
    """A guardrail has just switched the deployment to its fallback: remember why and queue the
    realignment that tries to win the deployment back (see ``schedule_guardrail_realign``). A
    deployment already in a guardrail fallback keeps its drafter and loss count."""
    now = utcnow()
    earlier = (deployment.drift_policy or {}).get(GUARDRAIL_FALLBACK)
    earlier = earlier if isinstance(earlier, dict) else {}
    marker = {
        "since": now.isoformat(),
        "mode": deployment.speculation_mode.value,
        "draft_model": earlier.get("draft_model") or previous_draft_model,
        "drafter_version": earlier.get("drafter_version") or previous_version,
        "losses": int(earlier.get("losses") or 0),
        # Live records up to here were served before the switch (the drift monitor skips them).
        "since_record_id": int(
            session.scalar(
                select(func.max(AcceptanceRecordRow.id)).where(
                    AcceptanceRecordRow.deployment_id == deployment.id
                )
            )
            or 0
        ),
        "canary_id": canary_id,
        "reason": reason[:500],
    }
    deployment.drift_policy = {**(deployment.drift_policy or {}), GUARDRAIL_FALLBACK: marker}
    session.flush()
    return schedule_guardrail_realign(session=session, deployment=deployment, settings=settings, now=now)


def candidate_lost_to_fallback(*, session: Session, deployment: Deployment, settings: Settings) -> Job | None:
    """A candidate judged against the guardrail fallback did not win: count the loss and queue the
    next try after a longer wait. None when the deployment is not in a guardrail fallback."""
    marker = guardrail_fallback(deployment)
    if marker is None:
        return None
    marker = {**marker, "losses": int(marker.get("losses") or 0) + 1}
    deployment.drift_policy = {**(deployment.drift_policy or {}), GUARDRAIL_FALLBACK: marker}
    session.flush()
    return schedule_guardrail_realign(session=session, deployment=deployment, settings=settings)


def resume_guardrail_fallback(
    *, session: Session, deployment: Deployment, settings: Settings, marker: dict[str, Any]
) -> Job | None:
    """A drafter promoted out of a guardrail fallback was rolled back to that fallback: the loop
    resumes where it was, one loss further on (so it waits longer), on the traffic from now."""
    if deployment.speculation_mode not in FALLBACK_MODES:
        return None
    resumed = {
        **marker,
        "since": utcnow().isoformat(),
        "losses": int(marker.get("losses") or 0) + 1,
        "since_record_id": int(
            session.scalar(
                select(func.max(AcceptanceRecordRow.id)).where(
                    AcceptanceRecordRow.deployment_id == deployment.id
                )
            )
            or 0
        ),
    }
    deployment.drift_policy = {**(deployment.drift_policy or {}), GUARDRAIL_FALLBACK: resumed}
    session.flush()
    return schedule_guardrail_realign(session=session, deployment=deployment, settings=settings)


def end_guardrail_fallback(*, session: Session, deployment: Deployment, actor: str, reason: str) -> list[int]:
    """The guardrail fallback is over (a drafter was promoted, or a person chose the mode or
    dismissed its alarm): forget it and cancel its realignments still waiting or running.
    Returns the ids of the jobs cancelled."""
    stored = dict(deployment.drift_policy or {})
    if GUARDRAIL_FALLBACK not in stored:
        return []
    stored.pop(GUARDRAIL_FALLBACK)
    deployment.drift_policy = stored
    pending = session.scalars(
        select(Job).where(
            Job.deployment_id == deployment.id,
            Job.kind == JobKind.realign,
            Job.requested_by == GUARDRAIL_ACTOR,
            Job.state.in_([s.value for s in ACTIVE]),
        )
    ).all()
    for job in pending:
        cancel_job(session=session, deployment=deployment, job_id=job.id, actor=actor, reason=reason)
    session.flush()
    return [job.id for job in pending]


def dismissed_during_fallback(*, session: Session, deployment: Deployment, actor: str) -> list[int]:
    """A person dismissed a drift event while a guardrail keeps the deployment on its fallback:
    they have taken the deployment in hand, so the guardrail's realignments stop (cancelled)."""
    if guardrail_fallback(deployment) is None:
        return []
    return end_guardrail_fallback(
        session=session, deployment=deployment, actor=actor, reason=f"drift event dismissed by {actor}"
    )


def guardrail_recovery_status(*, session: Session, deployment: Deployment) -> dict[str, Any] | None:
    """What /drift-status shows of a guardrail fallback: why, and the realignment queued for it."""
    marker = guardrail_fallback(deployment)
    if marker is None:
        return None
    job = active_realign_job(session=session, deployment_id=deployment.id)
    return {
        **marker,
        "reason": _guardrail_reason(marker),
        "guardrail_reason": marker.get("reason"),
        "realign_job_id": job.id if job is not None else None,
        "next_attempt_at": as_utc(job.next_attempt_at).isoformat()
        if job is not None and job.next_attempt_at is not None
        else None,
    }


def realign_on_drift(*, session: Session, deployment: Deployment, event: DriftEvent) -> RealignRequest | None:
    """The automatic response to a drift event: queue a realignment if the deployment wants one.

    Runs in the transaction that records the event (outbox style): the event and its job commit
    together or not at all, and the caller sends ``realign.run`` only after that commit. When a
    realignment is already queued or running (another event, a manual request), that job is
    returned instead (``created`` False): two simultaneous events start one job. The event becomes
    ``realigning`` and names its job in its evidence (``realign_job_id``); a guardrail's
    realignment still waiting out its backoff becomes due at once. None when the deployment does
    not realign automatically (``auto_realign`` off, or a speculation mode without a drafter model
    that a person chose; a guardrail's fallback does realign): the event stays ``open`` for a
    person.
    """
    fallback = guardrail_fallback(deployment)
    if not deployment.auto_realign or (
        deployment.speculation_mode not in REALIGNABLE_MODES and fallback is None
    ):
        return None
    outcome = request_realign(
        session=session,
        deployment=deployment,
        actor=f"drift-event:{event.id}",
        drift_event_id=event.id,
        trigger=TRIGGER_DRIFT,
    )
    job = outcome.job
    if (
        not outcome.created
        and job.requested_by == GUARDRAIL_ACTOR
        and job.state == JobState.queued
        and job.next_attempt_at is not None
    ):
        # The fallback itself drifted: the realignment waiting out its backoff is due now.
        job.next_attempt_at = utcnow()
        job.enqueued_at = None
        job.progress_message = f"due now: drift event {event.id} on the fallback"
    mark_realigning(event=event, job_id=job.id)
    return outcome


def claim_stale_queued_realigns(
    *, session: Session, older_than: datetime, limit: int = 100, now: datetime | None = None
) -> list[int]:
    """Realign jobs waiting in ``queued`` that need a message: one whose retry is due and was not
    sent since (``enqueued_at`` cleared when it was queued again), or one whose last message was
    sent before ``older_than`` (the message was lost: the send after commit failed, or the broker
    dropped it). A retry not yet due waits. Each is claimed by moving its ``enqueued_at`` to now,
    with a compare-and-set so two sweepers never both take one; the caller commits, then sends
    ``realign.run`` for the returned ids.
    """
    now = now or utcnow()
    stale = (
        Job.kind == JobKind.realign,
        Job.state == JobState.queued,
        or_(Job.next_attempt_at.is_(None), Job.next_attempt_at <= now),
        or_(Job.enqueued_at.is_(None), Job.enqueued_at < older_than),
    )
    job_ids = session.scalars(select(Job.id).where(*stale).order_by(Job.id).limit(limit)).all()
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


@dataclass(slots=True)
class LeaseSweep:
    """What a sweep of lapsed leases did: jobs queued again for another attempt, jobs failed."""

    requeued: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)


def recover_lapsed_leases(
    *, session: Session, settings: Settings, now: datetime | None = None, limit: int = 100
) -> LeaseSweep:
    """Running realign jobs whose lease lapsed: their worker died (killed, out of memory, its host
    gone) or hung. Each goes back to ``queued`` after the backoff, or fails once its attempts are
    spent, so a job that kills its worker every time ends instead of holding the gpu queue. The
    caller commits; the due retries go out with the next sweep's messages."""
    now = now or utcnow()
    lapsed = (
        Job.kind == JobKind.realign,
        Job.state == JobState.running,
        or_(Job.lease_expires_at.is_(None), Job.lease_expires_at <= now),
    )
    rows = session.execute(
        select(Job.id, Job.attempts, Job.lease_expires_at).where(*lapsed).order_by(Job.id).limit(limit)
    ).all()
    sweep = LeaseSweep()
    for job_id, attempts, expired_at in rows:
        lapse = (
            f"attempt {attempts} lost its worker: no heartbeat renewed its lease "
            f"(expired {as_utc(expired_at).isoformat() if expired_at else 'never set'})"
        )
        job = end_failed_attempt(
            session=session,
            job_id=int(job_id),
            attempt=int(attempts),
            error=lapse,
            settings=settings,
            now=now,
        )
        if job is None:
            continue  # renewed, cancelled or finished since it was read
        (sweep.requeued if job.state == JobState.queued else sweep.failed).append(job.id)
    return sweep


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


def cancel_job(
    *, session: Session, deployment: Deployment, job_id: int, actor: str, reason: str | None = None
) -> Job:
    """Cancel a queued or running job; a running worker stops at its next progress checkpoint."""
    job = get_job(session=session, deployment_id=deployment.id, job_id=job_id)
    before = job.state
    try:
        job.state = transition(job.state, JobState.cancelled)
    except IllegalTransitionError as exc:
        raise ConflictError(str(exc)) from exc
    job.finished_at = utcnow()
    job.lease_expires_at = None
    job.next_attempt_at = None
    job.progress_message = f"cancelled by {actor}" + (f": {reason}" if reason else "")
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=actor,
        action="job.cancel",
        resource=_resource(session, deployment, job.id),
        before={"state": before.value},
        after={"state": job.state.value, **({"reason": reason} if reason else {})},
    )
    if job.kind == JobKind.realign:
        end_events_of_job(
            session=session,
            job=job,
            resolution=DriftResolution.realignment_failed,
            reason=f"realign job {job.id} cancelled by {actor}" + (f": {reason}" if reason else ""),
        )
    if reason is None and job.requested_by == GUARDRAIL_ACTOR:
        # A person stopped the realignment the guardrail queued: the loop stops with it.
        end_guardrail_fallback(
            session=session, deployment=deployment, actor=actor, reason=f"job {job.id} cancelled by {actor}"
        )
    session.flush()
    return job


# ------------------------------------------------------------------------ worker-side transitions


def start_job(*, session: Session, job_id: int, celery_task_id: str | None = None) -> Job:
    """queued -> running (or a redelivered running job restarting): one more attempt.

    Raises IllegalTransitionError for a finished job (the caller drops the message). Realign
    jobs start through ``start_attempt`` instead, which holds a lease.
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


def start_attempt(
    *, session: Session, job: Job, delivery_id: str | None, lease_s: float, now: datetime | None = None
) -> int | None:
    """queued -> running for one delivery, holding a lease of ``lease_s``: the number of the
    attempt it starts, or None when another delivery started it first (compare-and-set on the
    state and the attempt count, so two deliveries of one job never both run it)."""
    now = now or utcnow()
    seen = job.attempts
    transition(job.state, JobState.running)  # refuses a finished job
    attempt = seen + 1
    result = session.execute(
        update(Job)
        .where(
            Job.id == job.id,
            Job.state == JobState.queued,
            Job.attempts == seen,
            or_(Job.next_attempt_at.is_(None), Job.next_attempt_at <= now),
        )
        .values(
            state=JobState.running,
            attempts=attempt,
            started_at=func.coalesce(Job.started_at, now),
            celery_task_id=delivery_id or job.celery_task_id,
            progress=0.0,
            progress_message=f"attempt {attempt} started",
            heartbeat_at=now,
            lease_expires_at=now + timedelta(seconds=lease_s),
            next_attempt_at=None,
        )
        .execution_options(synchronize_session=False)
    )
    session.expire(job)
    return attempt if getattr(result, "rowcount", 0) == 1 else None


def _attempt_is(job_id: int, attempt: int | None) -> tuple[Any, ...]:
    conditions: tuple[Any, ...] = (Job.id == job_id, Job.state == JobState.running)
    return conditions if attempt is None else (*conditions, Job.attempts == attempt)


def renew_lease(
    *, session: Session, job_id: int, attempt: int, lease_s: float, now: datetime | None = None
) -> bool:
    """The running attempt's heartbeat: extend its lease. False when the attempt is no longer the
    job's running one (cancelled, finished, or given up after its lease lapsed): stop."""
    now = now or utcnow()
    result = session.execute(
        update(Job)
        .where(*_attempt_is(job_id, attempt))
        .values(heartbeat_at=now, lease_expires_at=now + timedelta(seconds=lease_s))
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(result, "rowcount", 0))


def report_progress(
    *,
    session: Session,
    job_id: int,
    fraction: float,
    message: str,
    attempt: int | None = None,
    lease_s: float | None = None,
) -> bool:
    """Record progress on a running job (renewing the attempt's lease when ``lease_s`` is given);
    False when it is no longer running, or ``attempt`` is no longer the running one: stop."""
    fraction = min(1.0, max(0.0, float(fraction)))
    values: dict[str, Any] = {"progress": fraction, "progress_message": message[:500]}
    if lease_s is not None:
        now = utcnow()
        values |= {"heartbeat_at": now, "lease_expires_at": now + timedelta(seconds=lease_s)}
    result = session.execute(
        update(Job)
        .where(*_attempt_is(job_id, attempt))
        .values(**values)
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
    job.lease_expires_at = None
    job.next_attempt_at = None
    session.flush()
    return job


def _audit_job(
    session: Session, job: Job, action: str, before: dict[str, Any], after: dict[str, Any]
) -> None:
    deployment = session.get_one(Deployment, job.deployment_id)
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=f"job:{job.id}",
        action=action,
        resource=_resource(session, deployment, job.id),
        before=before,
        after=after,
    )


def fail_job(
    *,
    session: Session,
    job_id: int,
    error: str,
    resolution: DriftResolution = DriftResolution.realignment_failed,
    attempt: int | None = None,
) -> Job:
    """queued | running -> failed, keeping the error for the humans (audited).

    A failed realignment ends the drift events it answered with ``resolution`` and the error as
    the reason (too little post-drift traffic is ``not_enough_data``), so the detector re-arms
    instead of staying latched on an event nothing will answer. With ``attempt``, only that
    attempt, still running, can be failed (a superseded worker changes nothing).
    """
    job = session.get_one(Job, job_id, with_for_update=True)
    if job.state in TERMINAL:
        return job  # cancelled while failing: the cancel stands
    if attempt is not None and (job.state != JobState.running or job.attempts != attempt):
        return job  # that attempt was given up; the job has moved on without it
    before = job.state
    job.state = transition(job.state, JobState.failed)
    job.error = error[:10_000]
    job.progress_message = "failed"
    job.finished_at = utcnow()
    job.lease_expires_at = None
    job.next_attempt_at = None
    _audit_job(
        session,
        job,
        "job.fail",
        {"state": before.value},
        {"state": job.state.value, "attempts": job.attempts, "error": job.error[:500]},
    )
    if job.kind == JobKind.realign:
        end_events_of_job(session=session, job=job, resolution=resolution, reason=error)
    session.flush()
    if job.kind == JobKind.realign:
        deployment = session.get_one(Deployment, job.deployment_id)
        if guardrail_fallback(deployment) is not None:
            # No candidate came of it: the fallback keeps serving and the loop tries again later.
            candidate_lost_to_fallback(session=session, deployment=deployment, settings=get_settings())
    return job


def end_failed_attempt(
    *,
    session: Session,
    job_id: int,
    attempt: int,
    error: str,
    settings: Settings,
    now: datetime | None = None,
) -> Job | None:
    """A running attempt failed (it raised, or its lease lapsed): queue the job again after the
    backoff (``realign_retry_backoff_s`` * 2^(attempts-1)) while attempts remain, else fail it
    and end its drift events as ``realignment_failed`` with the reason. None when ``attempt`` is
    not the job's running one any more (nothing to do)."""
    now = now or utcnow()
    job = session.get(Job, job_id, with_for_update=True)
    if job is None or job.state != JobState.running or job.attempts != attempt:
        return None
    step = recovery.after_failed_attempt(
        attempts=attempt,
        max_attempts=settings.realign_max_attempts,
        backoff_base_s=settings.realign_retry_backoff_s,
    )
    if not step.retry:
        return fail_job(
            session=session,
            job_id=job_id,
            attempt=attempt,
            error=f"{error} (attempt {attempt} of {settings.realign_max_attempts}: no attempts left)",
        )
    job.state = transition(job.state, JobState.queued)
    job.error = error[:10_000]
    job.next_attempt_at = recovery.next_attempt_time(now, step)
    job.enqueued_at = None  # the sweep sends it once it is due
    job.lease_expires_at = None
    job.progress_message = (
        f"attempt {attempt} failed; attempt {attempt + 1} of {settings.realign_max_attempts} "
        f"after {step.delay_s:g} s"
    )[:500]
    _audit_job(
        session,
        job,
        "job.retry",
        {"state": JobState.running.value, "attempts": attempt},
        {
            "state": job.state.value,
            "error": job.error[:500],
            "next_attempt_at": job.next_attempt_at.isoformat(),
        },
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
        "trigger": job.trigger,
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
        "heartbeat_at": job.heartbeat_at.isoformat() if job.heartbeat_at else None,
        "lease_expires_at": job.lease_expires_at.isoformat() if job.lease_expires_at else None,
        "next_attempt_at": job.next_attempt_at.isoformat() if job.next_attempt_at else None,
    }
