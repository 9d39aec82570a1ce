"""Routes for drift: events with their evidence, detector status, dismissal, and the policy."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from controlplane.api.deps import Admin, Reader, SessionDep, SettingsDep
from controlplane.deployments.service import get_deployment
from controlplane.drift.service import (
    dismiss_event,
    event_summary,
    get_event,
    list_events,
    monitor_status,
    update_policy,
)

router = APIRouter(prefix="/v1/accounts/{account}/deployments/{deployment}", tags=["drift"])


class PolicyChange(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields get a clear 422 from the service


@router.get("/drift-events")
def list_(
    account: str,
    deployment: str,
    principal: Reader,
    session: SessionDep,
    state: str | None = None,
    limit: int = 100,
) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    events = list_events(
        session=session, deployment_id=target.id, state=state, limit=max(1, min(limit, 1000))
    )
    return {"drift_events": [event_summary(e) for e in events]}


@router.get("/drift-events/{event_id}")
def get(
    account: str, deployment: str, event_id: int, principal: Reader, session: SessionDep
) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    return event_summary(get_event(session=session, deployment_id=target.id, event_id=event_id))


@router.post("/drift-events/{event_id}:dismiss")
def dismiss(
    account: str, deployment: str, event_id: int, principal: Admin, session: SessionDep
) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    event = dismiss_event(session=session, principal=principal, deployment=target, event_id=event_id)
    session.commit()
    return event_summary(event)


@router.get("/drift-status")
def status(
    account: str, deployment: str, principal: Reader, session: SessionDep, settings: SettingsDep
) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    return monitor_status(session=session, deployment=target, settings=settings)


@router.patch("/drift-policy")
def policy(
    account: str,
    deployment: str,
    body: PolicyChange,
    principal: Admin,
    session: SessionDep,
    settings: SettingsDep,
) -> dict[str, Any]:
    target = get_deployment(session=session, account_id=principal.account_id, name=deployment)
    result = update_policy(
        session=session, principal=principal, deployment=target, changes=body.model_dump(), settings=settings
    )
    session.commit()
    return result
