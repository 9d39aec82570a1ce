"""Routes for drift: events with their evidence, detector status, dismissal, and the policy."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from controlplane.api import schemas
from controlplane.api.deps import Admin, AdminDeployment, ReadableDeployment, RowId, SessionDep, SettingsDep
from controlplane.drift.events import dismiss_event, event_summary, get_event, list_events
from controlplane.drift.service import update_policy
from controlplane.jobs.service import dismissed_during_fallback
from controlplane.loop.drift import monitor_status

router = APIRouter(prefix="/v1/accounts/{account}/deployments/{deployment}", tags=["drift"])


class PolicyChange(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields get a clear 422 from the service


@router.get("/drift-events")
def list_(
    account: str,
    deployment: ReadableDeployment,
    session: SessionDep,
    state: str | None = None,
    limit: int = 100,
) -> schemas.DriftEventList:
    events = list_events(
        session=session, deployment_id=deployment.id, state=state, limit=max(1, min(limit, 1000))
    )
    return schemas.DriftEventList(
        drift_events=[schemas.DriftEvent.model_validate(event_summary(e)) for e in events]
    )


@router.get("/drift-events/{event_id}")
def get(
    account: str, deployment: ReadableDeployment, event_id: RowId, session: SessionDep
) -> schemas.DriftEvent:
    event = get_event(session=session, deployment_id=deployment.id, event_id=event_id)
    return schemas.DriftEvent.model_validate(event_summary(event))


@router.post("/drift-events/{event_id}:dismiss")
def dismiss(
    account: str, deployment: AdminDeployment, event_id: RowId, principal: Admin, session: SessionDep
) -> schemas.DriftEvent:
    event = dismiss_event(
        session=session, deployment_id=deployment.id, event_id=event_id, actor=principal.actor
    )
    dismissed_during_fallback(session=session, deployment=deployment, actor=principal.actor)
    session.commit()
    return schemas.DriftEvent.model_validate(event_summary(event))


@router.get("/drift-status")
def status(
    account: str, deployment: ReadableDeployment, session: SessionDep, settings: SettingsDep
) -> schemas.DriftStatus:
    return schemas.DriftStatus.model_validate(
        monitor_status(session=session, deployment=deployment, settings=settings)
    )


@router.patch("/drift-policy")
def policy(
    account: str,
    deployment: AdminDeployment,
    body: PolicyChange,
    principal: Admin,
    session: SessionDep,
    settings: SettingsDep,
) -> schemas.DriftPolicy:
    result = update_policy(
        session=session,
        principal=principal,
        deployment=deployment,
        changes=body.model_dump(),
        settings=settings,
    )
    session.commit()
    return schemas.DriftPolicy.model_validate(result)
