"""A realign job's path through the loop, as the gpu worker drives it: claim the job and read what
it trains on (the jobs lifecycle's own steps, ``controlplane.jobs.realign``, named here so that the
worker drives the whole path from one module), then register the trained drafter as a candidate,
which on a deployment that realigns automatically opens its canary: a realignment carried into the
canary lifecycle.

Every function runs in the caller's unit of work and is safe to call again for the same job: a
redelivered message finds the version already registered and never registers a second one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from controlplane.canary.service import start_canary
from controlplane.db.models import Deployment, Job, JobState
from controlplane.drafters import service as drafters
from controlplane.jobs.realign import (
    Claim,
    RealignInputs,
    claim_job,
    realign_inputs,
    succeed_with,
    traces_to_train_on,
)
from controlplane.messaging import SHADOW_REPLAY, TaskMessage

__all__ = [
    "Claim",
    "RealignInputs",
    "Registered",
    "claim_job",
    "realign_inputs",
    "register_trained",
    "traces_to_train_on",
]


@dataclass(frozen=True, slots=True)
class Registered:
    """What registering a trained drafter did: the task's result, and the messages to send once
    the transaction has committed (the candidate's shadow replay)."""

    result: dict[str, Any]
    messages: list[TaskMessage]


def register_trained(
    *,
    session: Session,
    job_id: int,
    inputs: RealignInputs,
    artifact_path: str,
    artifact_sha256: str,
    manifest_sha256: str,
    metrics: dict[str, Any],
    attempt: int | None = None,
) -> Registered:
    """Register the job's drafter as a candidate, finish the job and, on a deployment with
    ``auto_realign``, open its canary. Under a lock on the job row, and only if the job has no
    version yet and ``attempt`` is still its running one: never two versions for one job, and
    never the work of an attempt that was given up."""
    job = session.get_one(Job, job_id, with_for_update=True)
    if (existing := drafters.version_of_job(session=session, job_id=job_id)) is not None:
        return Registered({"job_id": job_id, **succeed_with(session, job, existing)}, [])
    if job.state != JobState.running:
        return Registered({"job_id": job_id, "skipped": f"job became {job.state.value} while training"}, [])
    if attempt is not None and job.attempts != attempt:
        return Registered(
            {"job_id": job_id, "skipped": f"attempt {attempt} was superseded by attempt {job.attempts}"}, []
        )
    version = drafters.register_candidate(
        session=session,
        trained=drafters.TrainedDrafter(
            deployment_id=inputs.deployment_id,
            training_job_id=job_id,
            parent_version_id=inputs.parent_version_id,
            target_model=inputs.target_model,
            artifact_path=artifact_path,
            artifact_sha256=artifact_sha256,
            manifest_sha256=manifest_sha256,
            traffic_window_start=inputs.window_start,
            traffic_window_end=inputs.window_end,
            training_metrics=metrics,
            drift_event_id=job.drift_event_id,
        ),
        actor=f"job:{job_id}",
    )
    result = {"job_id": job_id, **succeed_with(session, job, version)}
    deployment = session.get_one(Deployment, job.deployment_id)
    if not deployment.auto_realign:
        return Registered(result, [])  # the version stays a candidate for a person to judge
    # No human in the loop: the candidate goes straight to its canary (shadow replay first).
    _canary, canary_job = start_canary(
        session=session, version=version, actor=f"job:{job_id}", reason=f"realign job {job_id} succeeded"
    )
    return Registered(result, [TaskMessage(SHADOW_REPLAY, (canary_job.id,))])
