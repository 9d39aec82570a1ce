"""Routes for jobs: list and get a deployment's jobs, cancel one, and start a realignment by hand.

``POST .../deployments/{deployment}:realign`` answers 202 with the job; when a realignment is
already queued or running it answers 200 with that job (``created: false``) and enqueues nothing.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response, status
from pydantic import BaseModel, ConfigDict, Field

from controlplane.api.deps import Admin, Reader, SessionDep, SettingsDep
from controlplane.deployments.service import get_deployment
from controlplane.jobs.queue import CeleryJobQueue, JobQueue
from controlplane.jobs.service import cancel_job, get_job, job_summary, list_jobs, request_realign

router = APIRouter(prefix="/v1/accounts/{account}/deployments", tags=["jobs"])


async def get_job_queue(request: Request, settings: SettingsDep) -> JobQueue:
    """The app's job queue, made on first use (one seam, so tests can record sends instead)."""
    queue: JobQueue | None = getattr(request.app.state, "job_queue", None)
    if queue is None:
        queue = CeleryJobQueue(settings.broker_url)
        request.app.state.job_queue = queue
    return queue


JobQueueDep = Annotated[JobQueue, Depends(get_job_queue)]


class RealignBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    params: dict[str, Any] = Field(default_factory=dict)


@router.get("/{deployment}/jobs")
def list_(
    account: str,
    deployment: str,
    principal: Reader,
    session: SessionDep,
    state: str | None = None,
    limit: int = 100,
) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    jobs = list_jobs(session=session, deployment_id=target.id, state=state, limit=limit)
    return {"jobs": [job_summary(j) for j in jobs]}


@router.get("/{deployment}/jobs/{job_id}")
def get(account: str, deployment: str, job_id: int, principal: Reader, session: SessionDep) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    return job_summary(get_job(session=session, deployment_id=target.id, job_id=job_id))


@router.post("/{deployment}/jobs/{job_id}:cancel")
def cancel(
    account: str, deployment: str, job_id: int, principal: Admin, session: SessionDep
) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    job = cancel_job(session=session, deployment=target, job_id=job_id, actor=principal.actor)
    session.commit()
    return job_summary(job)


@router.post("/{deployment}:realign", status_code=status.HTTP_202_ACCEPTED)
def realign(
    account: str,
    deployment: str,
    principal: Admin,
    session: SessionDep,
    queue: JobQueueDep,
    response: Response,
    body: RealignBody | None = None,
) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    outcome = request_realign(
        session=session, deployment=target, actor=principal.actor, params=(body.params if body else None)
    )
    session.commit()
    if outcome.created:
        # After the commit: the worker must find the row when the message arrives.
        queue.enqueue_realign(outcome.job.id)
    else:
        response.status_code = status.HTTP_200_OK
    return {**job_summary(outcome.job), "created": outcome.created}
