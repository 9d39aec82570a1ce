"""The shadow-replay job's reads and writes, for the worker that runs it: claim the job, plan the
replay (which models, which held-out requests, at which k and length), and record the result on
the canary. The worker (``workers.canary_tasks``) holds no SQL; it replays between these calls.

The replayed requests are held out by content: none shares its normalised prompt or its source
document with a trace the candidate may have trained on
(``controlplane.jobs.realign.trained_content``), whether it came after the training window or
from the window's held-out share. How the selection came out, with that overlap counted, is kept
on the canary as ``shadow_selection``.

A redelivered replay simply runs again: recording a result is conditional on the canary still
being in its shadow phase. A replay whose message was lost, or whose worker died, is found by
``sweep_overdue_replays`` (called by the judge's beat task): its message is sent again, up to a cap,
and then its canary ends inconclusive with the reason, so nothing waits on it forever.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from controlplane.canary.evaluate import record_shadow_result
from controlplane.canary.phases import OPEN, UNDECIDED, CanaryPhase
from controlplane.canary.service import (
    canary_of_job,
    canary_policy,
    end_inconclusive,
    pool_state,
    reject,
)
from controlplane.config import Settings
from controlplane.db.models import (
    Canary,
    Deployment,
    DrafterVersion,
    Job,
    JobState,
    SpeculationMode,
    Trace,
)
from controlplane.deployments.lookup import lock_deployment
from controlplane.deployments.spec import DEFAULT_DRAFT_TOKEN_COUNT, speculation_of
from controlplane.drafters.serving import incumbent_location, target_location
from controlplane.jobs.realign import holdout_of, trained_content
from controlplane.jobs.service import fail_job, finish_job, start_job
from controlplane.jobs.states import TERMINAL
from controlplane.models.location import ModelLocation, location_of_version
from controlplane.timestamps import as_utc, utcnow
from controlplane.traces.holdout import content_key, content_of, is_held_out, overlap_count


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """What the worker replays: the target, the arms' drafters, k, and the held-out requests
    (prompt, served completion), newest first."""

    canary_id: int
    target: ModelLocation
    candidate: ModelLocation
    # The drafter serving now (the active version, else the registered one), if any.
    incumbent: ModelLocation | None
    k: int
    requests: list[tuple[str, str]]
    new_tokens: int
    # How the live arm speculates now: "draft_model" (``incumbent``), or the fallback a guardrail
    # (or the deployment's own settings) put in place, "ngram" (of ``ngram_length``) or "disabled":
    # the candidate must beat what actually serves.
    incumbent_speculation: str = SpeculationMode.draft_model.value
    ngram_length: int = 3
    # How the requests were chosen (HeldOutRequests.figures), with their overlap with training.
    selection: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ReplayClaim:
    """``done`` says why there is nothing to replay (the task's result); else ``plan``."""

    done: dict[str, Any] | None
    plan: ReplayPlan | None = None


@dataclass(frozen=True, slots=True)
class HeldOutRequests:
    """The requests to replay (prompt, served completion), newest first, and how they were chosen:
    ``fresh`` (after the training window) and ``window_held_out`` (the window's held-out share)
    replayed, ``skipped_as_trained`` (either kind, skipped because its prompt or document may have
    been trained on) and ``heldout_prompt_overlap``, the replayed requests whose prompt or document
    is among those trained on, counted (0 by construction)."""

    requests: list[tuple[str, str]]
    figures: dict[str, int]


def held_out_requests(
    *, session: Session, deployment_id: int, candidate: DrafterVersion, n: int
) -> HeldOutRequests:
    """Recent requests the candidate never trained on: traces after its traffic window, then the
    window's held-out share (the trainer's own content split), newest first; either kind only if
    neither its normalised prompt nor its document occurs among the traces it may have trained on
    (a verbatim repeat of a trained prompt after the window is not held out)."""
    seed, share = holdout_of(candidate)
    trained = trained_content(session=session, version=candidate)
    rows = list(
        session.scalars(
            select(Trace).where(Trace.deployment_id == deployment_id).order_by(Trace.id.desc()).limit(20 * n)
        )
    )
    end = as_utc(candidate.traffic_window_end)
    fresh = [t for t in rows if end is not None and as_utc(t.created_at) > end]
    fresh_ids = {t.id for t in fresh}
    held = [
        t
        for t in rows
        if t.id not in fresh_ids and is_held_out(content_key(t.prompt, t.document), seed, share)
    ]
    chosen: list[Trace] = []
    skipped = 0
    for trace in fresh + held:
        if len(chosen) == n:
            break
        if trained.overlaps(content_of(trace.prompt, trace.document)):
            skipped += 1
            continue
        chosen.append(trace)
    figures = {
        "requests": len(chosen),
        "fresh": sum(1 for t in chosen if t.id in fresh_ids),
        "window_held_out": sum(1 for t in chosen if t.id not in fresh_ids),
        "skipped_as_trained": skipped,
        "heldout_prompt_overlap": overlap_count((content_of(t.prompt, t.document) for t in chosen), trained),
    }
    return HeldOutRequests([(t.prompt, t.completion) for t in chosen], figures)


def claim_replay(*, session: Session, job_id: int, delivery_id: str | None) -> ReplayClaim:
    """Start the replay job and plan it, or say why not (no such job, finished, canary gone)."""
    job = session.get(Job, job_id)
    if job is None:
        return ReplayClaim({"job_id": job_id, "skipped": "no such job"})
    if job.state in TERMINAL:
        return ReplayClaim({"job_id": job_id, "skipped": f"job is {job.state.value}"})
    canary = canary_of_job(session=session, job_id=job_id)
    if canary is None or canary.phase not in OPEN:
        fail_job(session=session, job_id=job_id, error="the canary is gone or already decided")
        return ReplayClaim({"job_id": job_id, "skipped": "canary not open"})
    if job.state == JobState.queued:
        start_job(session=session, job_id=job_id, celery_task_id=delivery_id)
    record_replay_heartbeat(session=session, job_id=job_id)  # loading the models takes a while
    deployment = session.get_one(Deployment, canary.deployment_id)
    candidate = session.get_one(DrafterVersion, canary.candidate_version_id)
    policy = canary_policy(deployment)
    config = speculation_of(deployment)
    incumbent = incumbent_location(session=session, deployment=deployment)
    speculation = incumbent_speculation(config.mode, has_drafter=incumbent is not None)
    held_out = held_out_requests(
        session=session, deployment_id=deployment.id, candidate=candidate, n=policy.shadow_prompts
    )
    canary.arms = {**canary.arms, "shadow_selection": held_out.figures}
    return ReplayClaim(
        None,
        ReplayPlan(
            canary_id=canary.id,
            target=target_location(session=session, deployment=deployment),
            candidate=location_of_version(candidate),
            incumbent=incumbent if speculation == SpeculationMode.draft_model.value else None,
            k=int(canary.arms.get("k") or config.effective_draft_token_count or DEFAULT_DRAFT_TOKEN_COUNT),
            requests=held_out.requests,
            new_tokens=policy.shadow_new_tokens,
            incumbent_speculation=speculation,
            ngram_length=deployment.ngram_speculation_length or 3,
            selection=held_out.figures,
        ),
    )


def incumbent_speculation(mode: SpeculationMode, *, has_drafter: bool) -> str:
    """How the live arm speculates, as the serving config tells the fleet (``drafters.serving``)."""
    if mode == SpeculationMode.default:
        return SpeculationMode.draft_model.value if has_drafter else SpeculationMode.disabled.value
    return mode.value


def finish_replay(
    *, session: Session, job_id: int, canary_id: int, result: dict[str, Any], settings: Settings
) -> dict[str, Any]:
    """Record the replay on its canary (which moves it on) and finish the job."""
    phase = record_shadow_result(session=session, canary_id=canary_id, result=result, settings=settings)
    job = session.get_one(Job, job_id)
    if job.state == JobState.running:
        finish_job(session=session, job_id=job_id, result={"canary_id": canary_id, "phase": phase})
    return {"job_id": job_id, "canary_id": canary_id, "phase": phase}


def fail_replay(*, session: Session, job_id: int, error: str, candidate_refused: bool) -> dict[str, Any]:
    """The replay could not run: fail its job and end its canary, so nothing waits on it forever.

    A candidate whose artifact failed verification is rejected (it is never promoted); any other
    failure leaves the canary inconclusive and the incumbent serving.
    """
    fail_job(session=session, job_id=job_id, error=error)
    canary = canary_of_job(session=session, job_id=job_id)
    if canary is None or canary.phase not in UNDECIDED:
        return {"job_id": job_id, "failed": error}
    if candidate_refused:
        reject(session=session, canary=canary, actor="system", reason=f"candidate artifact refused: {error}")
    else:
        end_inconclusive(session=session, canary=canary, reason=f"shadow replay failed: {error}", figures={})
    return {"job_id": job_id, "failed": error, "canary_id": canary.id, "phase": canary.phase}


def record_replay_heartbeat(*, session: Session, job_id: int) -> None:
    """The replay's worker is alive: the sweep leaves a running replay with a fresh heartbeat alone."""
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.state == JobState.running)
        .values(heartbeat_at=utcnow())
        .execution_options(synchronize_session=False)
    )


@dataclass(slots=True)
class ReplaySweep:
    """What one sweep did: the jobs whose message goes out again (after the commit), and the
    canaries it ended."""

    resend_jobs: list[int] = field(default_factory=list)
    ended_canaries: list[int] = field(default_factory=list)


def _alive(job: Job, cutoff: datetime, now: datetime) -> bool:
    """A running replay whose worker showed a sign of life within the window."""
    if job.state != JobState.running:
        return False
    lease = as_utc(job.lease_expires_at)
    heartbeat = as_utc(job.heartbeat_at)
    return (lease is not None and lease > now) or (heartbeat is not None and heartbeat > cutoff)


def sweep_overdue_replays(
    *, session: Session, resend_after_s: float, max_sends: int, now: datetime | None = None
) -> ReplaySweep:
    """Canaries in shadow whose replay has not answered ``resend_after_s`` after its last send.

    A replay still queued, or running without a heartbeat, is sent again (the caller sends each
    returned job once this commits) until it was sent ``max_sends`` times; then its canary ends
    inconclusive with the reason (its drift event resolves ``canary_inconclusive`` with it), and
    its job fails. A canary waiting for its candidate pool, or holding a replay result, is not a
    replay's to answer.
    """
    now = now or utcnow()
    cutoff = now - timedelta(seconds=resend_after_s)
    overdue = session.scalars(
        select(Canary)
        .where(
            Canary.phase == CanaryPhase.shadow,
            Canary.shadow_sent_at.is_not(None),
            Canary.shadow_sent_at < cutoff,
        )
        .order_by(Canary.id)
    ).all()  # at most one open canary per deployment
    sweep = ReplaySweep()

    def awaits_replay(canary: Canary) -> bool:
        sent = as_utc(canary.shadow_sent_at)
        return (
            canary.phase == CanaryPhase.shadow
            and pool_state(canary) is None
            and "shadow" not in canary.arms
            and sent is not None
            and sent < cutoff
        )

    for canary in overdue:
        if not awaits_replay(canary):
            continue  # it has its replay's result (and waits for its candidate pool)
        lock_deployment(session=session, deployment_id=canary.deployment_id)
        session.refresh(canary)
        if not awaits_replay(canary):
            continue  # the replay answered (or another sweep acted) since the query
        job = session.get(Job, canary.job_id) if canary.job_id is not None else None
        if job is not None and _alive(job, cutoff, now):
            continue
        if job is not None and job.state in (JobState.queued, JobState.running):
            if canary.shadow_attempts < max_sends:
                canary.shadow_attempts += 1
                canary.shadow_sent_at = now
                sweep.resend_jobs.append(job.id)
                continue
            reason = (
                f"the shadow replay (job {job.id}) was sent {canary.shadow_attempts} times and never "
                f"reported a result within {resend_after_s:g} s of a send; the incumbent keeps serving"
            )
            end_inconclusive(session=session, canary=canary, reason=reason, figures={})
            fail_job(session=session, job_id=job.id, error=reason)
        else:
            state = "is gone" if job is None else f"ended {job.state.value}"
            detail = f": {job.error}" if job is not None and job.error else ""
            reason = f"the shadow replay job {state} without a result{detail}; the incumbent keeps serving"
            end_inconclusive(session=session, canary=canary, reason=reason, figures={})
        sweep.ended_canaries.append(canary.id)
    return sweep
