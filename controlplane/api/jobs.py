"""Routes for jobs: list and get a deployment's jobs, cancel one, and start a realignment by hand.

``POST .../deployments/{deployment}:realign`` answers 202 with the job; when a realignment is
already queued or running it answers 200 with that job (``created: false``) and enqueues nothing.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response, status
from pydantic import BaseModel, ConfigDict, Field

from controlplane.api import schemas
from controlplane.api.deps import (
    Admin,
    AdminDeployment,
    ReadableDeployment,
    RowId,
    SessionDep,
    SettingsDep,
    WorkQueueDep,
)
from controlplane.jobs.service import (
    TRIGGER_MANUAL,
    cancel_job,
    get_job,
    job_summary,
    list_jobs,
    request_realign,
)

router = APIRouter(prefix="/v1/accounts/{account}/deployments", tags=["jobs"])


class RealignBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    params: dict[str, Any] = Field(default_factory=dict)


@router.get("/{deployment}/jobs")
def list_(
    account: str,
    deployment: ReadableDeployment,
    session: SessionDep,
    state: str | None = None,
    limit: int = 100,
) -> schemas.JobList:
    jobs = list_jobs(session=session, deployment_id=deployment.id, state=state, limit=limit)
    return schemas.JobList(jobs=[schemas.Job.model_validate(job_summary(j)) for j in jobs])


@router.get("/{deployment}/jobs/{job_id}")
def get(account: str, deployment: ReadableDeployment, job_id: RowId, session: SessionDep) -> schemas.Job:
    return schemas.Job.model_validate(
        job_summary(get_job(session=session, deployment_id=deployment.id, job_id=job_id))
    )


@router.post("/{deployment}/jobs/{job_id}:cancel")
def cancel(
    account: str, deployment: AdminDeployment, job_id: RowId, principal: Admin, session: SessionDep
) -> schemas.Job:
    job = cancel_job(session=session, deployment=deployment, job_id=job_id, actor=principal.actor)
    session.commit()
    return schemas.Job.model_validate(job_summary(job))


@router.post(
    "/{deployment}:realign",
    status_code=status.HTTP_202_ACCEPTED,
    responses={
        status.HTTP_200_OK: {
            "model": schemas.RealignResult,
            "description": "A realignment was already queued or running: that job, nothing enqueued",
        }
    },
)
def realign(
    account: str,
    deployment: AdminDeployment,
    principal: Admin,
    session: SessionDep,
    queue: WorkQueueDep,
    settings: SettingsDep,
    response: Response,
    body: RealignBody | None = None,
) -> schemas.RealignResult:
    outcome = request_realign(
        session=session,
        deployment=deployment,
        actor=principal.actor,
        params=(body.params if body else None),
        settings=settings,
        trigger=TRIGGER_MANUAL,
    )
    session.commit()
    if outcome.created:
        # After the commit: the worker must find the row when the message arrives.
        queue.enqueue_realign(outcome.job.id)
    else:
        response.status_code = status.HTTP_200_OK
    return schemas.RealignResult.model_validate({**job_summary(outcome.job), "created": outcome.created})
