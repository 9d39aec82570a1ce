"""Routes for a deployment's adaptation policy: read it with what it does now (viewer), replace
it (PUT) or change some fields (PATCH) (admin, audited)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict
from sqlalchemy.orm import Session

from controlplane.accounts.service import Principal
from controlplane.adaptation.service import adaptation_status, update_adaptation_policy
from controlplane.api import schemas
from controlplane.api.deps import Admin, AdminDeployment, ReadableDeployment, SessionDep, SettingsDep
from controlplane.config import Settings
from controlplane.db.models import Deployment

router = APIRouter(prefix="/v1/accounts/{account}/deployments/{deployment}", tags=["adaptation"])


class PolicyBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # every field is checked by the service: one clear 422


def _reply(session: Session, deployment: Deployment, settings: Settings) -> schemas.AdaptationPolicy:
    return schemas.AdaptationPolicy.model_validate(
        adaptation_status(session=session, deployment=deployment, settings=settings)
    )


def _store(
    session: Session, principal: Principal, deployment: Deployment, body: PolicyBody, *, replace: bool
) -> None:
    update_adaptation_policy(
        session=session,
        principal=principal,
        deployment=deployment,
        changes=body.model_dump(),
        replace=replace,
    )
    session.commit()


@router.get("/adaptation-policy")
def policy_get(
    account: str, deployment: ReadableDeployment, session: SessionDep, settings: SettingsDep
) -> schemas.AdaptationPolicy:
    """The policy (stored fields over the defaults) and what it does now."""
    return _reply(session, deployment, settings)


@router.put("/adaptation-policy")
def policy_put(
    account: str,
    deployment: AdminDeployment,
    body: PolicyBody,
    principal: Admin,
    session: SessionDep,
    settings: SettingsDep,
) -> schemas.AdaptationPolicy:
    """Replace the stored policy: fields left out return to their defaults."""
    _store(session, principal, deployment, body, replace=True)
    return _reply(session, deployment, settings)


@router.patch("/adaptation-policy")
def policy_patch(
    account: str,
    deployment: AdminDeployment,
    body: PolicyBody,
    principal: Admin,
    session: SessionDep,
    settings: SettingsDep,
) -> schemas.AdaptationPolicy:
    """Change the fields given; the others keep their stored values."""
    _store(session, principal, deployment, body, replace=False)
    return _reply(session, deployment, settings)
