"""The automatic realignments besides the drift trigger: a first drafter for a deployment that has
none, and continuous realignment under the deployment's adaptation policy, within its daily GPU
budget. Also the policy's reads and audited writes for the API.

``adapt_deployment`` runs in the periodic monitor pass, once per deployment in its own unit of
work: it reads the facts the pure rules need (``adaptation_policy.choose_trigger``), requests the
realignment the rules ask for (``jobs.service.request_realign``, with its trigger) and records a
skip over budget in the audit log (once per hour per trigger, not once per pass). The caller
commits, then sends the job's message.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from controlplane.accounts.service import Principal
from controlplane.adaptation_policy import (
    DAY,
    FIRST_DRAFTER,
    AdaptationPolicy,
    AdaptationPolicyError,
    DeploymentFacts,
    TriggerDecision,
    choose_trigger,
    gpu_seconds_used,
)
from controlplane.audit.service import record_change
from controlplane.canary.service import open_canary
from controlplane.config import Settings
from controlplane.db.models import (
    AuditEntry,
    Deployment,
    DrafterVersion,
    Job,
    JobKind,
    SpeculationMode,
    Trace,
)
from controlplane.deployments.guardrail import guardrail_fallback
from controlplane.deployments.lookup import lock_deployment, resource_name, resource_of
from controlplane.drafters.serving import incumbent_location
from controlplane.errors import ValidationProblem
from controlplane.jobs.service import active_realign_job, request_realign
from controlplane.timestamps import as_utc, utcnow

ACTOR = "adaptation"
# A first drafter starts far from the target (a cut of its leading layers agrees with it on about
# two tokens in five; an incumbent being realigned, usually on most): it gets this many times the
# realignment's training budget. The workers' own default budget when none is configured:
FIRST_DRAFTER_BUDGET_FACTOR = 2.0
WORKERS_DEFAULT_BUDGET_S = 240.0
SKIP_ACTION = "adaptation.skip"
# A skip that repeats on every monitor pass is recorded again only after this long.
SKIP_RECORD_INTERVAL = timedelta(hours=1)


# --- the policy ---------------------------------------------------------------------------------


def adaptation_policy(deployment: Deployment) -> AdaptationPolicy:
    """The deployment's adaptation policy: its stored fields over the defaults."""
    return AdaptationPolicy.for_deployment(deployment.adaptation_policy)


def update_adaptation_policy(
    *, session: Session, principal: Principal, deployment: Deployment, changes: dict[str, Any], replace: bool
) -> AdaptationPolicy:
    """Store the policy (audited): ``replace`` stores exactly ``changes`` (fields left out return to
    their defaults), else they are merged over what is stored. Every bad field is named in one 422
    and nothing is stored."""
    try:
        valid = AdaptationPolicy.validate_changes(changes)
    except AdaptationPolicyError as exc:
        raise ValidationProblem(f"invalid adaptation policy: {exc}", details=exc.problems) from exc
    before = dict(deployment.adaptation_policy or {})
    stored = valid if replace else {**before, **valid}
    deployment.adaptation_policy = stored
    deployment.row_version += 1
    record_change(
        session=session,
        account_id=principal.account_id,
        actor=principal.actor,
        action="adaptation_policy.update",
        resource=resource_name(principal.account_name, deployment.name),
        before=before,
        after=dict(stored),
    )
    return adaptation_policy(deployment)


# --- the facts ----------------------------------------------------------------------------------


def serves_a_drafter(*, session: Session, deployment: Deployment) -> bool:
    """Whether the live arm speculates with a drafter model (an active version or a registered
    drafter); n-gram lookup, speculation off, or the default mode with no drafter for the target
    do not."""
    if deployment.speculation_mode in (SpeculationMode.ngram, SpeculationMode.disabled):
        return False
    return incumbent_location(session=session, deployment=deployment) is not None


def deployment_gpu_seconds(*, session: Session, deployment_id: int, now: datetime) -> float:
    """Run time of the deployment's jobs (realignments and replays) inside the last 24 hours."""
    runs = session.execute(
        select(Job.started_at, Job.finished_at).where(
            Job.deployment_id == deployment_id,
            Job.started_at.is_not(None),
            (Job.finished_at.is_(None)) | (Job.finished_at > now - DAY),
        )
    ).all()
    return gpu_seconds_used(
        ((as_utc(started), as_utc(finished)) for started, finished in runs),
        now=now,
    )


def _busy(session: Session, deployment: Deployment) -> str | None:
    job = active_realign_job(session=session, deployment_id=deployment.id)
    if job is not None:
        return f"realign job {job.id} is {job.state.value}"
    canary = open_canary(session=session, deployment_id=deployment.id)
    if canary is not None:
        # A canary's replay job runs while its canary is open (shadow): the canary says it all.
        return f"canary {canary.id} is {canary.phase}"
    return None


def deployment_facts(
    *, session: Session, deployment: Deployment, settings: Settings, now: datetime
) -> DeploymentFacts:
    """What ``choose_trigger`` needs, read from the database."""
    last = session.scalar(
        select(func.max(Job.created_at)).where(
            Job.deployment_id == deployment.id, Job.kind == JobKind.realign
        )
    )
    since = as_utc(last) if last is not None else None
    # The rules only compare the count with a threshold: counting stops there (a deployment with
    # millions of traces and no job yet costs no more than one with a few).
    enough = max(settings.realign_min_traces, adaptation_policy(deployment).continuous_every_traces)
    recent = select(Trace.id).where(Trace.deployment_id == deployment.id)
    if since is not None:
        recent = recent.where(Trace.created_at > since)
    traces = select(func.count()).select_from(recent.limit(enough).subquery())
    start = since or as_utc(deployment.created_at) or now
    return DeploymentFacts(
        auto_realign=deployment.auto_realign,
        has_drafter=serves_a_drafter(session=session, deployment=deployment),
        had_drafter=session.scalar(
            select(DrafterVersion.id)
            .where(DrafterVersion.deployment_id == deployment.id, DrafterVersion.activated_at.is_not(None))
            .limit(1)
        )
        is not None,
        in_guardrail_fallback=guardrail_fallback(deployment) is not None,
        busy=_busy(session, deployment),
        new_traces=int(session.scalar(traces) or 0),
        minutes_since_last=max(0.0, (now - start).total_seconds() / 60.0),
        gpu_seconds_used=deployment_gpu_seconds(session=session, deployment_id=deployment.id, now=now),
        min_traces=settings.realign_min_traces,
    )


# --- the pass -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AdaptationOutcome:
    """What one pass did for a deployment: the job it requested (send its message after the
    commit), and the rules' decision."""

    deployment_id: int
    job_id: int | None
    decision: TriggerDecision

    def as_dict(self) -> dict[str, Any]:
        return {
            "deployment_id": self.deployment_id,
            "job_id": self.job_id,
            "trigger": self.decision.trigger,
            "reason": self.decision.reason,
            "skipped": self.decision.skipped,
        }


def evaluate_triggers(
    *, session: Session, deployment: Deployment, settings: Settings, now: datetime | None = None
) -> TriggerDecision:
    """The rules' decision for the deployment now, without acting on it."""
    now = now or utcnow()
    facts = deployment_facts(session=session, deployment=deployment, settings=settings, now=now)
    return choose_trigger(adaptation_policy(deployment), facts)


def adapt_deployment(
    *, session: Session, deployment_id: int, settings: Settings, now: datetime | None = None
) -> AdaptationOutcome:
    """Request the deployment's first-drafter or continuous realignment when the rules say so;
    record a skip over the GPU budget. The caller commits, then sends ``realign.run``."""
    now = now or utcnow()
    deployment = session.get(Deployment, deployment_id)
    if deployment is None or deployment.deleted_at is not None:
        return AdaptationOutcome(deployment_id, None, TriggerDecision(None, "no such deployment"))
    decision = evaluate_triggers(session=session, deployment=deployment, settings=settings, now=now)
    if decision.trigger is None:
        return AdaptationOutcome(deployment_id, None, decision)
    if decision.skipped:
        _record_skip(session, deployment, decision, now)
        return AdaptationOutcome(deployment_id, None, decision)
    # Decided on unlocked reads: check again under the deployment's lock, which a canary's start
    # also takes, so no job starts beside a canary opened in between.
    deployment = lock_deployment(session=session, deployment_id=deployment_id)
    decision = evaluate_triggers(session=session, deployment=deployment, settings=settings, now=now)
    if decision.trigger is None or decision.skipped:
        return AdaptationOutcome(deployment_id, None, decision)
    outcome = request_realign(
        session=session,
        deployment=deployment,
        actor=f"{ACTOR}:{decision.trigger}",
        trigger=decision.trigger,
        params=realign_params(decision.trigger, settings),
        settings=settings,
    )
    outcome.job.progress_message = f"queued: {decision.reason}"[:500]
    return AdaptationOutcome(deployment_id, outcome.job.id if outcome.created else None, decision)


def realign_params(trigger: str, settings: Settings) -> dict[str, Any]:
    """The job params of an automatic realignment: a first drafter's larger time budget (within
    the ceiling the broker's visibility timeout sets); a continuous one takes the defaults."""
    if trigger != FIRST_DRAFTER:
        return {}
    base = settings.realign_time_budget_s or WORKERS_DEFAULT_BUDGET_S
    return {"time_budget_s": min(FIRST_DRAFTER_BUDGET_FACTOR * base, settings.realign_budget_ceiling_s)}


def _record_skip(session: Session, deployment: Deployment, decision: TriggerDecision, now: datetime) -> None:
    resource = resource_of(session, deployment)
    last = session.scalar(
        select(AuditEntry)
        .where(
            AuditEntry.account_id == deployment.account_id,
            AuditEntry.resource == resource,
            AuditEntry.action == SKIP_ACTION,
        )
        .order_by(AuditEntry.id.desc())
        .limit(1)
    )
    if (
        last is not None
        and (last.after or {}).get("trigger") == decision.trigger
        and as_utc(last.created_at) > now - SKIP_RECORD_INTERVAL
    ):
        return
    record_change(
        session=session,
        account_id=deployment.account_id,
        actor=ACTOR,
        action=SKIP_ACTION,
        resource=resource,
        before=None,
        after={"trigger": decision.trigger, "reason": decision.reason, "at": now.isoformat()},
    )


def last_skip(*, session: Session, deployment: Deployment) -> dict[str, Any] | None:
    """The latest recorded skip of an automatic realignment (trigger, reason, when), if any."""
    entry = session.scalar(
        select(AuditEntry)
        .where(
            AuditEntry.account_id == deployment.account_id,
            AuditEntry.resource == resource_of(session, deployment),
            AuditEntry.action == SKIP_ACTION,
        )
        .order_by(AuditEntry.id.desc())
        .limit(1)
    )
    if entry is None:
        return None
    after = entry.after or {}
    return {
        "trigger": after.get("trigger"),
        "reason": after.get("reason"),
        "at": as_utc(entry.created_at).isoformat() if entry.created_at else None,
    }


def adaptation_status(*, session: Session, deployment: Deployment, settings: Settings) -> dict[str, Any]:
    """The policy as it applies now, for the API: the GPU seconds spent in the last 24 hours, what
    the rules would do on the next pass, and the last recorded skip."""
    now = utcnow()
    policy = adaptation_policy(deployment)
    decision = evaluate_triggers(session=session, deployment=deployment, settings=settings, now=now)
    return {
        **policy.as_dict(),
        "status": {
            "gpu_seconds_last_24h": round(
                deployment_gpu_seconds(session=session, deployment_id=deployment.id, now=now), 3
            ),
            "has_drafter": serves_a_drafter(session=session, deployment=deployment),
            "next_trigger": decision.trigger if not decision.skipped else None,
            "reason": decision.reason,
            "last_skip": last_skip(session=session, deployment=deployment),
        },
    }
