"""The shadow-replay job's reads and writes, for the worker that runs it: claim the job, plan the
replay (which models, which held-out requests, at which k and length), and record the result on
the canary. The worker (``workers.canary_tasks``) holds no SQL; it replays between these calls.

A redelivered replay simply runs again: recording a result is conditional on the canary still
being in its shadow phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.canary.evaluate import record_shadow_result
from controlplane.canary.phases import OPEN, UNDECIDED
from controlplane.canary.service import canary_of_job, canary_policy, end_inconclusive, reject
from controlplane.config import Settings
from controlplane.db.models import Deployment, DrafterVersion, Job, JobState, Trace
from controlplane.deployments.spec import DEFAULT_DRAFT_TOKEN_COUNT, speculation_of
from controlplane.drafters.service import location_of_version
from controlplane.drafters.serving import incumbent_location, target_location
from controlplane.jobs.service import fail_job, finish_job, start_job
from controlplane.jobs.states import TERMINAL
from controlplane.models.location import ModelLocation
from controlplane.timestamps import as_utc
from controlplane.traces.holdout import REALIGN_HOLDOUT_SHARE, is_held_out, trace_key


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


@dataclass(frozen=True, slots=True)
class ReplayClaim:
    """``done`` says why there is nothing to replay (the task's result); else ``plan``."""

    done: dict[str, Any] | None
    plan: ReplayPlan | None = None


def held_out_requests(
    *, session: Session, deployment_id: int, candidate: DrafterVersion, n: int
) -> list[tuple[str, str]]:
    """Recent requests (prompt, served completion) the candidate never trained on: traces after its
    traffic window, then the window's held-out share (the trainer's own hash split), newest first."""
    seed = int((candidate.training_metrics or {}).get("seed", 0))
    rows = list(
        session.scalars(
            select(Trace).where(Trace.deployment_id == deployment_id).order_by(Trace.id.desc()).limit(20 * n)
        )
    )
    end = as_utc(candidate.traffic_window_end)
    fresh = [t for t in rows if end is not None and as_utc(t.created_at) > end]
    held = [t for t in rows if t not in fresh and is_held_out(trace_key(t.id), seed, REALIGN_HOLDOUT_SHARE)]
    return [(t.prompt, t.completion) for t in (fresh + held)[:n]]


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
    deployment = session.get_one(Deployment, canary.deployment_id)
    candidate = session.get_one(DrafterVersion, canary.candidate_version_id)
    policy = canary_policy(deployment)
    config = speculation_of(deployment)
    return ReplayClaim(
        None,
        ReplayPlan(
            canary_id=canary.id,
            target=target_location(session=session, deployment=deployment),
            candidate=location_of_version(candidate),
            incumbent=incumbent_location(session=session, deployment=deployment),
            k=int(canary.arms.get("k") or config.effective_draft_token_count or DEFAULT_DRAFT_TOKEN_COUNT),
            requests=held_out_requests(
                session=session, deployment_id=deployment.id, candidate=candidate, n=policy.shadow_prompts
            ),
            new_tokens=policy.shadow_new_tokens,
        ),
    )


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
