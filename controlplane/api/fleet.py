"""Routes for the serving fleet: a deployment's backends, its actuator (how decisions reach the
fleet) and the events handed to it. Viewers read, admins write; every change is audited, and no
reply shows a webhook's signing secret except the one that set it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request, Response, status
from pydantic import BaseModel, ConfigDict
from sqlalchemy import select
from sqlalchemy.orm import Session

from controlplane.accounts.service import Principal
from controlplane.api import schemas
from controlplane.api.deps import (
    ADMIN_ROLES,
    Admin,
    AdminDeployment,
    BigRowId,
    ReadableDeployment,
    SessionDep,
    SettingsDep,
    check_access,
    get_principal,
)
from controlplane.config import Settings
from controlplane.db.models import Account, Deployment
from controlplane.deployments.lookup import get_deployment
from controlplane.errors import NotFoundError
from controlplane.fleet import actuators, backends, payloads

router = APIRouter(prefix="/v1/accounts/{account}/deployments/{deployment}", tags=["fleet"])


class Fields(BaseModel):
    # Validated by the services, which name every bad field in their 422.
    model_config = ConfigDict(extra="allow")


def send_deliveries(request: Request, session: Session) -> None:
    """After a commit: hand the deliveries this request wrote to the workers, off the request path.

    An app without a background sender (ingest nudges off) leaves them to the beat's resend,
    which sends every due delivery within seconds: the committed row is the outbox either way.
    """
    messages = actuators.take_outbox(session)
    sender = getattr(request.app.state, "task_sender", None)
    if sender is None:
        return
    for message in messages:
        sender.send_throttled(f"actuator:{message.args[0]}", message)


# --- who may say a candidate pool is ready ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReadyCaller:
    """Who calls ``POST .../canaries/{id}/ready``: an admin key, or the actuator itself proving
    it holds the deployment's webhook secret by signing the request as the webhooks are signed
    (``X-Specctl-Timestamp`` and ``X-Specctl-Signature`` over ``"<timestamp>.<body>"``)."""

    actor: str
    principal: Principal | None
    timestamp: str | None = None
    signature: str | None = None
    body: bytes = b""


async def ready_caller(request: Request) -> ReadyCaller:
    signature = request.headers.get(payloads.HEADER_SIGNATURE)
    if signature is None:
        principal = await get_principal(request)
        check_access(principal, request.path_params["account"], ADMIN_ROLES)
        return ReadyCaller(principal.actor, principal)
    timestamp = request.headers.get(payloads.HEADER_TIMESTAMP)
    return ReadyCaller("actuator:webhook-signature", None, timestamp, signature, await request.body())


ReadyCallerDep = Annotated[ReadyCaller, Depends(ready_caller)]


def ready_deployment(
    *, session: Session, settings: Settings, account: str, deployment: str, caller: ReadyCaller
) -> Deployment:
    """The path's deployment for this caller. A signed call that does not verify is a 401 whatever
    the reason (unknown account or deployment, no webhook, bad or stale signature), so that the
    answer says nothing about what exists."""
    if caller.principal is not None:
        return get_deployment(session=session, account_id=caller.principal.account_id, name=deployment)
    refused = HTTPException(status.HTTP_401_UNAUTHORIZED, "invalid or stale webhook signature")
    account_id = session.scalar(select(Account.id).where(Account.name == account))
    if account_id is None:
        raise refused
    try:
        row = get_deployment(session=session, account_id=account_id, name=deployment)
    except NotFoundError:
        raise refused from None
    secret = actuators.webhook_secret(row, settings)
    if secret is None or not payloads.verify(secret, caller.timestamp, caller.body, caller.signature):
        raise refused
    return row


# --- backends -------------------------------------------------------------------------------


@router.get("/backends")
def backends_list(
    account: str, deployment: ReadableDeployment, session: SessionDep
) -> schemas.ServingBackendList:
    rows = backends.list_backends(session=session, deployment_id=deployment.id)
    return schemas.ServingBackendList(
        backends=[schemas.ServingBackend.model_validate(backends.backend_summary(b)) for b in rows]
    )


@router.post("/backends", status_code=status.HTTP_201_CREATED)
def backend_create(
    account: str, deployment: AdminDeployment, body: Fields, principal: Admin, session: SessionDep
) -> schemas.ServingBackend:
    row = backends.add_backend(
        session=session, principal=principal, deployment=deployment, fields=body.model_dump()
    )
    session.commit()
    return schemas.ServingBackend.model_validate(backends.backend_summary(row))


@router.delete("/backends/{backend}", status_code=status.HTTP_204_NO_CONTENT)
def backend_delete(
    account: str, deployment: AdminDeployment, backend: str, principal: Admin, session: SessionDep
) -> Response:
    backends.delete_backend(session=session, principal=principal, deployment=deployment, name=backend)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)


# --- actuator -------------------------------------------------------------------------------


@router.get("/actuator")
def actuator_get(account: str, deployment: ReadableDeployment) -> schemas.Actuator:
    return schemas.Actuator.model_validate(actuators.actuator_view(deployment))


@router.put("/actuator")
def actuator_put(
    account: str,
    deployment: AdminDeployment,
    body: Fields,
    principal: Admin,
    session: SessionDep,
    settings: SettingsDep,
) -> schemas.Actuator:
    """Set how decisions reach the fleet. A webhook's reply carries its signing secret: keep it,
    it is never shown again (setting the webhook again makes a new one)."""
    view: dict[str, Any] = actuators.set_actuator(
        session=session,
        principal=principal,
        deployment=deployment,
        fields=body.model_dump(),
        settings=settings,
    )
    session.commit()
    return schemas.Actuator.model_validate(view)


# --- deliveries -----------------------------------------------------------------------------


def _delivery(row: Any) -> schemas.ActuatorDelivery:
    return schemas.ActuatorDelivery.model_validate(actuators.delivery_summary(row))


@router.get("/deliveries")
def deliveries_list(
    account: str, deployment: ReadableDeployment, session: SessionDep, limit: int = 50
) -> schemas.ActuatorDeliveryList:
    rows = actuators.list_deliveries(
        session=session, deployment_id=deployment.id, limit=max(1, min(limit, 500))
    )
    return schemas.ActuatorDeliveryList(deliveries=[_delivery(r) for r in rows])


@router.post("/deliveries/{delivery_id}/retry", status_code=status.HTTP_202_ACCEPTED)
def delivery_retry(
    account: str,
    deployment: AdminDeployment,
    delivery_id: BigRowId,
    principal: Admin,
    session: SessionDep,
    request: Request,
) -> schemas.ActuatorDelivery:
    """Send a delivery again now (a failed one gets a fresh attempt budget)."""
    row = actuators.retry_delivery(
        session=session, principal=principal, deployment=deployment, delivery_id=delivery_id
    )
    session.commit()
    send_deliveries(request, session)
    return _delivery(row)
